"""Exact causal attention of a query chunk against a key prefix, tiled over keys.

Holds:
    chunk_causal_attention: the public op (``_ChunkAttention``, its autograd Function).
    KeyLimits, query_lower_bounds: what limits each query's keys (documents, sliding windows, chunked attention).
    default_kv_block_size, CPU_KV_BLOCK_SIZE: keys per full tile.
    The tiling plan (``_Tile``, ``_plan``): which tiles a chunk is cut into, made on the host once per call.
The kernels the tiles run on, and which kernel takes a tile, live in ``ops.tile_kernels``.

Shape legend: B batch, H query heads, Hkv key/value heads (H = Hkv * R, GQA), C query chunk,
S key prefix, K keys of the chunk itself, D head dim.

The queries are the LAST C positions of the S + K keys (bottom-right aligned causal mask): query i
sits at global key index S + K - C + i and attends keys [0, S + K - C + i]. That covers both a
StreamBP chunk (K == C, the prefix holds earlier chunks' keys) and generation with a KV cache
(S == 0, K >= C). For S = 5, K = C = 3 (``x`` = attended)::

        keys:  0 1 2 3 4 | 5 6 7
    query 0:   x x x x x | x . .
    query 1:   x x x x x | x x .
    query 2:   x x x x x | x x x
               "full" tiles | square "diagonal" tile

The keys are split into tiles: "full" tiles that every query sees (only the padding mask applies;
GQA query heads are stacked along rows, so K/V are never repeated) and one square "diagonal" tile
over the last C keys with a causal mask (square, so top-left and bottom-right agree). No mask over
the whole key range is ever built: a padding mask is a (B, 1, 1, tile) additive bias. With document
bounds (``query_lo``) the plan skips keys outside each query's document, and the diagonal becomes
one square causal tile per document starting in the chunk, so a packed chunk costs its documents'
own triangles and its tiles need no mask. The plan (tiles, cuts, which tiles hold padding) is made
on the host once per call in forward; backward reuses it and never waits for the device.

Each tile runs a kernel that returns its output and row log-sum-exp; tiles are merged exactly by
log-sum-exp (as ring attention merges blocks). Backward calls each tile's kernel backward with the
FINAL output and log-sum-exp, which yields exactly that tile's share of dQ, dK, dV
(FlashAttention-2's recompute backward; torch's own ring attention does the same). The kernel is the first of the
device's chain that takes the tile (``ops.tile_kernels``: cuDNN, flash, memory-efficient on CUDA, the fused CPU op,
math on any device), so a dtype, head dim or mask a kernel cannot take goes to the next kernel, never to a wrong
result; a kernel named explicitly that cannot take a tile is an error. On CUDA the default tile covers the whole
prefix (the fused kernels hold no score tile); on CPU it is 1024 keys.

Autocast: like ``scaled_dot_product_attention``, the op runs in the autocast dtype when autocast is
on for the tensors' device (float32 inputs are cast; float64 stays), and its kernels run with
autocast off.

The prefix keys/values are constants of this op. Their gradients, when wanted, are ADDED IN PLACE
into caller-owned buffers (``prefix_grad_sink``): StreamBP accumulates dK/dV of the whole sequence
across chunks, and writing each tile's share straight into that buffer avoids an (S x D) gradient
allocation per chunk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ds_longseq.ops.phases import phase
from ds_longseq.ops.tile_kernels import (
    KERNELS,
    KernelRngState,
    TileMask,
    compute_dtype,
    kernel_chain,
    kernel_refusal,
    pick_kernel,
    tile_backward,
    tile_forward,
    with_dropout,
    with_sink_logits,
)

if TYPE_CHECKING:
    from ds_longseq.ops.kept_attention import ChunkSlot

__all__ = [
    "chunk_causal_attention",
    "query_lower_bounds",
    "KeyLimits",
    "CPU_KV_BLOCK_SIZE",
    "default_kv_block_size",
]

_NEG_INF = float("-inf")
CPU_KV_BLOCK_SIZE = 1024
"""Default keys per full tile on CPU (the fused CPU kernel and the math tile hold a score tile)."""


def default_kv_block_size(num_keys: int, device: torch.device | str) -> int:
    """Keys per full tile when ``kv_block_size`` is None, for a chunk seeing ``num_keys`` keys in all:
    on CUDA all of them (the fused kernels hold no score tile), elsewhere :data:`CPU_KV_BLOCK_SIZE`."""
    return max(num_keys, 1) if torch.device(device).type == "cuda" else CPU_KV_BLOCK_SIZE


# --- the plan -----------------------------------------------------------------------------------

_MAX_LO_CUTS = 16
"""Tiles are cut at every distinct query lower bound (document start) when there are at most this
many in a chunk, so no prefix tile needs a per-row mask; sliding windows give one bound per row and
are masked per tile instead."""
_MAX_DIAG_TILES = 32
"""The diagonal is split at document starts into square causal tiles of at least C / this many rows
(fewer, larger kernel calls for chunks of many tiny documents; a merged document is masked)."""


@dataclass(frozen=True)
class _Tile:
    """Keys [a, b) of ``src`` (0 = prefix, 1 = own keys, 2 = both joined: the one-call tile), at global key
    indices offset + [a, b), serving query rows [r0, r1) of the chunk. ``causal``: a square tile on the diagonal
    (its keys are its rows' own keys), or the one-call tile (bottom-right); full tiles serve leading rows
    (r0 = 0). ``lo_shift``: subtract from ``query_lo`` for the tile's key_lo mask (None: no row is cut by it).
    ``padded``: some key of the tile is padding (found on the host when the plan is made, so running it needs no
    host sync)."""

    src: int
    a: int
    b: int
    offset: int
    causal: bool
    r0: int
    r1: int
    lo_shift: int | None
    padded: bool = False

    @property
    def rows(self) -> int:
        return self.r1 - self.r0


def _diagonal_cuts(lo: torch.Tensor | None, first_q: int, C: int) -> list[int]:
    """Row boundaries [0, ..., C] of the diagonal's square tiles: rows where a document starts in
    every batch row (the query's bound is its own key, so no later row sees an earlier key of the
    chunk), at least C / _MAX_DIAG_TILES rows apart."""
    cuts = [0]
    if lo is not None and C > 1:
        starts = (lo == torch.arange(first_q, first_q + C).view(1, C)).all(0)
        min_rows = max(1, C // _MAX_DIAG_TILES)
        for c in starts.nonzero().flatten().tolist():
            if c - cuts[-1] >= min_rows:
                cuts.append(c)
    return cuts + [C]


def _plan(S: int, K: int, C: int, block: int, lo: torch.Tensor | None, valid: torch.Tensor | None = None,
          single: bool = False) -> list[_Tile]:
    """The tiles of one chunk, the causal diagonal last. ``lo``: (B, C) query lower bounds on the
    CPU (non-decreasing along each row), or None; ``valid``: (B, S + K) key padding mask on the CPU,
    or None. ``single``: one bottom-right causal tile over the joined prefix and own keys (no mask but the
    causal one: the caller checked).

    With lower bounds, keys before the smallest bound are never visited, a full tile serves only the
    leading rows whose bound is below its end (bounds are non-decreasing, so those rows are a prefix
    of the chunk), and the diagonal is split into one square causal tile per document that starts in
    it: a packed row costs the sum of its documents' squared lengths, a sliding window
    C x (window + C) per chunk.
    """
    first_q = S + K - C  # global key index of query 0 (= the diagonal tile's first key)
    if single:
        return [_Tile(2, 0, S + K, 0, True, 0, C, None)]

    def tile(src, a, b, offset, causal, r0, r1, lo_shift):
        padded = valid is not None and not bool(valid[:, offset + a : offset + b].all())
        return _Tile(src, a, b, offset, causal, r0, r1, lo_shift, padded)

    tiles = []
    if lo is None:
        tiles += [tile(0, a, min(a + block, S), 0, False, 0, C, None) for a in range(0, S, block)]
        tiles += [tile(1, a, min(a + block, K - C), S, False, 0, C, None) for a in range(0, K - C, block)]
    else:
        start = int(lo.min())
        cuts = {start, first_q}
        if start < S < first_q:
            cuts.add(S)  # a tile never straddles the prefix and the own keys
        bounds = torch.unique(lo)
        if bounds.numel() <= _MAX_LO_CUTS * lo.shape[0]:
            cuts.update(int(x) for x in bounds if start < x < first_q)
        cuts = sorted(c for c in cuts if start <= c <= first_q)
        for lo_cut, hi_cut in itertools.pairwise(cuts):
            for ga in range(lo_cut, hi_cut, block):
                gb = min(ga + block, hi_cut)
                # rows whose bound is below gb see at least one key of the tile (all keys precede them)
                rows = int(torch.searchsorted(lo.contiguous(), torch.full((lo.shape[0], 1), gb)).max())
                if rows == 0:
                    continue
                cut = bool((lo[:, :rows] > ga).any())
                src, offset = (0, 0) if gb <= S else (1, S)
                tiles.append(tile(src, ga - offset, gb - offset, offset, False, 0, rows, ga if cut else None))
    for r0, r1 in itertools.pairwise(_diagonal_cuts(lo, first_q, C)):
        cut = lo is not None and bool((lo[:, r0:r1] > first_q + r0).any())
        tiles.append(tile(1, K - C + r0, K - C + r1, S, True, r0, r1, first_q + r0 if cut else None))
    return tiles


def _tile_keys(k, v, k_prefix, v_prefix, key_valid, t: _Tile, joined=None):
    """The (B, Hkv, b - a, D) keys/values of one tile and its (B, b - a) padding mask (None when the
    plan found no padding in it: an unpadded tile can take the faster unmasked kernels)."""
    kt, vt = ((k_prefix, v_prefix), (k, v), joined)[t.src]
    valid = key_valid[:, t.offset + t.a : t.offset + t.b] if t.padded else None
    return kt[:, :, t.a : t.b], vt[:, :, t.a : t.b], valid


def _stack(t: torch.Tensor, Hkv: int, rows: int) -> torch.Tensor:
    """(B, H, C, ...) -> (B, Hkv, R * rows, ...) of rows [0, rows): GQA query heads stacked as rows
    (row r * rows + c is query c of the KV head's r-th query head), so K/V are never repeated."""
    t = t[:, :, :rows]
    B, H = t.shape[:2]
    return t.reshape(B, Hkv, (H // Hkv) * rows, *t.shape[3:])


def _tile_mask(t: _Tile, valid, query_lo, softcap, n: int, R: int, dropout: tuple[float, int] | None = None,
               first_q: int = 0) -> TileMask:
    key_lo = None
    if t.lo_shift is not None:
        key_lo = query_lo[:, t.r0 : t.r1] - t.lo_shift
        if not t.causal and R > 1:
            key_lo = key_lo.repeat(1, R)  # stacked rows: R blocks of the chunk's rows
    mask = TileMask(t.causal, valid, key_lo, softcap, n)
    return mask if dropout is None else with_dropout(mask, dropout, (t.offset + t.a, first_q + t.r0,
                                                                    not t.causal and R > 1))


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_prefix, v_prefix, key_valid, query_lo, softcap, scale, plan, kernel, sink_k, sink_v,
                sink_own, sink_logits, joined_k, joined_v, dropout, kept):
        joined = (joined_k, joined_v)
        if kept is not None and kept.replaying:  # the forward's output and log-sum-exp: only the backward runs
            out, lse, rng = kept.take()
        else:
            rng = KernelRngState()
            with torch.autocast(q.device.type, enabled=False), phase("attention.forward"):
                out, lse = _attention_forward(q, k, v, k_prefix, v_prefix, key_valid, query_lo, softcap, scale, plan,
                                              kernel, joined, rng, dropout)
                if sink_logits is not None:
                    out, lse = with_sink_logits(out, lse, sink_logits)
            if kept is not None:
                kept.record(out, lse, rng)
        ctx.save_for_backward(q, k, v, k_prefix, v_prefix, key_valid, query_lo, out, lse, sink_logits, *joined)
        # the plan was made on the host in forward: backward reuses it (no host sync)
        ctx.softcap, ctx.scale, ctx.plan, ctx.kernel, ctx.dropout = softcap, scale, plan, kernel, dropout
        ctx.rng = rng  # what the fused kernels' forwards left for their backwards
        ctx.sinks, ctx.sink_own = (sink_k, sink_v), sink_own
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, k_prefix, v_prefix, key_valid, query_lo, out, lse, sink_logits, *joined = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False), phase("attention.backward"):
            dq, dk, dv = _attention_backward(
                grad_out, q, k, v, k_prefix, v_prefix, key_valid, query_lo, ctx.softcap, out, lse, ctx.scale,
                ctx.plan, ctx.kernel, ctx.sinks, ctx.sink_own, joined, ctx.rng, ctx.dropout,
            )
            d_sink = None
            if sink_logits is not None and ctx.needs_input_grad[14]:
                # the sink is a key with value 0: dLoss/ds_h = -sum_{b,q} p_sink * rowsum(dO * O)
                cdt = compute_dtype(q.dtype)
                p_sink = torch.exp(sink_logits.to(cdt).view(1, -1, 1) - lse)
                delta = (grad_out.to(cdt) * out.to(cdt)).sum(-1)
                d_sink = -(p_sink * delta).sum((0, 2)).to(sink_logits.dtype)
        return dq, dk, dv, *([None] * 11), d_sink, None, None, None, None


def _rows(t: torch.Tensor, tile: _Tile, C: int) -> torch.Tensor:
    """Rows [r0, r1) of a (B, H, C, ...) tensor, contiguous (the fused kernels get dense inputs)."""
    return t if tile.r0 == 0 and tile.r1 == C else t[:, :, tile.r0 : tile.r1].contiguous()


def _attention_forward(q, k, v, k_prefix, v_prefix, key_valid, query_lo, softcap, scale, plan, kernel, joined,
                       rng: KernelRngState, dropout=None):
    B, H, C, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[-1]
    first_q = (0 if k_prefix is None else k_prefix.shape[2]) + k.shape[2] - C  # the queries' first key index
    R = H // Hkv
    cdt = compute_dtype(q.dtype)
    m = acc = None
    owned = False  # acc/m are buffers of ours (not a kernel's output) that partial tiles update in place
    covered = 0  # rows [covered, C) have no contribution yet
    for t in plan:
        kt, vt, valid = _tile_keys(k, v, k_prefix, v_prefix, key_valid, t, joined)
        mask = _tile_mask(t, valid, query_lo, softcap, kt.shape[2], R, dropout, first_q)
        if t.causal:  # K/V repeated over the query heads unless the kernel takes GQA itself
            q_t = _rows(q, t, C)
            o_t, lse_t = tile_forward(pick_kernel(kernel, q_t, mask), q_t, kt, vt, mask, scale, rng, kv_repeat=R)
        else:  # GQA query heads stacked as rows: K/V never repeated
            q_t = _stack(q, Hkv, t.rows)
            o_t, lse_t = tile_forward(pick_kernel(kernel, q_t, mask), q_t, kt, vt, mask, scale, rng)
            o_t, lse_t = o_t.reshape(B, H, t.rows, Dv), lse_t.reshape(B, H, t.rows)
        o_t, lse_t = o_t.to(cdt), lse_t.to(cdt)
        if m is None and t.rows == C:
            m, acc, covered = lse_t, o_t, C
            continue
        with phase("attention.merge"):
            if not owned:
                acc = torch.zeros((B, H, C, Dv), dtype=cdt, device=q.device) if acc is None else acc.clone()
                m = torch.full((B, H, C), _NEG_INF, dtype=cdt, device=q.device) if m is None else m.clone()
                owned = True
            r0, r1 = t.r0, t.r1
            if r0 >= covered:  # the first contribution to these rows (a document's own diagonal tile)
                acc[:, :, r0:r1] = o_t
                m[:, :, r0:r1] = lse_t
            else:
                # acc is normalised over the tiles so far, whose total log-mass is m.
                m_r = m[:, :, r0:r1]
                m_new = torch.logaddexp(m_r, lse_t)
                m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)  # rows still empty: weights exp(-inf) = 0
                acc[:, :, r0:r1] = acc[:, :, r0:r1] * torch.exp(m_r - m_safe).unsqueeze(-1) + o_t * torch.exp(
                    lse_t - m_safe
                ).unsqueeze(-1)
                m[:, :, r0:r1] = m_new
            covered = max(covered, r1)
    # acc is the normalised output; m the log-sum-exp. Rows with no valid key: 0 and -inf.
    # Without padding every row sees at least its own key. acc may be a kernel's output (a view
    # for some kernels), so it is masked out of place.
    if key_valid is not None:
        empty = m == _NEG_INF
        acc = acc.masked_fill(empty.unsqueeze(-1), 0.0)
        m = m.masked_fill(empty, float("inf"))  # +inf: exp(s - lse) = 0 in backward
    return acc.to(q.dtype), m


def _attention_backward(grad_out, q, k, v, k_prefix, v_prefix, key_valid, query_lo, softcap, out, lse, scale, plan,
                        kernel, sinks, sink_own, joined, rng: KernelRngState, dropout=None):
    sink_k, sink_v = sinks
    B, H, C, D = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    R = H // Hkv
    S = 0 if k_prefix is None else k_prefix.shape[2]
    first_q = S + K - C
    cdt = compute_dtype(q.dtype)
    grad_out = grad_out.contiguous()
    # The first tile's gradients become the accumulators (kernel outputs are fresh tensors) when it
    # covers every row; dK/dV need zeroed buffers only when several tiles cover the chunk's own keys.
    if plan[0].src == 2:
        return _single_call_backward(grad_out, q, k, v, out, lse, scale, plan[0], kernel, sinks, sink_own, joined, S,
                                     rng)
    dq = None
    dk = dv = None
    if not sink_own and (K > C or sum(t.causal for t in plan) > 1):
        dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
    for t in plan:
        if t.src == 0 and sink_k is None:
            continue
        kt, vt, valid = _tile_keys(k, v, k_prefix, v_prefix, key_valid, t)
        mask = _tile_mask(t, valid, query_lo, softcap, kt.shape[2], R, dropout, first_q)
        if t.causal:
            q_t, do_t, out_t, lse_t = (_rows(x, t, C) for x in (q, grad_out, out, lse))
            dq_t, dk_t, dv_t = tile_backward(pick_kernel(kernel, q_t, mask), do_t, q_t, kt, vt, out_t, lse_t, mask,
                                             scale, rng, kv_repeat=R)
        else:
            q_t = _stack(q, Hkv, t.rows)
            tile = pick_kernel(kernel, q_t, mask)
            dq_t, dk_t, dv_t = tile_backward(
                tile, _stack(grad_out, Hkv, t.rows), q_t, kt, vt, _stack(out, Hkv, t.rows), _stack(lse, Hkv, t.rows),
                mask, scale, rng,
            )
            dq_t = dq_t.reshape(B, H, t.rows, D)
        if dq is None and t.rows == C:
            dq = dq_t.to(cdt)
        else:
            if dq is None:
                dq = torch.zeros((B, H, C, D), dtype=cdt, device=q.device)
            dq[:, :, t.r0 : t.r1] += dq_t
        if t.src == 0 or sink_own:
            a_sink = t.a if t.src == 0 else S + t.a
            # added in place, cast on the fly (no float32 temporary of the tile's gradient): bitwise a cast, then add
            sink_k[:, :, a_sink : a_sink + t.b - t.a] += dk_t
            sink_v[:, :, a_sink : a_sink + t.b - t.a] += dv_t
        elif dk is None:  # one diagonal tile covers all own keys (K == C)
            dk, dv = dk_t, dv_t
        else:
            dk[:, :, t.a : t.b] += dk_t
            dv[:, :, t.a : t.b] += dv_t
    if sink_own:
        return dq.to(q.dtype), None, None
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _single_call_backward(grad_out, q, k, v, out, lse, scale, t: _Tile, kernel, sinks, sink_own, joined, S: int,
                          rng: KernelRngState):
    """The one-call tile's backward: one kernel call for dQ and the joined keys' dK/dV, which are then split: the
    prefix's [0, S) added into the sink (when wanted), the chunk's own keys returned (or added into the sink at
    [S, S + K) when it owns them)."""
    sink_k, sink_v = sinks
    kt, vt = joined
    R = q.shape[1] // k.shape[1]
    mask = TileMask(True, n=kt.shape[2])
    tile = pick_kernel(kernel, q, mask)
    dq, dk, dv = tile_backward(tile, grad_out, q, kt, vt, out, lse, mask, scale, rng, kv_repeat=R)
    if sink_own:
        sink_k[:, :, : t.b] += dk  # cast on the fly: no float32 temporary
        sink_v[:, :, : t.b] += dv
        return dq.to(q.dtype), None, None
    if sink_k is not None and S:
        sink_k[:, :, :S] += dk[:, :, :S]
        sink_v[:, :, :S] += dv[:, :, :S]
    return dq.to(q.dtype), dk[:, :, S:].to(k.dtype), dv[:, :, S:].to(v.dtype)


def _autocast_inputs(tensors, device_type: str):
    """Cast floating inputs to the autocast dtype, as autocast does for ``scaled_dot_product_attention``
    (float32 and other non-float64 floats; float64 and None pass through)."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t for t in tensors
    )


def chunk_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    k_prefix: torch.Tensor | None = None,
    v_prefix: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    kv_block_size: int | None = None,
    prefix_grad_sink: tuple[torch.Tensor, torch.Tensor] | None = None,
    sink_own_keys: bool = False,
    query_lo: torch.Tensor | None = None,
    softcap: float | None = None,
    kernel: str = "auto",
    sink_logits: torch.Tensor | None = None,
    joined_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    single_call: bool | None = None,
    dropout: float = 0.0,
    dropout_seed: int = 0,
    kept: "ChunkSlot | None" = None,
) -> torch.Tensor:
    """Causal attention of the last C positions against all S + K keys, bottom-right aligned.

    Args:
        q: (B, H, C, D) queries (after RoPE).
        k, v: (B, Hkv, K, D) keys, (B, Hkv, K, Dv) values of the query chunk itself (or all keys, S == 0);
            K >= C. Dv may differ from D (multi-head latent attention: DeepSeek-V2/V3).
        scale: softmax scale (usually D ** -0.5).
        k_prefix, v_prefix: (B, Hkv, S, D) keys/values before ``k``; constants of this op.
        key_valid: (B, S + K) bool, False for padding keys; None means all valid.
        kv_block_size: keys per full tile (the diagonal tile is always C x C). None: the whole
            prefix in one tile on CUDA, :data:`CPU_KV_BLOCK_SIZE` elsewhere.
        prefix_grad_sink: (dK, dV) buffers of shape (B, Hkv, >= S, D); backward ADDS the prefix
            gradients into ``[:, :, :S]`` in place. None: prefix gradients are not computed.
        sink_own_keys: the chunk's own ``k`` / ``v`` are constants too: their gradients are ADDED into
            ``prefix_grad_sink`` at ``[:, :, S:S + K]`` (the buffers must cover S + K keys). Sequence
            parallelism uses this: every key comes from the exchanged, heads-sharded K/V.
        query_lo: (B, C) int64, for each query the global key index (0 = the first prefix key) of
            the first key it may attend: its document's first token (packed rows) and/or its sliding
            window's first key (:func:`query_lower_bounds`). Non-decreasing along the chunk, at most
            the query's own index. None: every earlier key.
        softcap: logit softcapping (Gemma 2): scores become ``softcap * tanh(scores / softcap)``.
        kernel: "auto" (per tile, the first of :func:`kernel_chain` that takes it) or one of
            :data:`KERNELS` for every tile.
        sink_logits: (H,) attention sinks (gpt-oss's ``s_aux``): one extra logit per head in every query's
            softmax, with a zero value; differentiable. None: no sink.
        joined_kv: (B, Hkv, S + K, D) keys and (B, Hkv, S + K, Dv) values holding ``k_prefix`` then ``k`` (the same
            values; typically the caller's key buffer, the chunk's keys written into it), constants. They let a
            kernel whose causal mask is bottom-right aligned take the prefix and the diagonal in one call. Not
            needed when S == 0.
        single_call: whether a chunk that needs no mask but the causal one (no padding, documents, window or
            softcap) and comes with ``joined_kv`` runs as one kernel call per direction; other chunks are tiled.
            None (default): when the kernel the tiled path would give the prefix takes the bottom-right mask itself
            (FlashAttention-2 where cuDNN, twice as fast on Hopper, is not chosen; the memory-efficient kernel
            without GQA). True: always, on the first kernel that takes it (the math kernel, holding a (C x S + K)
            score matrix, where no fused one does); a named ``kernel`` that cannot is an error. False: never.
        dropout: dropout probability on the attention probabilities (each row's softmax over every key, then the
            mask, as stock eager attention); every tile then runs the math kernel, its keep mask drawn from its own
            generator (``dropout_seed`` and where the tile lies), the same in forward and backward. 0: none.
        dropout_seed: with ``dropout``: the call's seed (a StreamBP chunk draws it in its region, ``ops.draws``, so
            each of its passes draws the same masks).
        kept: a StreamBP chunk's kept attention outputs (``ops.kept_attention.ChunkSlot``): in the layer's forward
            this call's output and log-sum-exp are recorded into it; in the backward's replay they are taken from it
            instead of computed, and only the backward runs. None: computed, nothing kept.

    Returns:
        (B, H, C, Dv) attention output in q's dtype (the autocast dtype under autocast). Queries with
        no valid key give zeros.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if k.shape[2] < q.shape[2]:
        raise ValueError(f"chunk attention needs at least as many own keys ({k.shape[2]}) as queries ({q.shape[2]})")
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}: use one of {sorted(KERNELS)} or 'auto'")
    num_prefix = 0 if k_prefix is None else k_prefix.shape[2]
    key_valid, valid_cpu = _padding_keys(key_valid, num_prefix + k.shape[2])
    if num_prefix == 0:
        k_prefix = v_prefix = None
    if sink_own_keys and prefix_grad_sink is None:
        raise ValueError("sink_own_keys=True needs prefix_grad_sink buffers to add the key gradients into")
    if kv_block_size is None:
        kv_block_size = default_kv_block_size(num_prefix + k.shape[2], q.device)
    lo_cpu = None
    if query_lo is not None:
        query_lo, lo_cpu = _check_query_lo(query_lo, q.shape[0], q.shape[2], num_prefix + k.shape[2] - q.shape[2])
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number, got {softcap}")
    q, k, v, k_prefix, v_prefix = _autocast_inputs((q, k, v, k_prefix, v_prefix), q.device.type)
    if len({t.dtype for t in (q, k, v, k_prefix, v_prefix) if t is not None}) > 1:
        raise ValueError(
            "queries, keys and values have different dtypes "
            f"({q.dtype}, {k.dtype}, {v.dtype}" + ("" if k_prefix is None else f", prefix {k_prefix.dtype}") + "): "
            "cast them to one dtype, or run the model under torch.autocast"
        )
    sink_k, sink_v = prefix_grad_sink if prefix_grad_sink is not None else (None, None)
    joined_kv = _joined_keys(joined_kv, k, v, num_prefix, q.device.type)
    if not 0 <= dropout < 1:
        raise ValueError(f"attention dropout must be in [0, 1), got {dropout}")
    plain = key_valid is None and query_lo is None and softcap is None and not dropout
    one_call = _one_call_kernel(single_call, kernel, q, k.shape[1], num_prefix + k.shape[2], plain,
                                joined_kv is not None)
    plan = _plan(num_prefix, k.shape[2], q.shape[2], int(kv_block_size), lo_cpu, valid_cpu, single=one_call is not None)
    joined_k, joined_v = joined_kv if one_call is not None else (None, None)
    return _ChunkAttention.apply(
        q, k, v, k_prefix, v_prefix, key_valid, query_lo, None if softcap is None else float(softcap), float(scale),
        plan, one_call or kernel, sink_k, sink_v, sink_own_keys, sink_logits, joined_k, joined_v,
        (float(dropout), int(dropout_seed)) if dropout else None, kept,
    )


def _padding_keys(key_valid: torch.Tensor | None, num_keys: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(key_valid, its host copy), both None when every one of the ``num_keys`` keys is valid: the plan marks the
    padded tiles from the host copy (one copy per call)."""
    if key_valid is None:
        return None, None
    if key_valid.shape[-1] != num_keys:
        raise ValueError(f"key_valid covers {key_valid.shape[-1]} keys, expected {num_keys}")
    valid_cpu = key_valid.cpu()
    return (None, None) if bool(valid_cpu.all()) else (key_valid, valid_cpu)


def _joined_keys(joined_kv, k: torch.Tensor, v: torch.Tensor, num_prefix: int, device_type: str):
    """The prefix and chunk keys / values in one buffer each, checked (the chunk's own without a prefix), in the
    autocast dtype; None when the caller gave none."""
    if num_prefix == 0:
        return k, v
    if joined_kv is None:
        return None
    joined_kv = _autocast_inputs(joined_kv, device_type)
    want = (num_prefix + k.shape[2], num_prefix + v.shape[2])
    if (joined_kv[0].shape[2], joined_kv[1].shape[2]) != want or joined_kv[0].dtype != k.dtype:
        raise ValueError(f"joined_kv must hold the {want[0]} prefix and chunk keys in {k.dtype}, got "
                         f"{tuple(joined_kv[0].shape)} {joined_kv[0].dtype}")
    return joined_kv


def _one_call_kernel(single_call: bool | None, requested: str, q: torch.Tensor, num_kv_heads: int, n: int,
                     plain: bool, joined: bool) -> str | None:
    """The kernel that runs the chunk as one bottom-right causal tile over its ``n`` keys, or None for tiles."""
    if single_call is False or n == q.shape[2] or not plain or not joined:
        return None  # (a chunk without a prefix is one square tile already)
    mask = TileMask(True, n=n)
    if single_call is None:
        # Only where the tiled path's prefix tile would run on this very kernel: then one call is the same work
        # in fewer launches with no merge. cuDNN (top-left only) stays tiled: on an H100 it runs about twice as
        # fast as FlashAttention-2 (benchmarks/results/attention_h100.md), more than the merge costs.
        full = pick_kernel(requested, q, TileMask(False, n=n))
        no_repeat = full.native_gqa or q.shape[1] == num_kv_heads  # K/V repeated over S + K keys: too big
        if full.bottom_right and full.name != "math" and no_repeat and kernel_refusal(full, q, mask) is None:
            return full.name
        return None
    if requested != "auto":
        why = kernel_refusal(KERNELS[requested], q, mask)
        if why:
            raise ValueError(f"single_call=True with kernel {requested!r}, which cannot take the chunk in one call: "
                             f"{why}. Use kernel='auto' or single_call=None")
        return requested
    return next(name for name in (*kernel_chain(q.device), "math") if kernel_refusal(KERNELS[name], q, mask) is None)


def _check_query_lo(query_lo: torch.Tensor, B: int, C: int, first_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B, C) int64 bounds on their device and a host copy (the op's one sync for them)."""
    if query_lo.dim() != 2 or query_lo.shape[1] != C or query_lo.shape[0] not in (1, B):
        raise ValueError(f"query_lo has shape {tuple(query_lo.shape)}, expected ({B}, {C}) (one bound per query)")
    query_lo = query_lo.to(torch.int64).expand(B, C)
    lo = query_lo.cpu()
    if C > 1 and bool((lo[:, 1:] < lo[:, :-1]).any()):
        raise ValueError("query_lo decreases along the chunk: bounds come from document starts and sliding windows, "
                         "which never move back (documents must be contiguous)")
    own = torch.arange(first_q, first_q + C).view(1, C)
    if bool((lo > own).any()) or bool((lo < 0).any()):
        raise ValueError("query_lo must lie in [0, the query's own key index]: every query attends at least itself")
    return query_lo, lo


@dataclass(frozen=True)
class KeyLimits:
    """What limits a query's keys beyond causality and padding, by GLOBAL key index: packed documents, a sliding
    window, chunked attention. One value for the attention functions that take them (``ops.ulysses``; the local path
    of ``forwards.attention_interface``), which cut it to their queries with :meth:`query_lo`."""

    doc_start: torch.Tensor | None = None
    """(B, T) index of each token's document start (packed rows), or None (one document per row)."""
    sliding_window: int | None = None
    """Keys each query attends at most, itself included, or None."""
    attention_chunk: int | None = None
    """Chunked attention (Llama 4's ``attention_chunk_size``), or None."""
    chunk_origin: torch.Tensor | None = None
    """(B, 1) or (B, T) key index the attention chunks are counted from, or None (from 0)."""

    def query_lo(self, positions: torch.Tensor, columns: slice | torch.Tensor | None = None) -> torch.Tensor | None:
        """(B or 1, C) first key each query may attend (:func:`query_lower_bounds`), or None when nothing limits.

        Args:
            positions: (C,) global key indices of the queries.
            columns: which of the (B, T) tensors' columns are those queries (a slice or an index tensor); None: all
                (C = T).
        """
        if self.doc_start is None and self.sliding_window is None and self.attention_chunk is None:
            return None
        docs, origin = self.doc_start, self.chunk_origin
        if columns is not None:
            docs = None if docs is None else docs[:, columns]
            origin = origin if origin is None or origin.shape[-1] == 1 else origin[:, columns]
        docs = None if docs is None else docs.to(positions.device)
        return query_lower_bounds(positions, docs, self.sliding_window, self.attention_chunk, origin)


def query_lower_bounds(
    positions: torch.Tensor,
    doc_start: torch.Tensor | None = None,
    sliding_window: int | None = None,
    attention_chunk: int | None = None,
    chunk_origin: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """(B, C) first key index each query may attend (the ``query_lo`` of :func:`chunk_causal_attention`).

    Args:
        positions: (C,) global key indices of the queries.
        doc_start: (B, C) global index of each query's document's first token, or None (one document).
        sliding_window: the query sees at most this many keys, itself included (transformers'
            convention: key j is visible to query i when i - window < j <= i), or None.
        attention_chunk: chunked attention (Llama 4's ``attention_chunk_size``): keys are cut into
            chunks of this many, counted from ``chunk_origin``, and a query sees only keys of its own
            chunk (transformers' ``chunked_overlay``: (j - origin) // A == (i - origin) // A), or None.
        chunk_origin: (B, 1) or (B, C) int64 key index each query's chunks are counted from (transformers:
            the row's number of left-padding tokens, or in packed rows the query's document's first token);
            None: 0.

    Returns:
        (B or 1, C) int64 bounds, or None when nothing limits the queries.
    """
    lo = None if doc_start is None else doc_start.to(torch.int64)
    if sliding_window is not None:
        win = (positions.to(torch.int64) - (sliding_window - 1)).clamp(min=0).view(1, -1)
        lo = win if lo is None else torch.maximum(lo, win.to(lo.device))
    if attention_chunk is not None:
        origin = torch.zeros((1, 1), dtype=torch.int64) if chunk_origin is None else chunk_origin.to(torch.int64)
        origin = origin.to(positions.device)
        # the first key of the query's chunk; at most the query itself, so always a valid bound (0 and up)
        first = (torch.div(positions.to(torch.int64).view(1, -1) - origin, attention_chunk, rounding_mode="floor")
                 * attention_chunk + origin).clamp(min=0)
        lo = first if lo is None else torch.maximum(lo, first.to(lo.device))
    return lo
