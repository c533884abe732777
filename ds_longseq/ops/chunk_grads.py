"""Gradient bookkeeping shared by the chunked autograd Functions (StreamBP layer, mini-sequence).

Holds:
    acc_dtype: the dtype sums over chunks are kept in.
    AutocastState: the forward's autocast settings, re-entered by the backward's replays.
    autocast_dtype: the dtype autocast gives a tensor in a lower-precision op (attention, matmul).
    ChunkGrads: writes per-chunk input-gradient slices and sums per-chunk parameter gradients, so
        the Function returns each parameter's gradient once (one hook call per parameter: what
        DeepSpeed ZeRO and DDP expect).
    split_outputs, assemble_chunks, with_aux_grads: a chunk function may return auxiliary per-token
        outputs besides its main one (a mixture-of-experts layer's router logits, which feed the
        load-balancing loss); the Functions return them whole and replay their gradients per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = [
    "acc_dtype",
    "ChunkGrads",
    "AutocastState",
    "autocast_dtype",
    "split_outputs",
    "assemble_chunks",
    "with_aux_grads",
]


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

    def backward(self, outputs, grad_outputs, x_chunk: torch.Tensor, start: int, end: int, add: bool = False,
                 extra: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor | None, ...]:
        """Differentiate one chunk's ``outputs`` and fold the result into the totals.

        ``add=True`` adds to the chunk's input-gradient slice written by an earlier call (a second
        pass over the same chunk) instead of overwriting it. ``extra``: more leaves to differentiate for
        (StreamBP's prefix in whole-cache mode); their gradients are returned (None where unused).
        """
        inputs = ([x_chunk] if self.need_input else []) + [self.params[i] for i in self.trainable] + list(extra)
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
        grads, extra_grads = grads[: len(grads) - len(extra)], grads[len(grads) - len(extra):]
        if self.need_input:
            if grads[0] is not None:
                if add:
                    self.grad_in[:, start:end] += grads[0]
                else:
                    self.grad_in[:, start:end] = grads[0]
            elif not add:
                self.grad_in[:, start:end] = 0
            grads = grads[1:]
        self._add(grads)
        return tuple(extra_grads)

    def backward_to(self, outputs, grad_outputs, leaves: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """Differentiate ``outputs`` for the parameters (added to the totals) and for ``leaves`` (returned, None
        where unused): a part of the layer run once for the whole input rather than per chunk (a head-sharded
        mixer, ``ops.head_sharding``)."""
        inputs = [self.params[i] for i in self.trainable] + list(leaves)
        grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
        self._add(grads[: len(self.trainable)])
        return tuple(grads[len(self.trainable):])

    def _add(self, grads: Sequence[torch.Tensor | None]) -> None:
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


def split_outputs(result) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A chunk function's return value -> (main output, [auxiliary outputs])."""
    if isinstance(result, tuple):
        return result[0], list(result[1:])
    return result, []


def assemble_chunks(fn: Callable, x: torch.Tensor, bounds) -> list[torch.Tensor]:
    """[out, *aux]: ``fn(x_c, s, e)`` over ``bounds``, each output concatenated along dim 1 (B, T, ...)."""
    outs = None
    for s, e in bounds:
        out_c, aux_c = split_outputs(fn(x[:, s:e], s, e))
        parts = [out_c, *aux_c]
        if outs is None:
            outs = [p.new_empty((p.shape[0], x.shape[1], *p.shape[2:])) for p in parts]
        for full, part in zip(outs, parts, strict=True):
            full[:, s:e] = part
    return outs


def with_aux_grads(outputs: list, grad_outputs: list, aux, grad_aux, s: int, e: int) -> None:
    """Append a chunk's auxiliary outputs whose totals received a gradient, with that gradient's slice."""
    for t, g in zip(aux, grad_aux, strict=True):
        if g is not None and t.requires_grad:
            outputs.append(t)
            grad_outputs.append(g[:, s:e].to(t.dtype))
