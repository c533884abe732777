"""The one place where ds_longseq changes third-party objects, per model instance and undoably.

Holds:
    enable / disable: apply and undo long-sequence training on a loaded ``*ForCausalLM``.
    PatchHandle: the record of what was changed on one model, in order, with its undo.

What is changed, all on the given instance:
    - ``config._attn_implementation`` -> "ds_longseq" (streambp), after registering that NEW name
      with transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` (existing names such
      as "sdpa" are never overwritten, so other models in the process are unaffected);
    - ``layer.forward`` of each decoder layer (streambp; mini_seq with offload: a layer checkpoint),
      ``mlp.forward`` of each MLP (mini_seq);
    - ``model.forward`` (lm_head, and the ``use_cache=False`` default of streambp and offload),
      ``lm_head.forward`` (lm_head: the loss is computed inside the head module's call, for ZeRO-3's hooks);
    - ``_z3_leaf`` on decoder layers / MLPs (``mark_zero3_leaves``, DeepSpeed's own flag) so ZeRO-3
      gathers a layer's weights once for its whole chunk loop;
    - offload of layer inputs: a forward pre-hook and a forward hook on the base model (``model.model``)
      that check host memory and hand each training forward a fresh offloader; ``disable`` frees the
      pooled host memory;
    - sequence parallelism: ``config._attn_implementation`` -> "ds_longseq" (Ulysses attention) and a
      forward pre-hook on the base model (``model.model``) that passes each forward's shard context;
    - DeepSpeed ZeRO-3 + sequence parallelism: one method of the engine's optimizer INSTANCE
      (``fix_zero3_sequence_parallel_average``), correcting DeepSpeed 0.19.8's gradient average;
    - Approx-BP (``approx_bp``): ``forward`` of each SiLU/GELU activation module in the decoder layers
      (``activation``); with ``norm``, each foldable norm's weight is folded into the weights of the
      linear maps after it (a re-parameterisation that keeps the model's function; it is NOT undone by
      ``disable``, see docs/APPROX_BP.md), the norm weight frozen at 1 and its ``forward`` replaced;
    - adjoint sharding (``adjoint``, SSM models only): the ``adjoint_plan`` attribute of a
      ``ds_longseq.adjoint.ResidualSSMForCausalLM`` instance, which its training forward reads; the
      ``forward`` of a transformers ``MambaForCausalLM`` instance (``HFAdjointForward``);
    - ``deepspeed.initialize`` itself, only inside ``deepspeed_initialize_replaced`` (restored on
      exit): the Hugging Face Trainer integration reaches DeepSpeed through accelerate, which looks
      the function up on the module at call time.
Instance attributes shadow the class methods, so ``disable`` only deletes them again; hooks are removed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch

from ds_longseq.adjoint import ResidualSSMForCausalLM, make_plan
from ds_longseq.adjoint.stacks import HFAdjointForward, ssm_stack
from ds_longseq.config import LongSeqConfig
from ds_longseq.logging import get_logger, warn_once
from ds_longseq.models.adapters import DecoderLMAdapter, get_adapter, norm_kind
from ds_longseq.modules.approx_bp import ApproxActivationForward, MSNormForward, fold_norm, fold_targets
from ds_longseq.modules.attention import ATTN_IMPLEMENTATION, longseq_attention, longseq_mask
from ds_longseq.modules.causal_lm import CausalLMForward, FusedHeadSettings, LMHeadLossForward
from ds_longseq.modules.decoder_layer import CheckpointLayerForward, StreamBPLayerForward
from ds_longseq.modules.mlp import MiniSeqMLPForward
from ds_longseq.modules.moe import RouterTap, check_output_capturing
from ds_longseq.modules.offload import LayerInputOffload
from ds_longseq.modules.sequence_parallel import SequenceParallel, SequenceParallelForwardHook
from ds_longseq.ops.approx_bp import APPROX_ACTIVATIONS

logger = get_logger(__name__)

__all__ = [
    "enable",
    "disable",
    "PatchHandle",
    "is_enabled",
    "get_config",
    "mark_zero3_leaves",
    "fix_zero3_sequence_parallel_average",
    "sequence_parallel_of",
    "configure_fused_lm_head",
    "deepspeed_initialize_replaced",
]

_HANDLE_ATTR = "_ds_longseq_handle"


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` inside a PEFT ``PeftModel`` (``get_base_model()``), or ``model`` itself.

    ds_longseq patches that inner model; the PEFT wrapper's forward reaches it unchanged, and its
    LoRA layers sit inside the patched decoder layers, so either order (enable then wrap, or wrap
    then enable) trains the same. Duck-typed: peft stays an optional dependency.
    """
    if type(model).__name__.startswith("Peft") and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model
_MISSING = object()


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, longseq_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, longseq_mask)


class PatchHandle:
    """What ``enable`` changed on one model; :meth:`undo` restores it exactly."""

    def __init__(self, model: torch.nn.Module, config: LongSeqConfig):
        self.model = model
        self.config = config
        self._undo: list[Callable[[], None]] = []
        self.sp: SequenceParallel | None = None  # the model's sequence-parallel group, when enabled with one
        self.forward: CausalLMForward | None = None  # the model forward installed, when one is

    def set_instance_attr(self, obj: Any, name: str, value: Any) -> None:
        previous = obj.__dict__.get(name, _MISSING)
        object.__setattr__(obj, name, value)

        def restore():
            if previous is _MISSING:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, previous)

        self._undo.append(restore)

    def add_hook(self, hook_handle) -> None:
        """Record a ``torch.utils.hooks.RemovableHandle`` to remove on undo."""
        self._undo.append(hook_handle.remove)

    def add_undo(self, fn: Callable[[], None]) -> None:
        """Record a call to make on undo (after everything recorded later is undone)."""
        self._undo.append(fn)

    def set_attn_implementation(self, hf_config: Any, name: str) -> None:
        previous = hf_config._attn_implementation
        hf_config._attn_implementation = name
        self._undo.append(lambda: setattr(hf_config, "_attn_implementation", previous))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def _sequence_parallel_group(cfg: LongSeqConfig, group):
    """The process group for ``cfg.sequence_parallel``: ``group``, else DeepSpeed's initialised one."""
    import torch.distributed as dist

    size = cfg.sequence_parallel.size
    if group is None:
        try:
            import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu

            group = mpu._SEQUENCE_PARALLEL_GROUP
        except ImportError:  # pragma: no cover - deepspeed is an install requirement
            group = None
    if group is None or not dist.is_initialized():
        raise RuntimeError(
            f"long_seq.sequence_parallel.size={size} needs a process group of {size} ranks: create the engine with "
            "ds_longseq.engine.initialize(...), or pass enable(model, config, sp_group=<group>) after "
            "torch.distributed.init_process_group"
        )
    if dist.get_world_size(group) != size:
        raise ValueError(
            f"long_seq.sequence_parallel.size={size} but the sequence-parallel group has "
            f"{dist.get_world_size(group)} ranks: make them equal"
        )
    return group


def enable(
    model: torch.nn.Module, config: Mapping[str, Any] | LongSeqConfig | None, *, sp_group=None
) -> torch.nn.Module:
    """Apply long-sequence training to a loaded ``*ForCausalLM`` in place and return it.

    Args:
        model: a supported Hugging Face causal LM instance (see ``SUPPORTED_MODEL_TYPES``), or a PEFT
            ``PeftModel`` around one (the inner model is patched; LoRA may also be added after).
        config: the ``long_seq`` section as a dict or :class:`LongSeqConfig`.
        sp_group: with ``sequence_parallel.size > 1``, the process group of the ranks that share a
            sequence; default: DeepSpeed's (``parallel_state_sp``), as ``engine.initialize`` sets up.

    Returns:
        The same model. Other instances of its class are untouched; ``disable(model)`` undoes it.

    Raises:
        LongSeqConfigError: the config is invalid (every problem listed).
        UnsupportedModelError: the model or one of its settings is not supported.
        RuntimeError: the model is already enabled.
    """
    cfg = LongSeqConfig.from_dict(config)
    wrapper, model = model, _causal_lm(model)  # a PEFT model: its inner *ForCausalLM is patched
    if is_enabled(model):
        raise RuntimeError("ds_longseq is already enabled on this model: call ds_longseq.disable(model) first")
    if cfg.adjoint.enabled:
        _enable_adjoint(model, cfg)
        return wrapper
    adapter = get_adapter(model, cfg)
    sp = None
    if cfg.sequence_parallel.enabled:
        text = model.config.get_text_config()
        sp = SequenceParallel(
            _sequence_parallel_group(cfg, sp_group),
            text.num_attention_heads,
            getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        )
    handle = PatchHandle(model, cfg)
    handle.sp = sp
    try:
        _apply_approx_bp(handle, adapter, cfg)
        if cfg.streambp.enabled or sp is not None:
            _register_attention()
            handle.set_attn_implementation(model.config, ATTN_IMPLEMENTATION)
        if sp is not None:
            hook = SequenceParallelForwardHook(sp, cfg.streambp.kv_block_size)
            handle.add_hook(adapter.base_model.register_forward_pre_hook(hook, with_kwargs=True))
        offload = None
        if cfg.offload.layer_inputs == "cpu":
            offload = LayerInputOffload(len(adapter.layers), model.config.get_text_config().hidden_size)
            handle.add_undo(offload.close)
            # After the sequence-parallel hook (registration order), so it sees the local shard's shape.
            base = adapter.base_model
            handle.add_hook(base.register_forward_pre_hook(offload.before_forward, with_kwargs=True))
            handle.add_hook(base.register_forward_hook(offload.after_forward, with_kwargs=True, always_call=True))
        taps = {}  # mixture-of-experts layers: chunked layers return their router logits whole
        if cfg.streambp.enabled or cfg.mini_seq.enabled:
            for layer in adapter.layers:
                router = adapter.router(layer)
                if router is not None:
                    check_output_capturing()
                    taps[layer] = RouterTap()
                    handle.add_hook(router.register_forward_hook(taps[layer]))
        if cfg.streambp.enabled:
            for layer in adapter.layers:
                handle.set_instance_attr(
                    layer,
                    "forward",
                    StreamBPLayerForward(layer, layer.forward, cfg.streambp, offload, router_tap=taps.get(layer)),
                )
        if cfg.mini_seq.enabled:
            for layer in adapter.layers:
                mlp = adapter.mlp(layer)
                handle.set_instance_attr(
                    mlp,
                    "forward",
                    MiniSeqMLPForward(mlp, mlp.forward, cfg.mini_seq.mlp_num_chunks, router_tap=taps.get(layer)),
                )
                if offload is not None:
                    handle.set_instance_attr(
                        layer, "forward", CheckpointLayerForward(layer, layer.forward, offload, moe=layer in taps)
                    )
        if cfg.lm_head.enabled:
            head = adapter.lm_head
            handle.set_instance_attr(
                head,
                "forward",
                LMHeadLossForward(head, head.forward, cfg.lm_head.chunk_size, adapter.final_logit_softcap),
            )
        # Every path: the model forward also masks packed documents' boundary targets.
        if cfg.lm_head.enabled or cfg.streambp.enabled or cfg.mini_seq.enabled or sp is not None or offload is not None:
            forward = CausalLMForward(
                model,
                model.forward,
                cfg,
                sp,
                adapter.final_logit_softcap,
                decoder=adapter.base_model,
                head=adapter.lm_head,
            )
            handle.set_instance_attr(model, "forward", forward)
            handle.forward = forward
        handle.set_instance_attr(model, _HANDLE_ATTR, handle)
    except BaseException:
        handle.undo()
        raise
    return wrapper


def _enable_adjoint(model: torch.nn.Module, cfg: LongSeqConfig) -> None:
    """``long_seq.adjoint``: set the model's adjoint plan (its training forward reads it).

    In a distributed job every process is one stage of the layer split; gradients are scaled by the
    world size, because each parameter's gradient is produced on one rank and the data-parallel
    reduction (DeepSpeed's, or DDP's) averages over all of them.
    """
    import torch.distributed as dist

    stack = ssm_stack(model)  # raises for a model that is not a residual SSM stack, naming why
    world_size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    plan = make_plan(
        len(stack.layers),
        chunk_size=cfg.adjoint.chunk_size,
        truncation=cfg.adjoint.truncation,
        layer_split=cfg.adjoint.layer_split,
        world_size=world_size,
        rank=rank,
        grad_scale=float(world_size),
    )
    handle = PatchHandle(model, cfg)
    if isinstance(model, ResidualSSMForCausalLM):
        handle.set_instance_attr(model, "adjoint_plan", plan)
    else:  # a transformers SSM: its training forward is replaced on this instance
        handle.set_instance_attr(model, "forward", HFAdjointForward(model, model.forward, plan))
    handle.set_instance_attr(model, _HANDLE_ATTR, handle)


@contextlib.contextmanager
def _gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Inside: ZeRO-3-partitioned ``params`` (a model built under ``deepspeed.zero.Init``) are whole, and
    what rank 0 writes to them is partitioned back to every rank on exit; other params pass through."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
        yield


def _apply_approx_bp(handle: PatchHandle, adapter: DecoderLMAdapter, cfg: LongSeqConfig) -> None:
    """Install ``cfg.approx_bp`` (validated by ``get_adapter``): step-derivative activations, folded MS norms."""
    approx = cfg.approx_bp
    if approx.activation is not None:
        step = APPROX_ACTIVATIONS[approx.activation]
        for layer in adapter.layers:
            for _, act, _ in adapter.activations(layer):
                handle.set_instance_attr(act, "forward", ApproxActivationForward(act, act.forward, step))
    if approx.norm is None:
        return
    spec = adapter.spec
    layers_where = f"{spec.decoder_attr}.{spec.layers_attr}"
    folds = []  # (where, norm, [(consumer path, module, param name)])
    for i, layer in enumerate(adapter.layers):
        for norm_path, consumers in spec.norm_folds:
            targets = []
            for path in consumers:
                module_path, _, param = path.rpartition(".")
                targets.append((f"{layers_where}[{i}].{module_path}", layer.get_submodule(module_path), param))
            folds.append((f"{layers_where}[{i}].{norm_path}", layer.get_submodule(norm_path), targets))
    head = adapter.lm_head
    final_where = f"{spec.decoder_attr}.{spec.final_norm_attr}"
    if head.weight is adapter.model.get_input_embeddings().weight:
        warn_once(
            logger,
            f"ds_longseq approx_bp.norm: {final_where} stays a stock norm: the LM head's weight is tied to the input "
            "embeddings, and folding the norm's weight into it would change the embeddings",
        )
    else:
        folds.append((final_where, adapter.final_norm, [(spec.lm_head_attr, head, "weight")]))
    resolved = []
    for where, norm, consumers in folds:
        targets = [t for path, module, param in consumers for t in fold_targets(module, param, path)]
        resolved.append((where, norm, targets))
    params = [p for _, norm, targets in resolved for p in (*norm.parameters(), *(t.weight for t in targets))]
    params += [t.bias for _, _, targets in resolved for t in targets if t.bias is not None]
    with _gathered(list({id(p): p for p in params}.values())):
        for where, norm, targets in resolved:
            fold_norm(where, norm.weight, getattr(norm, "bias", None), targets)
    for where, norm, _ in resolved:
        kind = norm_kind(norm)
        eps = norm.variance_epsilon if kind == "rms" else norm.eps
        for p in norm.parameters():
            if p.requires_grad:
                p.requires_grad_(False)  # fixed at 1 (0): the forward no longer reads it
                handle.add_undo(lambda p=p: p.requires_grad_(True))
        handle.set_instance_attr(norm, "forward", MSNormForward(norm, kind, eps, where))


def mark_zero3_leaves(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Mark the modules whose chunk loops must see their weights gathered as ZeRO-3 leaf modules.

    DeepSpeed ZeRO-3 gathers a leaf module's parameters in the module's own pre-forward hook and
    registers no hooks on its children, so the chunk loop inside (StreamBP layer, MsT MLP) runs on
    weights gathered once per forward and once per backward. Must run before
    ``deepspeed.initialize``; recorded on the model's handle, so :func:`disable` undoes it.

    Returns:
        The modules marked.
    """
    model = _causal_lm(model)
    handle = model.__dict__.get(_HANDLE_ATTR)
    if handle is None:
        raise RuntimeError("mark_zero3_leaves needs ds_longseq.enable(model, ...) first")
    adapter = get_adapter(model, handle.config)
    leaves = []
    if handle.config.streambp.enabled:
        leaves = adapter.layers
    elif handle.config.mini_seq.enabled and handle.config.offload.layer_inputs is not None:
        # The layer checkpoint passes all the layer's weights to one Function, so the whole layer is
        # gathered for it; its MLP is marked too only to pass the MLP's own leaf check (DeepSpeed never
        # looks at the children of a leaf).
        leaves = [m for layer in adapter.layers for m in (layer, adapter.mlp(layer))]
    elif handle.config.mini_seq.enabled:
        leaves = [adapter.mlp(layer) for layer in adapter.layers]
    for module in leaves:
        # The same attribute deepspeed.utils.set_z3_leaf_modules sets, on these instances only.
        handle.set_instance_attr(module, "_z3_leaf", True)
        handle.add_hook(module.register_forward_pre_hook(_leaf_input_requires_grad, with_kwargs=True, prepend=True))
    return leaves


def _leaf_input_requires_grad(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a ZeRO-3 leaf: give its hidden-state input ``requires_grad`` when only
    its weights need gradients (a frozen embedding below LoRA layers, say).

    DeepSpeed reduces a leaf module's gradients in the module's full backward hook, and PyTorch fires
    that hook *before* the module's backward when no input requires grad: the leaf's weights would be
    reduced as zeros and released before their real gradients arrive. A detached alias that requires
    grad makes the hook fire after; its input gradient (one extra product in the first layer) is
    discarded.
    """
    if not torch.is_grad_enabled() or not any(p.requires_grad for p in module.parameters()):
        return None
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() and not args[0].requires_grad:
        return (args[0].detach().requires_grad_(), *args[1:]), kwargs
    hidden = kwargs.get("hidden_states")
    if not args and isinstance(hidden, torch.Tensor) and hidden.is_floating_point() and not hidden.requires_grad:
        return args, {**kwargs, "hidden_states": hidden.detach().requires_grad_()}
    return None


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable` on ``model`` (a no-op for a model that is not enabled) and return it."""
    handle = _causal_lm(model).__dict__.get(_HANDLE_ATTR)
    if handle is not None:
        handle.undo()
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether :func:`enable` is in effect on ``model`` (or on the model inside a PEFT wrapper)."""
    return _HANDLE_ATTR in _causal_lm(model).__dict__


def get_config(model: torch.nn.Module) -> LongSeqConfig | None:
    """The :class:`LongSeqConfig` in effect on ``model``, or None."""
    handle = _causal_lm(model).__dict__.get(_HANDLE_ATTR)
    return None if handle is None else handle.config


def sequence_parallel_of(model: torch.nn.Module) -> SequenceParallel | None:
    """The :class:`SequenceParallel` of an enabled model (``paused()``, ``local_losses()``), or None."""
    handle = _causal_lm(model).__dict__.get(_HANDLE_ATTR)
    return None if handle is None else handle.sp


def configure_fused_lm_head(
    model: torch.nn.Module,
    *,
    temperature: float = 1.0,
    outputs: tuple[str, ...] = FusedHeadSettings.outputs,
    cast_lm_head_to_fp32: bool = False,
) -> None:
    """Set what TRL's fused-LM-head calls (``model(..., labels=, fused_lm_head=True)``) compute on an
    enabled model: the arguments TRL gave ``trl.trainer.utils.add_fused_lm_head`` for it.

    ds_longseq's forward answers those calls in place of TRL's head (see
    ``modules.causal_lm.CausalLMForward.configure_fused_head``), so the temperature (GRPO), the
    per-token fields the trainer reads (DPO's ``mean_logits``, ``log_sum_sq_probs``) and
    ``cast_lm_head_to_fp32`` must be given again here. ``LongSeqTrainerMixin`` does it from the TRL
    trainer; call it yourself when you enable a model after TRL added its head, without the mixin.
    (A model enabled before TRL adds its head is answered by TRL's head over ds_longseq's decoder.)

    Raises:
        RuntimeError: the model is not enabled, or enabled with nothing that installs ds_longseq's forward.
        ValueError: a non-positive temperature or an output ds_longseq does not compute.
    """
    handle = _causal_lm(model).__dict__.get(_HANDLE_ATTR)
    if handle is None:
        raise RuntimeError("configure_fused_lm_head needs ds_longseq.enable(model, ...) first")
    if handle.forward is None:
        raise RuntimeError(
            "configure_fused_lm_head: the long_seq config enables nothing, so ds_longseq installed no forward and "
            "TRL's own fused head serves the calls; configure it through add_fused_lm_head instead"
        )
    handle.forward.configure_fused_head(
        temperature=temperature, outputs=outputs, cast_lm_head_to_fp32=cast_lm_head_to_fp32
    )


@contextlib.contextmanager
def deepspeed_initialize_replaced(stand_in: Callable[..., Any]) -> Iterator[None]:
    """Inside: ``deepspeed.initialize`` is ``functools.partial(stand_in, original)``; restored on exit.

    ``stand_in(original, **kwargs)`` receives the original function first, to call it. Used around
    Hugging Face ``Trainer`` calls, whose accelerate looks ``deepspeed.initialize`` up on the module
    when it prepares the model, so the engine is built the way ``ds_longseq.engine.initialize``
    builds it (sequence-parallel groups, ZeRO-3 leaves and its average fix).
    """
    import functools

    import deepspeed

    original = deepspeed.initialize
    deepspeed.initialize = functools.partial(stand_in, original)
    try:
        yield
    finally:
        deepspeed.initialize = original


_Z3_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def _zero3_scatter_ignores_sequence_parallel() -> bool:
    """Whether this DeepSpeed's ZeRO-3 reduce-scatter path averages gradients over the whole world.

    In DeepSpeed 0.19.8 ``reduce_scatter_coalesced`` divides by the world size and
    ``__avg_scatter_grads`` never multiplies ``sequence_parallel_size`` back, while every other
    reduction (ZeRO-1/2, ZeRO-3's contiguous all-reduce path) divides by world / SP. Probed from the
    source so that a DeepSpeed that fixes it is not corrected twice.
    """
    import inspect

    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    def source(fn) -> str:
        # DeepSpeed's nvtx decorator keeps the function in its closure, without functools.wraps.
        while True:
            inner = getattr(fn, "__wrapped__", None)
            if inner is None:
                cells = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())]
                funcs = [c for c in cells if inspect.isfunction(c)]
                inner = funcs[0] if len(funcs) == 1 and fn.__name__ == "wrapped_fn" else None
            if inner is None:
                return inspect.getsource(fn)
            fn = inner

    method = getattr(DeepSpeedZeroOptimizer_Stage3, _Z3_SCATTER, None)
    try:
        method_src = source(method)
        scatter_src = source(coalesced_collectives.reduce_scatter_coalesced)
    except (TypeError, OSError) as err:
        raise RuntimeError(
            "ds_longseq cannot read DeepSpeed's ZeRO-3 gradient averaging to check it under sequence parallelism "
            f"(DeepSpeed 0.19.8 averages over the world instead of world / sequence_parallel_size): {err}. "
            "Use ZeRO-2, or DeepSpeed 0.19.8."
        ) from err
    return "sequence_parallel_size" not in method_src and "div_(world_sz)" in scatter_src


def fix_zero3_sequence_parallel_average(optimizer, sp_size: int) -> bool:
    """Make a ZeRO-3 optimizer's reduce-scatter average over data-parallel replicas (world / SP).

    Under sequence parallelism each rank's gradient is its share of its replica's loss, so the
    replicas' gradients are the sums over their SP ranks and DeepSpeed must divide by world / SP, as
    its other reduction paths do. DeepSpeed 0.19.8's ZeRO-3 reduce-scatter path (the default,
    ``reduce_scatter: true``) divides by the world instead: gradients SP times too small. This wraps
    that method on the given optimizer instance only, multiplying its partitions by ``sp_size``.

    Returns:
        Whether the fix was applied (False when this DeepSpeed does not need it).
    """
    if sp_size <= 1 or not _zero3_scatter_ignores_sequence_parallel():
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
