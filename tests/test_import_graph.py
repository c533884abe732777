"""The package's import graph: no circles, and every import goes down the layers.

Layers, each importing only from the ones below it: config, logging and compat (the one module touching
third-party private names) -> ops -> families (model knowledge) -> forwards and adjoint -> techniques
(one module each) -> patch (the enable driver; the deprecated ``models`` re-export sits beside it) ->
engine -> trainer (the Hugging Face Trainer integration), toolkit (the examples' library) and the
top-level package -> cli (the ``ds-longseq`` command) and integrations (other frameworks' plugins: axolotl's,
on the Trainer integration).
The graph is read from the source with ``ast`` and counts EVERY import of a ds_longseq module: at
the top, inside functions and under ``if TYPE_CHECKING:`` (a TYPE_CHECKING import of a sibling that
imports the file back is a circle that only type annotations hide; the next runtime use of the
name would be an ImportError).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ds_longseq

PACKAGE_DIR = Path(ds_longseq.__file__).parent
LAYERS = {
    "config": 0, "config_files": 0, "rules": 0, "batch_size": 0, "logging": 0, "compat": 0, "lazy": 0, "ops": 1,
    "processes": 1,
    "resolver": 2, "families": 2, "forwards": 3, "adjoint": 3, "techniques": 4, "patch": 5, "plan_memory": 5,
    "plan_search": 5, "plan": 5, "engine": 6, "trainer": 7, "toolkit": 7, "cli": 8, "integrations": 8,
}
"""Rank of each top-level part of ds_longseq (a subpackage or a module): imports go to a rank <= own."""
TOP_RANK = 7  # ds_longseq/__init__.py: the public surface (it leaves the heavy ``trainer`` to be imported alone)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, from {module: (source, is_package)}.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module of the
    package, else of ``pkg`` itself (its ``__init__``, which imports its submodules).
    """
    names = set(sources)
    root = next(iter(names)).split(".")[0]
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        package = module if is_package else module.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the package, up level - 1 parents
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in names else target)
        graph[module] = {d for d in deps if d in names and d != module and d.split(".")[0] == root}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None when the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def package_sources(directory: Path = PACKAGE_DIR) -> dict[str, tuple[str, bool]]:
    return {
        _module_name(path, directory): (path.read_text(), path.name == "__init__.py")
        for path in sorted(directory.rglob("*.py"))
    }


def _rank(module: str) -> int:
    parts = module.split(".")
    return TOP_RANK if len(parts) == 1 else LAYERS[parts[1]]


def test_modules_import_graph_is_acyclic():
    """ds_longseq.forwards on its own (the reason for ``forwards.attn_spec`` and ``forwards.zero3``)."""
    graph = import_graph(package_sources())
    modules = {m: {d for d in deps if d.startswith("ds_longseq.forwards")}
               for m, deps in graph.items() if m.startswith("ds_longseq.forwards")}
    assert len(modules) >= 8, sorted(modules)  # the files were found
    assert find_cycle(modules) is None, " -> ".join(find_cycle(modules))


def test_package_import_graph_is_acyclic():
    graph = import_graph(package_sources())
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_imports_go_down_the_layers():
    graph = import_graph(package_sources())
    unknown = sorted({m.split(".")[1] for m in graph if "." in m} - set(LAYERS))
    assert not unknown, f"new top-level parts {unknown}: give them a rank in LAYERS"
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if _rank(d) > _rank(m))
    assert not upward, upward


def test_training_library_stays_off_the_trainer_and_the_top_level():
    """``toolkit`` and ``trainer`` share a rank but are two ways to train: neither builds on the other, and
    ``import ds_longseq`` stays light (it imports neither)."""
    graph = import_graph(package_sources())
    toolkit = {m: deps for m, deps in graph.items() if m.startswith("ds_longseq.toolkit")}
    assert len(toolkit) >= 8, sorted(toolkit)  # the files were found
    bad = sorted(f"{m} -> {d}" for m, deps in toolkit.items() for d in deps
                 if d == "ds_longseq" or d.startswith("ds_longseq.trainer"))
    assert not bad, bad
    assert not any(d.startswith(("ds_longseq.toolkit", "ds_longseq.trainer")) for d in graph["ds_longseq"])


@pytest.mark.parametrize("guarded", [False, True])
def test_a_circle_is_found_also_under_type_checking(guarded):
    """The checks above catch the circle this file guards against (attention.py importing
    ShardContext from sequence_parallel under TYPE_CHECKING, sequence_parallel importing attention)."""
    back = "from pkg.sp import ShardContext"
    if guarded:
        back = f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {back}"
    sources = {
        "pkg": ("from pkg.attention import f\n", True),
        "pkg.attention": (back + "\n", False),
        "pkg.sp": ("from pkg import attention\nfrom .layer import g\n", False),
        "pkg.layer": ("import torch\n", False),
    }
    graph = import_graph(sources)
    assert graph["pkg.sp"] == {"pkg.attention", "pkg.layer"}  # `from pkg import attention`, relative import
    assert find_cycle(graph) == ["pkg.attention", "pkg.sp", "pkg.attention"]
    del sources["pkg.attention"]
    assert find_cycle(import_graph({**sources, "pkg.attention": ("import torch\n", False)})) is None


def test_trainer_cases_are_composed_not_inherited():
    """Issue 52, item 1: each part of a Trainer case has at most one ds_longseq base between it and ``object``, and
    no constructor calls a method of its own object (an override a subclass could change under it)."""
    from ds_longseq.trainer import cases

    classes = [c for c in vars(cases).values() if isinstance(c, type) and c.__module__ == cases.__name__]
    assert len(classes) >= 10, classes
    deep = {c.__name__: [b.__name__ for b in c.__mro__[1:] if b.__module__.startswith("ds_longseq")]
            for c in classes}
    assert all(len(bases) <= 1 for bases in deep.values()), deep
    tree = ast.parse(Path(cases.__file__).read_text())
    calls_in_init = [
        f"{cls.name}: self.{call.func.attr}()" for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
        for init in cls.body if isinstance(init, ast.FunctionDef) and init.name == "__init__"
        for call in ast.walk(init) if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
        and isinstance(call.func.value, ast.Name) and call.func.value.id == "self"
    ]
    assert not calls_in_init, calls_in_init


def test_no_class_over_250_lines_and_no_constructor_over_8_parameters():
    """Issue 52, item 3: settings objects instead of long argument lists (``LayerParts``, ``CausalLMSettings``,
    ``AutoChunkSettings``), and the work a class does not need its state for in functions beside it."""
    long_classes, long_inits = [], []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                long_classes.append(f"{path.relative_to(PACKAGE_DIR)}:{node.name}")
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                args = node.args
                count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) - 1  # without self
                if count > 8:
                    long_inits.append(f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} ({count} parameters)")
    assert not long_classes and not long_inits, (long_classes, long_inits)


def test_no_module_over_800_lines_and_no_compat_module_over_250():
    """Issue 65: no grab-bag file; the compat package split by the library each module covers."""
    long = {str(path.relative_to(PACKAGE_DIR)): n for path in sorted(PACKAGE_DIR.rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > (250 if path.parent.name == "compat" else 800)}
    assert not long, f"split these by what they hold: {long}"


def test_no_module_name_repeats_across_the_package():
    """Issue 52, item 5 (docs/LAYOUT.md, "Names"): a file's name says what is inside, so "where is offload" has
    one answer per layer (``ops/host_store.py``, ``forwards/layer_input_offload.py``, ``techniques/offload.py``)
    instead of three files called ``offload.py``. A package's ``__init__`` is the one name that may repeat."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(PACKAGE_DIR)))
    assert len(seen) > 80, len(seen)  # the files were found
    repeated = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not repeated, repeated
