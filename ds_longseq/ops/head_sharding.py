"""A recurrent token mixer sharded by heads across a sequence-parallel group, and StreamBP around it.

Holds:
    gather_tokens: (B, T_l, ...) shards -> (B, P*T_l, ...) on every rank; its backward sums the ranks' gradients.
    reduce_scatter_tokens: (B, P*T_l, ...) partial sums on every rank -> this rank's (B, T_l, ...) of their sum.
    MixerStream: what a StreamBP chunk of such a layer gets as its cache: the mixer's input is captured
        chunk by chunk, its output (computed once for the whole shard) served chunk by chunk.
    streambp_mixer_sp_apply: StreamBP over a layer whose mixer is one such collective call.
    MixedStream: the stream of a layer whose attention runs beside that mixer (Falcon-H1; ``streambp_mixer_sp_apply``
        with an ``exchange``): the group's keys/values exchanged as for any attention layer.

Why: a linear-attention layer's recurrence must run over the whole sequence in order. Under sequence
parallelism rank p holds tokens [p*T_l, (p+1)*T_l); sharding the mixer by heads (each rank runs the whole
sequence's recurrence for H/P heads, ``families.mixer_heads``) keeps the ranks working at once, where
passing the state rank to rank (``ops.state_passing``) runs them in turn. The mixer's input is gathered
(every rank gets the (B, T, d) sequence) and its output, a sum over heads, reduce-scattered back to tokens;
both are DeepSpeed-Ulysses' own differentiable all-to-all (``UlyssesExchange.all_to_all``). Per layer and
rank that moves 2 x (P-1)/P x T x d elements (Ulysses' attention exchange moves its q/k/v/out widths / P).

Under StreamBP the layer runs in chunks but the mixer may not (its recurrence needs the tokens before,
held by other ranks), so, as for attention's keys/values (``streambp_sp_apply``), a capture pass runs each
chunk up to the mixer and keeps its input, the mixer runs once on the whole shard, and the chunks then
run with its output. Backward replays the chunks with the output as a constant, sums its gradient, runs the
mixer's backward once, and pushes its input gradient through each chunk's part before the mixer. Kept
from forward to backward: the layer input only.

Shape legend: B batch, P ranks, T_l tokens per rank, T = P * T_l, d hidden size.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ds_longseq.ops.chunk_grads import AutocastState, ChunkGrads
from ds_longseq.ops.host_store import LayerInputOffloader, load_input, save_input
from ds_longseq.ops.kv_stream import GlobalKVStream, KVCaptured, global_kv
from ds_longseq.ops.streambp_autograd import chunk_bounds
from ds_longseq.ops.ulysses import UlyssesExchange

__all__ = ["gather_tokens", "reduce_scatter_tokens", "MixerStream", "streambp_mixer_sp_apply", "MixedStream"]

def gather_tokens(x: torch.Tensor, exchange: UlyssesExchange) -> torch.Tensor:
    """(B, T_l, ...) this rank's tokens -> (B, P*T_l, ...) every rank's of the group, in rank order.
    Differentiable: the gradient of this rank's tokens is the sum of every rank's gradient for them."""
    received = exchange.all_to_all(x.unsqueeze(0).expand(exchange.world_size, *x.shape))  # (P, B, T_l, ...)
    return received.transpose(0, 1).flatten(1, 2)


def reduce_scatter_tokens(y: torch.Tensor, exchange: UlyssesExchange) -> torch.Tensor:
    """(B, P*T_l, ...) a partial sum on each rank -> (B, T_l, ...) this rank's tokens of the sum over ranks
    (added in rank order, the same on every rank). Differentiable: the adjoint of :func:`gather_tokens`."""
    size = exchange.world_size
    blocks = y.unflatten(1, (size, y.shape[1] // size)).transpose(0, 1)  # token block r goes to rank r
    return exchange.all_to_all(blocks).sum(0)


class _MixerReached(Exception):
    """Raised by the mixer in a capture pass: the rest of the layer is not needed."""


class MixerStream:
    """The cache a StreamBP chunk of a head-sharded mixer layer runs with (``forwards.head_sharding_forward`` calls
    :meth:`mixer_call` in place of the mixer).

    Modes: "capture" keeps the chunk's mixer input (no grad) and stops the layer there; "apply" returns the
    chunk's rows of :attr:`output` (a leaf under grad, whose gradient the replay collects); "capture_grad"
    keeps the chunk's mixer input with its graph and stops the layer.
    """

    def __init__(self, local_len: int):
        self.local_len = local_len
        self.mode = "capture"
        self.start = self.end = 0
        self.inputs: torch.Tensor | None = None  # (B, T_l, d) the mixer's input, from the capture pass
        self.output: torch.Tensor | None = None  # (B, T_l, d) its output, from the whole-shard call
        self.leaf: torch.Tensor | None = None  # the served output chunk (apply under grad)
        self.input_chunk: torch.Tensor | None = None  # the captured input chunk (capture_grad)
        self.calls = 0

    def begin_chunk(self) -> None:
        self.calls = 0

    def mixer_call(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the mixer returns on this chunk's (B, C, d) input (see the modes)."""
        return _mixer_call(self, self.mode, hidden_states, leaf=self.mode == "apply")


def _mixer_call(stream, mode: str, hidden_states: torch.Tensor, leaf: bool) -> torch.Tensor:
    """A stream's answer to the mixer's call on a chunk's (B, C, d) input in ``mode``: "capture" stores it (no grad)
    and "capture_grad" keeps it with its graph, both stopping the layer (``_MixerReached``); otherwise the chunk's
    rows of ``stream.output``, as a leaf under grad (``stream.leaf``) where ``leaf``, after keeping the input with
    its graph in "keep_input"."""
    stream.calls += 1
    s, e = stream.start, stream.end
    if hidden_states.shape[1] != e - s:
        raise RuntimeError(f"the mixer got {hidden_states.shape[1]} tokens on chunk [{s}, {e})")
    if mode == "capture":
        if stream.inputs is None:
            B, _, d = hidden_states.shape
            stream.inputs = hidden_states.new_empty(B, stream.local_len, d)
        stream.inputs[:, s:e] = hidden_states.detach()
        raise _MixerReached
    if mode in ("capture_grad", "keep_input"):
        stream.input_chunk = hidden_states
        if mode == "capture_grad":
            raise _MixerReached
    out = stream.output[:, s:e]
    if leaf and torch.is_grad_enabled():
        out = out.detach().requires_grad_(True)
        stream.leaf = out
    return out


def _not_reached(s: int, e: int) -> RuntimeError:
    return RuntimeError(
        f"StreamBP: on tokens [{s}, {e}) the layer never called its head-sharded mixer, so the mixer's input "
        "cannot be captured: set long_seq.sequence_parallel.recurrent='pass_state'"
    )


def _run_mixer(run_chunk, hidden: torch.Tensor, bounds, mixer: Callable, stream) -> None:
    """``stream.output``: the mixer's output for the whole shard (no grad), from its input captured chunk by chunk
    (``stream`` in a capture mode: each chunk runs up to the mixer)."""
    with torch.no_grad():
        for s, e in bounds:
            stream.start, stream.end = s, e
            try:
                run_chunk(hidden[:, s:e], s, e, stream)
            except _MixerReached:
                continue
            raise _not_reached(s, e)
        stream.output = mixer(stream.inputs)


def _capture(run_chunk, hidden: torch.Tensor, bounds, mixer: Callable, exchange=None) -> MixerStream | MixedStream:
    """A stream holding the mixer's output for the whole shard (no grad), in "apply" mode; with ``exchange`` (an
    attention beside the mixer) a :class:`MixedStream` that then also captured and exchanged the group's keys/values,
    in "serve" and "attend" modes."""
    if exchange is None:
        stream = MixerStream(hidden.shape[1])
        _run_mixer(run_chunk, hidden, bounds, mixer, stream)
        stream.mode = "apply"
        return stream
    stream = MixedStream(hidden.shape[1], exchange)
    _run_mixer(run_chunk, hidden, bounds, mixer, stream)
    stream.mixer_mode = "serve"
    return global_kv(run_chunk, hidden, bounds, stream)


def _forward(run_chunk, hidden: torch.Tensor, bounds, mixer: Callable, exchange=None) -> torch.Tensor:
    """The layer's output under no grad: the captures (:func:`_capture`), then every chunk run whole."""
    stream = _capture(run_chunk, hidden, bounds, mixer, exchange)
    outs = []
    with torch.no_grad():
        for s, e in bounds:
            stream.start, stream.end = s, e
            out = run_chunk(hidden[:, s:e], s, e, stream)
            if isinstance(out, tuple):
                raise NotImplementedError("streambp_mixer_sp_apply: auxiliary chunk outputs (router logits) under "
                                          "sequence parallelism are not supported")
            outs.append(out)
    return torch.cat(outs, dim=1)


class _MixerSPFunction(torch.autograd.Function):
    """StreamBP around a head-sharded mixer; with an ``exchange``, also an attention beside it (MixedStream)."""

    @staticmethod
    def forward(ctx, hidden, run_chunk, bounds, mixer, exchange, offloader, *params):
        out = _forward(run_chunk, hidden, bounds, mixer, exchange)
        save_input(ctx, hidden, offloader)
        ctx.run_chunk, ctx.bounds, ctx.mixer, ctx.exchange, ctx.params = run_chunk, bounds, mixer, exchange, params
        ctx.autocast = AutocastState.capture(hidden.device.type)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden = load_input(ctx)
        mixed = ctx.exchange is not None
        with ctx.autocast.replay():
            stream = _capture(ctx.run_chunk, hidden, ctx.bounds, ctx.mixer, ctx.exchange)
        if mixed:  # the keys'/values' gradients gather in the stream's sinks during pass 1
            stream.alloc_grads()
            stream.outputs_read = False
        grads = ChunkGrads(hidden, ctx.params, ctx.needs_input_grad, first_param=6)
        grad_inputs = _replay_then_mixer(ctx, hidden, stream, grads, grad_out)

        def mixer_input(s: int, e: int) -> tuple:
            return stream.input_chunk, None if grad_inputs is None else grad_inputs[:, s:e]

        if not mixed:  # pass 2: each chunk up to the mixer, its input gradient pushed through the part before
            stream.mode = "capture_grad"
            _push_through_chunks(ctx, hidden, stream, grads, _MixerReached, lambda s, e: [mixer_input(s, e)])
        else:  # pass 2: each chunk up to its K/V, keeping the mixer's input on the way; both gradients pushed
            dk, dv = stream.grads_to_tokens()
            stream.mode, stream.mixer_mode = "capture_grad", "keep_input"
            _push_through_chunks(ctx, hidden, stream, grads, KVCaptured, lambda s, e: [
                mixer_input(s, e), (stream.k_chunk, dk[:, :, s:e]), (stream.v_chunk, dv[:, :, s:e])])
        grad_in, param_grads = grads.result()
        return (grad_in, None, None, None, None, None, *param_grads)


def _replay_then_mixer(ctx, hidden: torch.Tensor, stream, grads: ChunkGrads, grad_out: torch.Tensor):
    """The backward's first half for a layer with a head-sharded mixer: pass 1 runs every chunk through the whole
    layer with the mixer's output served as a constant (``stream.leaf``) whose gradient is kept; then the mixer runs
    once with grad (its collectives on every rank at once) for its parameters' gradients and its input's, which it
    returns ((B, T_l, d) or None) for pass 2 to push through each chunk's part of the layer before the mixer."""
    grad_mixer_out = torch.zeros_like(stream.output)
    with torch.enable_grad():
        for s, e in ctx.bounds:
            stream.start, stream.end, stream.leaf = s, e, None
            h_c = grads.leaf(hidden[:, s:e])
            with ctx.autocast.replay():
                out_c = ctx.run_chunk(h_c, s, e, stream)
            if stream.leaf is None:
                raise _not_reached(s, e)
            (leaf_grad,) = grads.backward([out_c], [grad_out[:, s:e]], h_c, s, e, extra=[stream.leaf])
            if leaf_grad is not None:
                grad_mixer_out[:, s:e] = leaf_grad
    inputs = stream.inputs.detach().requires_grad_(True)
    with torch.enable_grad():
        with ctx.autocast.replay():
            mixer_out = ctx.mixer(inputs)
        (grad_inputs,) = grads.backward_to([mixer_out], [grad_mixer_out.to(mixer_out.dtype)], [inputs])
    return grad_inputs


def _push_through_chunks(ctx, hidden: torch.Tensor, stream, grads: ChunkGrads, stop: type[Exception],
                         pushed: Callable[[int, int], list]) -> None:
    """The backward's pass 2: each chunk run with grad up to where ``stream`` stops it (``stop`` raised: at the
    mixer, or at the keys/values after it), then the gradients ``pushed(s, e)`` pairs with the tensors kept on the
    way ([(tensor, its gradient for tokens [s, e))]; either may be None) pushed through the chunk's part of the layer
    before them, into the input's and the parameters' totals."""
    with torch.enable_grad():
        for s, e in ctx.bounds:
            stream.start, stream.end, stream.input_chunk = s, e, None
            h_c = grads.leaf(hidden[:, s:e])
            try:
                with ctx.autocast.replay():
                    ctx.run_chunk(h_c, s, e, stream)
            except stop:
                pass
            else:
                raise _not_reached(s, e)
            pairs = [(t, g) for t, g in pushed(s, e) if t is not None and g is not None and t.requires_grad]
            if pairs:
                grads.backward([t for t, _ in pairs], [g.to(t.dtype) for t, g in pairs], h_c, s, e, add=True)
            stream.input_chunk = None
            if hasattr(stream, "k_chunk"):
                stream.k_chunk = stream.v_chunk = None


def streambp_mixer_sp_apply(
    run_chunk: Callable,
    hidden: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    chunk_size: int,
    mixer: Callable[[torch.Tensor], torch.Tensor],
    offloader: LayerInputOffloader | None = None,
    exchange=None,
) -> torch.Tensor:
    """StreamBP over a decoder layer whose token mixer runs head-sharded over the sequence-parallel group.

    With ``exchange``, the layer calls that mixer and then an attention on the same chunk (Falcon-H1): the mixer runs
    once per pass as without it, and the attention's keys/values are exchanged once per pass (as
    ``ops.streambp_autograd.streambp_sp_apply``). Forward: capture the mixer's input (each chunk up to the mixer), run
    the mixer, capture the K/V (each chunk up to them, the mixer's output served), exchange them, run the chunks.
    Backward: the same captures again; pass 1 replays each chunk whole with both as constants, keeping their
    gradients; the mixer's backward once; pass 2 runs each chunk up to its K/V with grad, keeping the mixer's input
    on the way, and pushes the mixer's input gradient and dK / dV through together.

    Args:
        run_chunk: ``run_chunk(h_c, s, e, stream)`` runs the layer on tokens [s, e) with ``stream`` (a
            :class:`MixerStream`, with ``exchange`` a :class:`MixedStream`) as its cache; the layer's mixer must call
            ``stream.mixer_call`` once.
        hidden: (B, T_l, d) this rank's layer input.
        params: every parameter the layer uses (the mixer's included).
        chunk_size: tokens per chunk of the local shard.
        mixer: (B, T_l, d) the mixer's input on this rank -> (B, T_l, d) its output, a collective call every
            rank of the group makes at once (``forwards.head_sharding_forward.HeadShardedMixerForward.sharded``).
        offloader: where ``hidden`` goes until backward (host memory); None keeps it on its device.
        exchange: the group's ``UlyssesExchange`` for the keys/values of an attention beside the mixer; None: none.

    Returns:
        (B, T_l, d) the layer output; under grad mode only ``hidden`` is saved for backward.
    """
    bounds = chunk_bounds(hidden.shape[1], chunk_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
        return _MixerSPFunction.apply(hidden, run_chunk, bounds, mixer, exchange, offloader, *params)
    return _forward(run_chunk, hidden, bounds, mixer, exchange)


# --- attention beside the head-sharded mixer (Falcon-H1) ----------------------------------------------------------


class MixedStream(GlobalKVStream):
    """The stream of a layer that calls its head-sharded mixer and then its attention on the same chunk (Falcon-H1):
    the attention's keys/values as :class:`~ds_longseq.ops.kv_stream.GlobalKVStream` (its modes), the mixer's as
    :class:`MixerStream` (:meth:`mixer_call`, its own :attr:`mixer_mode`).

    Mixer modes: "capture" and "capture_grad" as :class:`MixerStream`'s (the layer stops at the mixer); "serve"
    returns the chunk's rows of :attr:`output` (a leaf under grad, :attr:`leaf`) and lets the layer go on to its
    attention; "keep_input" keeps the chunk's mixer input with its graph (:attr:`input_chunk`) and serves the output
    as a constant (the K/V capture after it stops the layer).
    """

    def __init__(self, local_len: int, exchange):
        super().__init__(local_len, exchange)
        self.mixer_mode = "capture"
        self.inputs: torch.Tensor | None = None  # (B, T_l, d) the mixer's input
        self.output: torch.Tensor | None = None  # (B, T_l, d) its output, from the whole-shard call
        self.leaf: torch.Tensor | None = None
        self.input_chunk: torch.Tensor | None = None
        self.calls = 0

    def begin_chunk(self) -> None:
        super().begin_chunk()
        self.calls = 0

    def mixer_call(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the mixer returns on this chunk's (B, C, d) input (see the modes)."""
        if self.updates:
            raise NotImplementedError(
                "StreamBP under sequence parallelism: this layer writes its keys/values before calling its "
                "head-sharded mixer; ds_longseq runs a layer with both only when the mixer comes first (Falcon-H1)"
            )
        return _mixer_call(self, self.mixer_mode, hidden_states, leaf=self.mixer_mode == "serve")
