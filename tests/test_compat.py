"""ds_longseq.compat: the one package that touches third-party private names, and the version-keyed ZeRO-3 fix."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

import ds_longseq
from ds_longseq import compat
from ds_longseq.config import LongSeqConfigError
from ds_longseq.engine import split_config

PACKAGE_DIR = Path(ds_longseq.__file__).parent

# Private names of DeepSpeed, transformers and torch.distributed the package relies on (the compat package's list).
THIRD_PARTY_PRIVATE = {
    "_attn_implementation",
    "_active_collector",
    "_SEQUENCE_PARALLEL_GROUP",
    "_dim_zero_all_to_all",
    "_z3_leaf",
    "_get_default_group",
    "_get_default_store",
    "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
    "ds_id",
    "_hp_mapping",
    "_DimZeroAllToAll",
}


def _in_compat(path: Path) -> bool:
    """Whether ``path`` is one of the compat package's modules (the home of every third-party private touch)."""
    return (PACKAGE_DIR / "compat") in path.parents


def _code_names(source: str) -> set[str]:
    """Names and string literals of the code, without comments and docstrings (tokens, not text)."""
    found = set()
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME:
            found.add(tok.string)
        elif tok.type == tokenize.STRING and previous not in (tokenize.INDENT, tokenize.NEWLINE, tokenize.NL, None):
            found.add(tok.string.strip("\"'"))  # a literal in code, not a docstring
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
    return found


def test_only_compat_touches_third_party_private_names():
    offenders = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if _in_compat(path):
            continue
        hits = _code_names(path.read_text()) & THIRD_PARTY_PRIVATE
        if hits:
            offenders[str(path.relative_to(PACKAGE_DIR))] = sorted(hits)
    assert not offenders, f"third-party private names outside ds_longseq/compat/: {offenders}"


def test_the_scan_sees_code_and_skips_docstrings():
    source = '"""docstring naming _z3_leaf"""\nx = 1  # comment: _z3_leaf\ny = getattr(m, "_z3_leaf")\n'
    assert "_z3_leaf" in _code_names(source)
    assert "_z3_leaf" not in _code_names(source.replace('getattr(m, "_z3_leaf")', "2"))


# ---- the detector: every touch of another library's internals or objects is in compat/, or listed there - -------

_IDIOM_OBJECTS = {"self", "cls", "ctx"}
"""Objects a method may assign to: its own instance or class, and an autograd Function's ``ctx`` (torch's documented
place for what forward leaves to backward)."""
_ATTR_CALLS = {"getattr", "setattr", "hasattr", "delattr"}


def _package_trees(root: Path = PACKAGE_DIR) -> dict[str, ast.Module]:
    return {str(p.relative_to(root)): ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))
            if "__pycache__" not in p.parts and (root / "compat") not in p.parents}


def _defined_names(trees) -> tuple[set[str], set[str]]:
    """(every name ds_longseq defines: functions, classes, arguments, variables, imports, attributes it sets on its
    own objects; the attributes of ds_longseq's own classes: class-body names and ``self.<name> =``)."""
    names, attrs = set(), set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                args = node.args
                names.update(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg,
                                             args.kwarg] if a is not None)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                for item in node.body:
                    targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                    attrs.update(t.id for t in targets if isinstance(t, ast.Name))
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        attrs.add(item.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                names.add(node.attr)
                attrs.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add((node.asname or node.name).split(".")[0])
    return names, attrs


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _third_party_private_hooks() -> set[str]:
    """The private methods of the third-party classes ds_longseq subclasses or mixes into (a ``def`` of one of these
    names in ds_longseq overrides their internals)."""
    import transformers
    import trl

    classes = [transformers.Trainer, trl.SFTTrainer, trl.DPOTrainer, trl.GRPOTrainer]
    return {name for cls in classes for name in dir(cls) if _is_private(name)}


def _third_party_private_attributes() -> set[str]:
    """The private attributes of the third-party classes whose objects ds_longseq handles (the Trainer and TRL's
    trainers, accelerate's Accelerator, PEFT's model, DeepSpeed's engine, torch's modules, optimizers and data
    loaders): a read, call or write of one of these on any object but ds_longseq's own is a touch, also where
    ds_longseq defines an attribute of the same name (the mixin overrides ``Trainer._prepare_inputs``, so a call of
    ``trainer._prepare_inputs`` elsewhere is still one)."""
    import accelerate
    import deepspeed
    import peft
    import torch

    classes = [accelerate.Accelerator, peft.PeftModel, deepspeed.DeepSpeedEngine, torch.nn.Module,
               torch.optim.Optimizer, torch.utils.data.DataLoader]
    return _third_party_private_hooks() | {name for cls in classes for name in dir(cls) if _is_private(name)}


def _backed_classes(tree: ast.Module, hooks: set[str]) -> set[str]:
    """The classes of ``tree`` that override a third-party private hook: mixins into a third-party class (the
    Trainer mixin), whose ``self`` is that class's object."""
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and any(
        isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in hooks for item in node.body)}


class _Touches(ast.NodeVisitor):
    """The touches in one file, as ``file:function:name`` keys (the function: ``Class.method``, or ``*`` at the top)."""

    def __init__(self, file: str, defined: set[str], own_attrs: set[str], hooks: set[str], local_defs: set[str],
                 third_party: set[str] = frozenset(), backed: set[str] = frozenset()):
        self.file, self.defined, self.own_attrs = file, defined, own_attrs
        self.hooks, self.local_defs = hooks, local_defs
        self.third_party, self.backed = third_party, backed
        self.scope: list[str] = []
        self.classes: list[str] = []
        self.found: list[str] = []

    def _add(self, name: str) -> None:
        self.found.append(f"{self.file}:{'.'.join(self.scope) or '*'}:{name}")

    def _scoped(self, node) -> None:
        overrides = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and bool(self.scope) and \
            _is_private(node.name) and node.name in self.hooks
        self.scope.append(node.name)
        if isinstance(node, ast.ClassDef):
            self.classes.append(node.name)
        if overrides:
            self._add(node.name)  # a method overriding a third-party class's private hook
        self.generic_visit(node)
        if isinstance(node, ast.ClassDef):
            self.classes.pop()
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _on_own_object(self, base: ast.expr) -> bool:
        """``self`` / ``cls`` / ``super()`` inside a ds_longseq class that is not mixed into a third-party one."""
        own = (isinstance(base, ast.Name) and base.id in ("self", "cls")) or (
            isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super")
        return own and bool(self.classes) and self.classes[-1] not in self.backed

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if _is_private(node.attr) and node.attr not in self.defined:
            self._add(node.attr)  # another library's private attribute
        elif node.attr in self.third_party and not self._on_own_object(node.value):
            self._add(node.attr)  # a third-party class's private attribute, a namesake of one ds_longseq defines
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in _ATTR_CALLS and len(node.args) > 1:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value) \
                    and name.value not in self.defined:
                self._add(name.value)
            if func.id in ("setattr", "delattr") and not (
                    isinstance(node.args[0], ast.Name) and node.args[0].id in _IDIOM_OBJECTS):
                self._add(func.id)  # a dynamic assignment to some other object
        if isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__") and \
                isinstance(func.value, ast.Name) and func.value.id == "object" and node.args and not (
                    isinstance(node.args[0], ast.Name) and node.args[0].id in _IDIOM_OBJECTS):
            self._add(f"object.{func.attr}")  # past the object's own __setattr__ (a frozen dataclass's own is fine)
        self.generic_visit(node)

    def _targets(self, targets) -> None:
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if not isinstance(t, ast.Attribute) or t.attr in self.own_attrs:
                    continue
                base = t.value
                if isinstance(base, ast.Name) and (base.id in _IDIOM_OBJECTS or (
                        base.id in self.local_defs and t.attr.startswith("__"))):
                    continue  # its own object, or the metadata of a function defined here (__signature__)
                self._add(ast.unparse(t))  # an assignment to another library's object

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node.targets)
        self.generic_visit(node)

    def visit_AugAssign(self, node) -> None:
        self._targets([node.target])
        self.generic_visit(node)

    visit_AnnAssign = visit_AugAssign

    def visit_Delete(self, node: ast.Delete) -> None:
        self._targets(node.targets)
        self.generic_visit(node)


def third_party_touches(trees: dict[str, ast.Module]) -> list[str]:
    """Every touch of another library's internals or objects in ``trees`` ({file: module}), as ``file:function:name``:
    a private attribute ds_longseq does not define (read, written, or named to getattr and kin); an assignment or
    ``del`` on an object other than the method's own (``self``, ``cls``, autograd's ``ctx``) of an attribute none of
    ds_longseq's classes has; ``setattr`` / ``delattr`` / ``object.__setattr__`` on such an object; a method that
    overrides a private method of the Trainer or TRL's trainers; a third-party class's private attribute
    (``_third_party_private_attributes``) read, called or written on anything but a ds_longseq object's own ``self``,
    ``cls`` or ``super()`` (in a class mixed into a third-party one, ``self`` is that class's object), also where
    ds_longseq defines a namesake. Read from the code as text, so an alias can hide a
    touch: the list is a net for the usual ways, not a proof."""
    defined, own_attrs = _defined_names(trees)
    hooks = _third_party_private_hooks()
    third_party = _third_party_private_attributes()
    found = []
    for file, tree in trees.items():
        local_defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        visitor = _Touches(file, defined, own_attrs, hooks, local_defs, third_party, _backed_classes(tree, hooks))
        visitor.visit(tree)
        found.extend(visitor.found)
    return found


def test_every_third_party_touch_outside_compat_is_listed_there_with_its_reason():
    found = set(third_party_touches(_package_trees()))
    unlisted = sorted(found - set(compat.TOUCHES_ELSEWHERE))
    assert not unlisted, (
        "touches of third-party internals or objects outside ds_longseq/compat/: move each behind a named function "
        f"in the compat module of its library, or list it in compat.TOUCHES_ELSEWHERE with its reason: {unlisted}"
    )
    stale = sorted(set(compat.TOUCHES_ELSEWHERE) - found)
    assert not stale, f"compat.TOUCHES_ELSEWHERE lists touches no longer in the code (drop them): {stale}"
    assert all(reason.strip() for reason in compat.TOUCHES_ELSEWHERE.values())


@pytest.mark.parametrize("added, key", [
    ("self.accelerator.gather = None", "trainer/mixin.py:LongSeqTrainerMixin.compute_loss:self.accelerator.gather"),
    ("del model.config.use_cache", "trainer/mixin.py:LongSeqTrainerMixin.compute_loss:model.config.use_cache"),
    ("print(self._metrics)", "trainer/mixin.py:LongSeqTrainerMixin.compute_loss:_metrics"),
    ("getattr(self, '_train_batch_size')", "trainer/mixin.py:LongSeqTrainerMixin.compute_loss:_train_batch_size"),
    ("setattr(self.args, 'gradient_checkpointing', False)",
     "trainer/mixin.py:LongSeqTrainerMixin.compute_loss:setattr"),
])
def test_the_detector_finds_a_touch_added_to_the_trainer(added, key):
    trees = _package_trees()
    source = (PACKAGE_DIR / "trainer" / "mixin.py").read_text()
    anchor = "    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):\n"
    assert anchor in source
    trees["trainer/mixin.py"] = ast.parse(source.replace(anchor, anchor + f"        {added}\n"))
    found = set(third_party_touches(trees))
    assert key in found and key not in compat.TOUCHES_ELSEWHERE


@pytest.mark.parametrize("added, key", [
    ("inputs = trainer._prepare_inputs(inputs)", "_prepare_inputs"),  # the call the detector once missed
    ("shared.stock._get_num_items_in_batch([inputs], None)", "_get_num_items_in_batch"),
    ("model._parameters.clear()", "_parameters"),
])
def test_the_detector_finds_a_third_party_private_name_that_ds_longseq_also_defines(added, key):
    """A private attribute of a third-party class read, called or written on another object is a touch even where
    ds_longseq defines a namesake (the mixin's ``_prepare_inputs`` override; ``_parameters``: torch's Module)."""
    trees = _package_trees()
    source = (PACKAGE_DIR / "trainer" / "cases.py").read_text()
    anchor = "        sp, trainer = shared.sp, shared.trainer\n"
    assert source.count(anchor) == 1
    trees["trainer/cases.py"] = ast.parse(source.replace(anchor, anchor + f"        {added}\n"))
    assert f"trainer/cases.py:ShardedEvaluation.prediction_step:{key}" in third_party_touches(trees)


def test_the_detector_finds_an_overridden_private_hook():
    trees = _package_trees()
    source = (PACKAGE_DIR / "trainer" / "mixin.py").read_text()
    anchor = "    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):\n"
    hook = "    def _maybe_log_save_evaluate(self, *args, **kwargs):\n        return None\n\n"
    trees["trainer/mixin.py"] = ast.parse(source.replace(anchor, hook + anchor))
    assert ("trainer/mixin.py:LongSeqTrainerMixin._maybe_log_save_evaluate:_maybe_log_save_evaluate"
            in third_party_touches(trees))


@pytest.mark.parametrize("version", ["0.18.9", "0.19.8", "0.19.8+cu124", "0.19.8rc1"])
def test_the_checked_release_runs_zero3_with_sequence_parallelism(version):
    assert compat.zero3_sequence_parallel_problem(version) is None


@pytest.mark.parametrize("version", ["0.19.9", "0.20.0", "0.18.2", "0.18.8"])
def test_an_unchecked_release_is_refused_not_corrected(version):
    problem = compat.zero3_sequence_parallel_problem(version)
    assert f"DeepSpeed {version}" in problem and "use ZeRO stage 2" in problem
    with pytest.raises(RuntimeError, match="use ZeRO stage 2"):
        compat.fix_zero3_sequence_parallel_average(object(), 2, version=version)


class _Stage3Stub:
    """Stands in for DeepSpeed's ZeRO-3 optimizer: its name-mangled average of a list of gradients."""

    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params, communication_data_type):
        return [p / 4 for p in params]  # averaged over a world of 4


def test_the_fix_multiplies_back_by_the_sequence_parallel_size_on_this_instance_only():
    import torch

    optimizer, other = _Stage3Stub(), _Stage3Stub()
    assert compat.fix_zero3_sequence_parallel_average(optimizer, 2, version="0.19.8") is True
    grads = [torch.tensor([8.0]), torch.tensor([4.0])]
    fixed = optimizer._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(grads, None)
    assert [g.item() for g in fixed] == [4.0, 2.0]  # over world / SP = 2 replicas
    assert [g.item() for g in other._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(grads, None)] == [2.0, 1.0]
    assert compat.fix_zero3_sequence_parallel_average(_Stage3Stub(), 1, version="0.19.9") is False
    with pytest.raises(RuntimeError, match="expected DeepSpeed's ZeRO-3 optimizer"):
        compat.fix_zero3_sequence_parallel_average(object(), 2, version="0.19.8")


def test_split_config_refuses_zero3_with_sequence_parallelism_on_an_unchecked_deepspeed(monkeypatch):
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "long_seq": {"sequence_parallel": {"size": 2}, "streambp": {"enabled": True}}}
    split_config(config)  # the installed, checked release
    monkeypatch.setattr(deepspeed, "__version__", "0.19.9")
    with pytest.raises(LongSeqConfigError, match="on DeepSpeed 0.19.9: ds_longseq checked"):
        split_config(config)
    split_config({**config, "zero_optimization": {"stage": 2}})  # ZeRO-2 averages right on every release


@pytest.mark.parametrize("backend,version,one_at_a_time", [
    ("gloo", "0.18.9", True),  # waits on its last all-gather only: gloo's others may not have landed
    ("gloo", "0.18.9+cpu", True),
    ("nccl", "0.18.9", False),  # one stream: the last one's end covers the others
    ("gloo", "0.19.8", False),  # waits on every handle
    (None, "0.18.9", False),  # no process group: nothing to gather
])
def test_deepspeed_0_18_gathers_parameters_one_at_a_time_under_gloo(backend, version, one_at_a_time):
    assert compat.gathers_one_at_a_time(backend, version) is one_at_a_time


class _RecordedGather:
    """Stands in for ``deepspeed.zero.GatheredParameters``: records the parameter lists it is entered with."""

    calls: list = []

    def __init__(self, params, **kwargs):
        self.params, self.kwargs = list(params), kwargs

    def __enter__(self):
        _RecordedGather.calls.append((self.params, self.kwargs))

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("version,expected", [("0.18.9", [["a"], ["b"]]), ("0.19.8", [["a", "b"]])])
def test_deepspeeds_own_gathers_take_one_parameter_at_a_time_inside_the_block(monkeypatch, version, expected):
    """``deepspeed_gathers_one_at_a_time`` (the Trainer's save_model runs inside it): DeepSpeed's own
    ``deepspeed.zero.GatheredParameters([a, b])`` is entered once per parameter on 0.18 under gloo, whole on 0.19;
    the original is back after the block."""
    import deepspeed
    import torch.distributed as dist

    from ds_longseq.compat import deepspeed_shims

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", _RecordedGather)
    monkeypatch.setattr(deepspeed_shims, "deepspeed_version", lambda: version)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    _RecordedGather.calls = []
    with compat.deepspeed_gathers_one_at_a_time():
        with deepspeed.zero.GatheredParameters(["a", "b"], modifier_rank=0):
            pass
        with compat.gathered_parameters(["a", "b"], modifier_rank=0):  # ds_longseq's own: the same way
            pass
    assert [params for params, _ in _RecordedGather.calls] == expected * 2
    assert all(kwargs == {"modifier_rank": 0} for _, kwargs in _RecordedGather.calls)
    assert deepspeed.zero.GatheredParameters is _RecordedGather
