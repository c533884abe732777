"""Exact causal attention of a query chunk against a key prefix, tiled over keys.

Holds:
    chunk_causal_attention: the public op.
    attention_kernel_for: which per-tile kernel a tensor runs on ("cpu_flash" or "math").

Shape legend: B batch, H query heads, Hkv key/value heads (H = Hkv * R, GQA), C query chunk,
S key prefix, K keys of the chunk itself, D head dim.

The queries are the LAST C positions of the S + K keys (bottom-right aligned causal mask): query i
sits at global key index S + K - C + i and attends keys [0, S + K - C + i]. That covers both a
StreamBP chunk (K == C, the prefix holds earlier chunks' keys) and generation with a KV cache
(S == 0, K >= C). The keys are split into tiles: "full" tiles that every query sees (only the
padding mask applies; GQA query heads are stacked along rows, so K/V are never repeated) and one
square "diagonal" tile over the last C keys with a top-left causal mask (square, so top-left and
bottom-right agree). No mask over the whole key range is ever built: a padding mask is a
(B, 1, 1, tile) additive bias.

Each tile runs a kernel that returns its output and row log-sum-exp; tiles are merged exactly by
log-sum-exp (as ring attention merges blocks). Backward calls each tile's kernel backward with the
FINAL output and log-sum-exp, which yields exactly that tile's share of dQ, dK, dV
(FlashAttention-2's recompute backward). Kernels: torch's fused CPU flash-attention op
("cpu_flash"), or a pure-PyTorch tile ("math": any device, scores of one tile at a time).

The prefix keys/values are constants of this op. Their gradients, when wanted, are ADDED IN PLACE
into caller-owned buffers (``prefix_grad_sink``): StreamBP accumulates dK/dV of the whole sequence
across chunks, and writing each tile's share straight into that buffer avoids an (S x D) gradient
allocation per chunk.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_causal_attention", "attention_kernel_for"]

_NEG_INF = float("-inf")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision tiles are merged in float32, as flash-attention accumulates.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def attention_kernel_for(t: torch.Tensor, requested: str = "auto") -> str:
    """The tile kernel used for tensors like ``t``: "cpu_flash" on CPU, else "math"."""
    if requested != "auto":
        return requested
    return "cpu_flash" if t.device.type == "cpu" else "math"


# --- tile kernels -------------------------------------------------------------------------------
# forward(q (B,h,r,D), k (B,h,n,D), v, causal, valid (B,n)|None, scale) -> (o (B,h,r,D), lse (B,h,r))
#   lse is -inf on rows that see no valid key (their o is 0).
# backward(do, q, k, v, out, lse, causal, valid, scale) -> (dq, dk, dv), where out/lse are the FINAL
#   merged output and log-sum-exp, lse = +inf on rows without any valid key (their p is 0).


def _empty_rows(valid: torch.Tensor | None, causal: bool, rows: int, heads: int) -> torch.Tensor | None:
    """(B, heads, rows) True where a row sees no valid key of this tile, or None if none can."""
    if valid is None:
        return None
    B = valid.shape[0]
    if causal:  # row i of a square causal tile sees keys [0, i]
        seen = valid.cumsum(-1) > 0
        return (~seen).view(B, 1, rows).expand(B, heads, rows)
    return (~valid.any(-1)).view(B, 1, 1).expand(B, heads, rows)


def _bias(valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if valid is None:
        return None
    B, n = valid.shape
    return torch.zeros((B, 1, 1, n), dtype=dtype, device=valid.device).masked_fill(~valid.view(B, 1, 1, n), _NEG_INF)


def _cpu_flash_forward(q, k, v, causal, valid, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=_bias(valid, q.dtype), scale=scale
    )
    empty = _empty_rows(valid, causal, q.shape[2], q.shape[1])
    if empty is not None:  # the kernel reports lse = 0 for rows with no valid key
        lse = lse.masked_fill(empty, _NEG_INF)
    return out, lse


def _cpu_flash_backward(do, q, k, v, out, lse, causal, valid, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, causal, attn_mask=_bias(valid, q.dtype), scale=scale
    )


def _math_scores(q, k, causal, valid, scale):
    cdt = _compute_dtype(q.dtype)
    scores = (q.to(cdt) * scale) @ k.to(cdt).transpose(-1, -2)
    keep = None
    if causal:
        n = k.shape[2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril().view(1, 1, n, n)
    if valid is not None:
        pad = valid.view(valid.shape[0], 1, 1, -1)
        keep = pad if keep is None else keep & pad
    return scores if keep is None else scores.masked_fill(~keep, _NEG_INF)


def _math_forward(q, k, v, causal, valid, scale):
    scores = _math_scores(q, k, causal, valid, scale)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.masked_fill(lse == _NEG_INF, 0.0).unsqueeze(-1))
    return p @ v.to(p.dtype), lse


def _math_backward(do, q, k, v, out, lse, causal, valid, scale):
    cdt = _compute_dtype(q.dtype)
    p = torch.exp(_math_scores(q, k, causal, valid, scale) - lse.to(cdt).unsqueeze(-1))
    do, out = do.to(cdt), out.to(cdt)
    delta = (do * out).sum(-1, keepdim=True)  # the softmax-backward correction per row
    ds = p * (do @ v.to(cdt).transpose(-1, -2) - delta)
    dq = (ds @ k.to(cdt)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(cdt)) * scale
    dv = p.transpose(-1, -2) @ do
    return dq, dk, dv


_KERNELS = {"cpu_flash": (_cpu_flash_forward, _cpu_flash_backward), "math": (_math_forward, _math_backward)}


# --- the op -------------------------------------------------------------------------------------


def _tiles(S: int, K: int, C: int, block: int):
    """Yield (source, start, end, causal, offset): keys [start, end) of ``source`` (0 = prefix,
    1 = own keys) sit at global key indices [offset + start, offset + end); the diagonal is last."""
    for a in range(0, S, block):
        yield 0, a, min(a + block, S), False, 0
    for a in range(0, K - C, block):
        yield 1, a, min(a + block, K - C), False, S
    yield 1, K - C, K, True, S


def _tile_keys(k, v, k_prefix, v_prefix, key_valid, src, a, b, offset):
    """The (B, Hkv, b - a, D) keys/values of one tile and its (B, b - a) padding mask (or None)."""
    kt, vt = (k_prefix, v_prefix) if src == 0 else (k, v)
    valid = None if key_valid is None else key_valid[:, offset + a : offset + b]
    return kt[:, :, a:b], vt[:, :, a:b], valid


def _repeat_heads(t: torch.Tensor, R: int) -> torch.Tensor:
    # (B, Hkv, n, D) -> (B, Hkv * R, n, D); no copy without GQA
    return t if R == 1 else t.repeat_interleave(R, 1)


def _sum_heads(t: torch.Tensor, R: int) -> torch.Tensor:
    # (B, Hkv * R, n, D) -> (B, Hkv, n, D): the gradient of _repeat_heads
    return t if R == 1 else t.reshape(t.shape[0], t.shape[1] // R, R, *t.shape[2:]).sum(2)


class _ChunkAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, k_prefix, v_prefix, key_valid, scale, block, kernel, sink_k, sink_v, sink_own):
        B, H, C, D = q.shape
        Hkv, K = k.shape[1], k.shape[2]
        R = H // Hkv
        S = 0 if k_prefix is None else k_prefix.shape[2]
        tile_forward = _KERNELS[kernel][0]
        cdt = _compute_dtype(q.dtype)
        q_stacked = q.reshape(B, Hkv, R * C, D)  # rows (r, c) of KV head h: no K/V repeat for GQA
        m = acc = None
        for src, a, b, causal, offset in _tiles(S, K, C, block):
            kt, vt, valid = _tile_keys(k, v, k_prefix, v_prefix, key_valid, src, a, b, offset)
            if causal:
                o_t, lse_t = tile_forward(q, _repeat_heads(kt, R), _repeat_heads(vt, R), True, valid, scale)
            else:
                o_t, lse_t = tile_forward(q_stacked, kt, vt, False, valid, scale)
                o_t, lse_t = o_t.reshape(B, H, C, D), lse_t.reshape(B, H, C)
            o_t, lse_t = o_t.to(cdt), lse_t.to(cdt)
            if m is None:
                m, acc = lse_t, o_t
                continue
            # acc is normalised over the tiles so far, whose total log-mass is m.
            m_new = torch.logaddexp(m, lse_t)
            m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)  # rows still empty: weights exp(-inf) = 0
            acc = acc * torch.exp(m - m_safe).unsqueeze(-1) + o_t * torch.exp(lse_t - m_safe).unsqueeze(-1)
            m = m_new
        # acc is the normalised output; m the log-sum-exp. Rows with no valid key: 0 and -inf.
        # Without padding every row sees at least its own key. acc is a fresh tensor (a kernel's
        # output or the merge's), so it is zeroed in place rather than copied.
        if key_valid is not None:
            empty = m == _NEG_INF
            acc.masked_fill_(empty.unsqueeze(-1), 0.0)
            m = m.masked_fill(empty, float("inf"))  # +inf: exp(s - lse) = 0 in backward
        out, lse = acc.to(q.dtype), m
        ctx.save_for_backward(q, k, v, k_prefix, v_prefix, key_valid, out, lse)
        ctx.scale, ctx.block, ctx.kernel, ctx.sinks, ctx.sink_own = scale, block, kernel, (sink_k, sink_v), sink_own
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, k_prefix, v_prefix, key_valid, out, lse = ctx.saved_tensors
        sink_k, sink_v = ctx.sinks
        scale, block = ctx.scale, ctx.block
        tile_backward = _KERNELS[ctx.kernel][1]
        B, H, C, D = q.shape
        Hkv, K = k.shape[1], k.shape[2]
        R = H // Hkv
        S = 0 if k_prefix is None else k_prefix.shape[2]
        cdt = _compute_dtype(q.dtype)
        grad_out = grad_out.contiguous()
        stacked = (q.reshape(B, Hkv, R * C, D), grad_out.reshape(B, Hkv, R * C, D), out.reshape(B, Hkv, R * C, D))
        lse_stacked = lse.reshape(B, Hkv, R * C)
        # The first tile's gradients become the accumulators (kernel outputs are fresh tensors); dK/dV
        # need zeroed buffers only when several tiles cover the chunk's own keys.
        dq = None
        dk = dv = None
        if not ctx.sink_own and K > C:
            dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
            dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
        for src, a, b, causal, offset in _tiles(S, K, C, block):
            if src == 0 and sink_k is None:
                continue
            kt, vt, valid = _tile_keys(k, v, k_prefix, v_prefix, key_valid, src, a, b, offset)
            if causal:
                dq_t, dk_t, dv_t = tile_backward(
                    grad_out, q, _repeat_heads(kt, R), _repeat_heads(vt, R), out, lse, True, valid, scale
                )
                dk_t, dv_t = _sum_heads(dk_t, R), _sum_heads(dv_t, R)
            else:
                dq_t, dk_t, dv_t = tile_backward(
                    stacked[1], stacked[0], kt, vt, stacked[2], lse_stacked, False, valid, scale
                )
                dq_t = dq_t.reshape(B, H, C, D)
            if dq is None:
                dq = dq_t.to(cdt)
            else:
                dq += dq_t
            if src == 0 or ctx.sink_own:
                a_sink = a if src == 0 else S + a
                sink_k[:, :, a_sink : a_sink + b - a] += dk_t.to(sink_k.dtype)
                sink_v[:, :, a_sink : a_sink + b - a] += dv_t.to(sink_v.dtype)
            elif dk is None:  # the diagonal tile covers all own keys (K == C)
                dk, dv = dk_t, dv_t
            else:
                dk[:, :, a:b] += dk_t
                dv[:, :, a:b] += dv_t
        if ctx.sink_own:
            return dq.to(q.dtype), None, None, None, None, None, None, None, None, None, None, None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None, None


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
    sink_own_keys: bool = False,
    kernel: str = "auto",
) -> torch.Tensor:
    """Causal attention of the last C positions against all S + K keys, bottom-right aligned.

    Args:
        q: (B, H, C, D) queries (after RoPE).
        k, v: (B, Hkv, K, D) keys/values of the query chunk itself (or all keys, S == 0); K >= C.
        scale: softmax scale (usually D ** -0.5).
        k_prefix, v_prefix: (B, Hkv, S, D) keys/values before ``k``; constants of this op.
        key_valid: (B, S + K) bool, False for padding keys; None means all valid.
        kv_block_size: keys per full tile (the diagonal tile is always C x C).
        prefix_grad_sink: (dK, dV) buffers of shape (B, Hkv, >= S, D); backward ADDS the prefix
            gradients into ``[:, :, :S]`` in place. None: prefix gradients are not computed.
        sink_own_keys: the chunk's own ``k`` / ``v`` are constants too: their gradients are ADDED into
            ``prefix_grad_sink`` at ``[:, :, S:S + K]`` (the buffers must cover S + K keys). Sequence
            parallelism uses this: every key comes from the exchanged, heads-sharded K/V.
        kernel: "auto", "cpu_flash" (CPU tensors only) or "math".

    Returns:
        (B, H, C, D) attention output in q's dtype. Queries with no valid key give zeros.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if k.shape[2] < q.shape[2]:
        raise ValueError(f"chunk attention needs at least as many own keys ({k.shape[2]}) as queries ({q.shape[2]})")
    num_prefix = 0 if k_prefix is None else k_prefix.shape[2]
    if key_valid is not None:
        if key_valid.shape[-1] != num_prefix + k.shape[2]:
            raise ValueError(f"key_valid covers {key_valid.shape[-1]} keys, expected {num_prefix + k.shape[2]}")
        if bool(key_valid.all()):
            key_valid = None
    if num_prefix == 0:
        k_prefix = v_prefix = None
    kernel = attention_kernel_for(q, kernel)
    if kernel not in _KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}: use one of {sorted(_KERNELS)} or 'auto'")
    if sink_own_keys and prefix_grad_sink is None:
        raise ValueError("sink_own_keys=True needs prefix_grad_sink buffers to add the key gradients into")
    sink_k, sink_v = prefix_grad_sink if prefix_grad_sink is not None else (None, None)
    return _ChunkAttention.apply(
        q, k, v, k_prefix, v_prefix, key_valid, float(scale), int(kv_block_size), kernel, sink_k, sink_v, sink_own_keys
    )
