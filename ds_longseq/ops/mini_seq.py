"""MsT mini-sequence computation: run a token-wise module over sequence chunks, forward and backward.

Holds:
    mini_sequence_apply: an autograd Function that saves only the input and recomputes each chunk
    in backward (MsT paper Alg. 1 and App. B Alg. 3), with parameter gradients summed over chunks
    and returned once.

Shape legend: B batch, T sequence, d hidden, I intermediate.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ds_longseq.ops.chunk_grads import AutocastState, ChunkGrads

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
    def forward(ctx, x, fn, bounds, *params):
        out = None
        with torch.no_grad():
            for s, e in bounds:
                y = fn(x[:, s:e])
                if out is None:
                    out = y.new_empty((y.shape[0], x.shape[1], *y.shape[2:]))
                out[:, s:e] = y
        ctx.save_for_backward(x)
        ctx.fn, ctx.bounds, ctx.params = fn, bounds, params
        ctx.autocast = AutocastState.capture(x.device.type)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        grads = ChunkGrads(x, ctx.params, ctx.needs_input_grad, first_param=3)
        with torch.enable_grad():
            for s, e in ctx.bounds:
                x_c = grads.leaf(x[:, s:e])
                with ctx.autocast.replay():  # recompute exactly what the forward computed
                    y_c = ctx.fn(x_c)
                grads.backward(y_c, grad_out[:, s:e], x_c, s, e)
        grad_in, param_grads = grads.result()
        return (grad_in, None, None, *param_grads)


def mini_sequence_apply(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    num_chunks: int,
) -> torch.Tensor:
    """Apply a token-wise ``fn`` to ``x`` (B, T, d) in ``num_chunks`` sequence chunks.

    ``fn`` must treat tokens independently (an MLP); ``params`` are the parameters it uses.
    Returns (B, T, d_out). Only ``x`` is saved for backward.
    """
    bounds = _bounds(x.shape[1], num_chunks)
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return _MiniSeqFunction.apply(x, fn, bounds, *params)
    with torch.no_grad():
        return torch.cat([fn(x[:, s:e]) for s, e in bounds], dim=1)
