"""The planner loads without torch (issue 52, item 4), and the lazy package namespaces behind that
(``ds_longseq.lazy``) give every public name as the eager imports did."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

import ds_longseq
from ds_longseq.lazy import lazy_exports

HEAVY = ("torch", "transformers", "deepspeed")


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys\n{statement}\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("statement", ["import ds_longseq.plan", "import ds_longseq",
                                       "from ds_longseq.plan import Setup, estimate"])
def test_the_planner_imports_without_torch(statement):
    assert _loaded_after(statement) == []


def test_a_public_name_loads_torch_on_first_use():
    """The control: the same probe sees torch once a name that needs it is used, so the test above can fail."""
    assert "torch" in _loaded_after("import ds_longseq\nds_longseq.enable")


@pytest.mark.parametrize("package", ["ds_longseq", "ds_longseq.ops", "ds_longseq.families"])
def test_every_public_name_resolves_to_its_modules_object(package):
    module = __import__(package, fromlist=["_"])
    names = [n for n in module.__all__ if n != "__version__"]
    assert names, package
    for name in names:
        value = getattr(module, name)
        assert value is not None and name in dir(module), name
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018 (the lookup is the test)


def test_submodules_are_attributes_and_listed_names_come_from_their_modules():
    from ds_longseq.ops import chunk_causal_attention
    from ds_longseq.ops.chunk_attention import chunk_causal_attention as direct

    assert chunk_causal_attention is direct
    assert ds_longseq.ops.ring.__name__ == "ds_longseq.ops.ring"
    assert ds_longseq.enable is __import__("ds_longseq.patch", fromlist=["enable"]).enable


def test_the_table_is_read_from_the_type_checking_block(tmp_path, monkeypatch):
    init = tmp_path / "__init__.py"
    init.write_text(textwrap.dedent("""
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from json import dumps as to_text, loads
    """))
    monkeypatch.setitem(sys.modules, "lazy_probe", types.ModuleType("lazy_probe"))
    getattr_, dir_ = lazy_exports("lazy_probe", str(init))
    assert getattr_("to_text") is json.dumps and sys.modules["lazy_probe"].to_text is json.dumps  # cached
    assert "loads" in dir_()
    with pytest.raises(AttributeError):
        getattr_("x")
    init.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import y\n")
    with pytest.raises(ImportError, match="only absolute"):
        lazy_exports("lazy_probe", str(init))
