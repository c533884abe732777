"""The kernels one tile of attention runs on, and which of them runs: the chunk attention (``ops.chunk_attention``)
and ring attention (``ops.ring``) cut their work into tiles and merge the tiles' outputs by log-sum-exp.

Holds:
    TileMask: what one tile's kernel must apply (the causal diagonal, padding, document and window bounds, softcap,
        attention-probability dropout).
    TileKernel, KERNELS: the per-tile kernels by name; KERNEL_CHAINS / kernel_chain: the order "auto" tries them in
        on each device; pick_kernel, kernel_refusal, attention_kernel_for: which kernel takes a tile, or why one
        cannot.
    tile_forward / tile_backward: one kernel's forward / backward on one tile (K/V repeated over GQA query heads and
        values of another head dim padded, where the kernel needs it).
    KernelRngState: what the fused CUDA ops' forwards hand their backwards, kept per attention call.
    with_dropout, dropout_masks_tapped: a tile's attention-probability dropout drawn from its own generator, and the
        tests' view of every mask drawn.
    with_sink_logits: merged (output, log-sum-exp) with attention sinks folded in; compute_dtype: the dtype tiles are
        merged in.

Shape legend: B batch, h a tile's query heads, hk its key/value heads (h unless GQA), r the tile's query rows, n its
keys, D head dim (Dv the values').

Kernels, chosen per tile by what the tile needs (:func:`pick_kernel`):
    "cuda_cudnn":     torch's cuDNN attention op (``aten._scaled_dot_product_cudnn_attention``):
                      sm90+, fp16/bf16, no padding, head dim up to 128; about twice FlashAttention-2's
                      speed on an H100 (``benchmarks/attention_gpu.py``).
    "cuda_flash":     torch's FlashAttention-2 op (``aten._scaled_dot_product_flash_attention`` and
                      its backward): CUDA, fp16/bf16, no padding in the tile, head dim a multiple
                      of 8 up to 256; native GQA on the diagonal tile (no K/V repeat).
    "cuda_efficient": torch's memory-efficient op (``aten._efficient_attention_forward`` /
                      ``_backward``): CUDA, fp16/bf16/fp32, padding as an additive bias broadcast
                      over heads and rows by stride 0.
    "cpu_flash":      torch's fused CPU flash-attention op.
    "math":           pure PyTorch on any device and dtype, one tile of scores at a time: the
                      reference the fused kernels are tested against, and the last fallback.
"auto" walks the device's chain (:data:`KERNEL_CHAINS`; CUDA: cuda_cudnn, cuda_flash, cuda_efficient, math; CPU:
cpu_flash, math) and runs the first kernel that accepts the tile, so a dtype, head dim or mask a kernel cannot take
goes to the next kernel, never to a wrong result. A kernel named explicitly that cannot take a tile is an error.

Each kernel's backward takes the FINAL merged output and log-sum-exp of its rows, which yields exactly that tile's
share of dQ, dK, dV (FlashAttention-2's recompute backward). The kernels run with autocast off (the ops cast their
inputs first).
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Callable

import torch

__all__ = [
    "TileMask",
    "TileKernel",
    "KERNELS",
    "KERNEL_CHAINS",
    "KernelRngState",
    "kernel_chain",
    "kernel_refusal",
    "pick_kernel",
    "attention_kernel_for",
    "tile_forward",
    "tile_backward",
    "with_dropout",
    "with_sink_logits",
    "dropout_masks_tapped",
    "compute_dtype",
]

_DROPOUT_TAP: ContextVar[Callable | None] = ContextVar("ds_longseq_attention_dropout_tap", default=None)


@contextlib.contextmanager
def dropout_masks_tapped(tap: Callable[[torch.Tensor, "TileMask"], None]):
    """Within: ``tap(keep, mask)`` is called with every attention-probability dropout mask a tile draws ((B, h, r, n)
    bool, in forward and backward) and its :class:`TileMask` (``dropout_where`` says where it lies): what the tests
    assemble into the whole (B, H, T, T) mask the stock eager attention replays."""
    token = _DROPOUT_TAP.set(tap)
    try:
        yield
    finally:
        _DROPOUT_TAP.reset(token)


_NEG_INF = float("-inf")
_HALF = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype tiles are merged in: float32 for half-precision tiles (as flash-attention accumulates), else
    ``dtype``."""
    return torch.float32 if dtype in _HALF else dtype


@dataclass(frozen=True)
class TileMask:
    """What a tile's kernel applies besides the softmax scale.

    New mask kinds (document segments, a sliding window, a logit softcap) become fields here; each
    kernel's :meth:`TileKernel.refuses` then names what it cannot apply and the chain moves on.
    """

    causal: bool
    """Causal tile, bottom-right aligned: query row i of r sees the tile's keys [0, n - r + i]. A square tile (the
    chunk's own keys: row i sees [0, i]), or one call over the prefix and the chunk's keys together (only on a
    kernel with :attr:`TileKernel.bottom_right`)."""
    valid: torch.Tensor | None = None
    """(B, n) bool, False for the tile's padding keys; None when every key is real."""
    key_lo: torch.Tensor | None = None
    """(B, r) int64: query row i sees only the tile's keys [key_lo[:, i], n) (its document's start or
    its sliding window's first key, relative to the tile; <= 0 for no limit); None: no limit."""
    softcap: float | None = None
    """Logit softcapping (Gemma 2): scores become softcap * tanh(scores / softcap) before the mask."""
    n: int = 0
    """Keys in the tile (set by the op; used to find rows that see none of them)."""
    dropout: float = 0.0
    """Dropout probability on the tile's attention probabilities (after the softmax over every tile, as stock
    eager attention applies it); 0: none. Only the math kernel applies it (the fused ones refuse the tile)."""
    dropout_seed: int = 0
    """With ``dropout``: the seed of the tile's own generator, which draws its keep mask the same in forward and
    backward (and in every re-run of the chunk that draws the same call seed: ``ops.draws``)."""
    dropout_where: tuple[int, int, bool] = (0, 0, False)
    """With ``dropout``, where the tile's mask lies, for :func:`dropout_masks_tapped`: (index of its first key, of
    its first query, both among the call's keys, whether its rows are GQA-stacked: each key/value head's query
    heads stacked as rows, as ``ops.chunk_attention``'s full tiles are)."""

    @property
    def plain(self) -> bool:
        """Nothing but (optionally) the causal diagonal: what the unmasked fused kernels take."""
        return self.valid is None and self.key_lo is None and self.softcap is None and not self.dropout


class TileKernel:
    """One tile's attention, forward and backward.

    ``forward(q (B,h,r,D), k (B,hk,n,D), v, mask, scale, rng) -> (o (B,h,r,D), lse (B,h,r))``: ``hk == h``
    unless the kernel has ``native_gqa`` and the tile is causal. ``lse`` is -inf and ``o`` is 0 on
    rows that see no valid key. ``rng``: the call's :class:`KernelRngState` (a fused CUDA op keeps there what its
    backward takes back).

    ``backward(do, q, k, v, out, lse, mask, scale, rng) -> (dq, dk, dv)``: ``out``/``lse`` are the FINAL
    merged output and log-sum-exp (``lse`` = +inf on rows without a valid key, so their p is 0);
    the result is this tile's share of the gradients, dk/dv with k's heads. ``rng``: the one the call's forward got.
    """

    name = ""
    native_gqa = False
    bottom_right = False
    """Whether the kernel takes a causal tile with more keys than rows in one call (bottom-right aligned: the
    prefix and the chunk's own keys together). Top-left kernels (cuDNN's op, the fused CPU op's ``is_causal``)
    take square causal tiles only."""
    same_head_dims = True
    """Whether queries, keys and values must share one head dim (the fused kernels); values of another head dim
    (multi-head latent attention) are then zero-padded to the larger one and the padding cut off again, which
    leaves every score, output and gradient exactly as it is (the padded entries only ever multiply zeros)."""

    def refuses(self, q: torch.Tensor, mask: TileMask) -> str | None:
        """Why this kernel cannot take the tile, or None when it can."""
        raise NotImplementedError

    def forward(self, q, k, v, mask: TileMask, scale: float, rng: KernelRngState):
        raise NotImplementedError

    def backward(self, do, q, k, v, out, lse, mask: TileMask, scale: float, rng: KernelRngState):
        raise NotImplementedError


class KernelRngState:
    """What the fused CUDA ops' forwards return for their backwards (the dropout RNG seed and offset, the cumulative
    sequence lengths), for one attention call: made by the call's forward and handed to its backward (through the
    autograd context, or a StreamBP chunk's kept outputs, whose replay runs the backward alone).

    Dropout is always 0 in those ops (attention dropout runs on the math kernel), so the values are never read, but
    each backward still takes tensors of the right kind: the call's latest forward of a kernel serves every tile of
    it, rather than one set saved per tile.
    """

    def __init__(self):
        self._by_kernel: dict[str, tuple] = {}

    def keep(self, kernel: str, state: tuple) -> None:
        """Keep ``state``, what ``kernel``'s forward op returned for its backward."""
        self._by_kernel[kernel] = state

    def read(self, kernel: str) -> tuple:
        """What ``kernel``'s latest forward in this call kept."""
        try:
            return self._by_kernel[kernel]
        except KeyError:
            raise RuntimeError(f"the {kernel} attention kernel's backward ran in a call whose forward never ran it: "
                               "pass the forward's KernelRngState to the backward") from None


def _keep(mask: TileMask, rows: int, n: int, device) -> torch.Tensor | None:
    """(B or 1, 1, rows, n) bool: which keys each query row of the tile attends; None: all of them.
    Materialised only for the kernels that take a mask tensor (rows x n per sequence)."""
    keep = None
    cols = torch.arange(n, device=device)
    if mask.causal:  # bottom-right: row i sees keys [0, n - rows + i]
        keep = (cols.view(1, n) <= torch.arange(n - rows, n, device=device).view(rows, 1)).view(1, 1, rows, n)
    if mask.valid is not None:
        pad = mask.valid.view(mask.valid.shape[0], 1, 1, n)
        keep = pad if keep is None else keep & pad
    if mask.key_lo is not None:
        lo = cols.view(1, 1, 1, n) >= mask.key_lo.view(mask.key_lo.shape[0], 1, rows, 1)
        keep = lo if keep is None else keep & lo
    return keep


def _empty_rows(mask: TileMask, rows: int, heads: int, n: int) -> torch.Tensor | None:
    """(B, heads, rows) True where a row sees no key of this tile, or None if every row sees one."""
    valid, key_lo = mask.valid, mask.key_lo
    if valid is None and key_lo is None:
        return None  # a causal row sees at least its own key; a full tile every key
    if key_lo is None:
        B = valid.shape[0]
        if mask.causal:  # row i of a causal tile sees keys [0, n - rows + i]
            seen = valid.cumsum(-1)[:, n - rows :] > 0
            return (~seen).reshape(B, 1, rows).expand(B, heads, rows)
        return (~valid.any(-1)).view(B, 1, 1).expand(B, heads, rows)
    # Keys [lo_i, hi_i) of row i: hi = n (full tile) or i + 1 (causal); count the valid ones among them.
    B = key_lo.shape[0]
    lo = key_lo.clamp(0, n)
    hi = torch.arange(n - rows + 1, n + 1, device=lo.device).view(1, rows) if mask.causal else torch.full_like(lo, n)
    if valid is None:
        empty = lo >= hi
    else:
        counts = torch.nn.functional.pad(valid.to(torch.int32).cumsum(-1), (1, 0))  # (B, n + 1)
        empty = counts.gather(1, hi.expand(B, rows)) - counts.gather(1, lo) <= 0
    return empty.view(B, 1, rows).expand(B, heads, rows)


def _mask_empty_rows(o, lse, mask: TileMask):
    # Fused kernels report lse = 0 (CPU) or leave undefined values on rows with no valid key.
    empty = _empty_rows(mask, o.shape[2], o.shape[1], mask.n)
    if empty is None:
        return o, lse
    return o.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, _NEG_INF)


def _bias(mask: TileMask, rows: int, n: int, dtype: torch.dtype, device, causal_in_bias: bool = False):
    """Additive (B, 1, 1 or rows, n) bias for the padding / key_lo mask (the causal diagonal too when
    ``causal_in_bias``), or None when the tile needs none."""
    if mask.valid is None and mask.key_lo is None:
        return None
    if mask.key_lo is None:
        B = mask.valid.shape[0]
        return torch.zeros((B, 1, 1, n), dtype=dtype, device=device).masked_fill(
            ~mask.valid.view(B, 1, 1, n), _NEG_INF
        )
    keep = _keep(TileMask(causal_in_bias and mask.causal, mask.valid, mask.key_lo), rows, n, device)
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, _NEG_INF)


class _CpuFlash(TileKernel):
    name = "cpu_flash"

    def refuses(self, q, mask):
        if q.device.type != "cpu":
            return f"tensors on {q.device.type}, not the CPU"
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            return f"dtype {q.dtype}"
        if mask.softcap is not None:
            return "logit softcapping (the fused CPU kernel has no softcap)"
        return None

    def forward(self, q, k, v, mask, scale, rng):
        bias = _bias(mask, q.shape[2], k.shape[2], q.dtype, q.device)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, mask.causal, attn_mask=bias, scale=scale
        )
        return _mask_empty_rows(out, lse, mask)

    def backward(self, do, q, k, v, out, lse, mask, scale, rng):
        bias = _bias(mask, q.shape[2], k.shape[2], q.dtype, q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, mask.causal, attn_mask=bias, scale=scale
        )



def _cuda_refuses(q: torch.Tensor, dtypes: tuple, what: str) -> str | None:
    if q.device.type != "cuda":
        return f"tensors on {q.device.type}, not CUDA"
    if q.dtype not in dtypes:
        return f"{what} takes {', '.join(str(d).removeprefix('torch.') for d in dtypes)}, not {q.dtype}"
    return None


def _unmasked_half_refuses(q, mask, what: str, max_head_dim: int, min_capability: tuple[int, int]) -> str | None:
    """Why a fused CUDA kernel without a mask argument cannot take the tile, or None."""
    why = _cuda_refuses(q, _HALF, what)
    if why:
        return why
    if mask.softcap is not None:
        return f"logit softcapping ({what} has no softcap)"
    if mask.valid is not None:
        return f"the tile has padding ({what} is called without a mask)"
    if mask.key_lo is not None:
        return f"the tile is cut by a document boundary or sliding window ({what} is called without a mask)"
    D = q.shape[-1]
    if D % 8 or D > max_head_dim:
        return f"head dim {D} ({what} needs a multiple of 8, at most {max_head_dim})"
    if torch.cuda.get_device_capability(q.device) < min_capability:
        return f"{what} is used on sm{min_capability[0]}{min_capability[1]}+ GPUs"
    return None


class _CudaFlash(TileKernel):
    """FlashAttention-2 as built into torch. Its ``is_causal`` is bottom-right aligned when there are more keys
    than queries (flash-attn 2.1+; torch's ``causal_lower_right`` bias calls this op with ``is_causal=True`` for
    exactly that), so one call covers a chunk's prefix and diagonal."""

    name = "cuda_flash"
    native_gqa = True
    bottom_right = True

    def refuses(self, q, mask):
        return _unmasked_half_refuses(q, mask, "flash attention", max_head_dim=256, min_capability=(8, 0))

    def forward(self, q, k, v, mask, scale, rng):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, mask.causal, False, scale=scale)
        # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
        rng.keep(self.name, (res[2], res[3], res[6], res[7]))
        return res[0], res[1]

    def backward(self, do, q, k, v, out, lse, mask, scale, rng):
        cum_q, cum_k, rng_state, unused = rng.read(self.name)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), cum_q, cum_k, q.shape[2], k.shape[2],
            0.0, mask.causal, rng_state, unused, scale=scale,
        )


class _CudaCudnn(TileKernel):
    """cuDNN's fused attention as built into torch (``aten._scaled_dot_product_cudnn_attention``):
    on Hopper it runs about twice as fast as FlashAttention-2 (benchmarks/attention_gpu.py). Its
    causal mask is top-left aligned, which is right for our square diagonal tiles only; full tiles
    are unmasked. Tiles with padding go to the next kernel."""

    name = "cuda_cudnn"

    def refuses(self, q, mask):
        # sm90+ only: elsewhere flash is as fast
        why = _unmasked_half_refuses(q, mask, "cuDNN attention", max_head_dim=128, min_capability=(9, 0))
        if why:
            return why
        if q.shape[2] < 16:
            # cuDNN 9 (torch 2.11, H100) crashed the process in backward on a 1-query tile; tiles of
            # 13 and more queries were tested exact. Short tiles are cheap on flash anyway.
            return f"{q.shape[2]} query rows (cuDNN attention is used from 16 rows)"
        if not torch.backends.cudnn.is_available():
            return "cuDNN is not available in this torch build"
        return None

    def forward(self, q, k, v, mask, scale, rng):
        # cuDNN wants (B, H, L, D) with matching strides for q/out/dO: contiguous copies of a
        # chunk's queries are small next to the keys.
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, mask.causal, False, scale=scale
        )
        # (output, logsumexp (B, H, L, 1), cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset, debug)
        rng.keep(self.name, (res[2], res[3], res[6], res[7]))
        return res[0], res[1].squeeze(-1)

    def backward(self, do, q, k, v, out, lse, mask, scale, rng):
        cum_q, cum_k, seed, offset = rng.read(self.name)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
            lse.unsqueeze(-1).contiguous(), seed, offset, None, cum_q, cum_k, q.shape[2], k.shape[2], 0.0,
            mask.causal, scale=scale,
        )


def _efficient_bias(mask: TileMask, dtype: torch.dtype, heads: int, rows: int, n: int) -> torch.Tensor | None:
    """(B, heads, rows, n) additive bias as a stride-0 view (over heads, and over rows for padding
    alone) of a (B, 1, 1 or rows, n) tensor whose rows are 16-element aligned, as the kernel wants."""
    if mask.valid is None and mask.key_lo is None:
        return None
    B = (mask.valid if mask.valid is not None else mask.key_lo).shape[0]
    device = (mask.valid if mask.valid is not None else mask.key_lo).device
    keep = _keep(TileMask(False, mask.valid, mask.key_lo), rows, n, device)  # causal: the kernel's own mask
    storage = torch.zeros((B, 1, keep.shape[2], -(-n // 16) * 16), dtype=dtype, device=device)
    bias = storage[..., :n]
    bias.masked_fill_(~keep, _NEG_INF)
    return bias.expand(B, heads, rows, n)


class _CudaEfficient(TileKernel):
    """The memory-efficient (CUTLASS) kernel torch ships; takes an additive bias and float32. Its causal mask
    type 2 is bottom-right aligned (torch's ``causal_lower_right``)."""

    name = "cuda_efficient"
    bottom_right = True

    def refuses(self, q, mask):
        why = _cuda_refuses(q, (*_HALF, torch.float32), "the memory-efficient kernel")
        if why:
            return why
        if mask.softcap is not None:
            return "logit softcapping (the memory-efficient kernel has no softcap)"
        if q.shape[-1] % 8:
            return f"head dim {q.shape[-1]} (the memory-efficient kernel wants a multiple of 8)"
        return None

    def forward(self, q, k, v, mask, scale, rng):
        B, h, r, _ = q.shape
        res = torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), _efficient_bias(mask, q.dtype, h, r, k.shape[2]),
            None, None, None, None, 0.0, _efficient_mask_type(mask, r), True, scale=scale,
        )
        rng.keep(self.name, (res[2], res[3]))
        # logsumexp comes padded to a multiple of 32 rows
        return _mask_empty_rows(res[0].transpose(1, 2), res[1][:, :, :r], mask)

    def backward(self, do, q, k, v, out, lse, mask, scale, rng):
        B, h, r, _ = q.shape
        seed, offset = rng.read(self.name)
        lse_padded = torch.zeros((B, h, -(-r // 32) * 32), dtype=torch.float32, device=q.device)
        lse_padded[:, :, :r] = lse
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            do.transpose(1, 2).contiguous(), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            _efficient_bias(mask, q.dtype, h, r, k.shape[2]), out.transpose(1, 2).contiguous(), None, None, r,
            k.shape[2],
            lse_padded, 0.0, seed, offset, _efficient_mask_type(mask, r), False, scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _efficient_mask_type(mask: TileMask, rows: int) -> int:
    # custom_mask_type: 0 none, 1 causal from the top left, 2 causal from the bottom right (equal on square tiles)
    if not mask.causal:
        return 0
    return 1 if rows == mask.n else 2


def _dropout_scale(mask: TileMask, shape, dtype: torch.dtype, device) -> torch.Tensor | None:
    """(shape) keep mask / (1 - p) in ``dtype`` of the tile's attention-probability dropout, drawn from the tile's
    own generator (the same tensor every time it is drawn), or None without dropout. The tap (tests) sees each mask
    drawn."""
    if not mask.dropout:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(mask.dropout_seed)
    keep = torch.rand(shape, generator=generator, device=device) >= mask.dropout
    tap = _DROPOUT_TAP.get()
    if tap is not None:
        tap(keep, mask)
    return keep.to(dtype).div_(1.0 - mask.dropout)  # as torch's dropout scales its noise, in the tile's dtype


def _math_scores(q, k, mask, scale):
    """(B, h, r, n) masked scores in the compute dtype, and (softcap only) tanh of the raw scores / cap."""
    cdt = compute_dtype(q.dtype)
    scores = (q.to(cdt) * scale) @ k.to(cdt).transpose(-1, -2)
    tanh = None
    if mask.softcap is not None:
        tanh = torch.tanh(scores / mask.softcap)
        scores = tanh * mask.softcap
    keep = _keep(mask, q.shape[2], k.shape[2], q.device)
    return (scores if keep is None else scores.masked_fill(~keep, _NEG_INF)), tanh


class _Math(TileKernel):
    name = "math"
    same_head_dims = False
    bottom_right = True

    def refuses(self, q, mask):
        return None

    def forward(self, q, k, v, mask, scale, rng):
        scores, _ = _math_scores(q, k, mask, scale)
        lse = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - lse.masked_fill(lse == _NEG_INF, 0.0).unsqueeze(-1))
        dropped = _dropout_scale(mask, p.shape, p.dtype, p.device)
        if dropped is not None:  # after the normalisation: lse stays the softmax's (tiles merge by it as before)
            p = p * dropped
        return p @ v.to(p.dtype), lse

    def backward(self, do, q, k, v, out, lse, mask, scale, rng):
        cdt = compute_dtype(q.dtype)
        scores, tanh = _math_scores(q, k, mask, scale)
        p = torch.exp(scores - lse.to(cdt).unsqueeze(-1))
        do, out = do.to(cdt), out.to(cdt)
        # the softmax-backward correction per row: sum_j p_ij dP_ij = dO_i . O_i, with O the (dropped) output
        delta = (do * out).sum(-1, keepdim=True)
        dp = do @ v.to(cdt).transpose(-1, -2)
        dropped = _dropout_scale(mask, p.shape, cdt, p.device)
        if dropped is not None:  # O = (P * M / (1 - p)) V: dP and dV see the mask, the softmax's P does not
            dp = dp * dropped
        ds = p * (dp - delta)
        if tanh is not None:  # d(cap * tanh(s / cap)) / ds = 1 - tanh^2
            ds = ds * (1 - tanh * tanh)
        dq = (ds @ k.to(cdt)) * scale
        dk = (ds.transpose(-1, -2) @ q.to(cdt)) * scale
        dv = (p if dropped is None else p * dropped).transpose(-1, -2) @ do
        return dq, dk, dv


KERNELS: dict[str, TileKernel] = {
    k.name: k for k in (_CudaCudnn(), _CudaFlash(), _CudaEfficient(), _CpuFlash(), _Math())
}
"""Every tile kernel by name."""
KERNEL_CHAINS: dict[str, tuple[str, ...]] = {
    "cuda": ("cuda_cudnn", "cuda_flash", "cuda_efficient", "math"), "cpu": ("cpu_flash", "math"),
}
"""The kernels "auto" tries on each device type, in order (:func:`kernel_chain`; "math" alone elsewhere)."""


def _pad_head_dim(t: torch.Tensor, n: int) -> torch.Tensor:
    return t if t.shape[-1] == n else torch.nn.functional.pad(t, (0, n - t.shape[-1]))


def tile_forward(tile: TileKernel, q, k, v, mask: TileMask, scale: float, rng: KernelRngState, kv_repeat: int = 1):
    """``tile.forward`` on keys/values of ``q``'s heads / ``kv_repeat`` heads each: repeated over the ``kv_repeat``
    query heads of each (GQA; no copy when 1) unless the kernel takes GQA itself on a causal tile, and values of
    another head dim than the keys padded for kernels that need one."""
    if kv_repeat > 1 and not (tile.native_gqa and mask.causal):
        k, v = _repeat_heads(k, kv_repeat), _repeat_heads(v, kv_repeat)
    D, Dv = q.shape[-1], v.shape[-1]
    if D == Dv or not tile.same_head_dims:
        return tile.forward(q, k, v, mask, scale, rng)
    n = max(D, Dv)
    o, lse = tile.forward(_pad_head_dim(q, n), _pad_head_dim(k, n), _pad_head_dim(v, n), mask, scale, rng)
    return o[..., :Dv], lse


def tile_backward(tile: TileKernel, do, q, k, v, out, lse, mask: TileMask, scale: float, rng: KernelRngState,
                  kv_repeat: int = 1):
    """``tile.backward``, K/V repeated and padded like :func:`tile_forward`; (dq, dk, dv), dk/dv with ``k``'s heads
    (summed back over the repeats)."""
    repeated = kv_repeat > 1 and not (tile.native_gqa and mask.causal)
    if repeated:
        k, v = _repeat_heads(k, kv_repeat), _repeat_heads(v, kv_repeat)
    D, Dv = q.shape[-1], v.shape[-1]
    if D == Dv or not tile.same_head_dims:
        dq, dk, dv = tile.backward(do, q, k, v, out, lse, mask, scale, rng)
    else:
        n = max(D, Dv)
        dq, dk, dv = tile.backward(*(_pad_head_dim(t, n) for t in (do, q, k, v, out)), lse, mask, scale, rng)
        dq, dk, dv = dq[..., :D], dk[..., :D], dv[..., :Dv]
    if repeated:
        dk, dv = _sum_heads(dk, kv_repeat), _sum_heads(dv, kv_repeat)
    return dq, dk, dv


def kernel_chain(device: torch.device | str) -> tuple[str, ...]:
    """Kernel names "auto" tries, in order, for tensors on ``device``."""
    return KERNEL_CHAINS.get(torch.device(device).type, ("math",))


def kernel_refusal(kernel: TileKernel, q: torch.Tensor, mask: TileMask) -> str | None:
    """Why ``kernel`` cannot take the tile (its own reasons, or a rectangular causal tile on a top-left kernel)."""
    if mask.dropout and kernel.name != "math":
        return "dropout on attention probabilities (drawn by the math kernel from the tile's own generator)"
    if mask.causal and mask.n != q.shape[2] and not kernel.bottom_right:
        return f"a causal tile of {q.shape[2]} queries on {mask.n} keys (the {kernel.name} kernel's mask is top-left)"
    return kernel.refuses(q, mask)


def pick_kernel(requested: str, q: torch.Tensor, mask: TileMask) -> TileKernel:
    """The kernel that runs a tile of queries like ``q`` with ``mask``: ``requested`` ("auto": the first of
    :func:`kernel_chain` that takes it, else math; a kernel's name: that one, or ValueError saying why not)."""
    if requested != "auto":
        kernel = KERNELS[requested]
        why = kernel_refusal(kernel, q, mask)
        if why:
            raise ValueError(
                f"attention kernel {requested!r} cannot take this tile: {why}. Use kernel='auto' to fall back "
                f"to the next kernel ({' -> '.join(kernel_chain(q.device))})"
            )
        return kernel
    for name in kernel_chain(q.device):
        kernel = KERNELS[name]
        if kernel_refusal(kernel, q, mask) is None:
            return kernel
    return KERNELS["math"]


def attention_kernel_for(
    q: torch.Tensor, requested: str = "auto", *, padded: bool = False, causal: bool = False
) -> str:
    """The kernel a tile of queries like ``q`` runs on (``padded``: the tile has padding keys)."""
    valid = torch.zeros(1, 1, dtype=torch.bool, device=q.device) if padded else None
    return pick_kernel(requested, q, TileMask(causal, valid, n=q.shape[2])).name


def _repeat_heads(t: torch.Tensor, R: int) -> torch.Tensor:
    # (B, Hkv, n, D) -> (B, Hkv * R, n, D); no copy without GQA
    return t if R == 1 else t.repeat_interleave(R, 1)


def _sum_heads(t: torch.Tensor, R: int) -> torch.Tensor:
    # (B, Hkv * R, n, D) -> (B, Hkv, n, D): the gradient of _repeat_heads
    return t if R == 1 else t.reshape(t.shape[0], t.shape[1] // R, R, *t.shape[2:]).sum(2)


def with_dropout(mask: TileMask, dropout: tuple[float, int], where: tuple[int, int, bool]) -> TileMask:
    """``mask`` with attention-probability dropout ``(p, call seed)`` for the tile at ``where`` (its first key and
    first query among the call's keys, whether its rows are GQA-stacked): the tile's own generator is seeded from the
    call's seed and where the tile lies, so its mask is the same in forward and backward whatever tiles ran before
    it (chunk tiles in ``ops.chunk_attention``, ring tiles in ``ops.ring``)."""
    p, seed = dropout
    tile_seed = int.from_bytes(hashlib.blake2b(struct.pack("<4q", seed, where[0], where[1], int(mask.causal)),
                                               digest_size=8).digest(), "little") & ((1 << 63) - 1)
    return replace(mask, dropout=p, dropout_seed=tile_seed, dropout_where=where)


def with_sink_logits(out: torch.Tensor, lse: torch.Tensor, sink_logits: torch.Tensor):
    """(out, lse) with one more key per head whose logit is ``sink_logits[h]`` and whose value is 0 (attention
    sinks, gpt-oss): the softmax mass moves to it by ``exp(lse - logaddexp(lse, s))``. The tiles' backward then
    runs on the returned pair (the sink changes only the normaliser). Rows with no valid key (lse = +inf, out
    0) stay so: all their mass is on the sink, as in the stock attention."""
    cdt = lse.dtype
    s = sink_logits.to(cdt).view(1, -1, 1)
    empty = lse == float("inf")
    total = torch.logaddexp(lse.masked_fill(empty, 0.0), s.expand_as(lse))
    weight = torch.exp(lse - total).masked_fill(empty, 0.0)
    return (out.to(cdt) * weight.unsqueeze(-1)).to(out.dtype), total.masked_fill(empty, float("inf"))

