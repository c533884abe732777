"""StreamBP's K/V streams: one layer's keys and values over a pass of its chunks, written chunk by chunk and attended.

Holds:
    KVStream: one layer's post-RoPE K/V over a pass of its chunks, written chunk by chunk (:meth:`KVStream.write_kv`)
        and read by the attention (prefix, gradient sinks).
    SharedKV: one layer's K/V that later layers of the same forward attend too (cross-layer K/V sharing),
        with the gradient those layers send back to it.
    GlobalKVStream, global_kv: the same under Ulysses sequence parallelism (a layer's K/V exchanged across the group,
        heads-sharded).
    capture_kv, KVCaptured: a pass that runs each chunk only up to its K/V ("capture") and stops the layer there.
    RunChunk: what a layer's chunk is run by.

The passes over the chunks that use these streams (forward, the backward's capture and replay, StreamBP's autograd
Functions) are ``ops.streambp_autograd``'s; its docstring has the algorithm.

This module is tensors only: a stream knows nothing of transformers. A stock layer reaches it
through ``forwards.layer_cache.StreamCache``, the KV cache the layer is called with, which turns transformers'
cache calls (``update``, ``get_seq_length``, the linear-attention state API) into the stream's.

Shape legend: B batch, T sequence, C chunk, d hidden, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Callable

import torch

from ds_longseq.ops.carried_state import CarriedState
from ds_longseq.ops.chunk_grads import acc_dtype, autocast_dtype
from ds_longseq.ops.kept_attention import ChunkSlot, KeptAttention

__all__ = [
    "capture_kv",
    "global_kv",
    "KVCaptured",
    "KVStream",
    "SharedKV",
    "GlobalKVStream",
    "RunChunk",
]


class KVCaptured(Exception):
    """Raised by ``KVStream.write_kv`` in capture mode to stop the layer right after K/V exist."""


class SharedKV:
    """Keys and values one StreamBP layer (the producer) computes and later layers of the same forward attend
    instead of their own (cross-layer K/V sharing: Gemma 4's ``kv_sharing_modes`` "store" / "reuse").

    ``k``, ``v``: the producer's stream buffers in the layout its attention reads, set during its forward
    (complete once its last chunk ran) and kept until its backward: (B, Hkv, T, D) in a :class:`KVStream`,
    the heads-sharded (B, Hkv_l, P*T_l, D) of the whole sequence in a :class:`GlobalKVStream`.

    ``dk``, ``dv``: the gradient the consuming layers send back, accumulated in their backward (they run
    first: they come later in the forward). The producer adds it to its own keys' gradient before replaying
    its chunks (``alloc_grads``), so the producing layer's projections get the consumers' share exactly;
    then everything here is released.
    """

    def __init__(self, name: str):
        self.name = name  # how errors name it (e.g. the producing layer and the sharing key)
        self.k = self.v = None
        self.dk = self.dv = None

    def grad_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, Hkv, T, D) accumulators consumers add their key/value gradients into (zeros at first)."""
        if self.dk is None:
            self.dk = torch.zeros(self.k.shape, dtype=acc_dtype(self.k.dtype), device=self.k.device)
            self.dv = torch.zeros(self.v.shape, dtype=acc_dtype(self.v.dtype), device=self.v.device)
        return self.dk, self.dv

    def checked(self) -> "SharedKV":
        """This object, once a layer of this forward produced its keys/values; else NotImplementedError."""
        if self.k is None:
            raise NotImplementedError(
                f"StreamBP: {self.name} are read before any layer of this forward produced them (keys/values "
                "passed in from outside the forward): this model cannot run under long_seq.streambp; use mini_seq"
            )
        return self

    def release(self) -> None:
        self.k = self.v = self.dk = self.dv = None


class KVStream:
    """One layer's keys and values over one pass of its chunks: each chunk writes its own (:meth:`write_kv`; a
    stock layer through its KV cache's ``update``, ``forwards.layer_cache``) and attends the prefix.

    Modes: ``"append"`` (forward: store the chunk's K/V at [start, end) and return them),
    ``"capture"`` (backward pass 1: store, then stop the layer), ``"replay"`` (backward pass 2:
    keep references to the chunk's recomputed K/V, which carry autograd history).

    The attention function reads :meth:`prefix` (keys before the chunk) and
    :attr:`prefix_grad_sink` (where to add their gradients) from the same object.

    ``concat`` (whole-cache mode): :meth:`write_kv` returns the cached tensors of every token so far, prefix and
    chunk, as a transformers ``DynamicCache`` does, and the layer attends them all. For layers that cache
    something other than the keys and values they attend (multi-head latent attention caches the compressed
    latent and expands it after the update: DeepSeek-V2/V3). The prefix then reaches the attention through
    the layer's own code, and in replay its gradient comes back through autograd into ``prefix_leaves``
    (the caller adds it to :attr:`dk` / :attr:`dv`). Set by the attention function on the first chunk
    (:meth:`prefer_concat`), which is the same in both modes.

    Cross-layer K/V sharing: ``produces`` (a :class:`SharedKV` this layer's K/V go to: its forward buffers
    are handed over, its backward adds the consumers' gradient) or ``reads`` (a layer that attends another
    layer's K/V instead of computing its own: :meth:`read_shared` stands in for :meth:`write_kv`, in whole-cache
    mode). Both are set by the decoder layer before each chunk.

    Recurrent token mixers (linear attention, state-space, short convolutions: hybrid stacks) carry their
    states from chunk to chunk in :attr:`state` (a :class:`~ds_longseq.ops.carried_state.CarriedState`).
    """

    def __init__(self, total_len: int, concat: bool = False):
        self.total_len = total_len
        self.mode = "append"
        self.concat = concat
        self.start = self.end = 0
        self.k = self.v = None  # (B, Hkv, T, D) buffers, allocated at the first write_kv
        self.dk = self.dv = None  # gradient buffers, backward only
        self.k_chunk = self.v_chunk = None
        self.prefix_leaves: tuple[torch.Tensor, torch.Tensor] | None = None  # whole-cache replay only
        self.produces: SharedKV | None = None
        self.reads: SharedKV | None = None
        # calls during the current chunk, for the caller's check that the layer's attention went
        # through the cache and the chunk attention (``begin_chunk`` resets them)
        self.updates, self.attended, self.updated_shapes = 0, [], None
        self.state = CarriedState()
        # False while the backward re-forwards chunks: the layer's output is then only autograd's root, its
        # values unread (forwards.unread_outputs may leave the MLP's output projection uncomputed)
        self.outputs_read = True
        # tokens [0, captured_end) had their K/V captured in the backward's capture pass. A replay of such a chunk
        # may reuse them (``reuse_kv``, set by the layer per chunk): its key/value projections then run for their
        # gradient only (values unread), write_kv() leaves the captured K/V in the buffers, and the attention takes
        # the chunk's own keys/values from there (:meth:`own_kv`).
        self.captured_end = 0
        self.reuse_kv = False
        # the layer's attention outputs kept from its forward (ops.kept_attention): recorded in "append", taken in
        # "replay" instead of recomputed; None: not kept
        self.keeper: KeptAttention | None = None

    def kept_slot(self) -> ChunkSlot | None:
        """The current chunk's kept attention outputs for the attention call: recorded into in the forward, taken
        from in the replay; None in other passes, or when nothing is kept."""
        if self.keeper is None or self.mode not in ("append", "replay"):
            return None
        return self.keeper.slot(self.start)

    def begin_chunk(self) -> None:
        """Reset the current chunk's ``updates`` (cache updates, the last one's (key shape, value shape) in
        ``updated_shapes``) and ``attended`` ((queries, keys) of each chunk-attention call, appended by the
        attention function)."""
        self.updates, self.attended, self.updated_shapes = 0, [], None

    def write_kv(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The current chunk's (B, Hkv, C, D) post-RoPE keys and (B, Hkv, C, Dv) values, stored at [start, end) of
        the buffers (in replay kept with their autograd history); returns what the layer attends: the chunk's
        own, or in whole-cache mode every token's so far. Raises ``KVCaptured`` in a capture pass (the rest of
        the layer is not needed). Counted in :attr:`updates` for the runtime guard."""
        self.updates += 1
        self.updated_shapes = (tuple(key_states.shape), tuple(value_states.shape))
        if self.k is None:
            # Stored as the attention will read them: under autocast, in the autocast dtype (half the
            # bytes of float32 post-RoPE keys, and no per-chunk cast of the whole prefix).
            B, Hkv, _, D = key_states.shape
            shape = (B, Hkv, self.total_len, D)
            self.k = key_states.new_empty(shape, dtype=autocast_dtype(key_states))
            self.v = value_states.new_empty(
                (B, value_states.shape[1], self.total_len, value_states.shape[-1]), dtype=autocast_dtype(value_states)
            )
        if self.mode == "replay":
            self.k_chunk, self.v_chunk = key_states, value_states
            if not self.concat and not self.reuse_kv:
                with torch.no_grad():  # the chunk's keys after its prefix, as in forward: see joined()
                    self.k[:, :, self.start : self.end] = key_states
                    self.v[:, :, self.start : self.end] = value_states
            if not self.concat or self.start == 0:
                return key_states, value_states
            # leaves standing for the prefix: autograd brings their gradient back through the layer's own code
            leaves = tuple(buf[:, :, : self.start].detach().requires_grad_(True) for buf in (self.k, self.v))
            self.prefix_leaves = leaves
            return (torch.cat([leaves[0].to(key_states.dtype), key_states], 2),
                    torch.cat([leaves[1].to(value_states.dtype), value_states], 2))
        with torch.no_grad():
            self.k[:, :, self.start : self.end] = key_states
            self.v[:, :, self.start : self.end] = value_states
        if self.mode == "capture":
            raise KVCaptured
        if self.produces is not None:  # complete once the last chunk ran
            self.produces.k, self.produces.v = self.k, self.v
        if self.concat and self.start > 0:  # every token so far (views of the buffers; no grad in this mode)
            return self.k[:, :, : self.end].to(key_states.dtype), self.v[:, :, : self.end].to(value_states.dtype)
        return key_states, value_states

    def read_shared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of tokens [0, end) from :attr:`reads` (another layer's), for a layer that attends
        them instead of computing its own: counted as this chunk's cache update, in whole-cache mode. In replay
        they are leaves (:attr:`prefix_leaves`) whose gradient the caller adds to :attr:`dk` / :attr:`dv`, which
        are the producer's accumulators (:meth:`SharedKV.grad_buffers`)."""
        shared = self.reads.checked()
        self.updates += 1
        self.concat = True  # every chunk attends all tokens so far, given in one tensor
        self.k, self.v = shared.k, shared.v
        k, v = shared.k[:, :, : self.end], shared.v[:, :, : self.end]
        self.updated_shapes = (tuple(k.shape), tuple(v.shape))
        if self.mode == "capture":
            raise KVCaptured
        if self.mode == "replay":
            self.prefix_leaves = k, v = tuple(t.detach().requires_grad_(True) for t in (k, v))
        return k, v

    def prefer_concat(self) -> bool:
        """Switch to whole-cache mode (see the class docstring) if still on the first chunk, where both modes
        return the same; whether the stream is (now) in it."""
        if self.start == 0 and self.mode == "append":
            self.concat = True
        return self.concat

    def attends(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Called by the attention function with what the layer attends: whether those are the keys/values this
        chunk wrote through the cache (or, in whole-cache mode, every cached token so far). A layer attending
        something else than it cached (multi-head latent attention) switches to whole-cache mode on its first
        chunk (:meth:`prefer_concat`)."""
        same = (tuple(key.shape), tuple(value.shape)) == self.updated_shapes
        return same or self.prefer_concat()

    def attended_keys(self) -> int:
        """How many keys the current chunk's attention call must be given (the runtime guard's check): the
        chunk's own, or in whole-cache mode every token up to the chunk's end."""
        return self.end if self.concat else self.end - self.start

    def tokens_before(self) -> int:
        """Tokens of the sequence before the current chunk (what a cache holds before the chunk's update: Llama 4's
        attention temperature tuning positions its queries by it)."""
        return self.start

    def prefix(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """(B, Hkv, start, D) keys and values before the current chunk (views of the buffers); None in
        whole-cache mode (the layer passes them with its own keys)."""
        if self.start == 0 or self.k is None or self.concat:
            return None, None
        return self.k[:, :, : self.start], self.v[:, :, : self.start]

    def own_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (key, value) the attention should use for the current chunk's own tokens: the layer's, or in a replay
        that reuses the captured K/V (:attr:`reuse_kv`) the captured values standing in for them, their gradient
        going to the layer's (whose values were left uncomputed)."""
        if not self.reuse_kv:
            return key, value
        s, e = self.start, self.end
        return _Captured.apply(key, self.k[:, :, s:e]), _Captured.apply(value, self.v[:, :, s:e])

    def joined(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(B, Hkv, end, D) keys and values of the prefix and then the current chunk (views of the buffers, which
        :meth:`write_kv` wrote the chunk's into in every mode), for an attention kernel that takes both in one call;
        None in whole-cache mode or before the chunk's update."""
        if self.k is None or self.concat or self.updates == 0:
            return None
        return self.k[:, :, : self.end], self.v[:, :, : self.end]

    @property
    def prefix_grad_sink(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.mode != "replay" or self.start == 0 or self.concat:
            return None
        return self.dk, self.dv

    def alloc_grads(self) -> None:
        """Zeroed (B, Hkv, T, D) key/value gradient accumulators; a consumer of shared K/V accumulates into the
        producer's (:meth:`SharedKV.grad_buffers`), a producer starts from what its consumers sent back."""
        if self.reads is not None:
            self.dk, self.dv = self.reads.grad_buffers()
            return
        self.dk = torch.zeros(self.k.shape, dtype=acc_dtype(self.k.dtype), device=self.k.device)
        self.dv = torch.zeros(self.v.shape, dtype=acc_dtype(self.v.dtype), device=self.v.device)
        if self.produces is not None:
            if self.produces.dk is not None:  # consumers ran their backward already (they come later)
                self.dk += self.produces.dk
                self.dv += self.produces.dv
            self.produces.release()


class _Captured(torch.autograd.Function):
    """``captured``'s values in place of ``x`` (the same values, computed earlier by the capture pass), the gradient
    passed to ``x`` in its dtype: exactly what autograd gives ``x`` when ``x`` is cast to the captured values'
    dtype (the autocast dtype the buffers hold) and used."""

    @staticmethod
    def forward(ctx, x, captured):
        ctx.dtype = x.dtype
        return captured.clone()  # not a view of the buffer: autograd outputs must own their values

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


# run_chunk(hidden_chunk (B, C, d), start, end, stream) -> out_chunk (B, C, d), or a tuple
# (out_chunk, *aux_chunks) with auxiliary per-token outputs (B, C, ...) such as router logits
RunChunk = Callable[[torch.Tensor, int, int, KVStream], "torch.Tensor | tuple[torch.Tensor, ...]"]


# --- sequence parallel (Ulysses) ------------------------------------------------------------------
# Every key is a constant of the chunk loop, heads-sharded and exchanged once per pass (why:
# ops.streambp_autograd's sequence-parallel section).


class GlobalKVStream:
    """:class:`KVStream` under sequence parallelism: a layer's keys and values exchanged across the group.

    Modes: ``"capture"`` (store the chunk's K/V in the local (B, Hkv, T_l, D) buffers, then stop the
    layer), ``"attend"`` (return K/V unchanged: the attention reads :attr:`k_heads` /
    :attr:`v_heads`), ``"capture_grad"`` (keep the chunk's K/V with their autograd history, stop).

    Where the K/V are taken (:attr:`capture_at`, found on the first chunk of the capture pass): ``"cache"``, at
    the cache update, for layers that attend what they cache; ``"attention"``, at the attention call
    (:meth:`attends`), for layers that cache something else and derive their keys/values from it after the
    update, token by token (multi-head latent attention caches the compressed latent and expands it): the
    expanded keys/values are then exchanged and attended like any layer's. Only families whose 2-rank parity
    test verified sequence parallelism get here (``FamilySpec.sequence_parallel_verified``), which proves that
    derivation per token for them (the whole-cache mode of :class:`KVStream` has no such requirement).

    Attributes read by the attention function: ``exchange``, ``start``, ``end``, ``k_heads`` /
    ``v_heads`` ((B, Hkv_l, P*T_l, D), heads-sharded K/V of the whole sequence) and
    :attr:`grad_sink`.
    """

    def __init__(self, local_len: int, exchange):
        self.local_len = local_len
        self.exchange = exchange
        self.mode = "capture"
        self.start = self.end = 0
        self.k = self.v = None
        self.k_heads = self.v_heads = None
        self.dk_heads = self.dv_heads = None
        self.k_chunk = self.v_chunk = None
        self.updates, self.attended, self.updated_shapes = 0, [], None  # as in KVStream
        self.produces: SharedKV | None = None  # as in KVStream, with the heads-sharded K/V
        self.reads: SharedKV | None = None
        self.capture_at: str | None = None  # "cache" | "attention" (class docstring); None until the first chunk
        self.taken = None  # the captured K/V's shapes without their token dim (_per_token)
        self.outputs_read = True  # as in KVStream: False during the backward's full-layer pass over the chunks
        self.keeper: KeptAttention | None = None  # as in KVStream: recorded in the forward's "attend" pass

    begin_chunk = KVStream.begin_chunk

    def kept_slot(self) -> ChunkSlot | None:
        """As :meth:`KVStream.kept_slot`: the chunk loop over the exchanged keys ("attend") records in the forward and
        takes in the backward's pass over the chunks (the keeper knows which)."""
        if self.keeper is None or self.mode != "attend":
            return None
        return self.keeper.slot(self.start)

    def attended_keys(self) -> int:
        """Keys the current chunk's attention call is given (the runtime guard's check): the chunk's own (the
        attention reads the rest from :attr:`k_heads`)."""
        return self.end - self.start

    def attends(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Called by the attention function with what the layer attends (see :meth:`KVStream.attends`). In the
        capture modes this is where a layer's K/V are taken when it attends something else than it cached
        (:attr:`capture_at` ``"attention"``, decided here on the first chunk): stored or kept, then the layer
        is stopped (raises ``KVCaptured``)."""
        shapes = (tuple(key.shape), tuple(value.shape))
        if self.capture_at is None:  # first chunk of the capture pass: write_kv() stored the cached tensors
            self.capture_at = "cache" if shapes == self.updated_shapes else "attention"
            if self.capture_at == "attention":
                self.k = self.v = None  # the buffers are for the attended tensors
        if self.mode == "attend":
            if self.capture_at == "attention":  # the chunk's own, as captured (the attention reads k_heads)
                return key.shape[2] == self.end - self.start and _per_token(key, value) == self.taken
            return shapes == self.updated_shapes
        if self.capture_at == "attention":
            self._take(key, value)
        raise KVCaptured

    def tokens_before(self) -> int:
        """Tokens of the whole sequence before the current chunk (the shard's global offset plus the chunk's
        start), as :meth:`KVStream.tokens_before` (Llama 4's temperature tuning positions its queries by it)."""
        if getattr(self.exchange, "ring", 1) > 1:  # zigzag shards: no single offset (such families are refused)
            raise NotImplementedError("StreamBP under ring attention: this layer positions its queries by the tokens "
                                      "before its chunk, which a zigzag shard does not have as one offset")
        return self.exchange.rank * self.local_len + self.start

    def read_shared(self) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`KVStream.read_shared` under sequence parallelism: the attention reads the producer's heads-sharded
        K/V (:meth:`exchange_kv`) and sends their gradient to its accumulators (:meth:`alloc_grads`); the layer gets
        zero-cost (B, 1, C, D) placeholders to pass it, and nothing of its own to capture."""
        shared = self.reads.checked()
        self.updates += 1
        self.capture_at = "cache"  # nothing of its own to capture at the attention either
        C = self.end - self.start
        k, v = (t.new_zeros(()).expand(t.shape[0], 1, C, t.shape[-1]) for t in (shared.k, shared.v))
        self.updated_shapes = (tuple(k.shape), tuple(v.shape))
        if self.mode != "attend":  # capture, capture_grad: no keys/values of its own
            raise KVCaptured
        return k, v

    def write_kv(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`KVStream.write_kv`: the chunk's keys and values returned unchanged where the attention call
        takes them (``"attend"``, or ``capture_at`` ``"attention"``), else taken (:meth:`_take`) and the layer
        stopped (``KVCaptured``; on the first chunk it goes on to the attention call, which decides where)."""
        self.updates += 1
        self.updated_shapes = (tuple(key_states.shape), tuple(value_states.shape))
        if self.mode == "attend" or self.capture_at == "attention":  # the attention call takes them (attends)
            return key_states, value_states
        self._take(key_states, value_states)
        if self.capture_at is None:  # first chunk: on to the attention call, which decides where to capture
            return key_states, value_states
        raise KVCaptured

    def _take(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The chunk's K/V: kept with their autograd history (capture_grad), or stored in the local (B, Hkv, T_l,
        D) buffers (capture)."""
        if self.mode == "capture_grad":
            self.k_chunk, self.v_chunk = key_states, value_states
            return
        self.taken = _per_token(key_states, value_states)
        if self.k is None:  # in the dtype the attention reads (see KVStream.write_kv)
            B, Hkv, _, D = key_states.shape
            self.k = key_states.new_empty((B, Hkv, self.local_len, D), dtype=autocast_dtype(key_states))
            self.v = value_states.new_empty(
                (B, value_states.shape[1], self.local_len, value_states.shape[-1]), dtype=autocast_dtype(value_states)
            )
        with torch.no_grad():
            self.k[:, :, self.start : self.end] = key_states
            self.v[:, :, self.start : self.end] = value_states

    def exchange_kv(self) -> None:
        """Local K/V -> heads-sharded K/V of the whole sequence (one all-to-all each); frees the local copy. A
        layer reading shared K/V takes the producer's (exchanged already)."""
        if self.reads is not None:
            self.k_heads, self.v_heads = self.reads.k, self.reads.v
            return
        with torch.no_grad():
            self.k_heads = self.exchange.kv_to_heads(self.k)
            self.v_heads = self.exchange.kv_to_heads(self.v)
        self.k = self.v = None
        if self.produces is not None:
            self.produces.k, self.produces.v = self.k_heads, self.v_heads

    @property
    def grad_sink(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.dk_heads is None else (self.dk_heads, self.dv_heads)

    def alloc_grads(self) -> None:
        """As :meth:`KVStream.alloc_grads`, heads-sharded."""
        if self.reads is not None:
            self.dk_heads, self.dv_heads = self.reads.grad_buffers()
            return
        dt = acc_dtype(self.k_heads.dtype)
        self.dk_heads = torch.zeros(self.k_heads.shape, dtype=dt, device=self.k_heads.device)
        self.dv_heads = torch.zeros(self.v_heads.shape, dtype=dt, device=self.v_heads.device)
        if self.produces is not None:
            if self.produces.dk is not None:  # consumers ran their backward already (they come later)
                self.dk_heads += self.produces.dk
                self.dv_heads += self.produces.dv
            self.produces.release()

    def grads_to_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Hkv, T_l, D) gradients of this rank's keys/values (one all-to-all each); frees the rest. (None, None)
        for a layer reading shared K/V: their gradient stays in the producer's accumulators."""
        if self.reads is not None:
            self.k_heads = self.v_heads = self.dk_heads = self.dv_heads = None
            return None, None
        # Sent in the model dtype (a float32 accumulator would double a half-precision model's bytes).
        with torch.no_grad():
            dk = self.exchange.kv_grad_to_tokens(self.dk_heads.to(self.k_heads.dtype))
            dv = self.exchange.kv_grad_to_tokens(self.dv_heads.to(self.v_heads.dtype))
        self.k_heads = self.v_heads = self.dk_heads = self.dv_heads = None
        return dk, dv


def _per_token(key: torch.Tensor, value: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(B, H, D) and (B, Hv, Dv): the shapes of a chunk's keys and values without their token dim."""
    return tuple(key.shape[:2] + key.shape[3:]), tuple(value.shape[:2] + value.shape[3:])


def capture_kv(run_chunk: RunChunk, hidden: torch.Tensor, bounds, stream) -> None:
    """Run every chunk of ``bounds`` up to its cache update (no attention, no MLP) so ``stream`` (in a capture
    mode) holds its K/V (a recurrent mixer before the attention is served its boundary states, ``stream.state``
    in capture mode); call under no_grad."""
    state = getattr(stream, "state", None)
    for i, (s, e) in enumerate(bounds):
        stream.start, stream.end = s, e
        if state is not None:
            state.enter(i)
        try:
            run_chunk(hidden[:, s:e], s, e, stream)
        except KVCaptured:
            continue
        raise RuntimeError(
            f"StreamBP: on tokens [{s}, {e}) the layer never reached its KV cache's update() and ds_longseq's "
            f"attention function (cache updates: {stream.updates}), so its keys/values cannot be captured (its "
            "attention does not write them through the cache, or is computed inline): disable long_seq.streambp "
            "for this model and use mini_seq"
        )


def global_kv(run_chunk: RunChunk, hidden: torch.Tensor, bounds, stream: GlobalKVStream) -> GlobalKVStream:
    """``stream`` holding the group's keys/values of the layer, heads-sharded, in "attend" mode: every chunk run up
    to its K/V (captured), then exchanged across the group (a collective: every rank calls it at once)."""
    stream.mode = "capture"
    with torch.no_grad():
        capture_kv(run_chunk, hidden, bounds, stream)
    stream.exchange_kv()
    stream.mode = "attend"
    return stream
