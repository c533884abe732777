"""The one module that touches DeepSpeed's, transformers', torch.distributed's (and bitsandbytes') private names.

Holds:
    TESTED_VERSIONS: the lowest and highest release of each dependency the suite runs on; every difference
        between the two ends is below, named by the release it covers.
    activation_checkpointing_on, set_activation_checkpointing, CHECKPOINTING_OFF_CALL: a model's activation
        checkpointing under transformers 5.23's names or the older ``gradient_checkpointing_*`` ones.
    get_attn_implementation / set_attn_implementation: a Hugging Face config's ``_attn_implementation``.
    output_collector: transformers' per-forward collector of recorded outputs (router logits).
    check_output_capturing: fail clearly where that collector is not where we read it.
    KV_SHARED_SLICING, unsliced_kv_shared_inputs: Gemma 4's slicing of its inputs before its K/V-sharing
        layers (an inference shortcut that indexes 4D masks), and a stand-in that leaves them whole.
    CACHE_KWARGS, cache_kwarg, pop_cache: the keyword a KV cache is passed by, which transformers 5.24
        renamed (``past_key_values`` to ``cache``; older layouts say ``layer_past``).
    packed_chunks_count_from_documents: whether chunked attention's chunks restart at each packed document
        (transformers 5.24) or count from the row's first key (5.16).
    deepspeed_sp_group: DeepSpeed's initialised sequence-parallel group (``parallel_state_sp``), or None.
    dim_zero_all_to_all: DeepSpeed-Ulysses' registered all-to-all and its group registration.
    parameters_replaced: a module's parameters read as other tensors inside a ``with`` block (torch's own
        ``functional_call`` machinery, without calling the module and its hooks).
    Z3_LEAF_ATTR, is_zero3_partitioned, full_numel: DeepSpeed ZeRO-3's leaf-module flag, partitioned-parameter
        mark and a partitioned parameter's full size.
    default_process_group / default_store: torch.distributed's default group and rendezvous store.
    deepspeed_initialize_replaced: ``deepspeed.initialize`` stood in for, inside a ``with`` block.
    drop_gguf_quantization_marker: a GGUF-loaded transformers model (dequantized on load, yet marked quantized and
        so refused by ``save_pretrained``) made a plain model.
    ZERO3_SP_AVERAGE_VERSIONS, check_zero3_sequence_parallel, fix_zero3_sequence_parallel_average: DeepSpeed
        ZeRO-3's gradient average under sequence parallelism, corrected on the versions where it is known
        wrong and refused on versions nobody checked.
    checkpoint_parallel_dims_keys: where a DeepSpeed 0.19 checkpoint records its tensor-parallel degree (0.18: nowhere).
    zero_flat_buffers_detached: DeepSpeed 0.18's ZeRO-1/2 flat parameter buffers taken off autograd, as 0.19 builds
        them.
    repair_zero3_universal_load: what DeepSpeed ZeRO-3's universal-checkpoint load leaves wrong in the optimizer
        (a step count shared by its sub-groups, the first group's hyperparameters in every group), put right.
    tensor_version: a tensor's in-place version counter.
    module_function_replaced: a function of a transformers modeling module stood in for, inside a ``with`` block
        (Jamba's selective scan, continued from a state).
    products_uncomputed: torch's dispatch below autograd, answering matrix products with zeros of their shape while
        autograd records its own nodes for them (their backward is autograd's own, call for call).
    keys_ignored_on_save: the state-dict keys a transformers model leaves out of ``save_pretrained``.
    keep_4bit_weights_unpacked: bitsandbytes' 4-bit linears kept off their lossy CPU inference repacking.
    The Hugging Face Trainer's internals (the Trainer integration's only way in):
        trainer_checkpointing_turned_off, trainer_counts_batch_tokens, trainer_micro_batch_size,
        trainer_num_items_in_batch, trainer_loss_scale; TRL's trainers: trl_metrics, trl_entropy_bonus_enabled,
        trl_makes_fused_head_calls (TRL 1.16's fused-LM-head calls, or TRL 1.9's logits and chunked-NLL calls);
        accelerate's: accelerator_gather_replaced, accelerate_parallelism_hidden, dataloader_resharded.
    TOUCHES_ELSEWHERE: the few touches of third-party internals or objects that must sit in another module, each
        with its reason (tests/test_compat.py fails on any other).

Every name here is private to its library and may move in any release; ``setup.py``'s ranges are the
versions the test suite ran with. Where a workaround depends on a third-party bug being present, it is
keyed on the exact versions checked (``ZERO3_SP_AVERAGE_VERSIONS``), never on a version range or the
library's source text, so a release that fixes the bug is refused until checked instead of corrected twice.

Not here, each listed in ``TOUCHES_ELSEWHERE`` with its reason (tests/test_compat.py reads the package's code
and fails on any other touch of a third party's internals or objects): ``torch.ops.aten._*`` attention kernels in
``ops/tile_kernels.py``'s kernel table (torch's operator registry, each kernel tested against the math path on every
device that runs it), the per-instance patch of ``techniques/base.py``, and a few documented hooks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from typing import Any, Callable, Iterator

__all__ = [
    "TESTED_VERSIONS",
    "activation_checkpointing_on",
    "set_activation_checkpointing",
    "CHECKPOINTING_OFF_CALL",
    "get_attn_implementation",
    "set_attn_implementation",
    "output_collector",
    "check_output_capturing",
    "KV_SHARED_SLICING",
    "unsliced_kv_shared_inputs",
    "CACHE_KWARGS",
    "cache_kwarg",
    "pop_cache",
    "packed_chunks_count_from_documents",
    "deepspeed_sp_group",
    "dim_zero_all_to_all",
    "parameters_replaced",
    "Z3_LEAF_ATTR",
    "is_zero3_partitioned",
    "full_numel",
    "default_process_group",
    "default_store",
    "deepspeed_initialize_replaced",
    "drop_gguf_quantization_marker",
    "keep_4bit_weights_unpacked",
    "ZERO3_SP_AVERAGE_VERSIONS",
    "zero3_sequence_parallel_problem",
    "fix_zero3_sequence_parallel_average",
    "repair_zero3_universal_load",
    "zero_flat_buffers_detached",
    "checkpoint_parallel_dims_keys",
    "tensor_version",
    "products_uncomputed",
    "keys_ignored_on_save",
    "trainer_checkpointing_turned_off",
    "trainer_counts_batch_tokens",
    "trainer_micro_batch_size",
    "trainer_num_items_in_batch",
    "trainer_prepared_inputs",
    "trainer_loss_scale",
    "trl_metrics",
    "trl_entropy_bonus_enabled",
    "trl_makes_fused_head_calls",
    "accelerator_gather_replaced",
    "accelerate_parallelism_hidden",
    "dataloader_resharded",
    "TOUCHES_ELSEWHERE",
]

TESTED_VERSIONS: dict[str, tuple[str, str]] = {
    # the two stacks the suite runs on: the floor is axolotl 0.19.0's pins (its `axolotl[deepspeed]` resolves
    # DeepSpeed 0.18.9), the top the newest releases on the package index; setup.py's lower bounds are the floors
    # (tests/test_versions.py)
    "torch": ("2.13.0", "2.13.0"),
    "transformers": ("5.16.1", "5.24.0"),
    "deepspeed": ("0.18.9", "0.19.8"),
    "trl": ("1.9.0", "1.16.0"),
    "accelerate": ("1.13.0", "1.15.0"),
    "peft": ("0.20.0", "0.21.2"),
}
"""(lowest, highest) release of each dependency the test suite ran on (README "Tested versions")."""


TOUCHES_ELSEWHERE: dict[str, str] = {
    # "<file under ds_longseq/>:<Class.method or function>:<name>": why it is not behind a function here
    "lazy.py:lazy_exports.__getattr__:setattr": "caches a lazily imported name on ds_longseq's own package module "
    "(ds_longseq, ds_longseq.ops, ds_longseq.families), as the import system does for a submodule; no third-party "
    "object",
    **{f"ops/tile_kernels.py:{kernel}.{direction}:{op}": "torch's operator registry (the schema-versioned "
       "entry points scaled_dot_product_attention dispatches to), one kernel table, each kernel tested against the "
       "math path"
       for kernel, ops in {
           "_CpuFlash": ("_scaled_dot_product_flash_attention_for_cpu",
                         "_scaled_dot_product_flash_attention_for_cpu_backward"),
           "_CudaFlash": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
           "_CudaCudnn": ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
           "_CudaEfficient": ("_efficient_attention_forward", "_efficient_attention_backward"),
       }.items() for direction, op in zip(("forward", "backward"), ops, strict=True)},
    **{f"techniques/base.py:PatchHandle.set_instance_attr{where}:object.{method}":
       "THE per-instance patch: every technique's change to a model goes through it, recorded and undone by "
       "disable() (object.__setattr__: an nn.Module's own __setattr__ would register a submodule)"
       for where, method in (("", "__setattr__"), (".restore", "__setattr__"), (".restore", "__delattr__"))},
    "forwards/head_sharding_forward.py:_attributes:setattr":
        "a recurrent mixer's head counts narrowed to this rank's heads for one call, restored on exit (the mixer "
        "reads them inside its forward; which attributes: families/mixer_heads.py)",
    **{f"processes/watchdog.py:PeerWatch.{method}:sys.excepthook":
       "the watchdog names the rank that died: Python's documented hook, chained to and restored on stop"
       for method in ("start", "stop")},
    "processes/mpi_env.py:main:sys.argv": "python -m ds_longseq.processes.mpi_env runs the user's script as __main__",
    "engine/initialize.py:initialize_with:args.deepspeed_config":
        "DeepSpeed reads the config path from the user's argparse namespace: emptied after the long_seq "
        "section was taken out (deepspeed.initialize's documented args= protocol)",
    "trainer/mixin.py:LongSeqTrainerMixin._prepare_inputs:_prepare_inputs":
        "TRL's GRPO generates inside this Trainer hook: under sequence parallelism generation runs paused (each "
        "rank its own prompts, whole); no public hook runs there",
}
"""Touches of third-party internals, or assignments to third-party objects, outside this module, keyed
``file:function:name``; tests/test_compat.py fails on any touch not here, and on any entry no longer found."""


# ---- transformers -------------------------------------------------------------------------------


def activation_checkpointing_on(model: Any) -> bool:
    """Whether a transformers model has activation (gradient) checkpointing turned on.

    transformers 5.23 renamed ``is_gradient_checkpointing`` / ``gradient_checkpointing_enable`` / ``_disable`` to
    ``is_activation_checkpointing`` / ``activation_checkpointing_*`` (the old names kept as deprecated aliases);
    5.16-5.22 (5.16.1 checked) have only the old names."""
    on = getattr(model, "is_activation_checkpointing", None)
    if on is None:
        on = getattr(model, "is_gradient_checkpointing", False)
    return bool(on)


def set_activation_checkpointing(model: Any, on: bool, kwargs: dict | None = None) -> None:
    """Turn a transformers model's activation checkpointing on (with ``kwargs``, e.g. ``{"use_reentrant": False}``)
    or off, under whichever name this transformers has (see :func:`activation_checkpointing_on`)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


CHECKPOINTING_OFF_CALL = (
    "model.activation_checkpointing_disable() (before transformers 5.23: gradient_checkpointing_disable())")
"""What a refusal tells the user to call to turn checkpointing off, on either side of transformers 5.23's rename."""


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


@functools.cache
def packed_chunks_count_from_documents() -> bool:
    """Whether transformers' mask builders count a packed row's positions from each document's start (5.24's
    ``masking_utils.remap_positions_for_packed_sequence``: chunked attention's chunks restart at every document),
    or from the row's key 0, only cutting the mask at the documents' boundaries (5.16.1 checked)."""
    from transformers import masking_utils

    return hasattr(masking_utils, "remap_positions_for_packed_sequence")


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


# ---- bitsandbytes ---------------------------------------------------------------------------------


def keep_4bit_weights_unpacked(model: Any) -> int:
    """Turn off, on each bitsandbytes ``Linear4bit`` of ``model``, the CPU inference repacking; returns how many.

    bitsandbytes 0.50's ``Linear4bit.forward``, on a CPU with avx512_bf16, in eval mode, for an input that does not
    require grad, replaces the module's packed weight in place by a CPU inference layout whose per-block scales are
    rounded to bfloat16 (``_convert_weight_packed_for_cpu``, undone only approximately). From then on every forward,
    training ones included, computes with other weights than dequant(W4), and some crash. transformers'
    ``from_pretrained`` returns models in eval mode, so any no-grad forward of a 4-bit model (an eval pass, a GRPO
    rollout, a probe) would change it silently. The switch is the module's own per-instance flag
    (``support_avx512bf16_for_cpu``, read at each forward); call this right after loading, before any forward.

    Raises:
        ValueError: a module was repacked already (its scales are rounded): load the model again.
    """
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:  # never imported: no module of ``model`` can be a bitsandbytes one
        return 0
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        if getattr(getattr(module.weight, "quant_state", None), "packing_format_for_cpu", False):
            raise ValueError(f"{name}: its 4-bit weight was already repacked for CPU inference (bfloat16 scales) by "
                             "a no-grad forward in eval mode: call keep_4bit_weights_unpacked before any forward")
        module.support_avx512bf16_for_cpu = False
        count += 1
    return count


# ---- DeepSpeed ------------------------------------------------------------------------------------


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
                f"sequence parallelism under torch.compile needs DeepSpeed 0.19 (DeepSpeed {_deepspeed_version()}'s "
                "all-to-all gives zero gradients when compiled): run the model eagerly, or pip install "
                "'deepspeed>=0.19.8'"
            )
        return function.apply(group, blocks)

    return all_to_all, lambda group: None


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


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


_Z3_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"

ZERO3_SP_AVERAGE_VERSIONS: dict[str, bool] = {"0.18.9": True, "0.19.8": True}
"""DeepSpeed releases whose ZeRO-3 gradient average under sequence parallelism was checked, and whether
it needs correcting (0.18.9 by the floor run's ZeRO-3 parity test, with the same correction). In 0.19.8 (as in
0.18.9) ``reduce_scatter_coalesced`` divides by the world size and
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
        version = _deepspeed_version()
    if _release(version) in ZERO3_SP_AVERAGE_VERSIONS:
        return None
    checked = ", ".join(sorted(ZERO3_SP_AVERAGE_VERSIONS))
    return (
        f"ZeRO stage 3 with sequence parallelism on DeepSpeed {version}: ds_longseq checked ZeRO-3's gradient "
        f"average under sequence parallelism on DeepSpeed {checked} only (they average over the world "
        "instead of world / sequence_parallel_size and are corrected); use ZeRO stage 2, or DeepSpeed " + checked
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
        version = _deepspeed_version()
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


def _same(a: Any, b: Any) -> bool:
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def _relinked_zero12_fragments(optimizer: Any) -> list[str]:
    """Point each parameter's fp32 fragment and optimizer-state fragments (``_hp_mapping.hp_fragment`` /
    ``optim_fragment``, what ``deepspeed.utils.safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``
    read and ``safe_set_*`` write) back into the ZeRO-1/2 optimizer's fp32 partition and its state.

    DeepSpeed 0.18 (0.18.9 checked): its universal load (``map_to_flat_opt_states``) re-points ``hp_fragment`` at
    each new optimizer-state buffer in turn, so it ends on the last one (``exp_avg_sq`` read as the fp32 weight),
    and leaves ``optim_fragment`` copies that the steps do not update; 0.19 sets the state fragments instead. The
    step itself uses the partition and its state, so training was right and only these reads were wrong."""
    lp_groups = getattr(optimizer, "bit16_groups", None)
    if lp_groups is None:
        return []
    inner = optimizer.optimizer
    relinked = 0
    for index, group in enumerate(inner.param_groups):
        flat = group["params"][0]
        state = inner.state.get(flat, {})
        for lp in lp_groups[index]:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:
                continue
            where = mapping.get_hp_fragment_address()
            right = flat.narrow(0, where.start, where.numel)
            if mapping.hp_fragment.data_ptr() != right.data_ptr():
                mapping.hp_fragment = right
                mapping.optim_fragment = {key: value.narrow(0, where.start, where.numel)
                                          for key, value in state.items()
                                          if getattr(value, "shape", None) == flat.shape}
                relinked += 1
    return [f"the fp32 and optimizer-state views of {relinked} parameters relinked"] if relinked else []


def repair_zero3_universal_load(engine: Any, universal_dir: str) -> list[str]:
    """Undo two slips of DeepSpeed ZeRO-3's universal-checkpoint load (``DeepSpeedZeroOptimizer_Stage3.
    load_hp_checkpoint_state_from_checkpoint_dir_stage3``, 0.19.8) on ``engine``'s optimizer, right after
    ``engine.load_checkpoint`` read ``universal_dir``; returns what was repaired (empty: nothing to).

    - It gives every sub-group's optimizer state the same ``step`` tensor object. torch's Adam increments its step
      in place, once per sub-group per step, so with two sub-groups (the Trainer's decay / no-decay groups, or a model
      larger than ``sub_group_size``) the shared count runs ahead and Adam's bias correction is off from the first
      step after the load (seen: 9e-4 on every LayerNorm weight after one step). Each state gets its own copy.
    - It copies the first parameter group's hyperparameters (``weight_decay``, ``lr``, ...) into every group, so a
      no-decay group would decay. Each group gets its own back from the checkpoint's ``optimizer_state.pt``.

    Under ZeRO-1/2 it relinks what DeepSpeed 0.18's load left pointing elsewhere (``_relinked_zero12_fragments``).

    The repairs restore what the checkpoint holds, so on a DeepSpeed that loads right they change nothing: keyed
    on what the load left, not on a version."""
    if engine.zero_optimization_stage() in (1, 2):
        return _relinked_zero12_fragments(engine.optimizer)
    if engine.zero_optimization_stage() != 3:
        return []
    import os

    import torch

    optimizer = engine.optimizer.optimizer  # the torch optimizer ZeRO-3 steps, one sub-group at a time
    repaired, seen, untied = [], set(), 0
    for state in optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
                untied += 1
            seen.add(id(state["step"]))
    if untied:
        repaired.append(f"the Adam step count {untied + 1} sub-groups shared untied")
    saved = torch.load(os.path.join(universal_dir, "zero", "optimizer_state.pt"), map_location="cpu",
                       weights_only=False)["optimizer_state_dict"]["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise RuntimeError(f"{universal_dir} has {len(saved)} optimizer parameter groups, this run's optimizer "
                           f"{len(optimizer.param_groups)}: resume with the optimizer settings that wrote it")
    for index, (group, loaded) in enumerate(zip(optimizer.param_groups, saved, strict=True)):
        wrong = sorted(k for k, v in loaded.items() if k != "params" and not _same(group.get(k), v))
        for key in wrong:
            group[key] = loaded[key]
        if wrong:
            repaired.append(f"group {index}'s {', '.join(wrong)} restored")
    return repaired


# ---- torch -------------------------------------------------------------------------------------------


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


# ---- transformers' Trainer, TRL's trainers, accelerate --------------------------------------------------------
# The Trainer integration (ds_longseq/trainer/) goes through these: each is a private name, or a change to an
# object the Trainer, TRL or accelerate owns, written against transformers 5.24, TRL 1.16 and accelerate 1.x; where
# TRL 1.9 differs, the function says so (trl_makes_fused_head_calls).


def keys_ignored_on_save(model: Any) -> set[str]:
    """The state-dict keys a transformers model leaves out of ``save_pretrained`` (its ``_keys_to_ignore_on_save``)."""
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())


def trainer_checkpointing_turned_off(trainer: Any) -> bool:
    """Turn the Trainer's activation checkpointing off (the model's, and ``TrainingArguments``' flags, which the
    Trainer applies in ``train()``); whether any was on."""
    model_on = activation_checkpointing_on(trainer.model)
    names = [name for name in ("activation_checkpointing", "gradient_checkpointing")
             if getattr(trainer.args, name, False)]
    if model_on:
        set_activation_checkpointing(trainer.model, False)
    for name in names:
        setattr(trainer.args, name, False)
    return bool(model_on or names)


def trainer_counts_batch_tokens(trainer: Any) -> None:
    """Give the model the batch's token count again (``num_items_in_batch``), which the Trainer withholds under
    ``parallelism_config``'s sequence parallelism (its ALST loss counts each shard's tokens itself): the Trainer's own
    test of whether the model takes loss kwargs, without parallelism_config."""
    from transformers.trainer_utils import unwrap_peft_model

    base = unwrap_peft_model(trainer.accelerator.unwrap_model(trainer.model))
    if hasattr(base, "accepts_loss_kwargs"):
        accepts = bool(base.accepts_loss_kwargs)
    else:
        params = inspect.signature(base.forward).parameters.values()
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    trainer.model_accepts_loss_kwargs = accepts


def trainer_micro_batch_size(trainer: Any) -> int:
    """Sequences per rank per micro-step, as the Trainer sized its dataloader (its ``_train_batch_size``)."""
    return trainer._train_batch_size


def trainer_num_items_in_batch(trainer: Any, batches: list, device: Any) -> Any:
    """The token count the Trainer's own step gives the loss for ``batches`` (its ``_get_num_items_in_batch``)."""
    return trainer._get_num_items_in_batch(batches, device)


def trainer_prepared_inputs(trainer: Any, inputs: Any) -> Any:
    """``inputs`` as the Trainer's own step prepares them (its ``_prepare_inputs``: moved to the device, and where
    TRL's trainers generate, generated; ds_longseq's mixin override included)."""
    return trainer._prepare_inputs(inputs)


def trainer_loss_scale(trainer: Any, num_items_in_batch: Any) -> float:
    """The factor ``Trainer.training_step`` puts on the loss ``compute_loss`` returns before its backward
    (transformers 5.24's four lines: 1 / the accumulation steps unless the loss is already scaled for them)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None)
    return 1.0 if scaled else 1.0 / trainer.current_gradient_accumulation_steps


def trl_metrics(trainer: Any, mode: str) -> dict[str, list[float]]:
    """A TRL trainer's metric values logged so far in this logging window (``"train"`` or ``"eval"``), by key."""
    return trainer._metrics[mode]


def trl_entropy_bonus_enabled(trainer: Any) -> bool:
    """Whether TRL's GRPO trainer adds an entropy bonus (``entropy_coef`` / ``use_adaptive_entropy``)."""
    return bool(getattr(trainer, "_entropy_bonus_enabled", False))


def trl_makes_fused_head_calls() -> bool:
    """Whether the installed TRL's trainers read their per-token outputs from fused-LM-head calls
    (``model(..., labels=..., fused_lm_head=True)``, the protocol of ``trl.trainer.utils.add_fused_lm_head``).

    TRL 1.16 (1.16.0 checked): yes, SFT, DPO and GRPO make only such calls for their losses. TRL 1.9 (1.9.0 checked):
    there is no ``add_fused_lm_head``; DPO and GRPO call the model without labels and read ``outputs.logits``, SFT
    (``loss_type="chunked_nll"``, its default) makes ``labels=`` calls and reads the sums of the forward it patches in
    (``trainer/trl.py`` says what ds_longseq answers each with). Decided on the function's presence."""
    import trl.trainer.utils

    return hasattr(trl.trainer.utils, "add_fused_lm_head")


@contextlib.contextmanager
def accelerator_gather_replaced(accelerator: Any, gather: Callable[[Callable, Any], Any]) -> Iterator[None]:
    """Inside: ``accelerator.gather(t)`` is ``gather(original_gather, t)`` on this accelerator only; restored on
    exit."""
    original = accelerator.gather
    accelerator.gather = functools.partial(gather, original)
    try:
        yield
    finally:
        del accelerator.gather  # the instance attribute: the class's method shows through again


@contextlib.contextmanager
def accelerate_parallelism_hidden(accelerator: Any, hidden: bool = True) -> Iterator[None]:
    """Inside: accelerate's state has no ``parallelism_config`` (so neither accelerate nor the Trainer does its part
    of ALST); restored on exit. A no-op with ``hidden=False``."""
    if not hidden:
        yield
        return
    state = accelerator.state
    config = state.parallelism_config
    state.parallelism_config = None
    try:
        yield
    finally:
        state.parallelism_config = config


def dataloader_resharded(dataloader: Any, replica: int, replicas: int, what: str) -> Any:
    """``dataloader`` (accelerate's, sharded over every rank) sharded over ``replicas`` instead, this process being
    ``replica``: its batch sampler's (or its iterable dataset shard's) process count and index are set.

    Raises:
        ValueError: accelerate dispatches batches from rank 0, or the dataloader is not one of accelerate's.
    """
    import torch.distributed as dist

    batch_sampler = getattr(dataloader, "batch_sampler", None)
    dataset = getattr(dataloader, "dataset", None)
    if type(dataloader).__name__ == "DataLoaderDispatcher":
        raise ValueError(
            "accelerate dispatches batches from rank 0 (an iterable dataset, or dispatch_batches=True): under "
            "ds_longseq sequence parallelism every rank reads its group's batches itself. Pass "
            "TrainingArguments(accelerator_config={'dispatch_batches': False})"
        )
    if hasattr(batch_sampler, "num_processes") and hasattr(batch_sampler, "process_index"):
        batch_sampler.num_processes, batch_sampler.process_index = replicas, replica
    elif hasattr(dataset, "num_processes") and hasattr(dataset, "process_index"):  # IterableDatasetShard
        dataset.num_processes, dataset.process_index = replicas, replica
    elif dist.get_world_size() > 1:
        raise ValueError(
            f"cannot share the {what} batches within sequence-parallel groups: unknown dataloader "
            f"{type(dataloader).__name__} (expected accelerate's DataLoaderShard)"
        )
    return dataloader
