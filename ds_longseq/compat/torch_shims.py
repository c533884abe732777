"""torch: its private module reparametrization and dispatch, a tensor's version counter, a modeling module's function
stood in for, and torch.distributed's default group and store.

Holds:
    parameters_replaced: a module's parameters read as other tensors inside a ``with`` block (torch's own
        ``functional_call`` machinery, without calling the module and its hooks).
    module_function_replaced: a function of a transformers modeling module stood in for, inside a ``with`` block
        (Jamba's selective scan, continued from a state).
    tensor_version: a tensor's in-place version counter.
    products_uncomputed: torch's dispatch below autograd, answering matrix products with zeros of their shape while
        autograd records its own nodes for them (their backward is autograd's own, call for call).
    default_process_group / default_store: torch.distributed's default group and rendezvous store.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

__all__ = [
    "parameters_replaced",
    "module_function_replaced",
    "tensor_version",
    "products_uncomputed",
    "default_process_group",
    "default_store",
]


def parameters_replaced(module: Any, tensors: dict) -> contextlib.AbstractContextManager:
    """Inside the block, ``module``'s parameters named in ``tensors`` (dotted paths below it) are those tensors
    (e.g. differentiable slices of the parameters themselves), restored after: ``torch.func.functional_call``'s
    ``_reparametrize_module``, for a caller that runs the module's unpatched forward itself (no hooks)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=False, strict=False)


@contextlib.contextmanager
def module_function_replaced(module_name: str, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    """Inside the block, the module-level function ``name`` of the (imported) module ``module_name`` is
    ``make(original)``; restored after, also on an error.

    For a per-instance forward that needs a modeling module's own call changed for that call only (the module's
    code looks the function up in its globals at call time). Not thread-safe: another thread running the same
    module's code meanwhile would see the stand-in too; ds_longseq runs a model's forward in one thread."""
    module = sys.modules[module_name]
    original = getattr(module, name)
    setattr(module, name, make(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def tensor_version(tensor: Any) -> int:
    """``tensor``'s version counter (bumped by every in-place write): tells a stale saved copy from a fresh one."""
    return tensor._version


@functools.cache
def _uncomputed_products_mode() -> type:
    """The dispatch mode class behind :func:`products_uncomputed` (built once, on first use: torch's python
    dispatch is private, ``torch.utils._python_dispatch``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    # product op -> index of its two factors in the op's arguments (out = [bias +] a @ b, or batched)
    factors = {aten.mm.default: 0, aten.addmm.default: 1, aten.bmm.default: 0, aten.baddbmm.default: 1}

    class UncomputedProducts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            first = factors.get(func)
            if first is None:
                return func(*args, **(kwargs or {}))
            a, b = args[first], args[first + 1]
            return a.new_zeros((*a.shape[:-1], b.shape[-1]))

    return UncomputedProducts


def products_uncomputed() -> contextlib.AbstractContextManager:
    """Within: every matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``) returns zeros of its output's shape
    and dtype instead of computing. The mode sits below autograd, so autograd still records each product's own
    node with its own saved inputs, and the gradients it gives later (outside the block) come from exactly the
    calls the computed product would have made: same ops, same operands, same layouts, so bitwise the same on
    any BLAS or device. Other ops run as usual (on the zeros)."""
    return _uncomputed_products_mode()()


# ---- torch.distributed --------------------------------------------------------------------------------


def default_process_group():
    """torch.distributed's default process group, or None before ``init_process_group``."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def default_store():
    """The default process group's rendezvous store."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
