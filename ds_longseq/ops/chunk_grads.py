"""Gradient bookkeeping shared by the chunked autograd Functions (StreamBP layer, mini-sequence).

Holds:
    acc_dtype: the dtype sums over chunks are kept in.
    AutocastState: the forward's autocast settings, re-entered by the backward's replays.
    autocast_dtype: the dtype autocast gives a tensor in a lower-precision op (attention, matmul).
    ChunkGrads: writes per-chunk input-gradient slices and sums per-chunk parameter gradients, so
        the Function returns each parameter's gradient once (one hook call per parameter: what
        DeepSpeed ZeRO and DDP expect).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["acc_dtype", "ChunkGrads", "AutocastState", "autocast_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Sums over chunks of half-precision gradients are kept in float32 and rounded once."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def autocast_dtype(t: torch.Tensor) -> torch.dtype:
    """``t``'s dtype after autocast's lower-precision cast (attention, matmuls): the autocast dtype
    when autocast is on for ``t``'s device and ``t`` is a non-float64 float, else ``t.dtype``."""
    device_type = t.device.type
    if t.is_floating_point() and t.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings in force when a chunked Function ran forward.

    Its backward re-forwards chunks; like ``torch.utils.checkpoint``, the re-forward must run under
    the same settings, or it would recompute a different (float32) function than the forward did.
    Only the re-forward runs under them: the gradients are taken outside, as for any forward.
    """

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> "AutocastState":
        """The current settings for ``device_type`` ("cpu", "cuda", ...)."""
        return cls(
            device_type,
            torch.is_autocast_enabled(device_type),
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled(),
        )

    def replay(self) -> torch.autocast:
        """A context manager that re-enters these settings."""
        return torch.autocast(
            self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=self.cache_enabled
        )


class ChunkGrads:
    """Accumulator for one backward of a Function whose inputs are ``(x, <non-tensors>..., *params)``.

    Args:
        x: the (B, T, ...) input whose gradient is assembled chunk by chunk along dim 1.
        params: the parameters passed to the Function after its non-tensor arguments.
        needs_input_grad: ``ctx.needs_input_grad``.
        first_param: index of the first parameter in the Function's inputs.
    """

    def __init__(self, x: torch.Tensor, params: Sequence[torch.Tensor], needs_input_grad, first_param: int):
        self.need_input = needs_input_grad[0]
        self.params = params
        self.trainable = [i for i, _ in enumerate(params) if needs_input_grad[first_param + i]]
        self.grad_in = torch.empty_like(x) if self.need_input else None
        self.sums: list[torch.Tensor | None] = [None] * len(params)

    def leaf(self, x_chunk: torch.Tensor) -> torch.Tensor:
        """A detached view of an input chunk that requires grad when the input does."""
        return x_chunk.detach().requires_grad_(self.need_input)

    def backward(self, outputs, grad_outputs, x_chunk: torch.Tensor, start: int, end: int, add: bool = False) -> None:
        """Differentiate one chunk's ``outputs`` and fold the result into the totals.

        ``add=True`` adds to the chunk's input-gradient slice written by an earlier call (a second
        pass over the same chunk) instead of overwriting it.
        """
        inputs = ([x_chunk] if self.need_input else []) + [self.params[i] for i in self.trainable]
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
        if self.need_input:
            if grads[0] is not None:
                if add:
                    self.grad_in[:, start:end] += grads[0]
                else:
                    self.grad_in[:, start:end] = grads[0]
            elif not add:
                self.grad_in[:, start:end] = 0
            grads = grads[1:]
        for i, g in zip(self.trainable, grads, strict=True):
            if g is None:
                continue
            if self.sums[i] is None:
                self.sums[i] = g.to(acc_dtype(g.dtype))
            else:
                self.sums[i] += g

    def result(self) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """(input gradient, parameter gradients in their parameters' dtypes)."""
        return self.grad_in, [None if g is None else g.to(p.dtype) for g, p in zip(self.sums, self.params, strict=True)]
