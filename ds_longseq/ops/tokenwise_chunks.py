"""MsT mini-sequence computation: run a token-wise module over sequence chunks, forward and backward.

Holds:
    mini_sequence_apply: an autograd Function that saves only the input and recomputes each chunk
    in backward (MsT paper Alg. 1 and App. B Alg. 3), with parameter gradients summed over chunks
    and returned once; a chunk's random draws (dropout) replayed in its recompute (``ops.draws``).

Shape legend: B batch, T sequence, d hidden, I intermediate.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from ds_longseq.ops.chunk_grads import AutocastState, ChunkGrads, assemble_chunks, split_outputs, with_aux_grads
from ds_longseq.ops.draws import Draws

__all__ = ["mini_sequence_apply"]


def _bounds(total: int, num_chunks: int) -> list[tuple[int, int]]:
    # Same split as torch.tensor_split: sizes differ by at most one, no token is dropped, and
    # empty chunks (T < num_chunks) are skipped.
    base, extra = divmod(total, num_chunks)
    bounds, s = [], 0
    for i in range(num_chunks):
        e = s + base + (1 if i < extra else 0)
        if e > s:
            bounds.append((s, e))
        s = e
    return bounds


class _MiniSeqFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, bounds, draws, *params):
        with torch.no_grad():
            outs = assemble_chunks(lambda x_c, s, e: _run(fn, x_c, draws, s), x, bounds)
        ctx.save_for_backward(x)
        ctx.fn, ctx.bounds, ctx.draws, ctx.params = fn, bounds, draws, params
        ctx.autocast = AutocastState.capture(x.device.type)
        ctx.set_materialize_grads(False)  # an auxiliary output no loss used gets no backward work
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx, grad_out, *grad_aux):
        (x,) = ctx.saved_tensors
        grads = ChunkGrads(x, ctx.params, ctx.needs_input_grad, first_param=4)
        with torch.enable_grad():
            for s, e in ctx.bounds:
                x_c = grads.leaf(x[:, s:e])
                with ctx.autocast.replay():  # recompute exactly what the forward computed, with its draws
                    y_c, aux_c = split_outputs(_run(ctx.fn, x_c, ctx.draws, s))
                outputs, grad_outputs = [], []
                if grad_out is not None:
                    outputs, grad_outputs = [y_c], [grad_out[:, s:e]]
                with_aux_grads(outputs, grad_outputs, aux_c, grad_aux, s, e)
                if outputs:
                    grads.backward(outputs, grad_outputs, x_c, s, e)
                elif grads.need_input:
                    grads.grad_in[:, s:e] = 0
        grad_in, param_grads = grads.result()
        return (grad_in, None, None, None, *param_grads)


def _run(fn, x_c: torch.Tensor, draws: Draws | None, s: int):
    """``fn(x_c)`` for the chunk starting at token ``s``, in its own region of ``draws`` when given."""
    with draws.region(s) if draws is not None else contextlib.nullcontext():
        return fn(x_c)


def mini_sequence_apply(
    fn: Callable[[torch.Tensor], "torch.Tensor | tuple[torch.Tensor, ...]"],
    x: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    num_chunks: int,
    draws: Draws | None = None,
) -> "torch.Tensor | tuple[torch.Tensor, ...]":
    """Apply a token-wise ``fn`` to ``x`` (B, T, d) in ``num_chunks`` sequence chunks.

    ``fn`` must treat tokens independently (an MLP); ``params`` are the parameters it uses.
    Returns (B, T, d_out); when ``fn`` returns ``(y_c, *aux_c)`` (auxiliary per-token outputs such
    as router logits, (B, C, ...)), the tuple ``(y, *aux)`` assembled along dim 1, all
    differentiable. Only ``x`` is saved for backward. ``draws``: where the random draws ``fn`` makes (dropout)
    come from, each chunk from its own region, so the backward's recompute draws what the forward drew
    (``ops.draws``); None: the global generators as they are (nothing random in ``fn``).
    """
    bounds = _bounds(x.shape[1], num_chunks)
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return _MiniSeqFunction.apply(x, fn, bounds, draws, *params)
    with torch.no_grad():  # with the draws a recompute of this call replays (a checkpointed layer's forward)
        outs = assemble_chunks(lambda x_c, s, e: _run(fn, x_c, draws, s), x, bounds)
    return outs[0] if len(outs) == 1 else tuple(outs)
