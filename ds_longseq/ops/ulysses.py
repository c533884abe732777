"""DeepSpeed-Ulysses layouts: tokens-sharded <-> heads-sharded, over DeepSpeed's own all-to-all.

Holds:
    UlyssesExchange: the four exchanges a sequence-parallel attention needs, for one process group.
    ulysses_attention: causal attention of a whole local shard (exchange, attend, exchange back).
    UlyssesRingExchange: the same exchanges for StreamBP under Ulysses x ring: K/V of the whole sequence,
        heads-sharded within the Ulysses group and gathered over the ring, in global order.
    ulysses_chunk_attention: one query chunk of every rank against exchanged K/V (StreamBP under SP).
    ulysses_ring_attention: a whole local shard under Ulysses x ring (heads exchanged within the Ulysses group,
        ring attention over the ring group): any SP degree on any head count.

Shape legend: B batch, P sequence-parallel ranks, p this rank, H query heads, Hkv kv-heads,
H_l = H / P and Hkv_l = max(Hkv / P, 1) heads per rank, C tokens per rank (a whole local shard
T_l, or one chunk of it), D head dim.

Tokens-sharded: rank p holds all heads for its C tokens. Heads-sharded: rank p holds heads
[p*H_l, (p+1)*H_l) for the P*C tokens of all ranks, ordered rank-major: row r*C + i is token i of
rank r (for whole shards that is the global sequence order). When Hkv < P, K/V heads are repeated
so every rank gets one (DeepSpeed's ``kv_replication_factor``); their gradients are summed back.

The data movement is ``deepspeed.sequence.layer._dim_zero_all_to_all``: DeepSpeed's registered,
differentiable all-to-all along dim 0 (its backward is the same exchange). Only the reshapes
around it live here; ``tests/test_sequence_parallel.py`` checks them against DeepSpeed's
``UlyssesSPAttentionHF`` layouts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_longseq.compat import dim_zero_all_to_all
from ds_longseq.ops.chunk_attention import KeyLimits, chunk_causal_attention
from ds_longseq.ops.phases import phase
from ds_longseq.ops.ring import ring_attention, zigzag_shard
from ds_longseq.ops.sp_layout import ulysses_fits
from ds_longseq.ops.sp_positions import position_runs, sp_positions

__all__ = [
    "UlyssesExchange", "UlyssesRingExchange", "ulysses_attention", "ulysses_chunk_attention", "ulysses_ring_attention",
]


def _all_to_all():
    try:
        return dim_zero_all_to_all()
    except ImportError as err:  # pragma: no cover - deepspeed is an install requirement
        raise ImportError("sequence parallelism needs DeepSpeed: pip install deepspeed (see setup.py)") from err


class UlyssesExchange:
    """All-to-all exchanges of one sequence-parallel group for a model with H / Hkv heads.

    Args:
        group: the sequence-parallel process group (``torch.distributed`` / ``deepspeed.comm``).
        world_size: P, its size.
        num_heads: H, query heads (a multiple of P).
        num_kv_heads: Hkv (a multiple of P, or a divisor of P).
    """

    def __init__(self, group, world_size: int, num_heads: int, num_kv_heads: int):
        if not ulysses_fits(world_size, num_heads, num_kv_heads):  # ops.sp_layout.sp_degrees never picks such a u
            raise ValueError(
                f"a Ulysses degree of {world_size} cannot shard {num_heads} query and {num_kv_heads} key/value heads "
                "(it must divide the query heads, and divide or be a multiple of the key/value heads: DeepSpeed-"
                "Ulysses replicates K/V heads only by a whole factor); the sequence-parallel size splits into Ulysses "
                "x ring degrees by ds_longseq.ops.sp_layout.sp_degrees"
            )
        self.group = group
        self.world_size = world_size
        self.rank = torch.distributed.get_rank(group)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.kv_repeat = max(world_size // num_kv_heads, 1)
        self._a2a, register = _all_to_all()
        # DeepSpeed's operator looks its group up by name; registration must precede the first call.
        register(group)
        self._positions: dict[int, torch.Tensor] = {}

    @classmethod
    def of_tokens(cls, group) -> "UlyssesExchange":
        """The group's exchange for token exchanges alone (:meth:`all_to_all`; no heads to split), e.g. a mixer
        sharded by heads over the whole group under Ulysses x ring (``forwards.head_sharding_forward``)."""
        size = torch.distributed.get_world_size(group)
        return cls(group, size, size, size)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        # (B, P*h, C, D) -> (P, B, h, C, D): block r goes to rank r -> receive (P, B, h, C, D) indexed by source.
        B, Hx, C, D = x.shape
        P = self.world_size
        blocks = x.reshape(B, P, Hx // P, C, D).transpose(0, 1)
        with phase("sp.exchange"):
            received = self._a2a(self.group, blocks)
        return received.permute(1, 2, 0, 3, 4).reshape(B, Hx // P, P * C, D)

    def _to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        # (B, h, P*C, D) -> (P, B, h, C, D): token block r goes back to rank r -> (B, P*h, C, D).
        B, h, PC, D = x.shape
        P = self.world_size
        blocks = x.reshape(B, h, P, PC // P, D).permute(2, 0, 1, 3, 4)
        with phase("sp.exchange"):
            received = self._a2a(self.group, blocks)
        return received.transpose(0, 1).reshape(B, P * h, PC // P, D)

    def all_to_all(self, blocks: torch.Tensor) -> torch.Tensor:
        """(P, ...) block r sent to rank r -> (P, ...) block r received from rank r: DeepSpeed's differentiable
        all-to-all on this group (its backward is the same exchange). For exchanges other than attention's
        (``ops.head_sharding``)."""
        with phase("sp.exchange"):
            return self._a2a(self.group, blocks.contiguous())

    def query_to_heads(self, q: torch.Tensor) -> torch.Tensor:
        """(B, H, C, D) tokens-sharded -> (B, H_l, P*C, D) heads-sharded. Differentiable."""
        return self._to_heads(q)

    def kv_to_heads(self, kv: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, C, D) tokens-sharded -> (B, Hkv_l, P*C, D) heads-sharded (repeated if Hkv < P). Differentiable."""
        if self.kv_repeat > 1:
            kv = kv.repeat_interleave(self.kv_repeat, dim=1)
        return self._to_heads(kv)

    def output_to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H_l, P*C, D) heads-sharded -> (B, H, C, D) tokens-sharded. Differentiable."""
        return self._to_tokens(out)

    def local_heads(self, per_head: torch.Tensor | None) -> torch.Tensor | None:
        """(H,) one value per query head (attention sinks) -> (H_l,) this rank's heads once heads-sharded.
        Differentiable: the other ranks' heads get their gradient on their ranks."""
        if per_head is None:
            return None
        h = self.num_heads // self.world_size
        return per_head[self.rank * h : (self.rank + 1) * h]

    def kv_grad_to_tokens(self, grad: torch.Tensor) -> torch.Tensor:
        """(B, Hkv_l, P*C, D) gradient of :meth:`kv_to_heads`'s output -> (B, Hkv, C, D), replicas summed."""
        back = self._to_tokens(grad)
        if self.kv_repeat > 1:
            B, _, C, D = back.shape
            back = back.reshape(B, self.num_kv_heads, self.kv_repeat, C, D).sum(2)
        return back

    def token_positions(self, seq_len: int) -> torch.Tensor:
        """(P, T_l) CPU int64: row r the global positions of rank r's tokens for a sequence of ``seq_len`` (rank r
        holds [r T_l, (r + 1) T_l)); the rows of a heads-sharded tensor of ``seq_len`` tokens, in that order. Built
        once per length: StreamBP's chunk attention reads it for every chunk of every layer."""
        if seq_len not in self._positions:
            self._positions[seq_len] = torch.arange(seq_len).view(self.world_size, seq_len // self.world_size)
        return self._positions[seq_len]


class UlyssesRingExchange:
    """The exchanges of StreamBP's chunk attention (:func:`ulysses_chunk_attention`) under Ulysses x ring.

    StreamBP attends each chunk against the whole sequence's keys, so under a ring it needs them all at once: a
    layer's K/V go through the Ulysses all-to-all (this ring rank's zigzag shard for Hkv_l heads), are gathered over
    the ring group (the other shards) and put in global order. Per layer that holds the whole sequence's K/V for
    Hkv / u heads (r times Ulysses alone's Hkv / P) and moves each rank's K/V to every ring rank once, as ring
    attention passes them round; dK/dV go home by one reduce-scatter over the ring. (Fetching the prefix chunk by
    chunk instead would hold less and send it again per chunk; docs/SEQUENCE_PARALLEL.md compares them.)
    Queries and outputs use the Ulysses group's exchange alone: each rank's queries stay with its own heads.

    Args:
        exchange: the Ulysses group's :class:`UlyssesExchange`, or None when u = 1.
        ring_group: the ring's process group (r ranks).
        ulysses, ring: the degrees u and r (``ops.sp_layout``).

    Attributes ``rank`` / ``world_size`` are the Ulysses group's (0 / 1 when u = 1): the query rows of a chunk are
    the Ulysses group's, as under Ulysses alone.
    """

    def __init__(self, exchange: UlyssesExchange | None, ring_group, ulysses: int, ring: int):
        self.exchange, self.ring_group = exchange, ring_group
        self.ulysses, self.ring = ulysses, ring
        self.ring_rank = dist.get_rank(ring_group)
        self.rank = 0 if exchange is None else exchange.rank
        self.world_size = ulysses
        # per sequence length, built once (the chunk attention reads them for every chunk of every layer)
        self._layouts: dict[int, torch.Tensor] = {}
        self._orders: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _layout(self, seq_len: int) -> torch.Tensor:
        """(P, T_l) CPU: ``sp_positions`` of the whole group for ``seq_len`` tokens."""
        if seq_len not in self._layouts:
            self._layouts[seq_len] = sp_positions(seq_len, self.ulysses, self.ring)
        return self._layouts[seq_len]

    def _order(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(T,) the global position of each row of the ring-gathered (rank-major) K/V."""
        key = (seq_len, device)
        if key not in self._orders:
            self._orders[key] = self._layout(seq_len).flatten().to(device)
        return self._orders[key]

    def token_positions(self, seq_len: int) -> torch.Tensor:
        """(u, T_l) CPU int64: row i the global positions of Ulysses rank i's tokens (of this ring rank's group)."""
        u = self.ulysses
        return self._layout(seq_len)[self.ring_rank * u : (self.ring_rank + 1) * u]

    def query_to_heads(self, q: torch.Tensor) -> torch.Tensor:
        return q if self.exchange is None else self.exchange.query_to_heads(q)

    def output_to_tokens(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.exchange is None else self.exchange.output_to_tokens(out)

    def local_heads(self, per_head: torch.Tensor | None) -> torch.Tensor | None:
        return per_head if self.exchange is None else self.exchange.local_heads(per_head)

    def kv_to_heads(self, kv: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, T_l, D) this rank's K/V -> (B, Hkv_l, T, D) the whole sequence's for its Ulysses heads, in global
        order. Not differentiable (StreamBP returns the gradient with :meth:`kv_grad_to_tokens`)."""
        shard = (kv if self.exchange is None else self.exchange.kv_to_heads(kv)).contiguous()
        B, h, C, D = shard.shape
        gathered = shard.new_empty((self.ring * B, h, C, D))  # ring rank j's shard in rows [j B, (j + 1) B)
        with phase("sp.exchange"):
            dist.all_gather_single(gathered, shard, group=self.ring_group)
        rank_major = gathered.view(self.ring, B, h, C, D).permute(1, 2, 0, 3, 4).reshape(B, h, self.ring * C, D)
        order = self._order(self.ring * C, kv.device)
        return torch.empty_like(rank_major).index_copy_(2, order, rank_major)

    def kv_grad_to_tokens(self, grad: torch.Tensor) -> torch.Tensor:
        """(B, Hkv_l, T, D) gradient of :meth:`kv_to_heads`'s output (every ring rank's part) -> (B, Hkv, T_l, D) this
        rank's, summed over the ring."""
        B, h, T, D = grad.shape
        rank_major = grad.index_select(2, self._order(T, grad.device))
        C = T // self.ring
        blocks = rank_major.view(B, h, self.ring, C, D).permute(2, 0, 1, 3, 4).reshape(self.ring * B, h, C, D)
        mine = blocks.new_empty((B, h, C, D))  # the sum over the ring of rows [j B, (j + 1) B)
        with phase("sp.exchange"):
            dist.reduce_scatter_single(mine, blocks, group=self.ring_group)
        return mine if self.exchange is None else self.exchange.kv_grad_to_tokens(mine)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    exchange: UlyssesExchange,
    *,
    scale: float,
    key_valid: torch.Tensor | None = None,
    kv_block_size: int | None = None,
    single_call: bool | None = None,
    limits: KeyLimits | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    dropout: float = 0.0,
    dropout_seed: int = 0,
) -> torch.Tensor:
    """Causal attention of a whole local shard under Ulysses (the non-StreamBP path). Differentiable.

    Args:
        q: (B, H, T_l, D); k, v: (B, Hkv, T_l, D): this rank's tokens, post-RoPE.
        exchange: the group's :class:`UlyssesExchange`.
        scale: softmax scale.
        key_valid: (B, P*T_l) bool padding mask of the GLOBAL sequence, or None.
        kv_block_size: keys per attention tile (None: the device default, see ``chunk_causal_attention``).
        single_call: one kernel call per chunk where a kernel takes the bottom-right mask (``chunk_causal_attention``).
        limits: packed documents, sliding window, attention chunks over the GLOBAL (B, P*T_l) sequence
            (:class:`~ds_longseq.ops.chunk_attention.KeyLimits`), or None.
        softcap: logit softcapping, or None.
        sink_logits: (H,) attention sinks of every head (gpt-oss), or None.
        dropout: dropout probability on the attention probabilities (0: none); each rank draws the masks of its
            heads from its own ``dropout_seed`` (``chunk_causal_attention``).
        dropout_seed: with ``dropout``: this rank's call seed.

    Returns:
        (B, H, T_l, Dv) attention output for this rank's tokens (v's head dim may differ from q's and k's).
    """
    qh = exchange.query_to_heads(q)
    kh, vh = exchange.kv_to_heads(k), exchange.kv_to_heads(v)
    N = kh.shape[2]
    lo = None if limits is None else limits.query_lo(torch.arange(N, device=q.device))
    out = chunk_causal_attention(qh, kh, vh, scale=scale, key_valid=key_valid, kv_block_size=kv_block_size,
                                 single_call=single_call,
                                 query_lo=lo, softcap=softcap, sink_logits=exchange.local_heads(sink_logits),
                                 dropout=dropout, dropout_seed=dropout_seed)
    return exchange.output_to_tokens(out)


def ulysses_chunk_attention(
    q: torch.Tensor,
    exchange: UlyssesExchange | UlyssesRingExchange,
    k_heads: torch.Tensor,
    v_heads: torch.Tensor,
    start: int,
    end: int,
    *,
    scale: float,
    key_valid: torch.Tensor | None = None,
    kv_block_size: int | None = None,
    single_call: bool | None = None,
    grad_sink: tuple[torch.Tensor, torch.Tensor] | None = None,
    limits: KeyLimits | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    dropout: float = 0.0,
    dropout_seed: int = 0,
    kept=None,
) -> torch.Tensor:
    """Causal attention of one query chunk of every rank against exchanged, heads-sharded K/V.

    Every rank calls this with the same ``[start, end)`` of its local shard (it runs collectives).
    The queries of Ulysses rank r sit at the global positions ``exchange.token_positions(T)[r, start:end]``:
    r*T_l + [start, end) under Ulysses alone, attending keys [0, r*T_l + end); under a ring (zigzag shards) up to two
    runs of consecutive positions, each attending the keys before its end. All keys are constants whose gradients
    are ADDED into ``grad_sink``.

    Args:
        q: (B, H, C, D) this rank's chunk queries, C = end - start. Differentiable.
        exchange: the group's :class:`UlyssesExchange`, or :class:`UlyssesRingExchange` under a ring.
        k_heads, v_heads: (B, Hkv_l, T, D) the layer's K/V of the whole sequence in global order, heads-sharded.
        start, end: the chunk's span inside the local shard.
        scale: softmax scale.
        key_valid: (B, P*T_l) bool global padding mask, or None.
        kv_block_size: keys per attention tile (None: the device default, see ``chunk_causal_attention``).
        single_call: one kernel call per chunk where a kernel takes the bottom-right mask (``chunk_causal_attention``).
        grad_sink: (dK, dV) of ``k_heads`` / ``v_heads``'s shape (backward adds into them), or None.
        limits: as for :func:`ulysses_attention` (a document may span ranks).
        softcap: logit softcapping, or None.
        sink_logits: (H,) attention sinks of every head (gpt-oss), or None.
        dropout, dropout_seed: as for :func:`ulysses_attention`; a tile's mask is seeded by its global positions, so
            the chunk's tiles draw the same masks in the chunk's forward, re-forward and backward.
        kept: the chunk's kept attention outputs (``ops.kept_attention.ChunkSlot``), recorded or taken by each of
            its ``chunk_causal_attention`` calls, in order; None: nothing kept.

    Returns:
        (B, H, C, D) attention output of this rank's chunk.
    """
    C = end - start
    T = k_heads.shape[2]
    qh = exchange.query_to_heads(q)  # (B, H_l, P*C, D): Ulysses rank r's chunk is rows [r*C, (r+1)*C)
    sinks = exchange.local_heads(sink_logits)
    outs = []
    for r, row in enumerate(exchange.token_positions(T)[:, start:end]):
        for lo_row, hi_row, a in position_runs(row):  # rows [lo_row, hi_row) of the chunk sit at positions [a, b)
            b = a + hi_row - lo_row
            lo = None if limits is None else limits.query_lo(torch.arange(a, b, device=q.device), slice(a, b))
            outs.append(
                chunk_causal_attention(
                    qh[:, :, r * C + lo_row : r * C + hi_row],
                    k_heads[:, :, a:b],
                    v_heads[:, :, a:b],
                    scale=scale,
                    k_prefix=k_heads[:, :, :a],
                    v_prefix=v_heads[:, :, :a],
                    key_valid=None if key_valid is None else key_valid[:, :b],
                    kv_block_size=kv_block_size,
                    prefix_grad_sink=grad_sink,
                    sink_own_keys=grad_sink is not None,
                    query_lo=lo,
                    softcap=softcap,
                    sink_logits=sinks,
                    joined_kv=(k_heads[:, :, :b], v_heads[:, :, :b]),
                    single_call=single_call,
                    dropout=dropout,
                    dropout_seed=dropout_seed,
                    kept=kept,
                )
            )
    return exchange.output_to_tokens(torch.cat(outs, dim=2))


def ulysses_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    exchange: UlyssesExchange | None,
    ring_group,
    *,
    scale: float,
    key_valid: torch.Tensor | None = None,
    limits: KeyLimits | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
    kernel: str = "auto",
    dropout: float = 0.0,
    dropout_seed: int = 0,
) -> torch.Tensor:
    """Causal attention of a whole local shard under sequence parallelism u x r (``ops.sp_layout``): the Ulysses
    exchange within this rank's Ulysses group gathers its ring rank's zigzag shard for H / u heads, ring attention
    over the ring group attends the whole sequence, and the exchange back returns this rank's tokens. Differentiable.

    Args:
        q: (B, H, T_l, D); k, v: (B, Hkv, T_l, D) / (B, Hkv, T_l, Dv): this rank's tokens (``sp_positions``' row),
            post-RoPE.
        exchange: the Ulysses group's :class:`UlyssesExchange`, or None when u = 1 (ring alone).
        ring_group: the ring's process group (r ranks: this rank's Ulysses index in every Ulysses group).
        scale: softmax scale.
        key_valid: (B, T) bool padding mask of the GLOBAL sequence, or None.
        limits, softcap: as :func:`ulysses_attention`.
        sink_logits: (H,) attention sinks of every head, or None.
        kernel: the tiles' kernel ("auto": the device's chain).
        dropout, dropout_seed: as for :func:`ulysses_attention` (``ops.ring.ring_attention``).

    Returns:
        (B, H, T_l, Dv) attention output for this rank's tokens.
    """
    if exchange is not None:
        q = exchange.query_to_heads(q)
        k, v = exchange.kv_to_heads(k), exchange.kv_to_heads(v)
        sink_logits = exchange.local_heads(sink_logits)
    ring_rank, ring_size = torch.distributed.get_rank(ring_group), torch.distributed.get_world_size(ring_group)
    T = q.shape[2] * ring_size
    positions = zigzag_shard(torch.arange(T, device=q.device).view(1, T), ring_rank, ring_size)[0]
    lo = None if limits is None else limits.query_lo(positions, positions)
    out = ring_attention(q, k, v, ring_group, scale=scale, key_valid=key_valid, query_lo=lo, softcap=softcap,
                         sink_logits=sink_logits, kernel=kernel, dropout=dropout, dropout_seed=dropout_seed)
    return out if exchange is None else exchange.output_to_tokens(out)
