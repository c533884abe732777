"""Sequence parallelism on grouped-query models whose key/value heads do not divide the SP size (issue 49 item 4).

Ulysses shards heads: its degree u must divide the query heads, and divide the key/value heads or be a multiple
of them (each rank then one replica of the key/value head its query heads share). ``ops.sp_layout.sp_degrees``
picks the largest such u and runs ring attention over the rest (u x r = the SP size). A model with 6 query and 3
key/value heads at SP 4 used to take u = 2 from the query heads alone and fail at start on every rank; real
shapes that hit it: Qwen2.5-1.5B (12 / 2) at SP 3, Qwen2.5-14B (40 / 8) at SP 5 or 10, Qwen2.5-0.5B (14 / 2) at
SP 7. Each shape below runs on that many gloo ranks against one process (float64, 1e-10, uneven valid tokens per
rank), under StreamBP and under whole-shard attention; the planner and the communication model make the same
split; a forced ring that breaks a head count is refused naming both counts and the ring degrees that work.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import comm_model
from ds_longseq.families.dims import ModelDims
from ds_longseq.ops.sp_layout import length_unit, sp_degrees
from ds_longseq.plan import Setup, sp_split
from tests.dist_utils import run_distributed
from tests.helpers import full_precision_norms, loss_and_grads, make_model
from tests.test_sequence_parallel import _check_ring, global_batch, ring_worker

HEAD_DIM = 8
# (query heads, key/value heads, SP size, (u, r)); each launch starts that many ranks on this 2-core machine
# (50-70 s): the issue's own 6 / 3 at SP 4 runs by default, the rest under -m slow
GRID = [
    (6, 3, 4, (1, 4)),
    pytest.param(12, 2, 3, (1, 3), marks=pytest.mark.slow),  # Qwen2.5-1.5B
    pytest.param(9, 3, 6, (3, 2), marks=pytest.mark.slow),  # SmolLM2-135M's 9 / 3 at 2, 3, 4 and 6
    pytest.param(9, 3, 3, (3, 1), marks=pytest.mark.slow),
    pytest.param(9, 3, 2, (1, 2), marks=pytest.mark.slow),
    pytest.param(9, 3, 4, (1, 4), marks=pytest.mark.slow),
    pytest.param(40, 8, 5, (1, 5), marks=pytest.mark.slow),  # Qwen2.5-14B
    pytest.param(40, 8, 10, (2, 5), marks=pytest.mark.slow),
    pytest.param(14, 2, 7, (1, 7), marks=pytest.mark.slow),  # Qwen2.5-0.5B
    pytest.param(28, 4, 8, (4, 2), marks=pytest.mark.slow),  # Qwen2.5-7B
]


def _overrides(heads: int, kv: int) -> dict:
    return {"num_attention_heads": heads, "num_key_value_heads": kv, "hidden_size": heads * HEAD_DIM,
            "head_dim": HEAD_DIM}


def _seq_len(size: int, ring: int) -> int:
    """The shortest length of at least 40 tokens the layout cuts evenly (2 u r under a ring)."""
    unit = length_unit(size, ring)
    return -(-40 // unit) * unit


@pytest.mark.parametrize("heads, kv, size, degrees", GRID)
def test_gqa_shapes_match_one_process(heads, kv, size, degrees):
    assert sp_degrees(size, heads, num_kv_heads=kv) == degrees
    seq_len = _seq_len(size, degrees[1])
    overrides = _overrides(heads, kv)
    cases = ["ulysses_only", "streambp"]
    results = run_distributed(ring_worker, world_size=size,
                              args=(size, "llama", overrides, None, cases, True, seq_len), timeout=900)
    model = full_precision_norms(make_model("llama", torch.float64, **overrides))
    reference = loss_and_grads(model, global_batch(seq_len=seq_len), use_reference=True, ref_dtype=torch.float64)
    _check_ring(results, reference, cases, degrees)


@pytest.mark.parametrize("heads, kv", [(6, 3), (12, 2), (40, 8), (14, 2), (9, 3), (28, 4), (32, 8), (64, 8)])
def test_the_planner_and_the_comm_model_make_the_same_split(heads, kv):
    """For every SP size up to 16: the model's split (``techniques.sequence_parallel`` via ``sp_degrees``), the
    planner's (``plan.sp_split``) and the communication model's (``benchmarks.comm_model``) agree."""
    dims = ModelDims(num_layers=2, hidden_size=heads * HEAD_DIM, intermediate_size=64, num_heads=heads,
                     num_kv_heads=kv, head_dim=HEAD_DIM, vocab_size=100)
    for size in range(1, 17):
        want = sp_degrees(size, heads, num_kv_heads=kv)
        assert sp_split(dims, Setup(sequence_parallel=size, gpus=size)) == want, size
        assert comm_model.sp_degrees(size, heads, None, kv) == want, size


def test_a_forced_ring_that_breaks_the_key_value_heads_is_refused_at_enable():
    """6 / 3 heads at SP 4 with ring 2 (Ulysses 2: it divides 6 but neither divides nor is a multiple of 3):
    refused before anything runs, naming both head counts, the sizes the user set and the ring degrees that work."""
    import ds_longseq

    model = make_model("llama", torch.float64, **_overrides(6, 3))
    with pytest.raises(Exception, match=r"ring=2 with sequence_parallel.size=4 leaves a Ulysses degree of 2, which "
                                        r"cannot shard the model's 6 query and 3 key/value heads.*one of \[4\]"):
        ds_longseq.enable(model, {"sequence_parallel": {"size": 4, "ring": 2}})
