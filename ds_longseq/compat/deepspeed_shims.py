"""DeepSpeed: its sequence-parallel group and all-to-all, ZeRO-3's parameter marks, ``deepspeed.initialize`` stood in
for, and the release differences of its checkpoints and ZeRO-1/2 buffers.

Holds:
    deepspeed_version: the installed DeepSpeed's version string.
    deepspeed_sp_group: DeepSpeed's initialised sequence-parallel group (``parallel_state_sp``), or None.
    dim_zero_all_to_all: DeepSpeed-Ulysses' registered all-to-all and its group registration.
    Z3_LEAF_ATTR, is_zero3_partitioned, full_numel: DeepSpeed ZeRO-3's leaf-module flag, partitioned-parameter
        mark and a partitioned parameter's full size.
    deepspeed_initialize_replaced: ``deepspeed.initialize`` stood in for, inside a ``with`` block.
    gathered_parameters, gathers_one_at_a_time, deepspeed_gathers_one_at_a_time: ``deepspeed.zero.GatheredParameters``
        one parameter at a time (ours, and DeepSpeed's own inside a block) where DeepSpeed 0.18's coalesced gather
        returns before its gloo all-gathers land.
    checkpoint_parallel_dims_keys: where a DeepSpeed 0.19 checkpoint records its tensor-parallel degree (0.18: nowhere).
    zero_flat_buffers_detached: DeepSpeed 0.18's ZeRO-1/2 flat parameter buffers taken off autograd, as 0.19 builds
        them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator

from ds_longseq.compat.versions import release

__all__ = [
    "deepspeed_version",
    "deepspeed_sp_group",
    "dim_zero_all_to_all",
    "Z3_LEAF_ATTR",
    "is_zero3_partitioned",
    "full_numel",
    "deepspeed_initialize_replaced",
    "gathered_parameters",
    "deepspeed_gathers_one_at_a_time",
    "gathers_one_at_a_time",
    "checkpoint_parallel_dims_keys",
    "zero_flat_buffers_detached",
]


def deepspeed_version() -> str:
    """The installed DeepSpeed's version string (``deepspeed.__version__``)."""
    import deepspeed

    return deepspeed.__version__


def deepspeed_sp_group():
    """DeepSpeed's sequence-parallel process group (``parallel_state_sp``), or None before it is built."""
    try:
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    except ImportError:  # pragma: no cover - deepspeed is an install requirement
        return None
    return mpu._SEQUENCE_PARALLEL_GROUP


def dim_zero_all_to_all() -> tuple[Callable, Callable]:
    """(all-to-all, group registration): the autograd-aware all-to-all over dimension 0 DeepSpeed-Ulysses itself
    uses, called ``a2a(group, blocks)``, and what must be called on a group before its first exchange.

    DeepSpeed 0.19: ``deepspeed.sequence.layer``'s ``_dim_zero_all_to_all`` (a ``torch.library`` operator that
    looks its group up by name) and ``register_all_to_all_group``. DeepSpeed 0.18 (0.18.9 checked) has neither,
    only the autograd Function ``_DimZeroAllToAll`` (the same exchange forward and backward, no registration);
    0.19's own docstring says that Function's gradient is zero under ``torch.compile``, so it is refused there.
    """
    import deepspeed.sequence.layer as layer

    if hasattr(layer, "_dim_zero_all_to_all"):
        return layer._dim_zero_all_to_all, layer.register_all_to_all_group
    function = layer._DimZeroAllToAll

    def all_to_all(group, blocks):
        import torch

        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"sequence parallelism under torch.compile needs DeepSpeed 0.19 (DeepSpeed {deepspeed_version()}'s "
                "all-to-all gives zero gradients when compiled): run the model eagerly, or pip install "
                "'deepspeed>=0.19.8'"
            )
        return function.apply(group, blocks)

    return all_to_all, lambda group: None


Z3_LEAF_ATTR = "_z3_leaf"
"""The attribute ``deepspeed.utils.set_z3_leaf_modules`` sets on a module: ZeRO-3 gathers a leaf's
parameters in the leaf's own hooks and registers none on its children."""


def is_zero3_partitioned(param: Any) -> bool:
    """Whether ``param`` is managed by ZeRO-3 (built under ``deepspeed.zero.Init`` or partitioned by it)."""
    return hasattr(param, "ds_id")


def full_numel(param: Any) -> int:
    """A parameter's number of elements, also under ZeRO-3 (whose partitioned parameter keeps its full size in
    ``ds_numel``, its local tensor being empty)."""
    return int(getattr(param, "ds_numel", param.numel()))


@contextlib.contextmanager
def deepspeed_initialize_replaced(stand_in: Callable[..., Any]) -> Iterator[None]:
    """Inside: ``deepspeed.initialize`` is ``functools.partial(stand_in, original)``; restored on exit.

    ``stand_in(original, **kwargs)`` receives the original function first, to call it. Used around
    Hugging Face ``Trainer`` calls, whose accelerate looks ``deepspeed.initialize`` up on the module
    when it prepares the model, so the engine is built the way ``ds_longseq.engine.initialize``
    builds it (sequence-parallel groups, ZeRO-3 leaves and its average fix).
    """
    import deepspeed

    original = deepspeed.initialize
    deepspeed.initialize = functools.partial(stand_in, original)
    try:
        yield
    finally:
        deepspeed.initialize = original


def gathers_one_at_a_time(backend: str | None, version: str) -> bool:
    """Whether :func:`gathered_parameters` gathers parameter by parameter: under gloo (CPU) on DeepSpeed before 0.19.

    DeepSpeed 0.18 (0.18.9 checked) gathers several ZeRO-3 parameters with one asynchronous all-gather each and waits
    on the last handle only (``Init._allgather_params_coalesced``): NCCL runs them in order on one stream, so the last
    one's end covers the others, but gloo runs each on its own, so the block could read a parameter whose all-gather
    had not landed (seen on CPU: garbage in one gathered weight in about one run in four of a plain
    ``deepspeed.initialize`` ZeRO-3 run, training itself right). 0.19 (0.19.8 checked) waits on every handle. One
    parameter at a time takes DeepSpeed's synchronous path; on a fixed release it is only slower, so the range is
    safe."""
    major_minor = tuple(int(part) for part in release(version).split(".")[:2])
    return backend == "gloo" and major_minor < (0, 19)


def gathered_parameters(params: Iterable[Any], **kwargs: Any) -> contextlib.AbstractContextManager:
    """``deepspeed.zero.GatheredParameters(params, **kwargs)`` (``modifier_rank=``, ``enabled=``, ...), which every
    gather of ZeRO-3 parameters in ds_longseq goes through: on the releases and backend
    :func:`gathers_one_at_a_time` names, one ``GatheredParameters`` per parameter, entered in order (each rank gathers
    the same parameters in the same order), so every one has landed before the block reads it."""
    import deepspeed

    if not gathers_one_at_a_time(_backend(), deepspeed_version()):
        return deepspeed.zero.GatheredParameters(params, **kwargs)
    return _one_at_a_time(deepspeed.zero.GatheredParameters, params, **kwargs)


@contextlib.contextmanager
def deepspeed_gathers_one_at_a_time() -> Iterator[None]:
    """Inside: DeepSpeed's own gathers (``deepspeed.zero.GatheredParameters``, as its engine looks it up: the Trainer's
    16-bit save under ZeRO-3 gathers each module's parameters together) take :func:`gathered_parameters`'s way, where
    :func:`gathers_one_at_a_time` says so; restored on exit. Elsewhere nothing is replaced."""
    import deepspeed

    if not gathers_one_at_a_time(_backend(), deepspeed_version()):
        yield
        return
    original = deepspeed.zero.GatheredParameters
    deepspeed.zero.GatheredParameters = functools.partial(_one_at_a_time, original)
    try:
        yield
    finally:
        deepspeed.zero.GatheredParameters = original


def _backend() -> str | None:
    import torch.distributed as dist

    return dist.get_backend() if dist.is_initialized() else None


def _one_at_a_time(gathered: Callable[..., Any], params: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
    """``gathered(params, **kwargs)`` (a ``GatheredParameters``) entered once per parameter, in order."""
    import torch

    params = [params] if isinstance(params, torch.Tensor) else list(params)  # one parameter, as DeepSpeed takes it
    if len(params) < 2:
        return gathered(params, **kwargs)
    stack = contextlib.ExitStack()
    with stack:  # a failed gather leaves the ones entered before it
        for param in params:
            stack.enter_context(gathered([param], **kwargs))
        return stack.pop_all()


def checkpoint_parallel_dims_keys() -> tuple[str, str] | None:
    """(model-state key of the parallel dimensions, its tensor-parallel degree key) a DeepSpeed checkpoint records
    and ``ds_to_universal`` checks, or None where it records none.

    DeepSpeed 0.19 writes ``checkpoint_parallel_dimensions`` (``{"tp_degree": ...}``) into each model-state file
    and its converter reads the tensor-parallel degree from there; DeepSpeed 0.18 (0.18.9 checked) has neither
    constant and counts the model-state files instead."""
    import deepspeed.checkpoint.constants as constants

    if not hasattr(constants, "CHECKPOINT_PARALLEL_DIMS"):
        return None
    return constants.CHECKPOINT_PARALLEL_DIMS, constants.CHECKPOINT_TP_DEGREE


def zero_flat_buffers_detached(optimizer: Any) -> int:
    """Detach a ZeRO-1/2 optimizer's flat parameter buffers (``bit16_groups_flat``) from autograd; how many were
    attached.

    DeepSpeed 0.18 (0.18.9 checked) builds them with ``torch.cat`` of the parameters and keeps the result's autograd
    history, so the step's all-gather into views of them can fail ("Output 0 of Split is a view and is being
    modified inplace"); 0.19 detaches them where it builds them. The detached buffer shares the same storage (the
    parameters stay views of it): decided on the buffers' state, not on a version, so a fixed release is left as it
    is."""
    flats = getattr(optimizer, "bit16_groups_flat", None) or []
    partitions = getattr(optimizer, "parallel_partitioned_bit16_groups", None) or [[] for _ in flats]
    attached = [i for i, flat in enumerate(flats) if getattr(flat, "requires_grad", False)]
    for i in attached:
        flats[i] = flats[i].detach()
        # this rank's partition and the others' are views of the attached buffer: the step writes into them too
        partitions[i][:] = [part.detach() for part in partitions[i]]
    return len(attached)
