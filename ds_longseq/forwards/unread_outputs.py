"""Linear layers whose output values a pass never reads, left uncomputed in that pass (exact, checked per layer).

Holds:
    UnreadLinear: the forward installed on such an ``nn.Linear`` instance: the stock linear, except inside
        :meth:`UnreadLinear.skipping`, where it returns zeros (``"zeros"``: nothing reads or differentiates the
        output) or the stock linear run with its product left uncomputed (``"graph"``: only its gradient is
        needed; autograd's own backward, see :func:`ds_longseq.compat.products_uncomputed`).
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

Why the probe's bitwise comparison decides structure, not rounding luck: the skipped run differs from the computed
one only in the values of the skipped products. Their gradients are autograd's own in both runs (``"graph"`` runs
the stock ``F.linear`` with its products answered by zeros below autograd, so the backward makes the very same
calls on the very same operands), and everything else runs the same ops on the same inputs. So the two results
are bitwise equal exactly when nothing reads the skipped values, on every BLAS and device; a norm reading them
(OLMo 2's output norm, Qwen 3's key norm) changes the result by far more than rounding, and the layer keeps the
linear computed. (A backward written out by hand, as this module had before, rounded differently from autograd's
on some MKL code paths, so the probe turned the skips off there.)
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ds_longseq.compat import products_uncomputed
from ds_longseq.ops.chunk_grads import autocast_dtype

__all__ = ["UnreadLinear", "outputs_unread", "PROBE_TOKENS"]

PROBE_TOKENS = 16
"""Tokens the one-time check runs a layer on."""


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
        wanted = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, b))
        if self.mode == "zeros" or not wanted:
            # the dtype F.linear gives under autocast (ops.chunk_grads.autocast_dtype: float64 stays)
            return x.new_zeros((*x.shape[:-1], w.shape[0]), dtype=autocast_dtype(x))
        # The stock linear itself, its product left uncomputed: autograd records the linear's own nodes on its own
        # operands, so the gradients are autograd's, call for call, on any BLAS (a backward written out by hand
        # here, (x^T g)^T for the weight where autograd computes g^T x, rounded differently on some MKL paths).
        with products_uncomputed():
            return self.orig_forward(x)

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
