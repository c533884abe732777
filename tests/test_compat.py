"""ds_longseq.compat: the one module that touches third-party private names, and the version-keyed ZeRO-3 fix."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

import ds_longseq
from ds_longseq import compat
from ds_longseq.config import LongSeqConfigError
from ds_longseq.engine import split_config

PACKAGE_DIR = Path(ds_longseq.__file__).parent

# Private names of DeepSpeed, transformers and torch.distributed the package relies on (compat.py's list).
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
}


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
        if path.name == "compat.py" and path.parent == PACKAGE_DIR:
            continue
        hits = _code_names(path.read_text()) & THIRD_PARTY_PRIVATE
        if hits:
            offenders[str(path.relative_to(PACKAGE_DIR))] = sorted(hits)
    assert not offenders, f"third-party private names outside ds_longseq/compat.py: {offenders}"


def test_the_scan_sees_code_and_skips_docstrings():
    source = '"""docstring naming _z3_leaf"""\nx = 1  # comment: _z3_leaf\ny = getattr(m, "_z3_leaf")\n'
    assert "_z3_leaf" in _code_names(source)
    assert "_z3_leaf" not in _code_names(source.replace('getattr(m, "_z3_leaf")', "2"))


@pytest.mark.parametrize("version", ["0.19.8", "0.19.8+cu124", "0.19.8rc1"])
def test_the_checked_release_runs_zero3_with_sequence_parallelism(version):
    assert compat.zero3_sequence_parallel_problem(version) is None


@pytest.mark.parametrize("version", ["0.19.9", "0.20.0", "0.18.2"])
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
