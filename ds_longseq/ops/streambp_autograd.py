"""StreamBP's autograd core: one causal layer run chunk by chunk, forward and backward exact, K/V computed once.

Holds:
    streambp_apply: run a layer through StreamBP (``_StreamBPFunction``, an autograd Function that saves only the
        input, on the device or through a ``LayerInputOffloader`` in host memory).
    streambp_sp_apply: the same under Ulysses sequence parallelism (``_StreamBPSPFunction``: K/V exchanged once per
        pass, query chunks streamed, dK/dV exchanged back once; see the section below).
    chunk_bounds, segment_bounds, segment_firsts: the chunks a layer's tokens are cut into (within each segment a
        rank holds under a ring).

The keys and values the chunks write and attend are ``ops.kv_stream``'s streams (KVStream, GlobalKVStream); this
module runs the passes over the chunks.

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
from ds_longseq.ops.chunk_grads import AutocastState, ChunkGrads, assemble_chunks, split_outputs, with_aux_grads
from ds_longseq.ops.host_store import LayerInputOffloader, load_input, save_input
from ds_longseq.ops.kept_attention import KeptAttention
from ds_longseq.ops.kv_stream import GlobalKVStream, KVCaptured, KVStream, RunChunk, capture_kv, global_kv
from ds_longseq.ops.phases import phase
from ds_longseq.ops.sparse_inputs import SparseInputs

__all__ = ["streambp_apply", "streambp_sp_apply", "chunk_bounds", "segment_bounds", "segment_firsts"]


def chunk_bounds(total: int, chunk_size: int, min_chunk: int = 1) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive chunks of ``chunk_size`` (at least ``min_chunk``) covering ``total`` (last may
    be short); a last chunk shorter than ``min_chunk`` is merged into the one before it."""
    chunk_size = max(chunk_size, min_chunk)
    bounds = [(s, min(s + chunk_size, total)) for s in range(0, total, chunk_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < min_chunk:
        bounds[-2:] = [(bounds[-2][0], total)]
    return bounds


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


def _global_kv(run_chunk: RunChunk, hidden: torch.Tensor, bounds, exchange) -> GlobalKVStream:
    return global_kv(run_chunk, hidden, bounds, GlobalKVStream(hidden.shape[1], exchange))


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
