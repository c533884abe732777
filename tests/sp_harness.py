"""One harness for the sequence-parallel parity tests (Ulysses, ring, Ulysses x ring; tests/test_sequence_parallel.py,
tests/test_ring_families.py, tests/test_real_weights.py, tests/test_gqa_layouts.py): one rank's step on its shard of
a batch, with the parameter gradients summed over the group and the global positions of the rank's tokens, which
each test then compares with one process run on the whole batch (its input gradient at those positions)."""

from __future__ import annotations

from typing import Callable

import torch


def rank_step(model, batch: dict, rank: int, world: int, ring: int,
              loss_and_grads: Callable[[torch.nn.Module, dict], tuple]) -> tuple:
    """``(loss, {name: gradient summed over the group}, input gradient, positions)``: this rank's input-gradient
    rows (B, T / P, d) and their global positions (T / P,).

    ``batch`` is the whole batch (the same on every rank), cut by the model's layout (``engine.shard_batch(batch,
    layout=model)``), which must be ``world / ring`` x ``ring``; ``model`` is enabled with sequence parallelism
    ``world`` over the default group; ``loss_and_grads(model, local_batch)``
    returns ``(loss, {name: gradient}, input gradient)`` as the test's reference does for one process.
    """
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch, sp_layout_of
    from ds_longseq.ops.sp_positions import sp_positions

    layout = sp_layout_of(model)
    assert (layout.size, layout.degrees, layout.rank) == (world, (world // ring, ring), rank), layout
    local = shard_batch(batch, layout=model)
    loss, grads, embed_grad = loss_and_grads(model, local)
    for g in grads.values():
        dist.all_reduce(g)
    positions = sp_positions(batch["input_ids"].shape[1], world // ring, ring)[rank]
    return loss, grads, embed_grad, positions
