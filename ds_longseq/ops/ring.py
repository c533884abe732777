"""Ring attention: exact causal attention of a sequence cut across a ring of ranks, K/V blocks passed around it.

Holds:
    zigzag_blocks: the two global blocks a rank holds in the zigzag layout.
    zigzag_shard / zigzag_unshard: a (B, T, ...) tensor cut into / glued from the ranks' zigzag shards.
    ring_attention: the op (autograd): each rank's queries against every rank's keys, merged by log-sum-exp, with
        padding keys, packed documents and sliding windows (a key block no query sees is skipped), softcaps and
        attention sinks.

Shape legend: B batch, H query heads, Hkv key/value heads (H = Hkv * R, GQA), r ranks in the ring, T the whole
sequence, b = T / (2 r) tokens per block, T_l = 2 b tokens per rank, D head dim (Dv for values).

Layout (zigzag, as in USP / zigzag ring attention): the sequence is cut into 2 r blocks and rank i holds blocks i
and 2 r - 1 - i, so under a causal mask every rank has the same work: at every ring step each rank runs exactly
two b x b tiles' worth of attention (the first step: two causal diagonals and one full tile). Contiguous shards
would leave rank r - 1 with r times rank 0's work. For r = 2 (blocks 0..3): rank 0 holds [0, 3], rank 1 [1, 2].

Forward, for ring step s = 0 .. r - 1: rank i holds the K/V of rank (i - s) mod r; the send of that block to the
next rank and the receive of the previous rank's are POSTED BEFORE this step's tiles run, so the transfer overlaps
the compute. Each pair of a query block A and a key block K_b is a full tile (K_b < A), a causal square tile
(K_b = A) or skipped (K_b > A); each tile's kernel returns its output and log-sum-exp, merged in float32 or better
(the running output rescaled by exp(lse_old - lse_new)). Backward runs the ring again with the FINAL output and
log-sum-exp (each tile's exact share of dQ, dK, dV, as ops/chunk_attention.py's tiles): a block's dK/dV travel with
it and after the last step go back to the rank that owns it (r sends; K/V itself r - 1).

The tiles run on ops/tile_kernels.py's kernels (the first of the device's chain that takes each tile), so what they
refuse (a dtype, a head dim) falls back there, never to a wrong result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_longseq.ops.tile_kernels import (
    KERNELS,
    KernelRngState,
    TileMask,
    compute_dtype,
    pick_kernel,
    tile_backward,
    tile_forward,
    with_dropout,
    with_sink_logits,
)

__all__ = ["zigzag_blocks", "zigzag_shard", "zigzag_unshard", "ring_attention"]

_NEG_INF = float("-inf")


def zigzag_blocks(rank: int, size: int) -> tuple[int, int]:
    """The global block indices (of 2 ``size`` blocks) rank ``rank`` holds, first half then second half."""
    return rank, 2 * size - 1 - rank


def zigzag_shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim`` (its length a multiple of 2 ``size``)."""
    if x.shape[dim] % (2 * size):
        raise ValueError(f"length {x.shape[dim]} along dim {dim} is not a multiple of 2 x {size} ring ranks: pad it")
    blocks = x.chunk(2 * size, dim=dim)
    return torch.cat([blocks[i] for i in zigzag_blocks(rank, size)], dim=dim)


def zigzag_unshard(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's zigzag shard (in rank order)."""
    size = len(shards)
    blocks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        a, b = zigzag_blocks(rank, size)
        blocks[a], blocks[b] = first, second
    return torch.cat(blocks, dim=dim)


def _ring_steps(size: int) -> range:
    return range(size)


def _tile_kind(query_block: int, key_block: int) -> str | None:
    """"full", "causal" or None (skipped): what query block ``query_block`` sees of key block ``key_block``."""
    if key_block < query_block:
        return "full"
    return "causal" if key_block == query_block else None


def _post_exchange(tensors: list[torch.Tensor], group, send_to: int, recv_from: int):
    """Send ``tensors`` to ring rank ``send_to`` and receive same-shaped ones from ``recv_from`` (ranks of
    ``group``), both posted now; returns (received buffers, requests to wait on)."""
    sent = [t.contiguous() for t in tensors]  # referenced until the requests are waited on
    received = [torch.empty_like(t) for t in sent]
    ops = []
    for t, buf in zip(sent, received, strict=True):
        ops.append(dist.P2POp(dist.isend, t, dist.get_global_rank(group, send_to), group))
        ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, recv_from), group))
    return received, (dist.batch_isend_irecv(ops), sent)


def _wait(requests) -> None:
    for req in requests[0]:
        req.wait()


def _pass_gradients(dkv: list[torch.Tensor], group, rank: int, size: int, step: int) -> list[torch.Tensor]:
    """The held block's dK/dV sent on with it to the next rank (which holds that block at the next step; after the
    last step, the block's owner) and the previous rank's received."""
    if size == 1:
        return dkv
    dkv, requests = _post_exchange(dkv, group, (rank + 1) % size, (rank - 1) % size)
    _wait(requests)
    return dkv


def _merge(acc: torch.Tensor | None, m: torch.Tensor | None, o: torch.Tensor, lse: torch.Tensor):
    """The running (output, log-sum-exp) of a query block with one more tile's, exactly: both are normalised over
    their own keys, so each is weighted by its share of the total mass exp(lse - lse_total); in ``acc``'s
    dtype (float32 for half-precision tiles, float64 stays)."""
    if acc is None:
        return o, lse
    m_new = torch.logaddexp(m, lse)
    m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)
    acc = acc * torch.exp(m - m_safe).unsqueeze(-1) + o * torch.exp(lse - m_safe).unsqueeze(-1)
    return acc, m_new


def _block_forward(kernel: str, q, k, v, mask: TileMask, scale: float, R: int, rng: KernelRngState):
    """(o (B, H, b, Dv), lse (B, H, b)) of query block ``q`` against one key block."""
    return tile_forward(pick_kernel(kernel, q, mask), q, k, v, mask, scale, rng, kv_repeat=R)


def _block_backward(kernel: str, do, q, k, v, out, lse, mask: TileMask, scale: float, R: int, rng: KernelRngState):
    """(dq, dk, dv) of one tile, dk/dv with k's heads."""
    return tile_backward(pick_kernel(kernel, q, mask), do, q, k, v, out, lse, mask, scale, rng, kv_repeat=R)


class _Masks:
    """The mask of each (query block, key block) tile of one call: the causal kind, the padding keys of the key
    block (from the whole sequence's ``key_valid``), each query's first visible key (``query_lo``: its document's
    start, its sliding window) relative to the key block, the softcap; None for a tile no query sees any key of
    (wholly after the queries, or before every query's document or window), which is then skipped. Decided on the
    host once per call (one copy of each mask) and reused by backward. With attention-probability ``dropout``
    ((p, call seed)), each tile draws its keep mask from its own generator, seeded from the call's seed and the
    tile's global query and key positions (``ops.tile_kernels.with_dropout``): the query's rank computes the tile in
    forward and in backward, so both draw the same mask whichever step of the ring it runs at."""

    def __init__(self, key_valid, query_lo, softcap, block: int, dropout: tuple[float, int] | None = None):
        self.key_valid, self.query_lo, self.softcap, self.block = key_valid, query_lo, softcap, block
        self.dropout = dropout
        self.valid_cpu = None if key_valid is None else key_valid.cpu()
        self.lo_cpu = None if query_lo is None else query_lo.cpu()

    def tile(self, qi: int, query_block: int, key_block: int) -> TileMask | None:
        kind = _tile_kind(query_block, key_block)
        if kind is None:
            return None
        b = self.block
        first, end = key_block * b, (key_block + 1) * b
        valid = None
        if self.valid_cpu is not None and not bool(self.valid_cpu[:, first:end].all()):
            if not bool(self.valid_cpu[:, first:end].any()):
                return None  # every key of the block is padding
            valid = self.key_valid[:, first:end]
        key_lo = None
        if self.lo_cpu is not None:
            lo = self.lo_cpu[:, qi * b:(qi + 1) * b]
            if bool((lo >= end).all()):
                return None  # before every query's document / window
            if bool((lo > first).any()):
                key_lo = self.query_lo[:, qi * b:(qi + 1) * b] - first
        mask = TileMask(kind == "causal", valid, key_lo, self.softcap, b)
        return mask if self.dropout is None else with_dropout(mask, self.dropout, (first, query_block * b, False))


def _halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.chunk(2, dim=2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_valid, query_lo, softcap, sink_logits, scale: float, group, kernel: str,
                dropout: tuple[float, int] | None):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        R = q.shape[1] // k.shape[1]
        cdt = compute_dtype(q.dtype)
        mine = zigzag_blocks(rank, size)
        masks = _Masks(key_valid, query_lo, softcap, q.shape[2] // 2, dropout)
        rng = KernelRngState()
        acc, m = [None, None], [None, None]
        kv = [k, v]
        for step in _ring_steps(size):
            pending = None
            if step < size - 1:  # the next block's transfer runs while this one's tiles compute
                pending = _post_exchange(kv, group, (rank + 1) % size, (rank - 1) % size)
            theirs = zigzag_blocks((rank - step) % size, size)
            for qi, q_half in enumerate(_halves(q)):
                for ki, (k_half, v_half) in enumerate(zip(_halves(kv[0]), _halves(kv[1]), strict=True)):
                    mask = masks.tile(qi, mine[qi], theirs[ki])
                    if mask is None:
                        continue
                    o, lse = _block_forward(kernel, q_half, k_half, v_half, mask, scale, R, rng)
                    acc[qi], m[qi] = _merge(acc[qi], m[qi], o.to(cdt), lse.to(cdt))
            if pending is not None:
                kv, requests = pending
                _wait(requests)
        out, lse = _finished(acc, m, q, v)
        if sink_logits is not None:
            out, lse = with_sink_logits(out, lse, sink_logits)
        ctx.save_for_backward(q, k, v, key_valid, query_lo, out, lse, sink_logits)
        # the masks (decided on the host, one copy of each) serve backward too: no second host copy there
        ctx.masks, ctx.scale, ctx.group, ctx.kernel = masks, scale, group, kernel
        ctx.rng = rng  # what the fused kernels' forwards left for their backwards
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, key_valid, query_lo, out, lse, sink_logits = ctx.saved_tensors
        group, scale, kernel = ctx.group, ctx.scale, ctx.kernel
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        R = q.shape[1] // k.shape[1]
        cdt = compute_dtype(q.dtype)
        mine = zigzag_blocks(rank, size)
        masks = ctx.masks
        do = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=cdt, device=k.device), torch.zeros(v.shape, dtype=cdt, device=v.device)]
        for step in _ring_steps(size):
            pending = None
            if step < size - 1:
                pending = _post_exchange(kv, group, (rank + 1) % size, (rank - 1) % size)
            theirs = zigzag_blocks((rank - step) % size, size)
            _ring_block_grads(kernel, q, kv, do, out, lse, mine, theirs, masks, scale, R, dq, dkv, ctx.rng)
            dkv = _pass_gradients(dkv, group, rank, size, step)
            if pending is not None:
                kv, requests = pending
                _wait(requests)
        d_sink = None
        if sink_logits is not None and ctx.needs_input_grad[6]:
            # the sink is a key with value 0: dLoss/ds_h = -sum_{b,q} p_sink * rowsum(dO * O)
            p_sink = torch.exp(sink_logits.to(cdt).view(1, -1, 1) - lse)
            d_sink = -(p_sink * (do.to(cdt) * out.to(cdt)).sum(-1)).sum((0, 2)).to(sink_logits.dtype)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, d_sink, None, None, None,
                None)


def _finished(acc, m, q, v):
    """The merged (out (B, H, T_l, Dv), lse (B, H, T_l)); rows that saw no valid key at all (only padding, or
    nothing in their window) get 0 and lse = +inf (their p is 0 in backward)."""
    B, H, T_l = q.shape[:3]
    cdt = compute_dtype(q.dtype)
    for i, a in enumerate(acc):
        if a is None:  # no tile of this query block ran
            acc[i] = torch.zeros((B, H, T_l // 2, v.shape[-1]), dtype=cdt, device=q.device)
            m[i] = torch.full((B, H, T_l // 2), _NEG_INF, dtype=cdt, device=q.device)
    out, lse = torch.cat(acc, dim=2), torch.cat(m, dim=2)
    empty = lse == _NEG_INF
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("inf"))


def _ring_block_grads(kernel, q, kv, do, out, lse, mine, theirs, masks: _Masks, scale, R, dq, dkv,
                      rng: KernelRngState) -> None:
    """Add one ring step's tiles' shares into ``dq`` (this rank's queries) and ``dkv`` (the held block's)."""
    for qi, (q_h, do_h, out_h, lse_h) in enumerate(zip(*(_halves(t) for t in (q, do, out, lse)), strict=True)):
        for ki, (k_h, v_h) in enumerate(zip(_halves(kv[0]), _halves(kv[1]), strict=True)):
            mask = masks.tile(qi, mine[qi], theirs[ki])
            if mask is None:
                continue
            dq_t, dk_t, dv_t = _block_backward(kernel, do_h, q_h, k_h, v_h, out_h.to(q.dtype), lse_h, mask, scale, R,
                                                 rng)
            b = q_h.shape[2]
            dq[:, :, qi * b:(qi + 1) * b] += dq_t
            dkv[0][:, :, ki * b:(ki + 1) * b] += dk_t
            dkv[1][:, :, ki * b:(ki + 1) * b] += dv_t


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, scale: float | None = None,
                   key_valid: torch.Tensor | None = None, query_lo: torch.Tensor | None = None,
                   softcap: float | None = None, sink_logits: torch.Tensor | None = None,
                   kernel: str = "auto", dropout: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    """Causal attention of this rank's zigzag shard of the queries against the whole sequence's keys, the keys and
    values passed around the ring ``group`` (every rank of it calls this with its own shards).

    Args:
        q: (B, H, T_l, D) this rank's queries, zigzag layout (:func:`zigzag_shard` along the sequence; T_l even).
        k, v: (B, Hkv, T_l, D) and (B, Hkv, T_l, Dv) this rank's keys and values, the same layout.
        group: the ring's process group (r ranks; every rank's shards the same shape).
        scale: softmax scale; default D ** -0.5.
        key_valid: (B, T) bool over the WHOLE sequence in its own order (T = r T_l), False for padding keys; the
            same on every rank. None: every key is real.
        query_lo: (B, T_l) int64, this rank's queries in the zigzag layout: the global index of the first key each
            may attend (its document's start, its sliding window's first key: ``ops.chunk_attention.query_lower_bounds``
            of its global positions). None: every earlier key. A key block wholly before every query's bound is
            skipped (no tile runs).
        softcap: logit softcapping (Gemma 2).
        sink_logits: (H,) attention sinks (gpt-oss): one more logit per head with a zero value; differentiable.
        kernel: "auto" (each tile on the first kernel of the device's chain that takes it) or one of
            ops/tile_kernels.py's kernels for every tile.
        dropout: dropout probability on the attention probabilities (each query's softmax over the whole
            sequence, then the keep mask / (1 - p)); the math kernel runs those tiles. 0: none.
        dropout_seed: with ``dropout``: this rank's call seed (each rank draws its own,
            ``forwards.attention_interface``).

    Returns:
        (B, H, T_l, Dv) this rank's outputs, the zigzag layout (0 for a query that sees no valid key); differentiable
        in q, k, v (dK/dV of this rank's keys, gathered back from the ranks whose queries read them) and the sinks.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if q.shape[2] != k.shape[2] or k.shape[2] != v.shape[2] or q.shape[2] % 2:
        raise ValueError(f"ring attention needs queries, keys and values of one even local length (two zigzag "
                         f"blocks), got {q.shape[2]}, {k.shape[2]}, {v.shape[2]}")
    if kernel != "auto" and kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}: use one of {sorted(KERNELS)} or 'auto'")
    if len({q.dtype, k.dtype, v.dtype}) > 1:
        raise ValueError(f"queries, keys and values have different dtypes ({q.dtype}, {k.dtype}, {v.dtype})")
    size = dist.get_world_size(group)
    if key_valid is not None and tuple(key_valid.shape) != (q.shape[0], q.shape[2] * size):
        raise ValueError(f"key_valid must cover the whole sequence, shape {(q.shape[0], q.shape[2] * size)}, "
                         f"got {tuple(key_valid.shape)}")
    if query_lo is not None and tuple(query_lo.shape[-1:]) != (q.shape[2],):
        raise ValueError(f"query_lo must give one bound per local query ({q.shape[2]}), got {tuple(query_lo.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number, got {softcap}")
    if not 0 <= dropout < 1:
        raise ValueError(f"attention dropout must be in [0, 1), got {dropout}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, key_valid, query_lo, None if softcap is None else float(softcap),
                                sink_logits, scale, group, kernel,
                                (float(dropout), int(dropout_seed)) if dropout else None)
