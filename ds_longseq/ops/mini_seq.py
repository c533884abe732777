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
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        fn, bounds, params = ctx.fn, ctx.bounds, ctx.params
        need_input = ctx.needs_input_grad[0]
        trainable = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        grad_in = torch.empty_like(x) if need_input else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        with torch.enable_grad():
            for s, e in bounds:
                x_c = x[:, s:e].detach().requires_grad_(need_input)
                y = fn(x_c)
                inputs = ([x_c] if need_input else []) + [params[i] for i in trainable]
                grads = torch.autograd.grad(y, inputs, grad_out[:, s:e], allow_unused=True)
                if need_input:
                    grad_in[:, s:e] = grads[0]
                    grads = grads[1:]
                for i, g in zip(trainable, grads):
                    if g is None:
                        continue
                    if sums[i] is None:
                        # float32 sums for half-precision grads, rounded once at the end
                        sums[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                    else:
                        sums[i] += g
        return (grad_in, None, None, *[None if g is None else g.to(p.dtype) for g, p in zip(sums, params)])


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
