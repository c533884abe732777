"""Which parameters of a recurrent token mixer belong to which of its heads, to shard it by heads.

Holds:
    HeadLayout: one rank's share of a mixer: its parameters' slices and the head counts to run them with.
    head_layout: that share for rank ``rank`` of ``size``, or the reason the mixer cannot be sharded so.
    LAYOUTS: mixer class name -> the function that cuts it (one per layout kind below).

Why: under sequence parallelism a linear-attention layer's recurrence runs over the whole sequence, one
group of heads per rank (``forwards.head_sharding_forward``), as Ulysses runs attention. The mixer's own code is
run unchanged on the full sequence with its parameters cut to the rank's heads, so what must be known is
only the layout: which rows of each projection feed which head. That is model knowledge, kept here.
``forwards.head_sharding_forward`` checks it numerically on the first forward (the ranks' partial outputs must sum
to the whole mixer's), so a transformers release that changes a layout is refused, never wrong.

A share is exact when every part of the mixer is per head (sliced) or shared by all heads and read, not
summed, by each (replicated: a low-rank first factor, a norm's per-channel weight applied within one head).
A part added once to the output (an output bias) or normalising over several heads is refused, named.

Layout kinds (shape legend: nk / nv key / value heads, dk / dv their head dims, H heads of width D,
d channels, P ranks, r this rank; a rank's heads are the r-th contiguous 1/P of them):
    Gated DeltaNet, split projections (Qwen3.5, OLMo-hybrid): q/k rows per key head, v/z (gate) rows, b, a,
        A_log, dt_bias per value head; the depthwise conv over [q heads | k heads | v heads]; value head j
        reads key head j // (nv / nk), so a rank's key heads and value heads are both its contiguous 1/P.
    Gated DeltaNet, fused projections (Qwen3-Next): ``in_proj_qkvz`` rows in nk blocks, one per key head, each
        [q (dk) | k (dk) | v (nv/nk x dv) | z (nv/nk x dv)]; ``in_proj_ba`` in nk blocks [b (nv/nk) | a (nv/nk)].
    Kimi Delta Attention (Kimi Linear): q/k/v and the per-channel decay rows per head (H x D each); the
        forget gate's and output gate's first low-rank factors (d -> D) shared (replicated), their second
        factors' rows per head; A_log (1, 1, H, 1).
    Short convolution (LFM2): depthwise over d channels, gated elementwise, so its "heads" are channel groups:
        ``in_proj`` rows [B (d) | C (d) | x (d)], the conv and ``out_proj``'s columns per channel.
    Mamba-2 (Bamba, NemotronH, Granite-hybrid, Falcon-H1; nh heads of hd in ng groups, state N, inner = nh x hd):
        ``in_proj`` rows [z (inner) | x (inner) | B (ng x N) | C (ng x N) | dt (nh)], the conv over x | B | C,
        A_log / D / dt_bias per head, the gated norm's weight per channel but its statistics per group: a rank
        takes whole groups (ng / P) and their heads (nh / P), so n_groups must divide by P. Without a gated norm
        (Falcon-H1) a rank's heads may lie inside one group instead, its B / C rows replicated; Falcon-H1's
        ``mup_vector`` buffer scales ``in_proj``'s outputs and is cut as its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["HeadLayout", "head_layout", "LAYOUTS", "GATED_DELTANET_CLASSES"]

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


def _share(rank: int, n: int, size: int, device: torch.device) -> torch.Tensor:
    """(n / size,) rank ``rank``'s contiguous share of ``n`` heads."""
    return torch.arange(rank * n // size, (rank + 1) * n // size, device=device)


def _rows(heads: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:
    """(len(heads) x width,) the rows of ``heads`` in a block of heads ``width`` wide starting at ``offset``."""
    return (offset + heads[:, None] * width + torch.arange(width, device=heads.device)).flatten()


def _with_biases(mixer: torch.nn.Module, slices: dict) -> dict:
    """``slices`` plus, for each ``<module>.weight`` cut along its rows (outputs), that module's bias cut alike."""
    out = dict(slices)
    for path, (dim, index) in slices.items():
        module_path, _, leaf = path.rpartition(".")
        if leaf == "weight" and dim == 0 and module_path:
            if getattr(mixer.get_submodule(module_path), "bias", None) is not None:
                out[f"{module_path}.bias"] = (0, index)
    return out


def _output_bias(mixer: torch.nn.Module, out_proj: str) -> str | None:
    if getattr(getattr(mixer, out_proj), "bias", None) is not None:
        return (f"{type(mixer).__name__}.{out_proj} has a bias, which every rank's share of the heads would add "
                "(once per rank)")
    return None


def _gated_deltanet(mixer: torch.nn.Module, rank: int, size: int) -> HeadLayout | str:
    """Qwen3.5's and OLMo-hybrid's Gated DeltaNet (separate projections) and Qwen3-Next's (fused, interleaved)."""
    name = type(mixer).__name__
    nk, nv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    if nk % size or nv % size:
        return (f"{name} has {nk} key and {nv} value heads, not both divisible by sequence_parallel size {size}: "
                "choose a size that divides both")
    fused = hasattr(mixer, "in_proj_qkvz")
    out_proj = "out_proj" if hasattr(mixer, "out_proj") else "o_proj"
    if (problem := _output_bias(mixer, out_proj)) is not None:
        return problem
    device = getattr(mixer, out_proj).weight.device
    k_heads, v_heads = _share(rank, nk, size, device), _share(rank, nv, size, device)
    key_dim = nk * dk
    # the conv's channels are [q heads | k heads | v heads] in all three layouts (Qwen3-Next reorders its fused
    # projection into this before the conv)
    qkv = torch.cat([_rows(k_heads, dk), _rows(k_heads, dk, key_dim), _rows(v_heads, dv, 2 * key_dim)])
    values = _rows(v_heads, dv)
    slices = {"conv1d.weight": (0, qkv), "A_log": (0, v_heads), "dt_bias": (0, v_heads),
              f"{out_proj}.weight": (1, values)}
    if fused:  # Qwen3-Next: one block per key head, its value heads' rows inside it
        group = nv // nk
        slices["in_proj_qkvz.weight"] = (0, _rows(k_heads, 2 * dk + 2 * group * dv))
        slices["in_proj_ba.weight"] = (0, _rows(k_heads, 2 * group))
    elif hasattr(mixer, "in_proj_qkv"):  # Qwen3.5
        slices.update({"in_proj_qkv.weight": (0, qkv), "in_proj_z.weight": (0, values),
                       "in_proj_b.weight": (0, v_heads), "in_proj_a.weight": (0, v_heads)})
    else:  # OLMo-hybrid: one projection each, the output gate g_proj per value head
        keys = _rows(k_heads, dk)
        slices.update({"q_proj.weight": (0, keys), "k_proj.weight": (0, keys), "v_proj.weight": (0, values),
                       "g_proj.weight": (0, values), "b_proj.weight": (0, v_heads), "a_proj.weight": (0, v_heads)})
    local_k, local_v = nk // size, nv // size
    attrs = {
        "num_k_heads": local_k, "num_v_heads": local_v, "key_dim": local_k * dk, "value_dim": local_v * dv,
        "conv_dim": 2 * local_k * dk + local_v * dv,
    }
    return HeadLayout(_with_biases(mixer, slices), attrs)


def _kimi_delta_attention(mixer: torch.nn.Module, rank: int, size: int) -> HeadLayout | str:
    """Kimi Linear's KDA: per-head q/k/v, decays and gates; the gates' low-rank first factors shared."""
    name, H, D = type(mixer).__name__, mixer.num_heads, mixer.head_dim
    if H % size:
        return f"{name} has {H} heads, not divisible by sequence_parallel size {size}: choose a size that divides it"
    if (problem := _output_bias(mixer, "o_proj")) is not None:
        return problem
    heads = _share(rank, H, size, mixer.o_proj.weight.device)
    channels, width = _rows(heads, D), H * D
    qkv = torch.cat([channels, channels + width, channels + 2 * width])
    slices = {
        "q_proj.weight": (0, channels), "k_proj.weight": (0, channels), "v_proj.weight": (0, channels),
        "conv1d.weight": (0, qkv), "b_proj.weight": (0, heads),
        # f_a_proj / g_a_proj (d -> D) feed every head: replicated, each rank's share of their gradient summed
        "forget_gate.f_b_proj.weight": (0, channels), "forget_gate.dt_bias": (0, channels),
        "forget_gate.A_log": (2, heads), "g_b_proj.weight": (0, channels), "o_proj.weight": (1, channels),
    }
    local = H // size
    attrs = {"num_heads": local, "qkv_dim": local * D, "conv_dim": 3 * local * D}
    return HeadLayout(_with_biases(mixer, slices), attrs)


def _short_conv(mixer: torch.nn.Module, rank: int, size: int) -> HeadLayout | str:
    """LFM2's gated short convolution: every channel on its own (depthwise conv, elementwise gates)."""
    name, d = type(mixer).__name__, mixer.out_proj.in_features
    if d % size:
        return (f"{name} has {d} channels, not divisible by sequence_parallel size {size}: choose a size that "
                "divides them")
    if (problem := _output_bias(mixer, "out_proj")) is not None:
        return problem
    channels = _share(rank, d, size, mixer.out_proj.weight.device)
    slices = {"in_proj.weight": (0, torch.cat([channels, channels + d, channels + 2 * d])),
              "conv.weight": (0, channels), "out_proj.weight": (1, channels)}
    return HeadLayout(_with_biases(mixer, slices), {})


def _mamba2(mixer: torch.nn.Module, rank: int, size: int) -> HeadLayout | str:
    """Mamba-2 (Bamba, NemotronH, Granite-hybrid, Falcon-H1): heads in n_groups groups sharing their B / C rows.
    With a gated RMSNorm over each group's channels a rank must hold whole groups; without one (Falcon-H1's
    ``mamba_rms_norm=False``) a rank's heads may also lie inside one group, whose B / C rows the ranks sharing it
    each read (replicated). Falcon-H1's ``mup_vector`` (a buffer scaling ``in_proj``'s output) is cut as its rows."""
    name = type(mixer).__name__
    nh, hd, ng, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    inner = mixer.intermediate_size
    gated_norm = isinstance(getattr(getattr(mixer, "norm", None), "weight", None), torch.Tensor)
    if nh % size:
        return (f"{name} has {nh} heads, not divisible by sequence_parallel size {size}: choose a size that "
                "divides them")
    local_h, per_group = nh // size, nh // ng
    device = mixer.out_proj.weight.device
    heads = _share(rank, nh, size, device)
    if ng % size == 0:
        groups, local_g = _share(rank, ng, size, device), ng // size
    elif not gated_norm and per_group % local_h == 0:  # the rank's heads inside one group
        groups, local_g = torch.tensor([rank * local_h // per_group], device=device), 1
    elif gated_norm:
        return (f"{name} has n_groups={ng}, not divisible by sequence_parallel size {size}: its gated RMSNorm "
                f"normalises over each group's {per_group} heads together, which a rank's share cannot compute "
                "(choose a size that divides n_groups)")
    else:
        return (f"{name} has {nh} heads in n_groups={ng}: at sequence_parallel size {size} a rank's {local_h} heads "
                "would span parts of several groups (choose a size that divides n_groups, or one whose share of "
                "the heads lies inside one group)")
    if (problem := _output_bias(mixer, "out_proj")) is not None:
        return problem
    x = _rows(heads, hd)
    # x | B | C: the conv's channels, and the in_proj rows after the gate z's `inner`
    xbc = torch.cat([x, _rows(groups, N, inner), _rows(groups, N, inner + ng * N)])
    conv_dim = inner + 2 * ng * N
    projected = torch.cat([x, inner + xbc, inner + conv_dim + heads])
    slices = {
        "in_proj.weight": (0, projected), "conv1d.weight": (0, xbc), "dt_bias": (0, heads), "A_log": (0, heads),
        "D": (0, heads), "out_proj.weight": (1, x),
    }
    if gated_norm:
        slices["norm.weight"] = (0, x)
    mup = getattr(mixer, "mup_vector", None)
    if isinstance(mup, torch.Tensor):  # (1, 1, in_proj outputs)
        slices["mup_vector"] = (mup.dim() - 1, projected)
    attrs = {"num_heads": local_h, "n_groups": local_g, "intermediate_size": local_h * hd,
             "conv_dim": local_h * hd + 2 * local_g * N}
    return HeadLayout(_with_biases(mixer, slices), attrs)


LAYOUTS: dict[str, Callable[[torch.nn.Module, int, int], HeadLayout | str]] = {
    **dict.fromkeys(GATED_DELTANET_CLASSES, _gated_deltanet),
    "Qwen3NextGatedDeltaNet": _gated_deltanet,
    "OlmoHybridGatedDeltaNet": _gated_deltanet,
    "KimiLinearDeltaAttention": _kimi_delta_attention,
    # LFM2-MoE's short convolution is LFM2's, renamed (the same code)
    **dict.fromkeys(("Lfm2ShortConv", "Lfm2MoeShortConv"), _short_conv),
    **dict.fromkeys(("BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "FalconH1Mixer"), _mamba2),
}
"""Mixer class name -> its layout function (each class's layout checked by tests/test_hybrids.py)."""


def head_layout(mixer: torch.nn.Module, rank: int, size: int) -> HeadLayout | str:
    """Rank ``rank`` of ``size``'s share of ``mixer``'s heads, or why it cannot be sharded by heads."""
    name = type(mixer).__name__
    layout = LAYOUTS.get(name)
    if layout is None:
        return (f"{name}: ds_longseq knows which parameters of {', '.join(sorted(LAYOUTS))} belong to which head, "
                "not of this mixer")
    # The layouts cut the stock parameters by name and shape: a PEFT adapter renames a projection's weight
    # (base_layer.weight, plus its own A and B, which are not cut), and a 4-bit weight is stored packed
    adapted = sorted({n.split(".lora_")[0] for n, _ in mixer.named_parameters() if ".lora_" in n})
    if adapted:
        return (f"{name}: {', '.join(adapted)} carry LoRA adapters, which ds_longseq cannot cut by heads; leave the "
                "mixer's projections out of the LoRA targets")
    packed = sorted(n for n, p in mixer.named_parameters() if hasattr(p, "quant_state") or not p.is_floating_point())
    if packed:
        return (f"{name}: {', '.join(packed)} are quantised (packed 4-bit or integer weights), which cannot be cut "
                "by heads")
    return layout(mixer, rank, size)
