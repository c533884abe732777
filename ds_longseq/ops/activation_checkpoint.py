"""Activation checkpoint of one layer whose saved input can be offloaded to host memory.

Holds:
    checkpoint_apply: run ``fn(x)`` without keeping its activations; backward re-runs it on the saved
        input (through a :class:`LayerInputOffloader` when one is given) and returns the parameter
        gradients summed, once.

Shape legend: B batch, T sequence, d hidden.

This is what Hugging Face gradient checkpointing does for a decoder layer (MsT's recipe keeps only each
layer's input plus the chunked MLP's), with two differences: the input can live in host memory between
forward and backward, and the parameters are inputs of the Function, so each gets its gradient from one
``backward`` return (one reduction hook per parameter, as every chunk loop here) and, under ZeRO-3, the
layer is a leaf module whose weights are gathered for the recompute by the layer's own hooks.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ds_longseq.ops import sparse_inputs
from ds_longseq.ops.chunk_grads import AutocastState, ChunkGrads
from ds_longseq.ops.host_store import LayerInputOffloader, load_input, save_input
from ds_longseq.ops.sparse_inputs import SparseInputs

__all__ = ["checkpoint_apply"]


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, offloader, *params):
        device_type = x.device.type
        # The recompute must see the forward's RNG stream (dropout) and autocast state: backward runs
        # on autograd's own thread, where neither carries over.
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if device_type == "cuda" else None
        ctx.autocast = AutocastState.capture(device_type)
        with torch.no_grad():
            out = fn(x)
        save_input(ctx, x, offloader)
        ctx.fn, ctx.params = fn, params
        if isinstance(offloader, SparseInputs):  # the next layer's input may be rebuilt from ours (same RNG)
            offloader.produced(out, sparse_inputs.recompute(fn, ctx.autocast, params, rng=(ctx.cpu_rng, ctx.cuda_rng)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x = load_input(ctx)
        grads = ChunkGrads(x, ctx.params, ctx.needs_input_grad, first_param=3)
        devices = [x.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), ctx.autocast.replay():
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            x_leaf = grads.leaf(x)
            out = ctx.fn(x_leaf)
        # Outside autocast: the gradient pass must run as autograd's own backward would.
        grads.backward([out], [grad_out], x_leaf, 0, x.shape[1])
        grad_in, param_grads = grads.result()
        return (grad_in, None, None, *param_grads)


def checkpoint_apply(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Sequence[torch.nn.Parameter],
    offloader: LayerInputOffloader | None = None,
) -> torch.Tensor:
    """Run ``fn(x)`` keeping only ``x`` for backward, which re-runs ``fn`` with grad.

    Args:
        fn: the layer, with every other argument closed over; those must not require grad (their
            gradient would be lost) and must be the same objects in backward.
        x: (B, T, d) layer input.
        params: every parameter ``fn`` uses; those with ``requires_grad`` get exact gradients, summed
            and returned once.
        offloader: where ``x`` goes until backward (host memory); None keeps it saved on its device.

    Returns:
        ``fn(x)``. Under grad mode the only tensor kept for backward is ``x`` (in the offloader, if given).
    """
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        return _CheckpointFunction.apply(x, fn, offloader, *params)
    return fn(x)
