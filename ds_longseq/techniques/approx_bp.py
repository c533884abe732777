"""Approx-BP activations and memory-sharing norms (Approx-BP paper, Secs. 4-5) as a technique: ``long_seq.approx_bp``.

Holds:
    ApproxBP: checks that the model's activations and norms are of the configured kinds, then installs
        ``forwards.approx_forwards.ApproxActivationForward`` on every SiLU/GELU activation module of the decoder
        layers (``activation``) and, with ``norm``, folds each foldable norm's weight into the weights of
        the linear maps after it (a re-parameterisation that keeps the model's function; NOT undone by
        ``disable``, see docs/APPROX_BP.md), freezes the norm weight at 1 and replaces its ``forward``
        with ``forwards.approx_forwards.MSNormForward``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ds_longseq.compat import gathered_parameters, is_zero3_partitioned
from ds_longseq.config import ApproxBPConfig, LongSeqConfig
from ds_longseq.families import DecoderLMAdapter, norm_kind
from ds_longseq.forwards.approx_forwards import ApproxActivationForward, MSNormForward, fold_norm, fold_targets
from ds_longseq.logging import get_logger, warn_once
from ds_longseq.ops.approx_autograd import APPROX_ACTIVATIONS
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["ApproxBP"]

logger = get_logger(__name__)


@contextlib.contextmanager
def _gathered(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Inside: ZeRO-3-partitioned ``params`` (a model built under ``deepspeed.zero.Init``) are whole, and
    what rank 0 writes to them is partitioned back to every rank on exit; other params pass through."""
    partitioned = [p for p in params if is_zero3_partitioned(p)]
    if not partitioned:
        yield
        return
    with gathered_parameters(partitioned, modifier_rank=0):
        yield


@register
class ApproxBP(Technique):
    """Smaller saved activations for every path (stock, checkpointing, MsT, StreamBP), forward unchanged."""

    name = "approx_bp"
    Config = ApproxBPConfig

    @classmethod
    def active(cls, config: LongSeqConfig) -> bool:
        return config.approx_bp.enabled is True

    def check(self, ctx: EnableContext) -> list[str]:
        return _activation_problems(ctx) + _norm_problems(ctx)

    def install(self, ctx: EnableContext) -> None:
        approx = ctx.config.approx_bp
        if approx.activation is not None:
            step = APPROX_ACTIVATIONS[approx.activation]
            for layer in ctx.adapter.layers:
                for _, act, _ in ctx.adapter.activations(layer):
                    ctx.handle.set_instance_attr(act, "forward", ApproxActivationForward(act, act.forward, step))
        if approx.norm is not None:
            _fold_norms(ctx)


def _activation_problems(ctx: EnableContext) -> list[str]:
    approx, adapter = ctx.config.approx_bp, ctx.adapter
    if approx.activation is None:
        return []
    step = APPROX_ACTIVATIONS[approx.activation]
    for i, layer in enumerate(adapter.layers):
        found = adapter.activations(layer)
        if not found:
            return [
                f"long_seq.approx_bp.activation={approx.activation!r}: {adapter.where}[{i}] has no SiLU or GELU "
                f"activation module (config.hidden_act={getattr(adapter.model.config, 'hidden_act', None)!r}): "
                "set it to null"
            ]
        wrong = [(name, m) for name, m, kind in found if kind != step.stock]
        if wrong:
            name, m = wrong[0]
            other = next(s.name for s in APPROX_ACTIVATIONS.values() if s.stock != step.stock)
            return [
                f"long_seq.approx_bp.activation={approx.activation!r} approximates {step.stock.upper()}, but "
                f"{adapter.where}[{i}].{name} is {type(m).__name__}: use {other!r}"
            ]
    return []


def _norm_problems(ctx: EnableContext) -> list[str]:
    approx, adapter = ctx.config.approx_bp, ctx.adapter
    if approx.norm is None:
        return []
    spec, where = adapter.spec, adapter.where
    if not spec.norm_folds_known:
        return [
            f"long_seq.approx_bp.norm={approx.norm!r}: {spec.causal_lm_class} is a family found from its structure, "
            "and which of its norms feed only linear layers is not known; set long_seq.approx_bp.norm=null "
            "(approx_bp.activation still applies)"
        ]
    wanted = "rms" if approx.norm == "ms_rmsnorm" else "layer"
    problems = [
        f"long_seq.approx_bp.norm={approx.norm!r}: {where}[i].{path} {why}, so its weight cannot be folded "
        f"into a following linear layer ({spec.causal_lm_class}); set long_seq.approx_bp.norm=null "
        "(approx_bp.activation still applies)"
        for path, why in spec.unfoldable_norms
    ]
    norms = [
        (f"{where}[{i}].{path}", layer.get_submodule(path))
        for i, layer in enumerate(adapter.layers)
        for path, _ in spec.norm_folds
    ]
    norms.append((f"{spec.decoder_attr}.{spec.final_norm_attr}", adapter.final_norm))
    for name, norm in norms:
        kind = norm_kind(norm)
        if kind != wanted:
            hint = {"rms": "use 'ms_rmsnorm'", "layer": "use 'ms_layernorm'"}.get(kind, "set it to null")
            problems.append(f"long_seq.approx_bp.norm={approx.norm!r}: {name} is {type(norm).__name__}: {hint}")
            break
    return problems


def _norm_folds(adapter: DecoderLMAdapter) -> list[tuple[str, torch.nn.Module, list]]:
    """(where, norm, [(consumer path, module, param name)]) of every norm ``approx_bp.norm`` folds."""
    spec = adapter.spec
    layers_where = f"{spec.decoder_attr}.{spec.layers_attr}"
    folds = []
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
    return folds


def _fold_norms(ctx: EnableContext) -> None:
    resolved = []
    for where, norm, consumers in _norm_folds(ctx.adapter):
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
                ctx.handle.add_undo(lambda p=p: p.requires_grad_(True))
        ctx.handle.set_instance_attr(norm, "forward", MSNormForward(norm, kind, eps, where))
