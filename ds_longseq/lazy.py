"""Lazy package namespaces: a package's names are imported on first use, so that importing the package (or a
torch-free module inside it, such as ``ds_longseq.plan``'s arithmetic) does not load torch and transformers.

A lazy ``__init__`` lists its names once, as imports under ``if TYPE_CHECKING:`` (what type checkers, editors and
tests/test_import_graph.py read), and ends with ``__getattr__, __dir__ = lazy_exports(__name__, __file__)``: the
table of which submodule holds which name is read from those very import lines (as the ``lazy_loader`` package
reads a ``.pyi`` stub), so there is no second list to keep in step. A submodule is an attribute too
(``ds_longseq.ops.ring``), imported when asked for.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["lazy_exports"]


def _type_checking_imports(source: str) -> dict[str, tuple[str, str]]:
    """{exported name: (module, name in that module)} from the ``from X import a as b`` lines of the source's
    top-level ``if TYPE_CHECKING:`` block."""
    table: dict[str, tuple[str, str]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                if not isinstance(stmt, ast.ImportFrom) or stmt.level or stmt.module is None:
                    raise ImportError(f"lazy_exports: only absolute 'from X import a' lines under TYPE_CHECKING, "
                                      f"got {ast.unparse(stmt)!r}")
                for alias in stmt.names:
                    table[alias.asname or alias.name] = (stmt.module, alias.name)
    return table


def lazy_exports(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package whose ``__init__`` is ``init_file``: a listed name imports its
    module on first use (and is then cached in the package's namespace, so the lookup runs once per name); a
    submodule's name imports that submodule; anything else is an AttributeError, as for a plain module."""
    table = _type_checking_imports(Path(init_file).read_text())

    def __getattr__(name: str) -> Any:
        if name in table:
            module, attr = table[name]
            value = getattr(importlib.import_module(module), attr)
        elif name.startswith("__"):  # dunder probes (copy, inspect, pickle) are never submodules
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":  # the submodule exists but something it imports does not
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(table) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
