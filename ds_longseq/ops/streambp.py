"""StreamBP for one causal layer: exact chunked forward and backward with K/V computed once.

Holds:
    KVStream: the duck-typed cache a layer writes its post-RoPE K/V into, chunk by chunk.
    streambp_apply: run a layer through StreamBP (an autograd Function that saves only the input).

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

from typing import Callable, Sequence

import torch

from ds_longseq.ops.chunk_grads import ChunkGrads, acc_dtype

__all__ = ["KVStream", "streambp_apply", "chunk_bounds"]


class _KVCaptured(Exception):
    """Raised by ``KVStream.update`` in capture mode to stop the layer right after K/V exist."""


def chunk_bounds(total: int, chunk_size: int) -> list[tuple[int, int]]:
    """[(start, end)] of consecutive chunks of ``chunk_size`` covering ``total`` (last may be short)."""
    return [(s, min(s + chunk_size, total)) for s in range(0, total, chunk_size)]


class KVStream:
    """A stand-in for a transformers ``Cache`` that a decoder layer calls ``update(k, v, idx)`` on.

    Modes: ``"append"`` (forward: store the chunk's K/V at [start, end) and return them),
    ``"capture"`` (backward pass 1: store, then stop the layer), ``"replay"`` (backward pass 2:
    keep references to the chunk's recomputed K/V, which carry autograd history).

    The attention function reads :meth:`prefix` (keys before the chunk) and
    :attr:`prefix_grad_sink` (where to add their gradients) from the same object.
    """

    def __init__(self, total_len: int):
        self.total_len = total_len
        self.mode = "append"
        self.start = self.end = 0
        self.k = self.v = None  # (B, Hkv, T, D) buffers, allocated at the first update
        self.dk = self.dv = None  # gradient buffers, backward only
        self.k_chunk = self.v_chunk = None

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        if self.k is None:
            B, Hkv, _, D = key_states.shape
            shape = (B, Hkv, self.total_len, D)
            self.k = key_states.new_empty(shape)
            self.v = value_states.new_empty((B, value_states.shape[1], self.total_len, value_states.shape[-1]))
        if self.mode == "replay":
            self.k_chunk, self.v_chunk = key_states, value_states
            return key_states, value_states
        with torch.no_grad():
            self.k[:, :, self.start : self.end] = key_states
            self.v[:, :, self.start : self.end] = value_states
        if self.mode == "capture":
            raise _KVCaptured
        return key_states, value_states

    def prefix(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """(B, Hkv, start, D) keys and values before the current chunk (views of the buffers)."""
        if self.start == 0 or self.k is None:
            return None, None
        return self.k[:, :, : self.start], self.v[:, :, : self.start]

    @property
    def prefix_grad_sink(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.mode != "replay" or self.start == 0:
            return None
        return self.dk, self.dv

    def alloc_grads(self) -> None:
        self.dk = torch.zeros(self.k.shape, dtype=acc_dtype(self.k.dtype), device=self.k.device)
        self.dv = torch.zeros(self.v.shape, dtype=acc_dtype(self.v.dtype), device=self.v.device)


# run_chunk(hidden_chunk (B, C, d), start, end, stream) -> out_chunk (B, C, d)
RunChunk = Callable[[torch.Tensor, int, int, KVStream], torch.Tensor]


def _forward_chunks(run_chunk: RunChunk, hidden: torch.Tensor, bounds) -> torch.Tensor:
    stream = KVStream(hidden.shape[1])
    out = None
    for s, e in bounds:
        stream.start, stream.end = s, e
        out_c = run_chunk(hidden[:, s:e], s, e, stream)
        if out is None:
            out = out_c.new_empty((out_c.shape[0], hidden.shape[1], *out_c.shape[2:]))
        out[:, s:e] = out_c
    return out


class _StreamBPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, run_chunk, bounds, *params):
        with torch.no_grad():
            out = _forward_chunks(run_chunk, hidden, bounds)
        ctx.save_for_backward(hidden)
        ctx.run_chunk, ctx.bounds = run_chunk, bounds
        ctx.params = params
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (hidden,) = ctx.saved_tensors
        run_chunk, bounds = ctx.run_chunk, ctx.bounds
        stream = KVStream(hidden.shape[1])
        stream.mode = "capture"
        with torch.no_grad():
            for s, e in bounds:
                stream.start, stream.end = s, e
                try:
                    run_chunk(hidden[:, s:e], s, e, stream)
                except _KVCaptured:
                    continue
                raise RuntimeError("StreamBP: the layer never called past_key_values.update(); cannot capture K/V")
        stream.alloc_grads()
        stream.mode = "replay"
        grads = ChunkGrads(hidden, ctx.params, ctx.needs_input_grad, first_param=3)
        with torch.enable_grad():
            for s, e in reversed(bounds):
                stream.start, stream.end = s, e
                h_c = grads.leaf(hidden[:, s:e])
                out_c = run_chunk(h_c, s, e, stream)
                outputs, grad_outputs = [out_c], [grad_out[:, s:e]]
                for t, buf in ((stream.k_chunk, stream.dk), (stream.v_chunk, stream.dv)):
                    if t.requires_grad:
                        outputs.append(t)
                        grad_outputs.append(buf[:, :, s:e].to(t.dtype))
                grads.backward(outputs, grad_outputs, h_c, s, e)
                stream.k_chunk = stream.v_chunk = None
        grad_in, param_grads = grads.result()
        return (grad_in, None, None, *param_grads)


def streambp_apply(
    run_chunk: RunChunk,
    hidden: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    chunk_size: int,
) -> torch.Tensor:
    """Run a causal layer over ``hidden`` with StreamBP.

    Args:
        run_chunk: ``run_chunk(h_c, start, end, stream)`` runs the layer on ``h_c = hidden[:, start:end]``
            and must call ``stream.update(k, v, ...)`` once with the chunk's post-RoPE keys/values
            (shape (B, Hkv, end - start, D)) and attend ``stream.prefix()`` + those keys.
        hidden: (B, T, d) layer input.
        params: every parameter the layer uses; those with ``requires_grad`` get exact gradients.
        chunk_size: tokens per chunk.

    Returns:
        (B, T, d) layer output. Under grad mode the only tensor saved for backward is ``hidden``.
    """
    bounds = chunk_bounds(hidden.shape[1], chunk_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
        return _StreamBPFunction.apply(hidden, run_chunk, bounds, *params)
    return _forward_chunks(run_chunk, hidden, bounds)
