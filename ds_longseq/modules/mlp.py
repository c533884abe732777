"""MsT mini-sequence forward for a decoder layer's MLP.

Holds:
    MiniSeqMLPForward: the callable installed as an MLP instance's ``forward``.
"""

from __future__ import annotations

from typing import Callable

import torch

from ds_longseq.modules.moe import RouterTap, collection_paused, record_router_logits, router_logits_requested
from ds_longseq.modules.replay import check_no_active_dropout
from ds_longseq.modules.zero3 import check_zero3_leaf
from ds_longseq.ops.mini_seq import mini_sequence_apply

__all__ = ["MiniSeqMLPForward"]


class MiniSeqMLPForward:
    """Replacement ``forward`` of one MLP instance: (B, T, d) -> (B, T, d) in ``num_chunks`` chunks.

    A mixture-of-experts block (``router_tap`` given) routes each chunk's tokens itself; its router
    logits are returned whole by the chunked Function and recorded once (see modules/moe.py).
    """

    def __init__(
        self, mlp: torch.nn.Module, orig_forward: Callable, num_chunks: int, router_tap: RouterTap | None = None
    ):
        self.mlp = mlp
        self.orig_forward = orig_forward
        self.num_chunks = num_chunks
        self.router_tap = router_tap

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs:
            raise NotImplementedError(
                f"mini_seq: {type(self.mlp).__name__} is called with arguments besides its input "
                f"({len(args)} positional, {sorted(kwargs)}), which mini_seq does not cut into chunks: this model "
                "cannot run under long_seq.mini_seq"
            )
        check_zero3_leaf(self.mlp)
        check_no_active_dropout(self.mlp, "long_seq.mini_seq")
        params = list(self.mlp.parameters())
        tap = self.router_tap

        def block(x_c: torch.Tensor) -> torch.Tensor:
            # MoE blocks and GPT-2's Conv1D .view() their input flat; a chunk of a batch > 1 is not contiguous
            out = self.orig_forward(x_c.contiguous())
            if isinstance(out, tuple):  # e.g. gpt-oss's (hidden, router scores): only the hidden is chunked
                raise NotImplementedError(
                    f"mini_seq: {type(self.mlp).__name__} returns a tuple, whose other parts mini_seq cannot "
                    "assemble from chunks: this model cannot run under long_seq.mini_seq"
                )
            return out

        if tap is None:
            return mini_sequence_apply(block, x, params, self.num_chunks)

        if not router_logits_requested():
            with collection_paused():
                return mini_sequence_apply(block, x, params, self.num_chunks)

        def fn(x_c: torch.Tensor):
            return tap.call_recording(lambda: block(x_c), x_c.shape[0], x_c.shape[1])

        with collection_paused():
            out, logits = mini_sequence_apply(fn, x, params, self.num_chunks)
        record_router_logits(logits.flatten(0, 1))
        return out
