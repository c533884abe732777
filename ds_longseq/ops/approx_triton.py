"""Triton kernels for the Approx-BP activations' 2-bit state (the CUDA path of ``ops/approx_autograd.py``).

Holds:
    available: whether Triton can be imported (probed once).
    pack_step_codes: x -> (ceil(N / 4),) uint8 packed segment codes in one kernel, the same bits as
        ``pack_codes(step_codes(x, step))``.
    step_backward: (packed codes, grad_out) -> grad_out * step'(x) in one kernel, the same values as
        the torch ``step_backward``.
    StepLike: what the functions read from a step derivative (``thresholds``, ``slopes``).

Shape legend: N elements of x / grad_out (any shape, flattened row-major), B = ceil(N / 4) bytes.

Layout (as ``pack_codes``): element 4i + j sits in bits 2j..2j+1 of byte i; the codes of the padding
elements past N are 0. Supported dtypes: float16, bfloat16, float32; float64 is refused (ValueError),
the torch path in ``approx_autograd.py`` serves it.

Nothing is imported or compiled at import time: Triton is imported and the kernels are defined on
first use, so ``TRITON_INTERPRET=1`` set before that first use runs them on CPU tensors through
Triton's interpreter (how the tests run them without a GPU).
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any, Protocol

import torch

__all__ = ["StepLike", "available", "pack_step_codes", "step_backward"]

_BLOCK = 1024
"""Bytes per program (4 * _BLOCK elements): large enough that each program streams 4-16 KiB of x."""
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LAUNCH = {"enable_fp_fusion": False}
"""Launch options. No fused multiply-adds: the backward's one product must round like torch's (there is
nothing to fuse today; stating it also keeps Triton 3.9 from warning that its fusion default will change)."""


class StepLike(Protocol):
    """The fields of ``approx_bp.StepDerivative`` that the kernels read.

    A protocol rather than an import: ``approx_bp`` imports this module, and an import back (even
    under TYPE_CHECKING) would be a circle in the package's import graph (tests/test_import_graph.py).
    """

    @property
    def thresholds(self) -> tuple[float, float, float]: ...

    @property
    def slopes(self) -> tuple[float, float, float, float]: ...


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether Triton can be imported (probed on the first call, then cached)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install failing on import: either way, use torch
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernels() -> tuple[Any, Any]:
    """(pack kernel, backward kernel), defined on first use.

    ``triton.jit`` decides at decoration time whether a kernel is compiled or interpreted
    (``TRITON_INTERPRET``): defining the kernels here, not at import, lets that setting be made
    after this module is imported.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def _pack_kernel(x_ptr, out_ptr, n, n_bytes, c1, c2, c3, BLOCK: tl.constexpr):
        # A (BLOCK, 4) tile: row i = the four elements of byte i, so the load is contiguous.
        pid = tl.program_id(0).to(tl.int64)  # int64 offsets: N may exceed 2**31
        byte = pid * BLOCK + tl.arange(0, BLOCK)
        lane = tl.arange(0, 4)
        elem = byte[:, None] * 4 + lane[None, :]
        inside = elem < n
        # Compared in float32 against thresholds already rounded to x's dtype: every x of float16 /
        # bfloat16 is exact in float32, so this is the comparison in x's own dtype that torch makes.
        x = tl.load(x_ptr + elem, mask=inside, other=0.0).to(tl.float32)
        code = (x > c1).to(tl.int32) + (x > c2).to(tl.int32) + (x > c3).to(tl.int32)  # NaN: 0, as torch
        code = tl.where(inside, code, 0)  # padding past N packs as 0 (the masked 0.0 would give code 2)
        # The four 2-bit fields are disjoint, so their sum is their bitwise OR.
        packed = tl.sum(code << (lane[None, :] * 2), axis=1)
        tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < n_bytes)

    @triton.jit
    def _backward_kernel(packed_ptr, grad_ptr, out_ptr, n, n_bytes, s0, s1, s2, s3, BLOCK: tl.constexpr):
        # The same (BLOCK, 4) tiling: each program reads BLOCK packed bytes once and 4 * BLOCK grads.
        pid = tl.program_id(0).to(tl.int64)
        byte = pid * BLOCK + tl.arange(0, BLOCK)
        lane = tl.arange(0, 4)
        elem = byte[:, None] * 4 + lane[None, :]
        inside = elem < n
        bits = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
        code = (bits[:, None] >> (lane[None, :] * 2)) & 3
        # Four float32 scalars picked by the code (a select chain: no table in memory to gather from).
        slope = tl.where(code == 0, s0, tl.where(code == 1, s1, tl.where(code == 2, s2, s3)))
        g = tl.load(grad_ptr + elem, mask=inside, other=0.0).to(tl.float32)
        # Multiplied in float32 and rounded once to grad's dtype, as the torch step_backward does.
        tl.store(out_ptr + elem, (g * slope).to(out_ptr.dtype.element_ty), mask=inside)

    return _pack_kernel, _backward_kernel


def _check_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in _DTYPES:
        raise ValueError(
            f"approx_triton: {what} has dtype {t.dtype}; the Triton kernels take float16, bfloat16 and "
            "float32 (float64 and the rest go through the torch path in ds_longseq.ops.approx_autograd)"
        )


def _on_device(t: torch.Tensor):
    # Triton launches on the current CUDA device, not the tensor's: make them the same.
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def _grid(n_bytes: int) -> tuple[int]:
    return ((n_bytes + _BLOCK - 1) // _BLOCK,)


def pack_step_codes(x: torch.Tensor, step: StepLike) -> torch.Tensor:
    """The packed segment codes of ``x``: any shape -> (ceil(N / 4),) uint8.

    Bit-identical to ``pack_codes(step_codes(x, step))``. Raises ValueError for a dtype other than
    float16, bfloat16, float32.
    """
    _check_dtype(x, "x")
    x = x.contiguous()
    n = x.numel()
    n_bytes = (n + 3) // 4
    out = torch.empty(n_bytes, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    # Each threshold rounded to x's dtype (what torch compares x against), then widened to float32
    # exactly: the kernel takes float32 scalars.
    c1, c2, c3 = (float(torch.tensor(c, dtype=x.dtype)) for c in step.thresholds)
    pack, _ = _kernels()
    with _on_device(x):
        pack[_grid(n_bytes)](x, out, n, n_bytes, c1, c2, c3, BLOCK=_BLOCK, **_LAUNCH)
    return out


def step_backward(packed: torch.Tensor, grad_out: torch.Tensor, step: StepLike) -> torch.Tensor:
    """``grad_out * step'(x)`` from ``pack_step_codes(x, step)``: same shape and dtype as ``grad_out``.

    Bit-identical to the torch ``step_backward`` (the product in float32, rounded once to grad's
    dtype). Raises ValueError for a dtype other than float16, bfloat16, float32, or too few codes.
    """
    _check_dtype(grad_out, "grad_out")
    n = grad_out.numel()
    n_bytes = (n + 3) // 4
    if packed.dtype != torch.uint8 or packed.numel() < n_bytes:
        raise ValueError(
            f"approx_triton: packed must be uint8 with at least {n_bytes} bytes for {n} gradients, "
            f"got {packed.dtype} with {packed.numel()}"
        )
    grad = grad_out.contiguous()
    out = torch.empty_like(grad)
    if n == 0:
        return out
    # The slopes as float32 values (the table the torch path builds), passed as exact float32 scalars.
    s0, s1, s2, s3 = torch.tensor(step.slopes, dtype=torch.float32).tolist()
    _, backward = _kernels()
    with _on_device(grad):
        backward[_grid(n_bytes)](packed.contiguous(), grad, out, n, n_bytes, s0, s1, s2, s3, BLOCK=_BLOCK, **_LAUNCH)
    return out.view(grad_out.shape)
