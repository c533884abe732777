"""Trainer batches under sequence parallelism: cut across the group, sent from one rank of it, read in turns.

Holds:
    shard_inputs: this rank's part of a Trainer batch (its sequence tensors cut by ``engine.shard_batch``).
    broadcast_batch: one rank's batch (and token count) on every rank of its group.
    GroupTurnsLoader: a dataloader with ALST's data semantics (each rank reads its own batches, the group trains on
        them in turn).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from ds_longseq.engine import shard_batch
from ds_longseq.engine.sp_groups import SHARDED_KEYS
from ds_longseq.ops.sp_layout import SPLayout

__all__ = ["shard_inputs", "broadcast_batch", "GroupTurnsLoader"]


def shard_inputs(
    inputs: Mapping[str, Any], sp_rank: int, sp_size: int, ring: int | None = None
) -> dict[str, Any]:
    """This rank's part of a Trainer batch: the sequence tensors cut by ``shard_batch`` (labels become
    ``shift_labels``; under a ring, ``ring`` > 1, the layout's tokens, not a contiguous slice), flags and other
    non-sequence values passed on unchanged.

    Raises:
        ValueError: no (B, T) ``input_ids``, or a per-token tensor ``shard_batch`` cannot cut.
    """
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("ds_longseq sequence parallelism in the Trainer needs (batch, seq) input_ids in each batch")
    seq = {k: v for k, v in inputs.items() if k in SHARDED_KEYS}
    # seq_idx (TRL's padding-free collator: each token's document) is read only by the fused short-convolution
    # kernels of linear-attention layers; ds_longseq refuses packed rows on those families (it finds the
    # documents from the restarting position ids, which the collator also sends).
    rest = {k: v for k, v in inputs.items() if k not in SHARDED_KEYS and k != "seq_idx"}
    for key, value in rest.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(ids.shape):
            raise ValueError(
                f"batch key {key!r} is a per-token tensor that ds_longseq cannot cut by sequence: drop it from the "
                f"collator's output (keys it cuts: {sorted(SHARDED_KEYS)})"
            )
    return {**rest, **shard_batch(seq, sp_rank, sp_size, pad=True, layout=SPLayout(sp_size, ring or 1))}


def broadcast_batch(inputs: Mapping[str, Any], num_items, member: int, group) -> tuple[dict[str, Any], Any]:
    """Rank ``member`` (of ``group``)'s batch and token count, on every rank of the group: its tensors
    broadcast (shapes and dtypes first), its other values as they are."""
    src = dist.get_global_rank(group, member)
    device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    meta = [{k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
            num_items.item() if isinstance(num_items, torch.Tensor) else num_items]
    dist.broadcast_object_list(meta, src=src, group=group,
                               device=device if device.type == "cuda" else None)
    batch = {}
    for key, value in meta[0].items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype):
            tensor = inputs[key].contiguous() if dist.get_rank() == src else torch.empty(
                value[0], dtype=value[1], device=device)
            dist.broadcast(tensor, src=src, group=group)
            batch[key] = tensor
        else:
            batch[key] = value
    count = meta[1]
    if isinstance(num_items, torch.Tensor):
        count = torch.tensor(count, dtype=num_items.dtype, device=num_items.device)
    return batch, count


class GroupTurnsLoader:
    """A training dataloader under ``parallelism_config``'s sequence parallelism, with ALST's semantics
    (DeepSpeed's ``UlyssesSPDataLoaderAdapter``): every rank reads its own batches, and for each of them the group's
    P batches are trained on one after the other, rank 0's first, each whole on every rank of the group
    (the case's ``compute_loss`` cuts it). So an epoch has P times the wrapped loader's batches, as the Trainer
    counts it under ALST, and every step sees the same samples as under ALST."""

    def __init__(self, dataloader, rank: int, size: int, group):
        self.dataloader, self.rank, self.size, self.group = dataloader, rank, size, group

    def __len__(self) -> int:
        return len(self.dataloader) * self.size

    def __iter__(self):
        for batch in self.dataloader:
            for member in range(self.size):
                yield broadcast_batch(batch, None, member, self.group)[0]

    def __getattr__(self, name: str):  # set_epoch, sampler, dataset, ...: the wrapped loader's
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)
