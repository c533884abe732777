"""``enable`` / ``disable``: the short driver that applies the active techniques to one model instance.

Holds:
    enable / disable / is_enabled / get_config: apply, undo and inspect long-sequence training on a
        loaded ``*ForCausalLM`` (or the one inside a PEFT wrapper).
    mark_zero3_leaves: the ZeRO-3 leaf modules the active techniques need (before ``deepspeed.initialize``).
    sequence_parallel_of, configure_fused_lm_head, configure_loss_statistics: the model's sequence-parallel group;
        TRL's fused-head settings; TRL 1.9's statistics of a loss call.

``enable`` parses the config once, finds the model's family (``ds_longseq.families``), asks every active
technique (``ds_longseq.techniques``, in their declared order) what it cannot run, refuses with every
reason at once, then lets each install itself, and finally installs ds_longseq's causal-LM forward when
any active technique uses it. Every change is made on the given instance and recorded on a
``techniques.PatchHandle``: instance attributes shadow the class methods, so ``disable`` only deletes
them again; hooks are removed; other instances of the class are untouched. The one exception is
Approx-BP's norm folding, a re-parameterisation of the weights (docs/APPROX_BP.md).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ds_longseq import compat
from ds_longseq.config import LongSeqConfig
from ds_longseq.families import UnsupportedModelError, decoder_adapter
from ds_longseq.families.discovery import MOE_AUX_KINDS
from ds_longseq.forwards.attn_spec import AttentionSettings
from ds_longseq.forwards.causal_lm import CausalLMForward, CausalLMSettings
from ds_longseq.forwards.sp_model import SequenceParallel
from ds_longseq.forwards.token_outputs import FusedHeadSettings
from ds_longseq.ops.sp_layout import SPLayout
from ds_longseq.techniques import EnableContext, PatchHandle, active_techniques

__all__ = [
    "enable",
    "disable",
    "check_model",
    "PatchHandle",
    "is_enabled",
    "get_config",
    "decoder_layers",
    "recording_tokens",
    "mark_zero3_leaves",
    "sequence_parallel_of",
    "configure_fused_lm_head",
    "configure_loss_statistics",
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


def _handle(model: torch.nn.Module) -> PatchHandle | None:
    return _causal_lm(model).__dict__.get(_HANDLE_ATTR)


def enable(
    model: torch.nn.Module, config: Mapping[str, Any] | LongSeqConfig | None, *, sp_group=None,
    sp_layout: SPLayout | None = None,
) -> torch.nn.Module:
    """Apply long-sequence training to a loaded ``*ForCausalLM`` in place and return it.

    Args:
        model: a supported Hugging Face causal LM instance (see ``SUPPORTED_MODEL_TYPES``), or a PEFT
            ``PeftModel`` around one (the inner model is patched; LoRA may also be added after).
        config: the ``long_seq`` section as a dict or :class:`LongSeqConfig`.
        sp_group: with ``sequence_parallel.size > 1``, the process group of the ranks that share a
            sequence; default: DeepSpeed's (``parallel_state_sp``), as ``engine.initialize`` sets up. The model's
            layout (``ops.sp_layout.SPLayout``: Ulysses x ring degrees from its heads, the groups) is built on it.
        sp_layout: instead of ``sp_group``, a layout built already (``techniques.sequence_parallel_layout``), so
            several models run on the same groups; checked against the section and the model's heads.

    Returns:
        The same model. Other instances of its class are untouched; ``disable(model)`` undoes it.

    Raises:
        LongSeqConfigError: the config is invalid (every problem listed).
        UnsupportedModelError: the model or one of its settings is not supported (every reason listed).
        RuntimeError: the model is already enabled.
        ValueError: both ``sp_group`` and ``sp_layout``, or ``sp_layout`` without sequence parallelism.
    """
    cfg = LongSeqConfig.of(config)  # a parsed config is checked, not parsed again
    if sp_group is not None and sp_layout is not None:
        raise ValueError("enable: pass sp_group or sp_layout (built on a group), not both")
    if sp_layout is not None and not cfg.sequence_parallel.enabled:
        raise ValueError(f"enable(sp_layout=) with long_seq.sequence_parallel.size={cfg.sequence_parallel.size}: set "
                         f"the size to the layout's ({sp_layout.size}), or leave sp_layout out")
    wrapper, model = model, _causal_lm(model)  # a PEFT model: its inner *ForCausalLM is patched
    if is_enabled(model):
        raise RuntimeError("ds_longseq is already enabled on this model: call ds_longseq.disable(model) first")
    try:
        # Not undone by disable: the switch only turns off bitsandbytes' lossy repacking of a 4-bit weight at its
        # first no-grad eval forward, which would change every later gradient (compat.keep_4bit_weights_unpacked)
        compat.keep_4bit_weights_unpacked(model)
    except ValueError as err:
        raise UnsupportedModelError(str(err)) from None
    techniques = active_techniques(cfg)
    handle = PatchHandle(model, cfg)
    ctx = _checked_context(model, cfg, techniques, handle, sp_group, sp_layout)
    adapter = ctx.adapter
    try:
        for technique in techniques:
            technique.install(ctx)
            handle.techniques.append(technique)
        if any(t.uses_model_forward for t in techniques):
            # Every such path: the model forward also masks packed documents' boundary targets.
            settings = CausalLMSettings(
                streambp=cfg.streambp.enabled, offload=ctx.offload is not None, chunked_head=cfg.lm_head.enabled,
                attention=AttentionSettings.from_config(cfg.attention),
                final_logit_softcap=adapter.final_logit_softcap, decoder=adapter.base_model, head=adapter.lm_head,
                moe_aux=adapter.spec.head_kind in MOE_AUX_KINDS, logit_scale=adapter.logit_scale,
                stock_masks_see_packed_rows=adapter.stock_masks_see_packed_rows(),
                recurrent_mixers=any(adapter.mixer(layer) is not None for layer in adapter.layers),
                sliding_masks_read=adapter.sliding_masks_read(),
            )
            forward = CausalLMForward(model, model.forward, settings, ctx.sp)
            handle.set_instance_attr(model, "forward", forward)
            handle.forward = forward
        handle.set_instance_attr(model, _HANDLE_ATTR, handle)
        handle.context = ctx
    except BaseException:
        handle.undo()
        raise
    return wrapper


def mark_zero3_leaves(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Mark the modules whose chunk loops must see their weights gathered as ZeRO-3 leaf modules.

    DeepSpeed ZeRO-3 gathers a leaf module's parameters in the module's own pre-forward hook and
    registers no hooks on its children, so the chunk loop inside (StreamBP layer, MsT MLP) runs on
    weights gathered once per forward and once per backward. Which modules: what the active techniques
    declare (``Technique.zero3_leaves``). Must run before ``deepspeed.initialize``; recorded on the
    model's handle, so :func:`disable` undoes it.

    Returns:
        The modules marked.
    """
    handle = _handle(model)
    if handle is None:
        raise RuntimeError("mark_zero3_leaves needs ds_longseq.enable(model, ...) first")
    leaves = list({id(m): m for t in handle.techniques for m in t.zero3_leaves(handle.context)}.values())
    for module in leaves:
        # The same attribute deepspeed.utils.set_z3_leaf_modules sets, on these instances only.
        handle.set_instance_attr(module, compat.Z3_LEAF_ATTR, True)
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


def _checked_context(model, cfg: LongSeqConfig, techniques, handle: PatchHandle, sp_group=None,
                     sp_layout: SPLayout | None = None) -> EnableContext:
    """The context ``enable`` installs with, after every active technique checked the model (nothing changed)."""
    ssm = any(t.model_kind == "ssm" for t in techniques)  # adjoint: its conflicts keep decoder techniques out
    adapter = None if ssm else decoder_adapter(model)
    ctx = EnableContext(model, cfg, handle, sp_group=sp_group, sp_layout=sp_layout, adapter=adapter)
    problems = [problem for technique in techniques for problem in technique.check(ctx)]
    if problems:
        raise UnsupportedModelError(f"ds_longseq cannot be enabled on {type(model).__name__}:\n  - "
                                    + "\n  - ".join(problems))
    return ctx


def check_model(model: torch.nn.Module, config: Mapping[str, Any] | LongSeqConfig | None):
    """Raise :class:`UnsupportedModelError` (every reason at once) if ``enable(model, config)`` would refuse
    the model; else return its family adapter (None for an SSM model). Changes nothing."""
    cfg = LongSeqConfig.of(config)  # a parsed config is checked, not parsed again
    model = _causal_lm(model)
    return _checked_context(model, cfg, active_techniques(cfg), PatchHandle(model, cfg)).adapter


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable` on ``model`` (a no-op for a model that is not enabled) and return it."""
    handle = _handle(model)
    if handle is not None:
        handle.undo()
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether :func:`enable` is in effect on ``model`` (or on the model inside a PEFT wrapper)."""
    return _HANDLE_ATTR in _causal_lm(model).__dict__


def get_config(model: torch.nn.Module) -> LongSeqConfig | None:
    """The :class:`LongSeqConfig` in effect on ``model``, or None."""
    handle = _handle(model)
    return None if handle is None else handle.config


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a supported causal LM (or a PEFT model around one), in order; [] for a family without
    a decoder-layer stack ds_longseq knows (the SSM families)."""
    try:
        return list(decoder_adapter(_causal_lm(model)).layers)
    except UnsupportedModelError:
        return []


def recording_tokens(model: torch.nn.Module):
    """Context in which an enabled model's loss calls also append their targets' per-token (log-probs, valid mask)
    to the list it yields (``forwards.causal_lm.CausalLMForward.recording_tokens``); a PEFT model's inner model."""
    handle = _handle(_causal_lm(model))
    if handle is None or handle.forward is None:
        raise ValueError("recording_tokens needs a model enabled with ds_longseq (its loss forward)")
    return handle.forward.recording_tokens()


def sequence_parallel_of(model: torch.nn.Module) -> SequenceParallel | None:
    """The :class:`SequenceParallel` of an enabled model (``paused()``, ``local_losses()``, its ``layout``), or
    None."""
    handle = _handle(model)
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
    ``forwards.causal_lm.CausalLMForward.configure_fused_head``), so the temperature (GRPO), the
    per-token fields the trainer reads (DPO's ``mean_logits``, ``log_sum_sq_probs``) and
    ``cast_lm_head_to_fp32`` must be given again here. ``LongSeqTrainerMixin`` does it from the TRL
    trainer; call it yourself when you enable a model after TRL added its head, without the mixin.
    (A model enabled before TRL adds its head is answered by TRL's head over ds_longseq's decoder.)

    Raises:
        RuntimeError: the model is not enabled, or enabled with nothing that installs ds_longseq's forward.
        ValueError: a non-positive temperature or an output ds_longseq does not compute.
    """
    _installed_forward(model, "configure_fused_lm_head", "TRL's own fused head serves the calls; configure it "
                       "through add_fused_lm_head instead").configure_fused_head(
        temperature=temperature, outputs=outputs, cast_lm_head_to_fp32=cast_lm_head_to_fp32
    )


def configure_loss_statistics(model: torch.nn.Module, on: bool = True) -> None:
    """Make every loss call of an enabled model (``model(..., labels=...)``) also return the sums TRL 1.9's
    SFTTrainer reads from it under ``loss_type="chunked_nll"`` (``num_valid_tokens``, ``entropy_sum``,
    ``num_correct_tokens``; see ``forwards.token_outputs.LossStatisticsOutput``): what the forward TRL 1.9 patches in
    for that loss type returns, which ds_longseq's forward shadows. ``LongSeqTrainerMixin`` does it from the TRL
    trainer (``trainer/trl.py``).

    Raises:
        RuntimeError: the model is not enabled, or enabled with nothing that installs ds_longseq's forward.
    """
    _installed_forward(model, "configure_loss_statistics", "TRL's own forward serves the calls").report_loss_statistics(
        on)


def _installed_forward(model: torch.nn.Module, caller: str, otherwise: str):
    """The causal-LM forward ds_longseq installed on ``model``, for ``caller`` to configure.

    Raises:
        RuntimeError: the model is not enabled, or its config enables nothing (``otherwise``: what serves the calls).
    """
    handle = _handle(model)
    if handle is None:
        raise RuntimeError(f"{caller} needs ds_longseq.enable(model, ...) first")
    if handle.forward is None:
        raise RuntimeError(
            f"{caller}: the long_seq config enables nothing, so ds_longseq installed no forward and {otherwise}")
    return handle.forward
