"""The one module that touches DeepSpeed's, transformers' and torch.distributed's private names.

Holds:
    get_attn_implementation / set_attn_implementation: a Hugging Face config's ``_attn_implementation``.
    output_collector: transformers' per-forward collector of recorded outputs (router logits).
    check_output_capturing: fail clearly where that collector is not where we read it.
    KV_SHARED_SLICING, unsliced_kv_shared_inputs: Gemma 4's slicing of its inputs before its K/V-sharing
        layers (an inference shortcut that indexes 4D masks), and a stand-in that leaves them whole.
    CACHE_KWARGS, cache_kwarg, pop_cache: the keyword a KV cache is passed by, which transformers 5.24
        renamed (``past_key_values`` to ``cache``; older layouts say ``layer_past``).
    deepspeed_sp_group: DeepSpeed's initialised sequence-parallel group (``parallel_state_sp``), or None.
    dim_zero_all_to_all: DeepSpeed-Ulysses' registered all-to-all and its group registration.
    parameters_replaced: a module's parameters read as other tensors inside a ``with`` block (torch's own
        ``functional_call`` machinery, without calling the module and its hooks).
    Z3_LEAF_ATTR, is_zero3_partitioned: DeepSpeed ZeRO-3's leaf-module flag and partitioned-parameter mark.
    default_process_group / default_store: torch.distributed's default group and rendezvous store.
    deepspeed_initialize_replaced: ``deepspeed.initialize`` stood in for, inside a ``with`` block.
    drop_gguf_quantization_marker: a GGUF-loaded transformers model (dequantized on load, yet marked quantized and
        so refused by ``save_pretrained``) made a plain model.
    ZERO3_SP_AVERAGE_VERSIONS, check_zero3_sequence_parallel, fix_zero3_sequence_parallel_average: DeepSpeed
        ZeRO-3's gradient average under sequence parallelism, corrected on the versions where it is known
        wrong and refused on versions nobody checked.

Every name here is private to its library and may move in any release; ``setup.py``'s ranges are the
versions the test suite ran with. Where a workaround depends on a third-party bug being present, it is
keyed on the exact versions checked (``ZERO3_SP_AVERAGE_VERSIONS``), never on a version range or the
library's source text, so a release that fixes the bug is refused until checked instead of corrected twice.

Not here: ``torch.ops.aten._*`` attention kernels, called from ``ops/attention.py``'s kernel table. They
are torch's operator registry (schema-versioned entry points, the same ones ``scaled_dot_product_attention``
dispatches to), and each is tested against the math path on every device that runs it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from typing import Any, Callable, Iterator

__all__ = [
    "get_attn_implementation",
    "set_attn_implementation",
    "output_collector",
    "check_output_capturing",
    "KV_SHARED_SLICING",
    "unsliced_kv_shared_inputs",
    "CACHE_KWARGS",
    "cache_kwarg",
    "pop_cache",
    "deepspeed_sp_group",
    "dim_zero_all_to_all",
    "parameters_replaced",
    "Z3_LEAF_ATTR",
    "is_zero3_partitioned",
    "default_process_group",
    "default_store",
    "deepspeed_initialize_replaced",
    "drop_gguf_quantization_marker",
    "ZERO3_SP_AVERAGE_VERSIONS",
    "zero3_sequence_parallel_problem",
    "fix_zero3_sequence_parallel_average",
]


# ---- transformers -------------------------------------------------------------------------------


def get_attn_implementation(hf_config: Any) -> str | None:
    """The attention implementation a Hugging Face config selects (``config._attn_implementation``)."""
    return hf_config._attn_implementation


def set_attn_implementation(hf_config: Any, name: str | None) -> None:
    """Select attention implementation ``name`` on this config instance only.

    Set on the config, not through ``PreTrainedModel.set_attn_implementation``, which validates the
    name against the built-in kernels and would refuse ds_longseq's registered one.
    """
    hf_config._attn_implementation = name


def output_collector():
    """transformers' per-forward collector of recorded outputs (a ContextVar wrapper with get/set/reset)."""
    from transformers.utils.output_capturing import _active_collector

    return _active_collector


def check_output_capturing() -> None:
    """Raise ImportError naming the problem if transformers' output capturing is not where we read it."""
    try:
        var = output_collector()
    except ImportError as e:
        raise ImportError(
            "ds_longseq's mixture-of-experts support reads transformers.utils.output_capturing._active_collector "
            "(transformers >= 5), which this transformers lacks: upgrade transformers"
        ) from e
    for name in ("get", "set", "reset"):
        if not callable(getattr(var, name, None)):
            raise ImportError(f"transformers' output collector has no {name}(): upgrade ds_longseq or transformers")


KV_SHARED_SLICING = "_maybe_slice_kv_shared_inputs"
"""Gemma 4's decoder method that, before its first K/V-sharing layer, cuts the sequence to the positions
whose logits are kept (``logits_to_keep``), indexing every mask as 4D. ds_longseq's attention keeps masks 2D
(and a training forward keeps every position), so the decoder gets :func:`unsliced_kv_shared_inputs` on the
instance instead (``techniques.base.EnableContext.use_longseq_attention``)."""


def unsliced_kv_shared_inputs(hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping, *args,
                              **kwargs):
    """Stand-in for :data:`KV_SHARED_SLICING`: the inputs unchanged (the shortcut only saves inference compute;
    the K/V-sharing layers then run every position, and the logits are still cut where the head asks)."""
    return hidden_states, per_layer_inputs, position_embeddings, causal_mask_mapping


CACHE_KWARGS = ("cache", "past_key_values", "layer_past")
"""The keywords transformers passes a KV cache by: ``cache`` from 5.24 (models and layers still accept
``past_key_values`` until 5.40, with a warning, but a layer given both uses ``cache``), ``past_key_values``
before 5.24, ``layer_past`` in GPT-NeoX-style layers."""


def cache_kwarg(forward: Callable) -> str:
    """The keyword ``forward`` (a model's or a decoder layer's) takes its KV cache by: one of CACHE_KWARGS,
    the first its signature names (decorated forwards are read through ``__wrapped__``)."""
    params = inspect.signature(forward).parameters
    return next((name for name in CACHE_KWARGS if name in params), "past_key_values")


def pop_cache(kwargs: dict, given: Any = None) -> Any:
    """Remove every CACHE_KWARGS keyword from ``kwargs``; return the cache passed (``given`` first, then
    the first non-None of them; None when there is none), whatever its name in this transformers release."""
    found = [kwargs.pop(name) for name in CACHE_KWARGS if name in kwargs]
    return next((cache for cache in (given, *found) if cache is not None), None)


def drop_gguf_quantization_marker(model_or_config) -> None:
    """A transformers model (or config) loaded with ``gguf_file=``: its weights are plain tensors, dequantized on
    load, but transformers 5.24 keeps ``config.quantization_config`` (quant_method "gguf") and the model's
    ``hf_quantizer``, and ``save_pretrained`` then refuses the model as not serializable. Both are dropped: the
    model is what it holds, a float model."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if model_or_config is not config:
        model_or_config.hf_quantizer = None
        model_or_config.is_quantized = False


# ---- DeepSpeed ------------------------------------------------------------------------------------


def deepspeed_sp_group():
    """DeepSpeed's sequence-parallel process group (``parallel_state_sp``), or None before it is built."""
    try:
        import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    except ImportError:  # pragma: no cover - deepspeed is an install requirement
        return None
    return mpu._SEQUENCE_PARALLEL_GROUP


def dim_zero_all_to_all() -> tuple[Callable, Callable]:
    """(``_dim_zero_all_to_all``, ``register_all_to_all_group``) of ``deepspeed.sequence.layer``: the
    registered, autograd-aware all-to-all DeepSpeed-Ulysses itself uses."""
    from deepspeed.sequence.layer import _dim_zero_all_to_all, register_all_to_all_group

    return _dim_zero_all_to_all, register_all_to_all_group


def parameters_replaced(module: Any, tensors: dict) -> contextlib.AbstractContextManager:
    """Inside the block, ``module``'s parameters named in ``tensors`` (dotted paths below it) are those tensors
    (e.g. differentiable slices of the parameters themselves), restored after: ``torch.func.functional_call``'s
    ``_reparametrize_module``, for a caller that runs the module's unpatched forward itself (no hooks)."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=False, strict=False)


Z3_LEAF_ATTR = "_z3_leaf"
"""The attribute ``deepspeed.utils.set_z3_leaf_modules`` sets on a module: ZeRO-3 gathers a leaf's
parameters in the leaf's own hooks and registers none on its children."""


def is_zero3_partitioned(param: Any) -> bool:
    """Whether ``param`` is managed by ZeRO-3 (built under ``deepspeed.zero.Init`` or partitioned by it)."""
    return hasattr(param, "ds_id")


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


_Z3_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"

ZERO3_SP_AVERAGE_VERSIONS: dict[str, bool] = {"0.19.8": True}
"""DeepSpeed releases whose ZeRO-3 gradient average under sequence parallelism was checked, and whether
it needs correcting. In 0.19.8 ``reduce_scatter_coalesced`` divides by the world size and
``__avg_scatter_grads`` never multiplies ``sequence_parallel_size`` back, while every other reduction
(ZeRO-1/2, ZeRO-3's contiguous all-reduce path) divides by world / SP: gradients SP times too small.
A release not listed is refused for ZeRO-3 + sequence parallelism (``zero3_sequence_parallel_problem``)
until a test (tests/test_sequence_parallel_engine.py's ZeRO-3 parity) has been run on it and it is added."""


def _release(version: str) -> str:
    """"0.19.8" of "0.19.8+cu124" or "0.19.8rc1": the release a build or pre-release belongs to."""
    parts = [re.match(r"\d+", p) for p in version.split("+")[0].split(".")[:3]]
    return ".".join(m.group() if m else "0" for m in parts)


def zero3_sequence_parallel_problem(version: str | None = None) -> str | None:
    """Why ZeRO-3 + sequence parallelism cannot run exactly on this DeepSpeed (None when it can)."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    if _release(version) in ZERO3_SP_AVERAGE_VERSIONS:
        return None
    checked = ", ".join(sorted(ZERO3_SP_AVERAGE_VERSIONS))
    return (
        f"ZeRO stage 3 with sequence parallelism on DeepSpeed {version}: ds_longseq checked ZeRO-3's gradient "
        f"average under sequence parallelism on DeepSpeed {checked} only (0.19.8 averages over the world "
        "instead of world / sequence_parallel_size and is corrected); use ZeRO stage 2, or DeepSpeed " + checked
    )


def fix_zero3_sequence_parallel_average(optimizer, sp_size: int, version: str | None = None) -> bool:
    """Make a ZeRO-3 optimizer's reduce-scatter average over data-parallel replicas (world / SP).

    Under sequence parallelism each rank's gradient is its share of its replica's loss, so the
    replicas' gradients are the sums over their SP ranks and DeepSpeed must divide by world / SP, as
    its other reduction paths do. On the releases :data:`ZERO3_SP_AVERAGE_VERSIONS` marks as wrong,
    this wraps that method on the given optimizer instance only, multiplying its partitions by ``sp_size``.

    Returns:
        Whether the fix was applied (False with ``sp_size`` 1 or a release checked to be right).

    Raises:
        RuntimeError: this DeepSpeed release was never checked (see :func:`zero3_sequence_parallel_problem`),
            or the optimizer is not DeepSpeed's ZeRO-3 optimizer.
    """
    if sp_size <= 1:
        return False
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    problem = zero3_sequence_parallel_problem(version)
    if problem is not None:
        raise RuntimeError(problem)
    if not ZERO3_SP_AVERAGE_VERSIONS[_release(version)]:
        return False
    if not hasattr(optimizer, _Z3_SCATTER):
        raise RuntimeError(
            f"expected DeepSpeed's ZeRO-3 optimizer, got {type(optimizer).__name__}: cannot correct its gradient "
            "average under sequence parallelism"
        )
    original = getattr(optimizer, _Z3_SCATTER)

    def avg_scatter_grads(params, communication_data_type):
        return [g.mul(sp_size) for g in original(params, communication_data_type)]

    object.__setattr__(optimizer, _Z3_SCATTER, avg_scatter_grads)
    return True


# ---- torch.distributed --------------------------------------------------------------------------------


def default_process_group():
    """torch.distributed's default process group, or None before ``init_process_group``."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_initialized() else None


def default_store():
    """The default process group's rendezvous store."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
