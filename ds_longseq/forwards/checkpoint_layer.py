"""A decoder layer as one activation checkpoint whose input lives in host memory until backward (mini_seq with
``offload.layer_inputs``).

Holds:
    CheckpointLayerForward: the callable installed as a decoder layer's ``forward``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ds_longseq.compat import CACHE_KWARGS, CHECKPOINTING_OFF_CALL
from ds_longseq.forwards.moe import router_logits_requested
from ds_longseq.forwards.zero3 import check_zero3_leaf
from ds_longseq.ops.activation_checkpoint import checkpoint_apply

if TYPE_CHECKING:
    from ds_longseq.forwards.layer_input_offload import LayerInputOffload

__all__ = ["CheckpointLayerForward"]


def _check_no_grad_kwargs(layer: torch.nn.Module, kwargs: dict) -> None:
    """Raise if a layer argument other than the hidden states requires grad (its gradient would be lost)."""
    for name, value in kwargs.items():
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
            raise ValueError(
                f"{type(layer).__name__} got {name} that requires grad: long_seq.offload with mini_seq "
                "differentiates each layer with respect to its hidden states and weights only. Detach it, or "
                "remove long_seq.offload.layer_inputs"
            )


class CheckpointLayerForward:
    """Replacement ``forward`` of one decoder layer under mini_seq with ``offload.layer_inputs``.

    Runs the stock layer (whose MLP is the MsT mini-sequence MLP) as one activation checkpoint
    (:func:`checkpoint_apply`): forward under no_grad, the (B, T, d) input saved in host memory
    through the current forward's offloader, the layer re-run with grad in backward. This replaces
    Hugging Face gradient checkpointing, which would keep the input on the device (and, on top of
    this, recompute twice), so that must be off. With a KV cache (generation) the stock forward runs.
    """

    def __init__(
        self, layer: torch.nn.Module, orig_forward: Callable, offload: "LayerInputOffload", moe: bool = False
    ):
        self.layer = layer
        self.orig_forward = orig_forward
        self.offload = offload
        self.moe = moe  # a mixture-of-experts layer (router logits cannot leave the checkpoint yet)

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if any(kwargs.get(name) is not None for name in CACHE_KWARGS) or args:
            # A cache (generation), or the stock positional signature nobody in transformers uses.
            return self.orig_forward(hidden_states, *args, **kwargs)
        layer = self.layer
        if getattr(layer, "gradient_checkpointing", False) and layer.training:
            raise RuntimeError(
                "gradient (activation) checkpointing is on for a model with long_seq.mini_seq and "
                "long_seq.offload.layer_inputs: offload with mini_seq checkpoints each layer itself (keeping its "
                "input in host memory), so checkpointing would recompute every layer twice. Call "
                f"{CHECKPOINTING_OFF_CALL}."
            )
        check_zero3_leaf(layer)
        if self.moe and torch.is_grad_enabled() and router_logits_requested():
            raise NotImplementedError(
                "output_router_logits (the mixture-of-experts load-balancing loss) with mini_seq and "
                "long_seq.offload.layer_inputs: the layer checkpoint would record router logits without their "
                "gradient. Use streambp (with or without offload), drop offload.layer_inputs, or pass "
                "output_router_logits=False"
            )
        if torch.is_grad_enabled():
            _check_no_grad_kwargs(layer, kwargs)
        orig = self.orig_forward

        def run(h: torch.Tensor) -> torch.Tensor:
            out = orig(h, **kwargs)
            return out[0] if isinstance(out, tuple) else out

        return checkpoint_apply(run, hidden_states, list(layer.parameters()), self.offload.offloader())
