"""Hybrid models (recurrent layers) under Ulysses x ring, on CPU gloo ranks, against one process (float64, 1e-10).

Under a ring each rank's tokens are two runs of the sequence (``ops.sp_layout``); with
``sequence_parallel.recurrent="pass_state"`` (inside StreamBP) a recurrent layer carries its states from each run
to the rank holding the next one (``ops.state_passing.StateRing``), and StreamBP's chunks never cross a run's end.
The ranks hold different numbers of valid tokens (``model_zoo.tiny_batch``: one row right-padded, one prompt
masked); the loss, this rank's input gradient and every parameter gradient (summed over the ranks) must equal the
stock model on the whole batch.
"""

from __future__ import annotations

import pytest
import torch

from tests import model_sweep, model_zoo
from tests.dist_utils import run_distributed

STREAMBP = {"streambp": {"enabled": True, "chunk_size": 3}, "attention": {"kv_block_size": 4},
            "lm_head": {"enabled": True, "chunk_size": 9}}


def ring_pass_state_worker(rank: int, world: int, model_type: str, ring: int, mutations: tuple[str, ...]):
    """(positions of this rank's tokens, {case: (loss, grads summed over the group, input grads)}); the cases are
    "exact" and each mutation of ``mutations``: "state_not_passed" (every run starts from zeros: the received
    states dropped), "run_order_ignored" (the chain of runs replaced by Ulysses' rank-to-rank one)."""
    import torch.distributed as dist

    import ds_longseq
    from ds_longseq.engine import shard_batch
    from ds_longseq.ops import state_passing
    from ds_longseq.ops.sp_layout import sp_positions

    batch = model_zoo.tiny_batch(model_type)
    T = batch["input_ids"].shape[1]
    local = shard_batch(batch, rank, world, ring=ring)
    out = {"positions": sp_positions(T, world // ring, ring)[rank]}
    original_recv, original_init = state_passing.StateRing.from_previous, state_passing.StateRing.__init__
    for case in ("exact", *mutations):
        if case == "state_not_passed":
            state_passing.StateRing.from_previous = lambda self, device, segment=0: (
                original_recv(self, device, segment), {})[1]
        if case == "run_order_ignored":
            state_passing.StateRing.__init__ = lambda self, group, positions=None: original_init(self, group, None)
        try:
            model = ds_longseq.enable(
                model_zoo.tiny_model(model_type, torch.float64).train(),
                {**STREAMBP, "sequence_parallel": {"size": world, "ring": ring, "recurrent": "pass_state"}},
                sp_group=dist.group.WORLD)
            loss, grads, embeds = model_sweep._loss_and_grads(model, local)
        finally:
            state_passing.StateRing.from_previous, state_passing.StateRing.__init__ = original_recv, original_init
        for g in grads.values():
            dist.all_reduce(g)
        out[case] = (loss, grads, embeds)
    return out


def _errors(results, model_type: str, case: str) -> list[tuple[str, float]]:
    batch = model_zoo.tiny_batch(model_type)
    loss, grads, embeds = model_sweep._loss_and_grads(model_zoo.tiny_model(model_type, torch.float64).train(), batch)
    return [model_sweep.worst_error(r[case], (loss, grads, embeds[:, r["positions"]])) for r in results]


@pytest.mark.parametrize("model_type", ["qwen3_5_text"])
def test_pass_state_under_a_ring_matches_one_process(model_type):
    """Qwen3.5 (Gated DeltaNet layers and attention) at SP 2 with the ring forced (1 x 2: rank 0 holds tokens
    [0, 10) and [30, 40), rank 1 [10, 30)), StreamBP chunks of 3: the states go 0 -> 1 -> 0 along the runs, the
    gradients back. Exact at 1e-10; dropping the received states, or passing them rank to rank as under Ulysses
    alone, fails by more than 1e-3."""
    mutations = ("state_not_passed", "run_order_ignored")
    results = run_distributed(ring_pass_state_worker, 2, (2, model_type, 2, mutations))
    for worst, error in _errors(results, model_type, "exact"):
        assert error < 1e-10, (worst, error)
    for mutation in mutations:
        assert max(error for _, error in _errors(results, model_type, mutation)) > 1e-3, mutation
