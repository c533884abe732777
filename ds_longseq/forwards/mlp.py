"""MsT mini-sequence forward for a decoder layer's MLP.

Holds:
    MiniSeqMLPForward: the callable installed as an MLP instance's ``forward``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch

from ds_longseq.forwards.moe import RouterTap, collection_paused, record_router_logits, router_logits_requested
from ds_longseq.forwards.replay import check_token_wise, replay_draws
from ds_longseq.forwards.zero3 import check_zero3_leaf
from ds_longseq.ops.tokenwise_chunks import mini_sequence_apply

__all__ = ["MiniSeqMLPForward"]


class MiniSeqMLPForward:
    """Replacement ``forward`` of one MLP instance: (B, T, d) -> (B, T, d) in ``num_chunks`` chunks.

    A mixture-of-experts block (``router_tap`` given) routes each chunk's tokens itself; its router
    logits are returned whole by the chunked Function and recorded once (see forwards/moe.py).
    """

    def __init__(
        self, mlp: torch.nn.Module, orig_forward: Callable, num_chunks: int, router_tap: RouterTap | None = None,
        name: str | None = None,
    ):
        """``name``: how errors name the layer holding the MLP (e.g. ``LlamaForCausalLM.model.layers[3]``)."""
        self.mlp = mlp
        self.orig_forward = orig_forward
        self.num_chunks = num_chunks
        self.router_tap = router_tap
        self.name = name or type(mlp).__name__
        # the first training forward checks that the module found as the MLP mixes no tokens
        self.token_wise_checked = False

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            raise NotImplementedError(
                f"mini_seq: {type(self.mlp).__name__} is called with arguments besides its input "
                f"({len(args)} positional, {sorted(kwargs)}), which mini_seq does not cut into chunks: this model "
                "cannot run under long_seq.mini_seq"
            )
        check_zero3_leaf(self.mlp)
        # each chunk's random draws (dropout, router noise), replayed in its recompute (forwards.replay)
        draws = replay_draws(self.mlp, x.device)
        params = list(self.mlp.parameters())
        tap = self.router_tap
        layout = _OutputLayout(type(self.mlp).__name__)
        if not self.token_wise_checked and self.mlp.training and torch.is_grad_enabled():
            self.token_wise_checked = True
            with collection_paused() if tap is not None else nullcontext():
                check_token_wise(f"{self.name}'s MLP ({type(self.mlp).__name__})",
                                 lambda h: layout.per_token(self.orig_forward(h.contiguous()), *h.shape[:2]),
                                 x, "long_seq.mini_seq")

        def block(x_c: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # A copy, contiguous: MoE blocks and GPT-2's Conv1D .view() their input flat (a chunk of a batch > 1 is
            # not contiguous), and an MLP may write into its input (Mixtral's router jitter multiplies it in place),
            # which must neither change the saved input through a chunk's view of it nor hit the recompute's leaf.
            return layout.per_token(self.orig_forward(x_c.clone(memory_format=torch.contiguous_format)),
                                    x_c.shape[0], x_c.shape[1])

        if tap is None or not router_logits_requested():
            with collection_paused() if tap is not None else nullcontext():
                parts = mini_sequence_apply(block, x, params, self.num_chunks, draws)
            if draws is not None:
                draws.advance()
            return layout.restore(parts)

        def fn(x_c: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out, logits = tap.call_recording(lambda: block(x_c), x_c.shape[0], x_c.shape[1])
            return (*out, logits)

        with collection_paused():
            *parts, logits = mini_sequence_apply(fn, x, params, self.num_chunks, draws)
        if draws is not None:
            draws.advance()
        record_router_logits(logits.flatten(0, 1))
        return layout.restore(parts)


class _OutputLayout:
    """How an MLP's output is laid out per token, so mini_seq can assemble it from chunks along dim 1.

    Every returned tensor must hold one entry per token, either as (B, C, ...) or flattened as (B * C, ...)
    (Llama 4's MoE returns its output flat; gpt-oss's and Llama 4's also return router scores or logits per
    token). Each is handed to the chunk loop as (B, C, ...) and given back in its own layout: a chunk's
    rows are the same tokens as in the whole call, so the assembled tuple is the stock one.
    """

    def __init__(self, name: str):
        self.name = name
        self.tuple: bool | None = None
        self.flat: list[bool] | None = None

    def per_token(self, out, B: int, C: int) -> tuple[torch.Tensor, ...]:
        """A chunk's output as a tuple of (B, C, ...) tensors."""
        parts = out if isinstance(out, tuple) else (out,)
        flat = []
        for i, part in enumerate(parts):
            if isinstance(part, torch.Tensor) and part.dim() >= 2 and tuple(part.shape[:2]) == (B, C):
                flat.append(False)
            elif isinstance(part, torch.Tensor) and part.dim() >= 1 and part.shape[0] == B * C:
                flat.append(True)
            else:
                tensor = isinstance(part, torch.Tensor)
                what = f"a tensor of shape {tuple(part.shape)}" if tensor else type(part).__name__
                where = f" (element {i} of its tuple)" if isinstance(out, tuple) else ""
                raise NotImplementedError(
                    f"mini_seq: {self.name} returns {what}{where} for {B} x {C} tokens, not one entry per token, which "
                    "mini_seq cannot assemble from chunks: this model cannot run under long_seq.mini_seq"
                )
        if self.flat is None:
            self.tuple, self.flat = isinstance(out, tuple), flat
        elif (self.tuple, self.flat) != (isinstance(out, tuple), flat):
            raise NotImplementedError(
                f"mini_seq: {self.name} lays its output out differently for chunks of different lengths: this model "
                "cannot run under long_seq.mini_seq"
            )
        return tuple(p.view(B, C, *p.shape[1:]) if f else p for p, f in zip(parts, flat, strict=True))

    def restore(self, parts) -> "torch.Tensor | tuple[torch.Tensor, ...]":
        """The assembled (B, T, ...) parts in the layout the MLP returns them."""
        parts = parts if isinstance(parts, (tuple, list)) else (parts,)
        out = tuple(p.flatten(0, 1) if f else p for p, f in zip(parts, self.flat, strict=True))
        return out if self.tuple else out[0]
