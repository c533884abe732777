"""Mixture-of-experts layers under chunked execution: router logits kept whole and differentiable.

Holds:
    RouterTap: a forward hook on one router module that hands the logits of the call it was armed
        for to the chunk function that armed it.
    router_logits_requested, collection_paused, record_router_logits: the link to transformers'
        output capturing, which collects ``router_logits`` (``output_router_logits=True``, what the
        load-balancing loss reads) through forward hooks on the routers.

Why: the stock model records each router call's (B*T, E) logits once per layer. A chunked layer
(StreamBP, mini_seq) calls its router once per chunk, under no_grad in forward: recorded as is, the
load-balancing loss would get num_chunks detached pieces per layer, so wrong shapes and no router
gradient. Instead the chunk loop pauses that recording, returns each chunk's logits as an
auxiliary output of the chunked autograd Function (their gradient joins the chunk's replay in
backward), and records the whole (B*T, E) tensor once per layer, as the stock layer would, rows in
the same (batch-major) order.

Shape legend: B batch, T sequence, C chunk, E experts.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable

import torch

from ds_longseq.compat import output_collector

__all__ = [
    "RouterTap",
    "router_aux_loss_wanted",
    "router_aux_loss",
    "with_router_aux_loss",
    "router_logits_requested",
    "collection_paused",
    "record_router_logits",
]

_KEY = "router_logits"


def router_logits_requested() -> bool:
    """Whether the running model forward collects router logits (``output_router_logits``)."""
    collected = output_collector().get()
    return collected is not None and _KEY in collected


@contextmanager
def collection_paused():
    """No output recording inside: per-chunk router calls must not be recorded as layers."""
    var = output_collector()
    token = var.set(None)
    try:
        yield
    finally:
        var.reset(token)


def record_router_logits(logits: torch.Tensor) -> None:
    """Record one layer's whole (B*T, E) router logits, as the stock router's hook would have."""
    collected = output_collector().get()
    if collected is not None and _KEY in collected:
        collected[_KEY].append(logits)


class RouterTap:
    """Forward hook of one router (``mlp.gate``), whose output is ``(logits (N, E), ...)`` or logits."""

    def __init__(self):
        self.armed = False
        self.logits: torch.Tensor | None = None

    def __call__(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self.armed:
            self.logits = output[0] if isinstance(output, tuple) else output

    def call_recording(self, fn: Callable[[], Any], batch: int, length: int) -> tuple[Any, torch.Tensor]:
        """``(fn(), logits (batch, length, E))`` of the one router call ``fn`` makes.

        Raises:
            RuntimeError: ``fn`` returned without calling the router.
        """
        self.armed, self.logits = True, None
        try:
            out = fn()
        finally:
            self.armed = False
        logits, self.logits = self.logits, None
        if logits is None:
            raise RuntimeError("the mixture-of-experts block returned without calling its router (mlp.gate)")
        return out, logits.reshape(batch, length, logits.shape[-1])


def router_aux_loss_wanted(model: torch.nn.Module, moe_aux: bool | None, kwargs: dict, sequence_parallel: bool) -> bool:
    """Whether a model forward called with ``kwargs`` adds a mixture-of-experts load-balancing loss, as the stock one
    would (``moe_aux``: ``CausalLMSettings.moe_aux``); refused under (active) sequence parallelism."""
    if moe_aux is False or getattr(model, "router_aux_loss_coef", None) is None:
        return False  # a dense family, or a mixture of experts whose stock forward adds no such loss
    wanted = kwargs.get("output_router_logits")
    if wanted is None:
        wanted = getattr(model.config, "output_router_logits", False)
    if wanted and sequence_parallel:
        raise NotImplementedError(
            "output_router_logits (the mixture-of-experts load-balancing loss) under sequence parallelism: each "
            "rank routes only its shard, so the loss would need the group's routing statistics. Pass "
            "output_router_logits=False (or set config.output_router_logits=False), or disable sequence_parallel"
        )
    return bool(wanted)


def router_aux_loss(model: torch.nn.Module, outputs, attention_mask) -> torch.Tensor:
    """The family's own load-balancing loss (from its modeling module) on the recorded (B*T, E) router logits, as the
    stock forward computes it.

    Raises:
        NotImplementedError: the decoder recorded no router logits (transformers 5.16's Granite-MoE and DBRX models
            cannot: their stock forward fails on the loss too).
    """
    if not getattr(outputs, "router_logits", None):
        import transformers

        raise NotImplementedError(
            f"{type(model).__name__}: output_router_logits is set, but under transformers {transformers.__version__} "
            "its decoder records no router logits, so the load-balancing loss cannot be computed (the stock forward "
            "fails on it too): pass output_router_logits=False (or set config.output_router_logits=False), or "
            "pip install 'transformers>=5.24'"
        )
    balancing = sys.modules[type(model).__module__].load_balancing_loss_func
    return balancing(outputs.router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)


def with_router_aux_loss(model: torch.nn.Module, loss, logits, outputs, attention_mask):
    """The stock MoE ending: ``loss + coef * load_balancing_loss(router_logits)``, as its output class."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    aux_loss = router_aux_loss(model, outputs, attention_mask)
    return MoeCausalLMOutputWithPast(
        loss=loss + model.router_aux_loss_coef * aux_loss.to(loss.device),
        aux_loss=aux_loss,
        logits=logits,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )
