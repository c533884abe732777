"""Approx-BP activations and memory-sharing norms (Approx-BP paper, Secs. 4.2 and 5, Apps. E and G).

Holds:
    StepDerivative, RESILU2, REGELU2: the 4-segment step derivative that replaces SiLU's / GELU's in
        backward (the derivative of the paper's fitted 3-ReLU combination, Eqn. (13)), with the
        paper's constants (App. E).
    step_codes, pack_codes, unpack_codes, step_backward: the 2-bit state (one segment index per
        element, four per byte) and the backward it feeds; a pure-PyTorch path (CPU and fallback) and
        a Triton path on CUDA (``ops/approx_triton.py``) that computes the same bits.
    approx_activation: forward = the stock activation (bit-identical output), saved state = 2 bits per
        element, backward = the step derivative.
    ms_rms_norm, ms_layer_norm: normalisation without affine weight whose backward needs only its own
        output (which the consuming linear layers save anyway: one shared tensor) and one scalar per
        token (Algs. 2-3): no input tensor is saved.

Shape legend: N elements (any shape, flattened), d normalised (last) dimension.

Exactness: ``approx_activation``'s forward equals the stock activation bit for bit, and its backward
equals the step derivative exactly (it is *not* SiLU's / GELU's derivative: that is the approximation
the paper trains with). ``ms_rms_norm`` / ``ms_layer_norm`` are exact: their backward is the
analytic gradient of the normalisation, evaluated from the output instead of the input; in half
precision the output is rounded, so the gradient carries that rounding (float64: 1e-15).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ds_longseq.ops.chunk_grads import acc_dtype

__all__ = [
    "StepDerivative",
    "RESILU2",
    "REGELU2",
    "APPROX_ACTIVATIONS",
    "step_codes",
    "pack_codes",
    "unpack_codes",
    "step_backward",
    "packed_numel",
    "approx_activation",
    "ms_rms_norm",
    "ms_layer_norm",
]


@dataclass(frozen=True)
class StepDerivative:
    """The derivative of ``h~(x) = a1 relu(x-c1) + a2 relu(x-c2) + (1-a1-a2) relu(x-c3)`` (paper Eqn. (41)).

    A 4-segment step function: 0 below c1, a1 on (c1, c2], a1 + a2 on (c2, c3], 1 above c3. At a
    threshold the lower segment is taken (``x > c``), as autograd's ReLU derivative is 0 at 0.
    """

    name: str
    """Config name (``"resilu2"``, ``"regelu2"``)."""
    stock: str
    """The activation whose forward it keeps (``"silu"``, ``"gelu"``)."""
    weights: tuple[float, float]
    """(a1, a2): weights of the first two ReLUs; the third's is 1 - a1 - a2."""
    thresholds: tuple[float, float, float]
    """(c1, c2, c3), increasing: the ReLUs' biases, where the derivative steps."""

    @property
    def slopes(self) -> tuple[float, float, float, float]:
        """The derivative on each of the four segments, indexed by the 2-bit code."""
        a1, a2 = self.weights
        return (0.0, a1, a1 + a2, 1.0)

    def primitive(self, x: torch.Tensor) -> torch.Tensor:
        """``h~(x)``, the 3-ReLU combination itself (a reference: autograd of it is the step derivative)."""
        a1, a2 = self.weights
        c1, c2, c3 = self.thresholds
        return a1 * torch.relu(x - c1) + a2 * torch.relu(x - c2) + (1.0 - a1 - a2) * torch.relu(x - c3)


# App. E.2: simulated-annealing solution for SiLU.
RESILU2 = StepDerivative(
    "resilu2",
    "silu",
    weights=(-0.04060357190528599, 1.080925428529668),
    thresholds=(-6.3050461001646445, -0.0008684942046214787, 6.325815242089708),
)
# App. E.1: simulated-annealing solution for GELU (fitted to the erf form; the tanh forms differ from it
# by under 1e-3, far below the derivative's own approximation).
REGELU2 = StepDerivative(
    "regelu2",
    "gelu",
    weights=(-0.04922261145617846, 1.0979632065417297),
    thresholds=(-3.1858810036855245, -0.001178821281161997, 3.190832613414926),
)
APPROX_ACTIVATIONS: dict[str, StepDerivative] = {s.name: s for s in (RESILU2, REGELU2)}
"""Every step derivative by config name."""


def packed_numel(numel: int) -> int:
    """Bytes holding ``numel`` 2-bit codes, four per byte."""
    return (numel + 3) // 4


def step_codes(x: torch.Tensor, step: StepDerivative) -> torch.Tensor:
    """The segment index of every element of ``x``: (N,) uint8 in {0, 1, 2, 3}, flattened.

    Compared in ``x``'s own dtype against the thresholds rounded to it, as the Triton kernel does.
    """
    flat = x.reshape(-1)
    c1, c2, c3 = step.thresholds
    codes = (flat > c1).to(torch.uint8)
    codes += flat > c2
    codes += flat > c3
    return codes


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """(N,) uint8 codes in {0..3} -> (ceil(N / 4),) uint8, element 4i + j in bits 2j..2j+1 of byte i."""
    n = codes.numel()
    padded = torch.zeros(packed_numel(n) * 4, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    quads = padded.view(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


def unpack_codes(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: (ceil(N / 4),) uint8 -> (N,) uint8 codes."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 3).reshape(-1)[:numel]


def step_backward(packed: torch.Tensor, grad_out: torch.Tensor, step: StepDerivative) -> torch.Tensor:
    """``grad_out * step'(x)`` from the packed codes of ``x``: same shape and dtype as ``grad_out``."""
    codes = unpack_codes(packed, grad_out.numel())
    # half-precision gradients are multiplied in float32 and rounded once (what the Triton kernel does)
    table = torch.tensor(step.slopes, dtype=acc_dtype(grad_out.dtype), device=grad_out.device)
    grad = grad_out.reshape(-1).to(table.dtype) * table[codes.long()]
    return grad.to(grad_out.dtype).view(grad_out.shape)


def _triton_ready(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    from ds_longseq.ops import approx_triton

    return approx_triton.available()


class _ApproxActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, act, step):
        with torch.no_grad():
            y = act(x)
        if _triton_ready(x):
            from ds_longseq.ops import approx_triton

            packed = approx_triton.pack_step_codes(x, step)
        else:
            packed = pack_codes(step_codes(x, step))
        ctx.save_for_backward(packed)
        ctx.step = step
        return y

    @staticmethod
    def backward(ctx, grad_out):
        (packed,) = ctx.saved_tensors
        if _triton_ready(grad_out):
            from ds_longseq.ops import approx_triton

            return approx_triton.step_backward(packed, grad_out, ctx.step), None, None
        return step_backward(packed, grad_out.contiguous(), ctx.step), None, None


def approx_activation(
    x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor], step: StepDerivative
) -> torch.Tensor:
    """``act(x)`` in forward, ``step``'s derivative in backward; saves ``ceil(numel / 4)`` bytes.

    Args:
        x: the activation's input, any shape and float dtype.
        act: the stock activation (``nn.functional.silu``, a transformers activation module's
            original forward...): its output is returned unchanged.
        step: :data:`RESILU2` for SiLU, :data:`REGELU2` for GELU (either form).

    Without grad (or for an input that needs none) this is ``act(x)`` and saves nothing.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return act(x)
    return _ApproxActivation.apply(x, act, step)


def _rms_normalise(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The same operations as transformers' Llama-style RMSNorm without its weight, so the output is
    # bit-identical to the stock norm with weight 1 (for half and float32 inputs). float64 stays float64
    # (transformers' RMSNorms drop it to float32; MS norms keep it).
    h = x.to(acc_dtype(x.dtype))
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * rstd).to(x.dtype), rstd


class _MSRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        z, rstd = _rms_normalise(x, eps)
        ctx.save_for_backward(z, rstd)  # z is the output: the consuming linear layers save the same tensor
        return z

    @staticmethod
    def backward(ctx, grad_z):
        z, rstd = ctx.saved_tensors
        g = grad_z.to(rstd.dtype)
        zc = z.to(rstd.dtype)
        # Alg. 3: dx = rstd (I - z z^T / d) dz
        grad_x = rstd * (g - zc * (g * zc).mean(-1, keepdim=True))
        return grad_x.to(grad_z.dtype), None


class _MSLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        d = x.shape[-1]
        z, _, rstd = torch.native_layer_norm(x, (d,), None, None, eps)  # rstd (..., 1) in the accumulation dtype
        ctx.save_for_backward(z, rstd)
        return z

    @staticmethod
    def backward(ctx, grad_z):
        z, rstd = ctx.saved_tensors
        cdtype = acc_dtype(z.dtype)
        g = grad_z.to(cdtype)
        zc = z.to(cdtype)
        # Alg. 2: dx = rstd (H - z z^T / d) dz, with H = I - 1 1^T / d
        grad_x = rstd.to(cdtype) * (g - g.mean(-1, keepdim=True) - zc * (g * zc).mean(-1, keepdim=True))
        return grad_x.to(grad_z.dtype), None


def ms_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """MS-RMSNorm: ``x / sqrt(mean(x^2) + eps)`` over the last dim, no weight; (..., d) -> (..., d).

    Saves the output and one scalar per row; never the input.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return _rms_normalise(x, eps)[0]
    return _MSRMSNorm.apply(x, eps)


def ms_layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """MS-LN: ``(x - mean) / sqrt(var + eps)`` over the last dim, no affine; (..., d) -> (..., d).

    Saves the output and one scalar per row; never the input.
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), None, None, eps)
    return _MSLayerNorm.apply(x, eps)
