"""docs/LAYOUT.md: it opens with a table from each feature to its files, every path in that table exists, and its
tree names every module of ds_longseq in the entry of the module's directory.

The tree's convention: an entry is a line indented by two spaces under ``ds_longseq/`` (``  config.py``,
``  ops/``), continued by deeper-indented lines; a package's modules are named by their file name inside its
directory's entry (``kv_stream.py`` under ``ops/``), a package's ``__init__.py`` by the directory's entry itself.

Pure file reading: no import of ds_longseq.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ds_longseq"
LAYOUT = ROOT / "docs" / "LAYOUT.md"

# The features issue 65 asked the table to lead from (a row's first cell names each, case-insensitive).
FEATURES = ("StreamBP", "mini-sequence", "chunked LM head", "Ulysses", "ring", "offload tiers", "Approx-BP",
            "adjoint", "Trainer / TRL", "axolotl plugin", "checkpoints and resume", "resolver", "planner",
            "command", "version compat")


def _text() -> str:
    return LAYOUT.read_text(encoding="utf-8")


def _tree_entries() -> dict[str, str]:
    """{entry name ("config.py", "ops/"): its text, continuation lines included} of the ds_longseq/ tree."""
    fence = re.search(r"^```\nds_longseq/\n(.*?)^```", _text(), re.S | re.M)
    assert fence, "docs/LAYOUT.md has no tree starting with a line 'ds_longseq/' inside a ``` block"
    entries: dict[str, str] = {}
    name = None
    for line in fence.group(1).splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if line.strip() and indent < 2:
            break  # the next top-level entry of the repository (ds_configs/, examples/ ...): ds_longseq/ is done
        if indent == 2:
            name = line.split()[0]
            entries[name] = line[2 + len(name):]
        elif name is not None:
            entries[name] += "\n" + line
    return entries


def _table_rows() -> list[list[str]]:
    """The cells of the feature table's rows (the first table of the page, before the tree)."""
    before_tree = _text().split("```", 1)[0]
    rows = [line for line in before_tree.splitlines() if line.startswith("|")]
    assert len(rows) > 2, "docs/LAYOUT.md does not open with a table from each feature to its files"
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]  # past header and rule


def test_the_tree_names_every_module_in_its_directorys_entry():
    entries = _tree_entries()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:
            if parts[0] != "__init__.py" and parts[0] not in entries:
                missing.append(f"{parts[0]} (no entry of its own)")
            continue
        directory = parts[0] + "/"
        if directory not in entries:
            missing.append(f"{directory} (no entry for the package)")
            continue
        if parts[-1] == "__init__.py":
            continue
        name = "/".join(parts[1:])
        if not re.search(rf"(?<![\w/.]){re.escape(name)}(?!\w)", entries[directory]):
            missing.append(f"{directory}{name} (not in the {directory} entry)")
    assert not missing, f"docs/LAYOUT.md's tree does not name these modules: {missing}"


def test_the_tree_names_no_module_that_is_gone():
    """A renamed module leaves no stale name behind: every entry is a file or directory of the package, and every
    ``*.py`` name in an entry is a module of its directory, or a file named from there (``setup.py``'s console
    script, the ``config.py`` dataclasses) that exists in the package or at the repository's root."""
    elsewhere = {p.name for p in PACKAGE.rglob("*.py")} | {p.name for p in ROOT.glob("*.py")}
    stale = []
    for name, text in _tree_entries().items():
        if not (PACKAGE / name).exists():
            stale.append(name)
            continue
        if not name.endswith("/"):
            continue
        for module in re.findall(r"(?<![\w/.])([A-Za-z_]\w*\.py)\b", text):
            if not (PACKAGE / name / module).exists() and module not in elsewhere:
                stale.append(f"{name}{module}")
    assert not stale, f"docs/LAYOUT.md's tree names modules that do not exist: {stale}"


def test_the_page_opens_with_a_table_of_the_features_and_their_files():
    rows = _table_rows()
    firsts = [row[0].lower() for row in rows]
    absent = [f for f in FEATURES if not any(f.lower() in first for first in firsts)]
    assert not absent, f"docs/LAYOUT.md's feature table has no row for {absent}"
    gone = []
    for row in rows:
        for path in re.findall(r"`([\w/.]+\.py|[\w/]+/)`", row[1]):
            if not ((PACKAGE / path).exists() or (ROOT / path).exists()):
                gone.append(f"{row[0]}: {path}")
    assert not gone, f"docs/LAYOUT.md's feature table names files that do not exist: {gone}"
