"""MsT mini-sequence forward for a decoder layer's MLP.

Holds:
    MiniSeqMLPForward: the callable installed as an MLP instance's ``forward``.
"""

from __future__ import annotations

from typing import Callable

import torch

from ds_longseq.modules.zero3 import check_zero3_leaf
from ds_longseq.ops.mini_seq import mini_sequence_apply

__all__ = ["MiniSeqMLPForward"]


class MiniSeqMLPForward:
    """Replacement ``forward`` of one MLP instance: (B, T, d) -> (B, T, d) in ``num_chunks`` chunks."""

    def __init__(self, mlp: torch.nn.Module, orig_forward: Callable, num_chunks: int):
        self.mlp = mlp
        self.orig_forward = orig_forward
        self.num_chunks = num_chunks

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        check_zero3_leaf(self.mlp)
        return mini_sequence_apply(self.orig_forward, x, list(self.mlp.parameters()), self.num_chunks)
