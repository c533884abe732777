"""Ulysses sequence parallelism for a Hugging Face causal LM: per-forward shard state and the loss.

Holds:
    SequenceParallel: one model's sequence-parallel group (rank, size, ``UlyssesExchange``), the
        per-forward checks and gathers, and the token-weighted loss over the group.
    SequenceParallelForwardHook: the forward pre-hook installed on the base model (``model.model``), and its
        forward hook (:meth:`SequenceParallelForwardHook.end`).
    ShardOffsetCache, ShardOffsetHook: the shard's global offset for attention positioned by its cache's length.

Shape legend: B batch, P ranks per sequence, T = P * T_l global length, T_l local shard.

Each rank holds tokens [p*T_l, (p+1)*T_l) of every sequence in its batch (``engine.shard_batch``
cuts them); under Ulysses x ring (``ring`` > 1) the tokens ``ops.sp_positions.sp_positions`` gives it instead
(``shard_batch(..., layout=model)`` cuts by the model's ``ops.sp_layout.SPLayout``), and attention runs
``ops.ulysses.ulysses_ring_attention``. Once per forward the hook gathers the shards' padding masks and position
ids (a (2, B, T_l) int64 tensor per rank) to check them and to give attention the GLOBAL padding mask; positions
default to the global ones of the rank's tokens (p*T_l + arange(T_l) without a ring), as the stock model uses
arange(T).
The resulting per-forward state, ``ShardContext``, is defined in ``forwards.attn_spec``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ds_longseq.compat import cache_kwarg, pop_cache
from ds_longseq.forwards.attn_spec import SPEC_KWARG, AttentionSettings, AttnSpec, ShardContext
from ds_longseq.ops.documents import find_documents
from ds_longseq.ops.draws import Draws
from ds_longseq.ops.sp_layout import SPLayout
from ds_longseq.ops.sp_positions import sp_positions
from ds_longseq.ops.state_passing import StateRing
from ds_longseq.ops.ulysses import UlyssesExchange, UlyssesRingExchange

__all__ = ["SequenceParallel", "SequenceParallelForwardHook", "ShardOffsetCache", "ShardOffsetHook"]


class SequenceParallel:
    """The sequence-parallel group of one model.

    Args:
        layout: the model's layout (P = u x r and its process groups: ``ops.sp_layout.SPLayout.build``), which the
            model keeps (:attr:`layout`: batches for it are cut by it).
        num_heads, num_kv_heads: the model's attention head counts (checked against the Ulysses degree).
    """

    def __init__(self, layout: SPLayout, num_heads: int, num_kv_heads: int):
        self.layout = layout
        self.group = layout.group
        self.size = layout.size
        self.rank = dist.get_rank(layout.group)
        self.ring = layout.ring
        self.ring_group = layout.ring_group
        ulysses, ring = layout.degrees
        self.exchange = (UlyssesExchange(layout.ulysses_group, ulysses, num_heads, num_kv_heads)
                         if ulysses > 1 or ring == 1 else None)
        self.kv_exchange = self.exchange if ring == 1 else UlyssesRingExchange(self.exchange, self.ring_group,
                                                                               ulysses, ring)
        self._token_exchange = self.exchange if ring == 1 else None
        self.is_paused = False
        self.local_loss_values = False
        self._state_rings: dict[int, StateRing] = {}

    @property
    def degrees(self) -> tuple[int, int]:
        """(u, r): the Ulysses and ring degrees."""
        return self.layout.degrees

    @property
    def token_exchange(self) -> UlyssesExchange:
        """An all-to-all over the whole group (a mixer sharded by heads across every rank): the Ulysses exchange,
        or under a ring one built on first use."""
        if self._token_exchange is None:
            self._token_exchange = UlyssesExchange.of_tokens(self.group)
        return self._token_exchange

    def positions(self, local_len: int, device) -> torch.Tensor:
        """(T_l,) the global positions of this rank's tokens (``ops.sp_positions``), for shards of ``local_len``."""
        if self.ring == 1:
            return torch.arange(self.rank * local_len, (self.rank + 1) * local_len, device=device)
        return sp_positions(local_len * self.size, *self.degrees)[self.rank].to(device)

    def _state_ring(self, local_len: int) -> StateRing:
        """The group's chain for recurrent states with shards of ``local_len`` (built once per length)."""
        if local_len not in self._state_rings:
            layout = None if self.ring == 1 else sp_positions(local_len * self.size, *self.degrees)
            self._state_rings[local_len] = StateRing(self.group, layout)
        return self._state_rings[local_len]

    @contextlib.contextmanager
    def _flag_set(self, name: str):
        previous = getattr(self, name)
        setattr(self, name, True)
        try:
            yield
        finally:
            setattr(self, name, previous)

    def paused(self):
        """Context inside which the model runs as if sequence parallelism were off (whole sequences,
        no collective), for evaluation and generation on unsharded batches."""
        return self._flag_set("is_paused")

    def local_losses(self):
        """Context inside which :meth:`token_mean` returns this rank's share as the value too (the
        gradient is the share as always), for a caller that sums loss values over the group itself:
        the Trainer integration, where TRL's loss is computed from per-token log-probs on each rank."""
        return self._flag_set("local_loss_values")

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def begin_forward(
        self,
        batch_size: int,
        local_len: int,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        device: torch.device,
    ) -> tuple[ShardContext, torch.Tensor]:
        """Check the shards of this forward, gather the global padding mask; return it with the positions.

        Returns:
            (context for the attention calls, (B or 1, T_l) position ids to run the model with).
        """
        shapes = self._all_gather(torch.tensor([batch_size, local_len], dtype=torch.int64, device=device))
        shapes = [tuple(s.tolist()) for s in shapes]
        if len(set(shapes)) != 1:
            raise ValueError(
                f"the {self.size} ranks of a sequence-parallel group hold different (batch, local length) shards "
                f"{shapes}: every rank must get its 1/{self.size} of the same sequences. Cut batches with "
                "ds_longseq.engine.shard_batch."
            )
        if attention_mask is not None and tuple(attention_mask.shape) != (batch_size, local_len):
            raise ValueError(
                f"under sequence parallelism attention_mask must be this rank's (batch, T/P) = "
                f"{(batch_size, local_len)} slice of the 2D padding mask, got shape {tuple(attention_mask.shape)}"
            )
        if position_ids is None:
            position_ids = self.positions(local_len, device).unsqueeze(0)
        mask = torch.ones(batch_size, local_len, dtype=torch.int64, device=device)
        if attention_mask is not None:
            mask = attention_mask.to(device=device, dtype=torch.int64)
        both = torch.stack([mask, position_ids.to(device=device, dtype=torch.int64).expand(batch_size, local_len)])
        gathered = torch.cat(self._all_gather(both), dim=-1)  # (2, B, T), rank-major
        if self.ring > 1:  # rank-major is not the global order under a ring: put each rank's tokens in place
            order = sp_positions(gathered.shape[-1], *self.degrees).flatten().to(device)
            gathered = torch.empty_like(gathered).index_copy_(-1, order, gathered)
            self._check_ring_layout(gathered[1])
        key_valid = gathered[0].bool()
        # As in one process: positions that restart with no attention_mask mark packed documents,
        # found on the GLOBAL positions, so a document may span ranks.
        doc_start, _ = find_documents(
            gathered[1], None if attention_mask is None else key_valid, batch_size, gathered.shape[-1]
        )
        if bool(key_valid.all()):
            key_valid = None
        ctx = ShardContext(self.exchange, local_len, key_valid, doc_start, self.ring_group, local_len * self.size,
                           self.kv_exchange, self._state_ring(local_len))
        self.last_context = ctx  # the loss masks packed documents' boundary targets with it
        return ctx, position_ids

    def _check_ring_layout(self, positions: torch.Tensor) -> None:
        """Raise unless the (B, T) position ids, put in place by the ring layout, count up from 0 (restarting at 0
        where a packed document starts): a batch cut for Ulysses alone (contiguous shards) would otherwise train on
        a shuffled sequence."""
        steps = (positions[:, 1:] == positions[:, :-1] + 1) | (positions[:, 1:] == 0)
        if bool((positions[:, 0] != 0).any()) or not bool(steps.all()):
            raise ValueError(
                f"sequence parallelism {self.size // self.ring} x {self.ring} (Ulysses x ring) holds each rank's "
                "tokens in the ring's zigzag layout, but this batch's position ids are not in that order: cut "
                "batches for the model they are for: ds_longseq.engine.shard_batch(batch, layout=<the model or its "
                f"engine>) (or shard_batch(batch, rank, {self.size}, ring={self.ring}))"
            )

    def mask_boundary_targets(self, shift_labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """This rank's (B, T_l) ``shift_labels`` with ``ignore_index`` where the next token starts a new
        document (of the last forward's packed rows; also across the shard boundary), so no token is
        trained to predict another document's first token. Unchanged when no row is packed."""
        ctx = getattr(self, "last_context", None)
        if ctx is None or ctx.doc_start is None:
            return shift_labels
        doc_start = ctx.doc_start.to(shift_labels.device)
        N = doc_start.shape[-1]
        nxt = self.positions(ctx.local_len, doc_start.device) + 1
        inside = nxt < N
        starts = torch.zeros(doc_start.shape[0], ctx.local_len, dtype=torch.bool, device=doc_start.device)
        starts[:, inside] = doc_start[:, nxt[inside]] == nxt[inside]
        return shift_labels.masked_fill(starts, ignore_index)

    def token_mean(
        self, loss_sum: torch.Tensor, num_valid: torch.Tensor, denominator: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """The group's token-weighted mean loss, from this rank's (loss_sum, num_valid).

        The value is the same on every rank of the group: sum over the group / count over the group
        (or ``denominator``, e.g. a ``num_items_in_batch`` that already counts the whole group). The
        gradient is this rank's share only, d(loss_sum)/denominator: summing the ranks' gradients
        (DeepSpeed's reduction over the group) gives the gradient of the group's mean, exactly, also
        when a rank holds no valid token (its share is 0, and its backward still runs the collectives).
        """
        stats = torch.stack([loss_sum.detach().to(torch.float64), num_valid.to(loss_sum.device, torch.float64)])
        dist.all_reduce(stats, group=self.group)
        total = stats[0].to(loss_sum.dtype)
        denom = stats[1] if denominator is None else denominator
        if isinstance(denom, torch.Tensor):
            denom = denom.to(device=loss_sum.device, dtype=loss_sum.dtype)
        if self.local_loss_values:
            return loss_sum / denom
        # value = group total; gradient = this rank's own share
        return (loss_sum - loss_sum.detach() + total) / denom


class SequenceParallelForwardHook:
    """Forward pre-hook (``with_kwargs=True``) of the base model under sequence parallelism.

    Runs once per forward, before the embedding: checks the shards, gathers the global padding
    mask, sets global position ids when none are given, turns off the KV cache (a cache of one
    rank's shard could not be generated from) and passes the shard context to every layer and
    attention call as ``ds_longseq=AttnSpec(...)``.
    """

    _WHOLE_FORWARD = -1
    """The key of the draws region a training forward runs in (``ops.draws``): not a chunk's position."""

    def __init__(self, sp: SequenceParallel, attention: AttentionSettings):
        """``attention``: ``long_seq.attention``, passed to every attention call of the forward."""
        self.sp = sp
        self.attention = attention
        # per running forward: its region of this rank's draws (ops.draws) and their Draws, or None
        self._regions: list = []

    def __call__(self, module, args, kwargs):
        begun = self._begin(module, args, kwargs)  # its refusals first, before any region is entered
        region = None
        if module.training and not self.sp.is_paused:
            # The ranks hold different tokens of one sequence but the same global generator state: each draws its
            # shard's dropout masks from its own state (the rank mixed in), as one process would draw different
            # masks along the sequence; a chunked module inside takes its own replayed draws from there.
            draws = Draws.take(next(iter(module.parameters())).device)
            context = draws.region(self._WHOLE_FORWARD)
            context.__enter__()
            region = (draws, context)
        self._regions.append(region)
        return begun

    def end(self, module, args, kwargs, output) -> None:
        """Forward hook (``with_kwargs=True, always_call=True``, so also when the forward raised): the forward's
        draws region closed (the global generators restored, then advanced by one draw if the forward drew). After
        a refusal of the pre-hook itself nothing was pushed, and nothing is popped (no forward of this model runs
        inside another)."""
        region = self._regions.pop() if self._regions else None
        if region is not None:
            draws, context = region
            context.__exit__(None, None, None)
            draws.advance()

    def _begin(self, module, args, kwargs):
        if self.sp.is_paused:
            return None
        names = ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache")
        if len(args) > len(names):
            raise TypeError(f"{type(module).__name__} got {len(args)} positional arguments; pass them by name")
        kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
        if pop_cache(dict(kwargs)) is not None or kwargs.get("use_cache"):
            raise NotImplementedError(
                "a KV cache (generation, use_cache=True) is not supported under ds_longseq sequence parallelism: "
                "each rank holds only its shard of the sequence. Generate inside "
                "ds_longseq.patch.sequence_parallel_of(model).paused() (in the Trainer: "
                "trainer.sequence_parallel_paused()), with the exported model, or after ds_longseq.disable(model)."
            )
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise ValueError("the model needs input_ids or inputs_embeds")
        ctx, position_ids = self.sp.begin_forward(
            tokens.shape[0], tokens.shape[1], kwargs.get("attention_mask"), kwargs.get("position_ids"), tokens.device
        )
        kwargs["position_ids"] = position_ids
        kwargs["use_cache"] = False
        kwargs[SPEC_KWARG] = AttnSpec(None, self.attention, ctx)
        return (), kwargs


class ShardOffsetCache:
    """A stand-in cache for an attention module that positions its queries by the cache's length (Llama 4's
    temperature tuning: ``get_seq_length()`` + the query's index): it reports the shard's global offset and
    passes keys and values through unchanged (``update``), so this rank's queries sit where one process puts
    them. Only for a layer given no cache (a stock layer under sequence parallelism; StreamBP's own
    ``GlobalKVStream`` reports the offset itself)."""

    def __init__(self, offset: int):
        self.offset = offset

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.offset

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return key_states, value_states


class ShardOffsetHook:
    """Forward pre-hook (``with_kwargs=True``) of an attention module positioned by its cache's length
    (``DecoderLMAdapter.cache_positioned_attention``): given no cache, it gets a :class:`ShardOffsetCache` at
    this rank's offset, ``rank * T_l`` for its (B, T_l, d) hidden states."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(self, module, args, kwargs):
        if self.sp.is_paused or pop_cache(dict(kwargs)) is not None:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        offset = self.sp.exchange.rank * hidden.shape[1]
        return args, {**kwargs, cache_kwarg(module.forward): ShardOffsetCache(offset)}

