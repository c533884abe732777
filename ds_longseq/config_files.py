"""The JSON files ds_longseq reads its configuration from, and the DeepSpeed configs shipped with it.

Holds:
    ConfigFileError: a JSON file that cannot be read or is not a JSON object, in one line naming the file (and the
        line and column of the first error, with the likely slip).
    read_json_file: the JSON object in a file (a DeepSpeed config, a model's config.json).
    SHIPPED_CONFIGS / shipped_configs / find_ds_config: the DeepSpeed configs installed with the package
        (``ds_longseq/configs/``, the repository's ``ds_configs/``), and a ``--ds_config`` value (a path, or a
        shipped config's name) turned into the file it names.

The ``long_seq`` section such a file holds is parsed by ``ds_longseq.config``; this module knows files, not sections.
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["ConfigFileError", "read_json_file", "SHIPPED_CONFIGS", "shipped_configs", "find_ds_config"]


class ConfigFileError(ValueError):
    """A JSON file ds_longseq was pointed at (a DeepSpeed config, a model's config.json) cannot be read or is not
    valid JSON: the message names the file, and the line and column of the first error, in one line."""


SHIPPED_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
"""Where the shipped DeepSpeed configs are: package data (the repository's ``ds_configs/`` links here), so an
installed wheel has them and a name such as ``zero2_streambp`` finds them from any directory."""


def shipped_configs() -> dict[str, str]:
    """{name: path} of every shipped DeepSpeed config (``zero2_streambp``: ``.../configs/zero2_streambp.json``),
    sorted by name."""
    names = sorted(f[: -len(".json")] for f in os.listdir(SHIPPED_CONFIGS) if f.endswith(".json"))
    return {name: os.path.join(SHIPPED_CONFIGS, name + ".json") for name in names}


def find_ds_config(value: str | os.PathLike) -> str:
    """The file a ``--ds_config`` value names: an existing path as given (it wins over a shipped name), else the
    shipped config of that name: ``zero2_streambp``, ``zero2_streambp.json`` or the repository-relative
    ``ds_configs/zero2_streambp.json`` written in the docs, from any directory.

    Raises:
        ConfigFileError: neither a file nor a shipped name (the message lists the shipped names).
    """
    path = os.fspath(value)
    if os.path.exists(path):
        return path
    folder, base = os.path.split(path)
    name = base[: -len(".json")] if base.endswith(".json") else base
    shipped = shipped_configs()
    if name in shipped and os.path.basename(os.path.normpath(folder or "ds_configs")) == "ds_configs":
        return shipped[name]
    raise ConfigFileError(f"{path}: no such file, nor the name of a shipped DeepSpeed config ({', '.join(shipped)}; "
                          "`ds-longseq configs` describes them)")


def read_json_file(path: str | os.PathLike, what: str = "DeepSpeed config") -> dict[str, Any]:
    """The JSON object in ``path`` (a config: a DeepSpeed config, a model's config.json).

    Raises:
        ConfigFileError: ``path: cannot read the <what> (No such file or directory)``, ``path:LINE:COLUMN: not
            valid JSON (<the parser's reason>)`` with the likely fix for the common slips (a trailing comma, single
            quotes, a comment), or ``path: a <what> is a JSON object`` for another JSON value.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise ConfigFileError(f"{path}: cannot read the {what} ({reason})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigFileError(f"{path}:{err.lineno}:{err.colno}: the {what} is not valid JSON ({err.msg})"
                              f"{_json_slip(text, err.pos)}") from None
    if not isinstance(value, dict):
        raise ConfigFileError(f"{path}: a {what} is a JSON object ({{...}}), this file holds a {type(value).__name__}")
    return value


def _json_slip(text: str, pos: int) -> str:
    """The likely slip at a JSON error's position, as a hint ("" when none is recognised)."""
    before = text[:pos].rstrip()
    here = text[pos:pos + 1]
    if before.endswith(",") and here in "}]":
        line = text.count("\n", 0, len(before)) + 1
        return f": a comma after the last item (line {line}) is not JSON; remove it"
    if here == "'":
        return ": JSON strings and keys take double quotes"
    if text[pos:pos + 2] in ("//", "/*") or here == "#":
        return ": JSON has no comments; remove it"
    return ""
