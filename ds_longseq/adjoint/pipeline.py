"""Adjoint sharding across processes: layers split into stages, one stage per rank (paper 002 Alg. 4).

Holds:
    split_layers: [start, end) layers per stage from ``long_seq.adjoint.layer_split`` (or evenly).
    send_to / recv_from / broadcast_from_last: the point-to-point traffic of the layer pipeline.
    check_same_batch: every stage must see the same batch (they are one model, not data parallel).

Every process of the job is one stage (the layer split must match the world size). Each rank keeps
the inputs of its own layers only (Alg. 1 line 10, tables 2-6); its optimizer states are those
DeepSpeed's ZeRO-2 partitions over the ranks. Traffic per micro-step: one (B, T, P) tensor up and
one down per stage boundary, one scalar broadcast, two 5-number all-reduces (the batch check).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["split_layers", "send_to", "recv_from", "broadcast_from_last", "check_same_batch"]


def split_layers(num_layers: int, num_stages: int, layer_split: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers.

    Args:
        num_layers: K.
        num_stages: the world size.
        layer_split: layers per stage (must have ``num_stages`` positive entries summing to K);
            None: as even as possible, earlier stages taking the remainder.

    Raises:
        ValueError: the split does not match the world size or the model, naming the fix.
    """
    if layer_split is None:
        if num_layers < num_stages:
            raise ValueError(
                f"adjoint sharding over {num_stages} ranks needs at least one layer per rank, but the model has "
                f"{num_layers} layers: launch at most {num_layers} processes"
            )
        base, extra = divmod(num_layers, num_stages)
        layer_split = [base + (i < extra) for i in range(num_stages)]
    else:
        layer_split = list(layer_split)
        if len(layer_split) != num_stages:
            raise ValueError(
                f"long_seq.adjoint.layer_split={layer_split} has {len(layer_split)} entries but the world size is "
                f"{num_stages}: give one layer count per rank, or leave layer_split out for an even split"
            )
        if any(n < 1 for n in layer_split) or sum(layer_split) != num_layers:
            raise ValueError(
                f"long_seq.adjoint.layer_split={layer_split} must be positive layer counts summing to the model's "
                f"{num_layers} layers"
            )
    bounds, start = [], 0
    for n in layer_split:
        bounds.append((start, start + n))
        start += n
    return bounds


def send_to(plan, stage: int, tensor: torch.Tensor) -> None:
    dist.send(tensor.contiguous(), dst=plan.stage_ranks[stage])


def recv_from(plan, stage: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(out, src=plan.stage_ranks[stage])
    return out


def broadcast_from_last(plan, tensor: torch.Tensor) -> None:
    dist.broadcast(tensor, src=plan.stage_ranks[-1])


def check_same_batch(input_ids: torch.Tensor, targets: torch.Tensor) -> None:
    """Raise on every rank when the ranks were given different batches (before any other collective).

    A fingerprint (shape, two weighted sums of the ids, the number of valid targets) is reduced with
    MIN and MAX; they differ exactly when some rank's fingerprint differs.
    """
    ids = input_ids.reshape(-1).to(torch.int64)
    position = torch.arange(1, ids.numel() + 1, device=ids.device)
    print_ = torch.stack([
        torch.tensor(input_ids.shape[0], device=ids.device),
        torch.tensor(input_ids.shape[-1], device=ids.device),
        ids.sum(),
        (ids * position % 1_000_003).sum(),
        (targets != -100).sum(),
    ]).to(torch.int64)
    low, high = print_.clone(), print_.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise ValueError(
            f"adjoint sharding: the ranks were given different batches (rank {dist.get_rank()}: batch "
            f"{tuple(input_ids.shape)}, {int(print_[-1])} valid labels). Every rank holds different layers of ONE "
            "model and must see the same batch: build the data loader with the same seed and no "
            "DistributedSampler, or broadcast the batch from rank 0"
        )
