"""Evaluation loss by position: where in its document each target sits, bucketed (``eval_loss_pos_<b>of8``).

Holds:
    POSITION_BUCKETS: how many buckets of a document's length the loss is reported in.
    target_buckets: each position's bucket (of the token it predicts).
    PositionLosses: the loss sums and token counts per bucket over one evaluation loop.
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ds_longseq.engine import shard_sequence
from ds_longseq.patch import recording_tokens

__all__ = ["POSITION_BUCKETS", "target_buckets", "PositionLosses"]

POSITION_BUCKETS = 8
"""Evaluation reports the loss in this many buckets of each document's length (``eval_loss_pos_1of8`` ...)."""


def target_buckets(batch: Mapping[str, Any], buckets: int) -> torch.Tensor:
    """(B, T) long: for each position, the bucket (0 .. buckets - 1) of the token it predicts (the next one) by that
    token's place in its document, floor(buckets x place / document length); -1 where no token is predicted (the
    last position) or the next token is padding. Documents: rows (right or left padded by ``attention_mask``), or the
    packed documents of rows without a mask whose ``position_ids`` restart at 0."""
    ids = batch["input_ids"]
    mask, pos = batch.get("attention_mask"), batch.get("position_ids")
    if mask is None and pos is not None:  # packed rows: a document starts where the positions restart
        pos = pos.expand_as(ids).long()
        doc = (pos == 0).long().cumsum(-1)
        counts = pos.new_zeros(pos.shape[0], pos.shape[1] + 1).scatter_add_(1, doc, torch.ones_like(pos))
        length = counts.gather(1, doc)
        place, real = pos, torch.ones_like(pos, dtype=torch.bool)
    else:
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        place = real.long().cumsum(-1) - 1
        length = real.long().sum(-1, keepdim=True).expand_as(place)
    bucket = torch.where(real, (buckets * place) // length.clamp_min(1), torch.full_like(place, -1))
    return torch.cat([bucket[:, 1:], bucket.new_full((bucket.shape[0], 1), -1)], dim=1)


class PositionLosses:
    """The loss sums and token counts per position bucket of one evaluation loop of ``model`` (ds_longseq's forward
    records each loss call's per-token log-probs while :meth:`recording`)."""

    def __init__(self, model: torch.nn.Module, buckets: int = POSITION_BUCKETS):
        self.model, self.buckets = model, buckets
        self.sums = torch.zeros(2, buckets, dtype=torch.float64)  # loss sums, token counts

    @contextlib.contextmanager
    def recording(self, batch: Mapping[str, Any] | None, sp=None):
        """Around one evaluation forward of ``batch`` (whole; None: nothing recorded): the loss of its targets added
        by where each target sits in its document (this rank's shard under ``sp``, cut as ``shard_batch`` cuts: under
        a ring the layout's tokens, so each recorded log-prob meets its own target's bucket)."""
        if batch is None:
            yield
            return
        with recording_tokens(self.model) as records:
            yield
        targets = target_buckets(batch, self.buckets)  # (B, T): the bucket of the token each position predicts
        if sp is not None:
            targets = shard_sequence(targets, sp.rank, sp.size, fill=-1, ring=sp.ring)
        for logprobs, mask in records:
            width = logprobs.shape[1]  # T - 1 from a fused call given unshifted labels
            buckets = targets[:, :width].to(logprobs.device)
            valid = mask & (buckets >= 0)
            index = buckets[valid]
            sums = torch.zeros(2, self.buckets, dtype=torch.float64, device=logprobs.device)
            sums[0].index_add_(0, index, -logprobs[valid].double())
            sums[1].index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
            self.sums += sums.cpu()

    def metrics(self, prefix: str, device) -> dict[str, float]:
        """``<prefix>_loss_pos_<b>of<buckets>``: the token-mean loss of each bucket with targets, summed over every
        rank (a collective when a process group is up)."""
        sums = self.sums
        if dist.is_initialized():
            sums = sums.to(device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        return {f"{prefix}_loss_pos_{b + 1}of{self.buckets}": (sums[0, b] / sums[1, b]).item()
                for b in range(self.buckets) if sums[1, b] > 0}
