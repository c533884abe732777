"""StreamBP for one causal layer: exact chunked forward and backward with K/V computed once.

Holds:
    KVStream: one layer's post-RoPE K/V over a pass of its chunks, written chunk by chunk (:meth:`KVStream.write_kv`)
        and read by the attention (prefix, gradient sinks).
    SharedKV: one layer's K/V that later layers of the same forward attend too (cross-layer K/V sharing),
        with the gradient those layers send back to it.
    streambp_apply: run a layer through StreamBP (an autograd Function that saves only the input,
        on the device or through a ``LayerInputOffloader`` in host memory).
    GlobalKVStream, streambp_sp_apply: the same under Ulysses sequence parallelism (K/V exchanged
        once per pass, query chunks streamed, dK/dV exchanged back once; see the section below).

This module is tensors and autograd only: a stream knows nothing of transformers. A stock layer reaches it
through ``forwards.layer_cache.StreamCache``, the KV cache the layer is called with, which turns transformers'
cache calls (``update``, ``get_seq_length``, the linear-attention state API) into the stream's.

Shape legend: B batch, T sequence, C chunk, d hidden, Hkv key/value heads, D head dim.

Algorithm (StreamBP paper Sec. 3.2.2, Property 3.1; see DESIGN_NOTES.md, lead 1):
- forward, under no_grad: chunks in order; each chunk's K/V are appended to a (B, Hkv, T, D)
  buffer and its queries attend the buffer's prefix plus the chunk's own keys.
- backward: (1) K/V of the whole sequence, once, chunk by chunk under no_grad ("capture": the
  layer stops right after its cache update, so no attention and no MLP is run); (2) chunks in
  REVERSE order: re-forward the chunk with grad, its queries attending the captured prefix (a
  constant whose gradient the attention op adds into dK/dV buffers), then one
  ``torch.autograd.grad`` over [out_c, k_c, v_c] with grad_outputs [dOut_c, dK_c, dV_c]. Every
  later chunk already ran, so dK_c / dV_c are complete when chunk c consumes them.
- parameter gradients are summed over chunks inside the Function and returned once, so each
  parameter's gradient hook fires once per backward (what DeepSpeed ZeRO and DDP expect).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ds_longseq.ops import sparse_inputs
from ds_longseq.ops.carried_state import CarriedState
from ds_longseq.ops.chunk_grads import (
    AutocastState,
    ChunkGrads,
    acc_dtype,
    assemble_chunks,
    autocast_dtype,
    split_outputs,
    with_aux_grads,
)
from ds_longseq.ops.host_store import LayerInputOffloader, load_input, save_input
from ds_longseq.ops.kept_attention import ChunkSlot, KeptAttention
from ds_longseq.ops.phases import phase
from ds_longseq.ops.sparse_inputs import SparseInputs

__all__ = [
    "capture_kv",
    "global_kv",
    "KVCaptured",
    "KVStream",
    "SharedKV",
    "GlobalKVStream",
    "streambp_apply",
    "streambp_sp_apply",
    "chunk_bounds",
]


class KVCaptured(Exception):
    """Raised by ``KVStream.write_kv`` in capture mode to stop the layer right after K/V exist."""


def chunk_bounds(total: int, chunk_size: int, min_chunk: int = 1) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive chunks of ``chunk_size`` (at least ``min_chunk``) covering ``total`` (last may
    be short); a last chunk shorter than ``min_chunk`` is merged into the one before it."""
    chunk_size = max(chunk_size, min_chunk)
    bounds = [(s, min(s + chunk_size, total)) for s in range(0, total, chunk_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < min_chunk:
        bounds[-2:] = [(bounds[-2][0], total)]
    return bounds


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


def _forward_chunks(run_chunk: RunChunk, hidden: torch.Tensor, bounds, stream=None,
                    before_chunk: Callable[[int], None] | None = None) -> tuple[list[torch.Tensor], Any]:
    """([out, *aux], the stream) of a forward over the chunks, K/V appended to ``stream`` (a new KVStream if
    None), recurrent states carried from chunk to chunk (``stream.state``, where the stream has one);
    ``before_chunk(i)`` runs before chunk i enters its state."""
    stream = KVStream(hidden.shape[1]) if stream is None else stream
    state = getattr(stream, "state", None)
    index = {s: i for i, (s, _) in enumerate(bounds)}

    def fn(h_c, s, e):
        stream.start, stream.end = s, e
        if before_chunk is not None:
            before_chunk(index[s])
        if state is not None:
            state.enter(index[s])
        out = run_chunk(h_c, s, e, stream)
        if state is not None:
            state.leave()
        return out

    return assemble_chunks(fn, hidden, bounds), stream


def _forward_passing_states(run_chunk: RunChunk, hidden: torch.Tensor, bounds, ring,
                            keeper: KeptAttention | None = None) -> tuple[list[torch.Tensor], Any]:
    """:func:`_forward_chunks` on a new :class:`KVStream` (recording the attention outputs into ``keeper``); with a
    ``ring`` (sequence parallelism, a recurrent layer), each segment of this rank's tokens (one under Ulysses, two
    runs under a ring) starts from the states the segment before it ended with, on another rank, and its own go on
    to the rank that holds the next one."""
    stream = KVStream(hidden.shape[1])
    stream.keeper = keeper
    if ring is None:
        return _forward_chunks(run_chunk, hidden, bounds, stream)
    device, firsts = hidden.device, segment_firsts(bounds, ring, hidden.shape[1])
    stream.state = CarriedState(initial=ring.from_previous(device, 0))

    def continue_segment(i: int) -> None:
        segment = firsts.get(i, 0)
        if segment > 0:  # send the last segment's states on before receiving this one's (the chain's order)
            ring.to_next(stream.state.written, device, segment - 1)
            stream.state.restarts[i] = ring.from_previous(device, segment)

    outs, stream = _forward_chunks(run_chunk, hidden, bounds, stream, continue_segment)
    ring.to_next(stream.state.written, device, len(ring.starts) - 1)
    return outs, stream


def segment_firsts(bounds, ring, total: int) -> dict[int, int]:
    """{index of the chunk that starts segment k: k} for ``ring``'s segments of a local shard of ``total`` tokens."""
    starts = {s: k for k, (s, _) in enumerate(ring.local_spans(total))}
    return {i: starts[s] for i, (s, _) in enumerate(bounds) if s in starts}


def segment_bounds(spans: list[tuple[int, int]], chunk_size: int, min_chunk: int) -> list[tuple[int, int]]:
    """:func:`chunk_bounds` within each span (a chunk never crosses a segment's end)."""
    bounds = []
    for a, b in spans:
        if b - a < min_chunk:
            raise ValueError(
                f"under Ulysses x ring this rank holds a run of {b - a} token(s) of the sequence, and a recurrent "
                f"layer needs chunks of at least {min_chunk}: use a longer sequence (or fewer ranks)")
        bounds += [(a + s, a + e) for s, e in chunk_bounds(b - a, chunk_size, min_chunk)]
    return bounds


def _sp_forward(run_chunk: RunChunk, hidden: torch.Tensor, bounds, exchange,
                keeper: KeptAttention | None = None) -> torch.Tensor:
    """A StreamBP layer's forward under sequence parallelism: the group's keys/values, then this rank's chunks (their
    attention outputs recorded into ``keeper``)."""
    stream = _global_kv(run_chunk, hidden, bounds, exchange)
    stream.keeper = keeper
    return _single_output(_forward_chunks(run_chunk, hidden, bounds, stream)[0])


def _stash_kept(keeper: KeptAttention | None, hidden: torch.Tensor, offloader) -> KeptAttention | None:
    """After a layer's forward, before its input is saved: its kept attention outputs put in the tier the input goes
    to (the device, host memory, disk); under ``offload.keep_every`` only where the input itself is kept (a layer
    whose input is rebuilt in backward recomputes its attention too). Returns the keeper, or None (nothing kept)."""
    if keeper is None or keeper.empty:
        return None
    if isinstance(offloader, SparseInputs):
        if not offloader.will_keep(hidden):
            keeper.drop()
            return None
        offloader = offloader.offloader
    keeper.stash(None if offloader is None else offloader.save)
    return keeper


class _StreamBPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, run_chunk, bounds, offloader, ring, keeper, *params):
        with torch.no_grad(), phase("streambp.forward"):
            outs, stream = _forward_passing_states(run_chunk, hidden, bounds, ring, keeper)
        ctx.ring = ring
        ctx.keeper = _stash_kept(keeper, hidden, offloader)  # before the input: the offload tiers' load order
        save_input(ctx, hidden, offloader)
        ctx.run_chunk, ctx.bounds, ctx.concat = run_chunk, bounds, stream.concat
        ctx.has_kv = stream.k is not None  # an attention (not only a recurrent mixer): its K/V are captured again
        # a recurrent mixer's states at each chunk's start (small: no token dim), kept on the device for backward
        ctx.boundaries = stream.state.boundaries if stream.state.used_any else None
        ctx.params = params
        ctx.autocast = AutocastState.capture(hidden.device.type)
        if isinstance(offloader, SparseInputs) and ring is None:  # the next layer's input may be rebuilt from ours
            offloader.produced(outs[0], sparse_inputs.recompute(
                lambda x: _forward_passing_states(run_chunk, x, bounds, None)[0][0], ctx.autocast, params))
        ctx.out_shape = outs[0].shape  # not hidden's when per-token inputs ride along (forwards/streambp_layer.py)
        ctx.set_materialize_grads(False)  # an auxiliary output no loss used gets no backward work
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, grad_out, *grad_aux):
        hidden = load_input(ctx)
        if grad_out is None:
            grad_out = hidden.new_zeros(ctx.out_shape)
        run_chunk, bounds = ctx.run_chunk, ctx.bounds
        stream = KVStream(hidden.shape[1], concat=ctx.concat)
        stream.keeper, ctx.keeper = ctx.keeper, None  # taken once, chunk by chunk, by the replay's attention calls
        stream.state = CarriedState("capture", ctx.boundaries)
        if ctx.has_kv and len(bounds) > 1:
            # Every chunk's keys/values but the last's: no other chunk attends those, and its replay (the
            # first) computes them with grad. A one-chunk sequence needs no capture pass at all.
            stream.mode = "capture"
            with torch.no_grad(), ctx.autocast.replay(), phase("streambp.capture"):
                capture_kv(run_chunk, hidden, bounds[:-1], stream)
            stream.captured_end = bounds[-2][1]
            stream.alloc_grads()
        stream.mode = stream.state.mode = "replay"
        stream.outputs_read = False
        # gradient of the states the chunk being replayed writes, sent back by the next chunk (the next rank's
        # first chunk, for the last chunk of a segment under sequence parallelism)
        ring, device = ctx.ring, hidden.device
        firsts = {} if ring is None else segment_firsts(bounds, ring, hidden.shape[1])
        state_grads = {} if ring is None else ring.grads_from_next(device, len(ring.starts) - 1)
        grads = ChunkGrads(hidden, ctx.params, ctx.needs_input_grad, first_param=6)
        with torch.enable_grad():
            for i, (s, e) in reversed(list(enumerate(bounds))):
                if firsts.get(i + 1, 0) > 0:  # the last chunk of a segment: its states' gradient is another rank's
                    state_grads = ring.grads_from_next(device, firsts[i + 1] - 1)
                stream.start, stream.end = s, e
                stream.state.enter(i)
                h_c = grads.leaf(hidden[:, s:e])
                with ctx.autocast.replay(), phase("streambp.replay"):
                    out_c, aux_c = split_outputs(run_chunk(h_c, s, e, stream))
                if stream.dk is None and stream.k is not None:  # no capture pass ran (see above)
                    stream.alloc_grads()
                outputs, grad_outputs = [out_c], [grad_out[:, s:e]]
                with_aux_grads(outputs, grad_outputs, aux_c, grad_aux, s, e)
                for t, buf in ((stream.k_chunk, stream.dk), (stream.v_chunk, stream.dv)):
                    if t is not None and t.requires_grad:  # None: the layer reads shared K/V (read_shared)
                        outputs.append(t)
                        grad_outputs.append(buf[:, :, s:e].to(t.dtype))
                more, more_grads = stream.state.outputs_with_grads(state_grads)
                outputs += more
                grad_outputs += more_grads
                leaves = stream.prefix_leaves or ()
                state_keys = list(stream.state.leaves)
                with phase("streambp.grad"):
                    extra_grads = grads.backward(
                        outputs, grad_outputs, h_c, s, e, extra=(*leaves, *stream.state.leaves.values())
                    )
                prefix_grads, incoming_grads = extra_grads[: len(leaves)], extra_grads[len(leaves):]
                for buf, g in zip((stream.dk, stream.dv)[: len(leaves)], prefix_grads, strict=True):
                    if g is not None:  # whole-cache mode: the prefix's (or the shared keys') gradient
                        buf[:, :, : g.shape[2]] += g
                # what this chunk started from: the previous chunk wrote it, and gets this gradient for it
                state_grads = {k: g for k, g in zip(state_keys, incoming_grads, strict=True) if g is not None}
                stream.state.leave()
                stream.k_chunk = stream.v_chunk = stream.prefix_leaves = None
                if firsts.get(i, 0) > 0:  # a segment's first chunk: what it started from came from another rank
                    ring.grads_to_previous(state_grads, device, firsts[i])
                    state_grads = {}
        if ring is not None:  # the first segment's starting states came from another rank
            ring.grads_to_previous(state_grads, device, 0)
        grad_in, param_grads = grads.result()
        return (grad_in, None, None, None, None, None, *param_grads)


def streambp_apply(
    run_chunk: RunChunk,
    hidden: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    chunk_size: int,
    offloader: LayerInputOffloader | None = None,
    min_chunk: int = 1,
    ring=None,
    keep_attention_output: bool = False,
) -> torch.Tensor:
    """Run a causal layer over ``hidden`` with StreamBP.

    Args:
        run_chunk: ``run_chunk(h_c, start, end, stream)`` runs the layer on ``h_c = hidden[:, start:end]``
            and must call ``stream.write_kv(k, v)`` once with the chunk's post-RoPE keys/values
            (shape (B, Hkv, end - start, D)) and attend ``stream.prefix()`` + those keys (a stock layer
            does both through ``forwards.layer_cache.StreamCache`` and ds_longseq's attention function).
        hidden: (B, T, d_in) layer input: the hidden states, with any other per-token input of the layer
            concatenated on the last dim (``run_chunk`` splits its chunk again).
        params: every parameter the layer uses; those with ``requires_grad`` get exact gradients.
        chunk_size: tokens per chunk.
        offloader: where ``hidden`` goes until backward (host memory); None keeps it on its device.
        min_chunk: the fewest tokens a chunk may have (``chunk_size`` is raised to it, a shorter last chunk
            joins the one before): 2 for a layer with a recurrent mixer, whose 1-token steps take decode
            kernels that update a state in place.
        ring: under sequence parallelism, the group's ``ops.state_passing.StateRing`` for a recurrent layer (no
            attention): each segment of the shard (one, or two runs under Ulysses x ring; chunks never cross a
            segment's end) starts from the final states of the segment before it, received (and their gradient
            sent back) inside; every rank of the group must call this for the layer.
        keep_attention_output: keep each chunk-attention call's output and log-sum-exp from the forward, in the
            tier ``hidden`` goes to (``ops.kept_attention``), so the backward's replay runs the attention's backward
            only; False: the replay recomputes the attention forward too.

    ``run_chunk`` may instead (or also) carry recurrent states through ``stream.state``
    (``ops.carried_state``): each chunk then continues from the states the previous one wrote.

    Returns:
        (B, T, d) layer output; when ``run_chunk`` returns ``(out_c, *aux_c)``, the tuple ``(out,
        *aux)`` with each auxiliary output assembled along dim 1 and differentiable (its gradient
        joins the chunk's replay). Under grad mode the tensors saved for backward are ``hidden`` (in the
        offloader, if given), a recurrent mixer's states at each chunk's start and, with
        ``keep_attention_output``, the attention outputs (beside ``hidden``).
    """
    if ring is None:
        bounds = chunk_bounds(hidden.shape[1], chunk_size, min_chunk)
    else:
        bounds = segment_bounds(ring.local_spans(hidden.shape[1]), chunk_size, min_chunk)
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
        keeper = KeptAttention() if keep_attention_output else None
        return _StreamBPFunction.apply(hidden, run_chunk, bounds, offloader, ring, keeper, *params)
    outs, _ = _forward_passing_states(run_chunk, hidden, bounds, ring)
    return outs[0] if len(outs) == 1 else tuple(outs)


# --- sequence parallel (Ulysses) ------------------------------------------------------------------
# Under sequence parallelism the reverse-chunk trick above no longer completes dK_c before chunk c
# is replayed: keys of rank r also get gradient from every later rank's queries, in every chunk.
# So all keys become constants of the chunk loop (heads-sharded, exchanged once per pass), their
# gradient is accumulated over the loop, exchanged back once, and pushed through the layer's K/V
# projections by a second, K/V-only pass over the chunks.


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


def _global_kv(run_chunk: RunChunk, hidden: torch.Tensor, bounds, exchange) -> GlobalKVStream:
    return global_kv(run_chunk, hidden, bounds, GlobalKVStream(hidden.shape[1], exchange))


def global_kv(run_chunk: RunChunk, hidden: torch.Tensor, bounds, stream: GlobalKVStream) -> GlobalKVStream:
    """``stream`` holding the group's keys/values of the layer, heads-sharded, in "attend" mode: every chunk run up
    to its K/V (captured), then exchanged across the group (a collective: every rank calls it at once)."""
    stream.mode = "capture"
    with torch.no_grad():
        capture_kv(run_chunk, hidden, bounds, stream)
    stream.exchange_kv()
    stream.mode = "attend"
    return stream


class _StreamBPSPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, run_chunk, bounds, exchange, offloader, keeper, *params):
        with torch.no_grad(), phase("streambp.forward"):
            out = _sp_forward(run_chunk, hidden, bounds, exchange, keeper)
        ctx.keeper = _stash_kept(keeper, hidden, offloader)  # before the input: the offload tiers' load order
        save_input(ctx, hidden, offloader)
        ctx.run_chunk, ctx.bounds, ctx.exchange, ctx.params = run_chunk, bounds, exchange, params
        ctx.autocast = AutocastState.capture(hidden.device.type)
        if isinstance(offloader, SparseInputs):  # every rank drops and rebuilds the same layers' inputs
            offloader.produced(out, sparse_inputs.recompute(
                lambda x: _sp_forward(run_chunk, x, bounds, exchange), ctx.autocast, params))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden = load_input(ctx)
        run_chunk, bounds = ctx.run_chunk, ctx.bounds
        with ctx.autocast.replay(), phase("streambp.capture"):
            stream = _global_kv(run_chunk, hidden, bounds, ctx.exchange)
        stream.alloc_grads()
        stream.keeper, ctx.keeper = ctx.keeper, None  # taken chunk by chunk by pass 1's attention calls
        grads = ChunkGrads(hidden, ctx.params, ctx.needs_input_grad, first_param=6)
        # Pass 1: every chunk through the whole layer; keys are constants, their gradient goes to the sink.
        stream.outputs_read = False
        with torch.enable_grad():
            for s, e in bounds:
                stream.start, stream.end = s, e
                h_c = grads.leaf(hidden[:, s:e])
                with ctx.autocast.replay(), phase("streambp.replay"):
                    out_c = run_chunk(h_c, s, e, stream)
                with phase("streambp.grad"):
                    grads.backward([out_c], [grad_out[:, s:e]], h_c, s, e)
        dk, dv = stream.grads_to_tokens()
        # Pass 2: the chunk's K/V again (norm, projections, RoPE), now with grad, to push dK/dV through.
        stream.mode = "capture_grad"
        with torch.enable_grad():
            for s, e in bounds:
                stream.start, stream.end = s, e
                h_c = grads.leaf(hidden[:, s:e])
                try:
                    with ctx.autocast.replay(), phase("streambp.replay"):
                        run_chunk(h_c, s, e, stream)
                except KVCaptured:
                    pass
                outputs, grad_outputs = [], []
                for t, g in ((stream.k_chunk, dk), (stream.v_chunk, dv)):
                    if t is not None and t.requires_grad:
                        outputs.append(t)
                        grad_outputs.append(g[:, :, s:e].to(t.dtype))
                if outputs:
                    with phase("streambp.grad"):
                        grads.backward(outputs, grad_outputs, h_c, s, e, add=True)
                stream.k_chunk = stream.v_chunk = None
        grad_in, param_grads = grads.result()
        return (grad_in, None, None, None, None, None, *param_grads)


def streambp_sp_apply(
    run_chunk: RunChunk,
    hidden: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    chunk_size: int,
    exchange,
    offloader: LayerInputOffloader | None = None,
    keep_attention_output: bool = False,
) -> torch.Tensor:
    """:func:`streambp_apply` for a layer whose attention is sequence parallel (Ulysses).

    ``run_chunk`` gets a :class:`GlobalKVStream` instead of a :class:`KVStream`; its attention must
    attend the stream's heads-sharded K/V (``ulysses_chunk_attention``). Every rank of the group
    must call this with the same local length and ``chunk_size`` (the chunk loop runs collectives).

    Per layer and pass, K and V are exchanged once each (and their gradients once each in
    backward); queries and outputs are exchanged per chunk.

    Args:
        run_chunk: as for :func:`streambp_apply`.
        hidden: (B, T_l, d) this rank's layer input.
        params: every parameter the layer uses.
        chunk_size: tokens per chunk of the local shard.
        exchange: the group's ``UlyssesExchange``.
        offloader: where ``hidden`` goes until backward (host memory); None keeps it on its device.
        keep_attention_output: as for :func:`streambp_apply` (this rank's heads of every query of the group's chunk).

    Returns:
        (B, T_l, d) layer output; under grad mode only ``hidden`` (and with ``keep_attention_output`` the
        attention outputs) is saved for backward (in the offloader, if given).
    """
    bounds = chunk_bounds(hidden.shape[1], chunk_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
        keeper = KeptAttention() if keep_attention_output else None
        return _StreamBPSPFunction.apply(hidden, run_chunk, bounds, exchange, offloader, keeper, *params)
    with torch.no_grad():
        stream = _global_kv(run_chunk, hidden, bounds, exchange)
        return _single_output(_forward_chunks(run_chunk, hidden, bounds, stream)[0])


def _single_output(outs: list[torch.Tensor]) -> torch.Tensor:
    if len(outs) != 1:
        raise NotImplementedError(
            "streambp_sp_apply: auxiliary chunk outputs (router logits) under sequence parallelism are not supported"
        )
    return outs[0]
