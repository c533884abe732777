"""No module of ds_longseq uses another module's private (underscore) names.

A helper another module needs gets a public name in its own module (issue 65: ``ops/ring.py`` imported eight
underscore names of ``ops/chunk_attention.py``; they are ``ops/tile_kernels.py``'s public names now). Read from the
source with ``ast``, like tests/test_import_graph.py: ``from m import _x`` (relative imports too), an imported
private module (``from pkg import _m``), and ``m._x`` on a name bound to a ds_longseq module by an import
(``import ds_longseq.ops.ring as ring``, ``from ds_longseq.ops import ring``, or the dotted ``ds_longseq.ops.ring._x``).
Dunder names (``__version__``) are not private; a module reading its own names is not a use of another's.
"""

from __future__ import annotations

import ast
import textwrap

from tests.test_import_graph import package_sources


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _imports(module: str, source: str, is_package: bool, names: set[str]):
    """Yield (node, target, alias) for each ``from``-imported name of the package (``target``: the absolute module
    it is imported from) and fill ``alias`` {local name: package module} for names bound to modules."""
    root = module.split(".")[0]
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == root:
                    yield node, None, (a.asname, a.name) if a.asname else (root, root)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1 parents
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != root:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                yield node, (target, a.name), (a.asname or a.name, sub) if sub in names else None


def private_uses(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """'module:line: name' for each use of another ds_longseq module's private name, from {module: (source,
    is_package)} (``tests.test_import_graph.package_sources``)."""
    names = set(sources)
    found = []
    for module, (source, is_package) in sources.items():
        modules: dict[str, str] = {}  # local name -> the package module it is bound to
        for node, imported, bound in _imports(module, source, is_package, names):
            if bound is not None:
                modules[bound[0]] = bound[1]
            if imported is not None and _private(imported[1]) and imported[0] != module:
                found.append(f"{module}:{node.lineno}: {imported[0]}.{imported[1]}")
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain, base = [], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                owner = ".".join([modules[base.id], *reversed(chain)])
                if owner in names and owner != module:
                    found.append(f"{module}:{node.lineno}: {owner}.{node.attr}")
    return sorted(found)


def test_no_module_uses_another_modules_private_names():
    found = private_uses(package_sources())
    assert not found, (
        "these use another module's underscore names: give the name a public one in its own module (and list it in "
        f"that module's __all__) instead: {found}")


def test_the_detector_finds_each_kind_of_use():
    """The control: a planted use of each kind is found, and what is allowed is not."""

    def src(text: str) -> str:
        return textwrap.dedent(text)

    sources = {
        "pkg": ("__version__ = '1'\n", True),
        "pkg.ops": ("", True),
        "pkg.ops.a": (src("""
            _x = 1
            y = 2
            print(_x)
        """), False),
        "pkg.ops._hidden": ("", False),
        "pkg.ops.b": (src("""
            from pkg.ops.a import _x
            from .a import _x as x2
            from pkg.ops import _hidden
            from pkg.ops import a
            import pkg.ops.a as aa
            import pkg.ops.a
            from pkg.ops.a import y as _y
            from pkg import __version__
            print(a._x, aa._x, pkg.ops.a._x, a.y, _y)

            class C:
                _z = 0

                def f(self):
                    return self._z
        """), False),
    }
    # lines 2 and 3: imported, 4: a private module, 10: a._x, aa._x and pkg.ops.a._x (not a.y, _y, self._z)
    assert private_uses(sources) == sorted([
        "pkg.ops.b:2: pkg.ops.a._x", "pkg.ops.b:3: pkg.ops.a._x", "pkg.ops.b:4: pkg.ops._hidden",
        *["pkg.ops.b:10: pkg.ops.a._x"] * 3,
    ])
