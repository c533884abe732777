"""Exact causal attention of a query chunk against a key prefix, tiled over keys.

Holds:
    chunk_causal_attention: the public op (pure PyTorch, any device, float64-exact).

Shape legend: B batch, H query heads, Hkv key/value heads (H = Hkv * R, GQA), C query chunk,
S key prefix, K keys of the chunk itself, D head dim.

The queries are the LAST C positions of the S + K keys (bottom-right aligned causal mask): query i
sits at global key index S + K - C + i and attends keys [0, S + K - C + i]. That covers both a
StreamBP chunk (K == C, the prefix holds earlier chunks' keys) and generation with a KV cache
(S == 0, K >= C). Nothing of size (C x S) or (T x T) is ever materialised: scores exist one
(B, H, C, kv_block_size) tile at a time, with the online softmax of FlashAttention and its
recompute-based backward (O and the row log-sum-exp are the only saved intermediates).

The prefix keys/values are treated as constants of this op. Their gradients, when wanted, are
ADDED IN PLACE into caller-owned buffers (``prefix_grad_sink``): StreamBP accumulates dK/dV of the
whole sequence across chunks, and writing each tile's contribution straight into that buffer
avoids allocating an (S x D) gradient per chunk.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_causal_attention"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs are upcast per tile: scores, softmax statistics and the output
    # accumulator live in float32, as in flash-attention.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _tiles(num_prefix: int, num_own: int, block: int):
    """Yield (source, start, end) key tiles: ``source`` 0 = prefix, 1 = the chunk's own keys."""
    for a in range(0, num_prefix, block):
        yield 0, a, min(a + block, num_prefix)
    for a in range(0, num_own, block):
        yield 1, a, min(a + block, num_own)


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_prefix, v_prefix, key_valid, scale, block, sink_k, sink_v):
        B, H, C, D = q.shape
        Hkv = k.shape[1]
        R = H // Hkv
        S = 0 if k_prefix is None else k_prefix.shape[2]
        K = k.shape[2]
        cdt = _compute_dtype(q.dtype)
        # (B, H, C, D) -> (B, Hkv, R*C, D): the R query heads sharing one KV head are stacked
        # along rows, so one matmul per tile serves the group without repeating K/V.
        qs = (q.to(cdt) * scale).reshape(B, Hkv, R * C, D)
        m = torch.full((B, Hkv, R * C), float("-inf"), dtype=cdt, device=q.device)
        l = torch.zeros((B, Hkv, R * C), dtype=cdt, device=q.device)
        acc = torch.zeros((B, Hkv, R * C, D), dtype=cdt, device=q.device)
        for src, a, b in _tiles(S, K, block):
            kb, vb, ga = (k_prefix, v_prefix, a) if src == 0 else (k, v, S + a)
            scores = qs @ kb[:, :, a:b].to(cdt).transpose(-1, -2)
            scores = _apply_mask(scores, key_valid, ga, ga + b - a, S + K, C, R)
            m_new = torch.maximum(m, scores.amax(-1))
            # Rows with no visible key so far keep m = -inf; shift them by 0 to avoid inf - inf.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = torch.exp(scores - m_safe.unsqueeze(-1))
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(-1)
            acc = acc * alpha.unsqueeze(-1) + p @ vb[:, :, a:b].to(cdt)
            m = m_new
        empty = l == 0
        # A query with no valid key (left padding) outputs zeros, as torch SDPA does.
        out = acc / l.masked_fill(empty, 1.0).unsqueeze(-1)
        lse = (m.masked_fill(empty, 0.0) + torch.log(l.masked_fill(empty, 1.0))).masked_fill(empty, float("inf"))
        ctx.save_for_backward(q, k, v, k_prefix, v_prefix, key_valid, out, lse)
        ctx.scale, ctx.block = scale, block
        ctx.sinks = (sink_k, sink_v)
        return out.reshape(B, H, C, D).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, k_prefix, v_prefix, key_valid, out, lse = ctx.saved_tensors
        sink_k, sink_v = ctx.sinks
        scale, block = ctx.scale, ctx.block
        B, H, C, D = q.shape
        Hkv = k.shape[1]
        R = H // Hkv
        S = 0 if k_prefix is None else k_prefix.shape[2]
        K = k.shape[2]
        cdt = out.dtype
        qs = (q.to(cdt) * scale).reshape(B, Hkv, R * C, D)
        do = grad_out.to(cdt).reshape(B, Hkv, R * C, D)
        # delta_i = sum_d dO_id * O_id: the softmax-backward correction, one number per query row.
        delta = (do * out).sum(-1, keepdim=True)
        dqs = torch.zeros_like(qs)
        dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
        dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
        for src, a, b in _tiles(S, K, block):
            if src == 0 and sink_k is None:
                continue
            kb, vb, ga = (k_prefix, v_prefix, a) if src == 0 else (k, v, S + a)
            kt, vt = kb[:, :, a:b].to(cdt), vb[:, :, a:b].to(cdt)
            scores = _apply_mask(qs @ kt.transpose(-1, -2), key_valid, ga, ga + b - a, S + K, C, R)
            # lse is +inf on rows with no valid key, so their probabilities are exactly 0.
            p = torch.exp(scores - lse.unsqueeze(-1))
            dp = do @ vt.transpose(-1, -2)
            ds = p * (dp - delta)
            dqs += ds @ kt
            dk_t = ds.transpose(-1, -2) @ qs
            dv_t = p.transpose(-1, -2) @ do
            if src == 0:
                sink_k[:, :, a:b] += dk_t.to(sink_k.dtype)
                sink_v[:, :, a:b] += dv_t.to(sink_v.dtype)
            else:
                dk[:, :, a:b] = dk_t
                dv[:, :, a:b] = dv_t
        dq = (dqs * scale).reshape(B, H, C, D).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


def _apply_mask(scores, key_valid, ga, gb, total, C, R):
    """Mask a (B, Hkv, R*C, b) score tile for keys [ga, gb) of ``total`` keys (bottom-right causal).

    Builds at most a (B, 1, 1, C, b) boolean tile: never a mask over the whole key range.
    """
    first_query = total - C  # global key index of query 0
    causal = gb - 1 > first_query  # some key in the tile lies after some query
    if not causal and key_valid is None:
        return scores
    B, Hkv, RC, b = scores.shape
    keep = None
    if causal:
        qi = torch.arange(first_query, total, device=scores.device)
        kj = torch.arange(ga, gb, device=scores.device)
        keep = (kj.unsqueeze(0) <= qi.unsqueeze(1)).view(1, 1, 1, C, b)
    if key_valid is not None:
        kv = key_valid[:, ga:gb].view(B, 1, 1, 1, b)
        keep = kv if keep is None else keep & kv
    return scores.view(B, Hkv, R, C, b).masked_fill(~keep, float("-inf")).view(B, Hkv, RC, b)


def chunk_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    k_prefix: torch.Tensor | None = None,
    v_prefix: torch.Tensor | None = None,
    key_valid: torch.Tensor | None = None,
    kv_block_size: int = 1024,
    prefix_grad_sink: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of the last C positions against all S + K keys, bottom-right aligned.

    Args:
        q: (B, H, C, D) queries (after RoPE).
        k, v: (B, Hkv, K, D) keys/values of the query chunk itself (or all keys, S == 0); K >= C.
        scale: softmax scale (usually D ** -0.5).
        k_prefix, v_prefix: (B, Hkv, S, D) keys/values before ``k``; constants of this op.
        key_valid: (B, S + K) bool, False for padding keys; None means all valid.
        kv_block_size: keys per tile.
        prefix_grad_sink: (dK, dV) buffers of shape (B, Hkv, >= S, D); backward ADDS the prefix
            gradients into ``[:, :, :S]`` in place. None: prefix gradients are not computed.

    Returns:
        (B, H, C, D) attention output in q's dtype. Queries with no valid key give zeros.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if k.shape[2] < q.shape[2]:
        raise ValueError(f"chunk attention needs at least as many own keys ({k.shape[2]}) as queries ({q.shape[2]})")
    num_prefix = 0 if k_prefix is None else k_prefix.shape[2]
    if key_valid is not None and key_valid.shape[-1] != num_prefix + k.shape[2]:
        raise ValueError(f"key_valid covers {key_valid.shape[-1]} keys, expected {num_prefix + k.shape[2]}")
    if num_prefix == 0:
        k_prefix = v_prefix = None
    sink_k, sink_v = prefix_grad_sink if prefix_grad_sink is not None else (None, None)
    return _ChunkAttention.apply(q, k, v, k_prefix, v_prefix, key_valid, float(scale), int(kv_block_size), sink_k, sink_v)
