"""Linear layers whose output values a pass never reads, left uncomputed in that pass (exact, checked per layer).

Holds:
    UnreadLinear: the forward installed on such an ``nn.Linear`` instance: the stock linear, except inside
        :meth:`UnreadLinear.skipping`, where it returns zeros (``"zeros"``: nothing reads or differentiates the
        output) or the stock linear run with its product left uncomputed (``"graph"``: only its gradient is
        needed; autograd's own backward, see :func:`ds_longseq.compat.products_uncomputed`).
    outputs_unread: whether a layer gives the same gradients (or keys/values) with a linear skipped, run once.
    UnreadLinears: one StreamBP layer's such linears, its once-only probe and what each pass skips.

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
from ds_longseq.ops.chunk_grads import autocast_dtype, split_outputs
from ds_longseq.ops.draws import generators_kept
from ds_longseq.ops.kv_stream import KVStream, capture_kv

__all__ = ["UnreadLinear", "UnreadLinears", "outputs_unread", "PROBE_TOKENS"]

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
            # the dtype F.linear gives under autocast (ops.chunk_grads.autocast_dtype: float64 stays); the width is
            # out_features, not the weight's rows: a 4-bit weight (bitsandbytes) is stored packed, (n/2, 1) bytes
            width = getattr(self.module, "out_features", None) or w.shape[0]
            return x.new_zeros((*x.shape[:-1], width), dtype=autocast_dtype(x))
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


class UnreadLinears:
    """One StreamBP layer's linears whose outputs some pass never reads, and whether skipping each was found exact.

    Args:
        query_proj: the query projection as an installed :class:`UnreadLinear`, or None.
        output_proj: the MLP's output projection, or None.
        kv_projs: the key and value projections, or None.

    Each decision (:attr:`query_unread`, :attr:`output_unread`, :attr:`kv_reused`) is None until the layer's first
    training forward probes it (:meth:`probe`), False where there is no such linear (only plain attention layers are
    probed: ``UnreadLinears()`` for the others), then whether the skip was bitwise exact on that layer.
    """

    def __init__(self, query_proj: UnreadLinear | None = None, output_proj: UnreadLinear | None = None,
                 kv_projs: tuple[UnreadLinear, UnreadLinear] | None = None):
        self.query_proj, self.output_proj, self.kv_projs = query_proj, output_proj, kv_projs
        self.query_unread: bool | None = None if query_proj is not None else False
        self.output_unread: bool | None = None if output_proj is not None else False
        self.kv_reused: bool | None = None if kv_projs is not None else False

    @property
    def undecided(self) -> bool:
        return None in (self.query_unread, self.output_unread, self.kv_reused)

    def probe(self, run_chunk: Callable, params: list[torch.Tensor], x: torch.Tensor) -> None:
        """Decide once, on a forward's first tokens ``x`` (its packed layer input, (B, n, d_in)), whether the capture
        pass may leave the query projection uncomputed (the same keys/values, bitwise) and the backward's chunk
        re-forward the MLP's output projection (the same input and parameter gradients, bitwise, for a random output
        gradient), and whether the re-forward may reuse the captured keys/values. ``run_chunk``: the layer's
        ``run_chunk(x_c, s, e, stream)`` as one process would run it; ``params``: its trainable parameters. Run after
        the layer's first training forward, whose checks refuse a layer StreamBP cannot run with their own message
        first. The global random generators are left as they were (``ops.draws.generators_kept``)."""
        with generators_kept(x.device):
            self._probe(run_chunk, params, x)

    def _probe(self, run_chunk: Callable, params: list[torch.Tensor], x: torch.Tensor) -> None:
        n = x.shape[1]
        if self.query_unread is None:
            def capture(skip: bool):
                stream = KVStream(n)
                stream.mode = "capture"
                with torch.no_grad(), self.query_proj.skipping("zeros") if skip else contextlib.nullcontext():
                    capture_kv(run_chunk, x, [(0, n)], stream)
                return stream.k[:, :, :n], stream.v[:, :, :n]

            self.query_unread = outputs_unread(capture)
        if self.output_unread is None:
            def replay(skip: bool):
                # one chunk from token 0: "append" computes what a replay would, and lets a layer that attends
                # something else than it caches switch to whole-cache mode (KVStream.prefer_concat) as a forward
                with self.output_proj.skipping("graph") if skip else contextlib.nullcontext():
                    return _chunk_grads(run_chunk, x, KVStream(n), params)[1]

            self.output_unread = outputs_unread(replay)
        if self.kv_reused is None:
            self.kv_reused = outputs_unread(lambda reuse: self._replay_reusing_kv(run_chunk, params, x, reuse))

    def _replay_reusing_kv(self, run_chunk: Callable, params: list[torch.Tensor], x: torch.Tensor, reuse: bool):
        """The output, and the input and parameter gradients for random output and key/value gradients, of one
        chunk's replay after its capture, with the captured keys/values reused (the projections' values uncomputed)
        or not. Equal bitwise, the projections' values reach nothing but the attention's own keys/values (which
        sequence parallelism's chunk loops then need not compute at all: see :meth:`skipping`)."""
        n = x.shape[1]
        stream = KVStream(n)
        stream.mode = "capture"
        with torch.no_grad():
            capture_kv(run_chunk, x, [(0, n)], stream)
        stream.mode, stream.captured_end = "replay", n
        decided, self.kv_reused = self.kv_reused, reuse
        try:
            out, grads = _chunk_grads(run_chunk, x, stream, params, with_kv=True)
            return out, *grads
        finally:
            self.kv_reused = decided

    def skipping(self, stream) -> contextlib.ExitStack:
        """The linears to skip in a chunk's pass on ``stream`` (a context): the query projection in a capture pass;
        the MLP's output projection where the layer's output is only autograd's root (``outputs_read``); the key and
        value projections in the replay of a chunk whose keys/values were captured (``stream.reuse_kv``, set here),
        and under sequence parallelism in both chunk loops, where the attention reads the exchanged keys and values
        instead and their gradient goes through the K/V pass (values neither read nor differentiated)."""
        skips = contextlib.ExitStack()
        if self.query_unread and stream.mode in ("capture", "capture_grad") and \
                getattr(stream, "capture_at", "cache") == "cache":
            skips.enter_context(self.query_proj.skipping("zeros"))
        if self.output_unread and not stream.outputs_read:
            skips.enter_context(self.output_proj.skipping("graph"))
        if isinstance(stream, KVStream):
            stream.reuse_kv = (self.kv_reused is True and stream.mode == "replay" and not stream.concat
                               and stream.end <= stream.captured_end)
            if stream.reuse_kv:
                for proj in self.kv_projs:
                    skips.enter_context(proj.skipping("graph"))
        elif self.kv_reused is True and stream.mode == "attend" and stream.capture_at == "cache":
            for proj in self.kv_projs:
                skips.enter_context(proj.skipping("zeros"))
        return skips


def _chunk_grads(run_chunk, x: torch.Tensor, stream, params: list, with_kv: bool = False):
    """(output, gradients of [x, *params]) of the probes' one chunk, tokens [0, n) of ``x`` through ``run_chunk`` on
    ``stream``, for seeded random gradients of the output (and, ``with_kv``, of the chunk's keys/values). Identity
    saved-tensor hooks: what the probe saves stays out of any enclosing ones (as replay.check_token_wise)."""
    n = x.shape[1]
    stream.start, stream.end = 0, n
    leaf = x.clone().requires_grad_(True)
    gen = torch.Generator(x.device).manual_seed(0)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = split_outputs(run_chunk(leaf, 0, n, stream))[0]
        kv = (stream.k_chunk, stream.v_chunk) if with_kv else ()
        outputs = [out, *(t for t in kv if t is not None and t.requires_grad)]
        weights = [torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype) for t in outputs]
        return out.detach(), torch.autograd.grad(outputs, [leaf, *params], weights, allow_unused=True)
