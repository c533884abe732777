"""Which parameters of a recurrent token mixer belong to which of its heads, to shard it by heads.

Holds:
    HeadLayout: one rank's share of a mixer: its parameters' slices and the head counts to run them with.
    head_layout: that share for rank ``rank`` of ``size``, or the reason the mixer cannot be sharded so.

Why: under sequence parallelism a linear-attention layer's recurrence runs over the whole sequence, one
group of heads per rank (``forwards.sharded_mixer``), as Ulysses runs attention. The mixer's own code is
run unchanged on the full sequence with its parameters cut to the rank's heads, so what must be known is
only the layout: which rows of each projection feed which head. That is model knowledge, kept here.
``forwards.sharded_mixer`` checks it numerically on the first forward (the ranks' partial outputs must sum
to the whole mixer's), so a transformers release that changes a layout is refused, never wrong.

Shape legend: nk / nv key / value heads, dk / dv their head dims, P ranks, r this rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HeadLayout", "head_layout", "GATED_DELTANET_CLASSES"]

GATED_DELTANET_CLASSES = frozenset({"Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"})
"""Gated DeltaNet mixers laid out as Qwen3.5's: ``in_proj_qkv`` rows [q heads | k heads | v heads], ``in_proj_z``
rows per value head, ``in_proj_b`` / ``in_proj_a`` / ``A_log`` / ``dt_bias`` one entry per value head, the depthwise
``conv1d`` over the qkv channels, a gated norm over one head's dv, and ``out_proj`` reading every value head."""


@dataclass(frozen=True)
class HeadLayout:
    """One rank's heads of a mixer."""

    slices: dict[str, tuple[int, torch.Tensor]]
    """Parameter path inside the mixer -> (dim, index tensor) of this rank's entries along it."""
    attrs: dict[str, int]
    """Mixer attributes (head counts and widths) to run the mixer's forward with on those slices."""
    partial_output: bool = True
    """The output is this rank's heads' share of a sum over heads (the ranks' outputs add up to the mixer's)."""


def head_layout(mixer: torch.nn.Module, rank: int, size: int) -> HeadLayout | str:
    """Rank ``rank`` of ``size``'s share of ``mixer``'s heads, or why it cannot be sharded by heads."""
    name = type(mixer).__name__
    if name not in GATED_DELTANET_CLASSES:
        return (f"{name}: ds_longseq knows which parameters of {', '.join(sorted(GATED_DELTANET_CLASSES))} belong to "
                "which head, not of this mixer")
    nk, nv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    if nk % size or nv % size:
        return (f"{name} has {nk} key and {nv} value heads, not both divisible by sequence_parallel size {size}: "
                "choose a size that divides both")
    if mixer.out_proj.bias is not None:
        return f"{name}.out_proj has a bias, which one rank's share of the heads would add once per rank"
    device = mixer.out_proj.weight.device
    k_heads = torch.arange(rank * nk // size, (rank + 1) * nk // size, device=device)
    v_heads = torch.arange(rank * nv // size, (rank + 1) * nv // size, device=device)

    def rows(heads: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:
        return (offset + heads[:, None] * width + torch.arange(width, device=device)).flatten()

    key_dim = nk * dk
    qkv = torch.cat([rows(k_heads, dk), rows(k_heads, dk, key_dim), rows(v_heads, dv, 2 * key_dim)])
    values = rows(v_heads, dv)
    slices = {
        "in_proj_qkv.weight": (0, qkv),
        "conv1d.weight": (0, qkv),
        "in_proj_z.weight": (0, values),
        "in_proj_b.weight": (0, v_heads),
        "in_proj_a.weight": (0, v_heads),
        "A_log": (0, v_heads),
        "dt_bias": (0, v_heads),
        "out_proj.weight": (1, values),
    }
    if mixer.conv1d.bias is not None:
        slices["conv1d.bias"] = (0, qkv)
    local_k, local_v = nk // size, nv // size
    attrs = {
        "num_k_heads": local_k, "num_v_heads": local_v, "key_dim": local_k * dk, "value_dim": local_v * dv,
        "conv_dim": 2 * local_k * dk + local_v * dv,
    }
    return HeadLayout(slices, attrs)
