"""Linear layers whose output values a pass never reads, left uncomputed in that pass (exact, checked per layer).

Holds:
    UnreadLinear: the forward installed on such an ``nn.Linear`` instance: the stock linear, except inside
        :meth:`UnreadLinear.skipping`, where it returns zeros (``"zeros"``: nothing reads or differentiates the
        output) or zeros carrying the linear's exact backward (``"graph"``: only its gradient is needed).
    outputs_unread: whether a layer gives the same gradients (or keys/values) with a linear skipped, run once.

Two passes of StreamBP compute values nobody reads:
- the K/V capture (and, under sequence parallelism, the K/V-only gradient pass) runs each chunk up to its cache
  update: the query projection's output only feeds the queries' RoPE, discarded when the layer stops there;
- the chunk re-forward in backward computes the layer's output only as the root of ``torch.autograd.grad``: its
  values are never read, so neither are those of the MLP's output projection, whose result reaches the layer's
  output through the residual add (no norm after it) in the families that have one. Its backward needs its
  input and weight, not its output, as torch's non-reentrant checkpoint knows (it stops recomputing once every
  tensor the backward saved is back, which skips that same projection in HF gradient checkpointing);
- the same re-forward of a chunk whose keys/values the capture pass computed: the attention takes those
  (``KVStream.own_kv``), so the key and value projections run for their gradient only ("graph"); under sequence
  parallelism the chunk loops read the exchanged K/V and send their gradient through a K/V pass, so there the
  projections' outputs are neither read nor differentiated ("zeros").
Which linear is which is the family's knowledge (``DecoderLMAdapter.query_projection`` / ``key_value_projections``
/ ``mlp_output_projection``); that skipping it changes nothing is checked on each layer's first training forward
(:func:`outputs_unread`: bitwise equal keys/values, or outputs and gradients, on its first tokens, else the layer
computes it).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ds_longseq.ops.chunk_grads import autocast_dtype

__all__ = ["UnreadLinear", "outputs_unread", "PROBE_TOKENS"]

PROBE_TOKENS = 16
"""Tokens the one-time check runs a layer on."""


class _Unevaluated(torch.autograd.Function):
    """``F.linear(x, w, b)`` with its backward, but zeros for its value (which the caller never reads). The
    backward's products are autograd's own for ``F.linear`` (input gradient ``g @ w``, weight gradient
    ``(x^T @ g)^T``, bias gradient ``g.sum(0)``, on the flattened tokens), so the gradients are bitwise the
    stock ones."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return x.new_zeros((*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = g2.mm(weight).view(*x.shape)
        if ctx.needs_input_grad[1]:
            dw = x.reshape(-1, x.shape[-1]).t().mm(g2).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.sum(0)
        return dx, dw, db


class UnreadLinear:
    """Replacement ``forward`` of one ``nn.Linear`` instance (installed undoably by the StreamBP technique)."""

    def __init__(self, module: torch.nn.Linear, orig_forward: Callable):
        self.module = module
        self.orig_forward = orig_forward
        self.mode: str | None = None  # None: the stock linear; "zeros" | "graph": see skipping()
        self.skipped = 0  # calls answered without the product (tests count them)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            return self.orig_forward(x)
        self.skipped += 1
        w, b = self.module.weight, self.module.bias
        # as F.linear sees them under autocast (ops.chunk_grads.autocast_dtype: float64 stays)
        x, w, b = (None if t is None else t.to(autocast_dtype(t)) for t in (x, w, b))
        wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b))
        if self.mode == "zeros" or not wanted:
            return x.new_zeros((*x.shape[:-1], w.shape[0]))
        return _Unevaluated.apply(x, w, b)

    @contextlib.contextmanager
    def skipping(self, mode: str):
        """Within: ``"zeros"`` (the output is neither read nor differentiated) or ``"graph"`` (only differentiated)."""
        if mode not in ("zeros", "graph"):
            raise ValueError(f"unknown mode {mode!r}")
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous


def outputs_unread(run: Callable[[bool], tuple[torch.Tensor, ...]]) -> bool:
    """Whether ``run(skip)`` gives bitwise the same tensors with ``skip`` as without: ``run`` runs a layer's pass on
    its first tokens (the caller's probe) and returns what the pass is for (captured keys/values, or gradients)."""
    reference, skipped = run(False), run(True)
    return len(reference) == len(skipped) and all(
        (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and torch.equal(a, b))
        for a, b in zip(reference, skipped, strict=True)
    )
