"""The one place where ds_longseq changes third-party objects, per model instance and undoably.

Holds:
    enable / disable: apply and undo long-sequence training on a loaded ``*ForCausalLM``.
    PatchHandle: the record of what was changed on one model, in order, with its undo.

What is changed, all on the given instance:
    - ``config._attn_implementation`` -> "ds_longseq" (streambp), after registering that NEW name
      with transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` (existing names such
      as "sdpa" are never overwritten, so other models in the process are unaffected);
    - ``layer.forward`` of each decoder layer (streambp), ``mlp.forward`` of each MLP (mini_seq);
    - ``model.forward`` (lm_head, and streambp's ``use_cache=False`` default).
Instance attributes shadow the class methods, so ``disable`` only deletes them again.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ds_longseq.config import LongSeqConfig
from ds_longseq.models.adapters import get_adapter
from ds_longseq.modules.attention import ATTN_IMPLEMENTATION, longseq_attention, longseq_mask
from ds_longseq.modules.causal_lm import CausalLMForward
from ds_longseq.modules.decoder_layer import StreamBPLayerForward
from ds_longseq.modules.mlp import MiniSeqMLPForward

__all__ = ["enable", "disable", "PatchHandle", "is_enabled", "get_config"]

_HANDLE_ATTR = "_ds_longseq_handle"
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

    def set_instance_attr(self, obj: Any, name: str, value: Any) -> None:
        previous = obj.__dict__.get(name, _MISSING)
        object.__setattr__(obj, name, value)

        def restore():
            if previous is _MISSING:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, previous)

        self._undo.append(restore)

    def set_attn_implementation(self, hf_config: Any, name: str) -> None:
        previous = hf_config._attn_implementation
        hf_config._attn_implementation = name
        self._undo.append(lambda: setattr(hf_config, "_attn_implementation", previous))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


def enable(model: torch.nn.Module, config: Mapping[str, Any] | LongSeqConfig | None) -> torch.nn.Module:
    """Apply long-sequence training to a loaded ``*ForCausalLM`` in place and return it.

    Args:
        model: a supported Hugging Face causal LM instance (see ``SUPPORTED_MODEL_TYPES``).
        config: the ``long_seq`` section as a dict or :class:`LongSeqConfig`.

    Returns:
        The same model. Other instances of its class are untouched; ``disable(model)`` undoes it.

    Raises:
        LongSeqConfigError: the config is invalid (every problem listed).
        UnsupportedModelError: the model or one of its settings is not supported.
        RuntimeError: the model is already enabled.
    """
    cfg = LongSeqConfig.from_dict(config)
    if is_enabled(model):
        raise RuntimeError("ds_longseq is already enabled on this model: call ds_longseq.disable(model) first")
    adapter = get_adapter(model, cfg)
    handle = PatchHandle(model, cfg)
    try:
        if cfg.streambp.enabled:
            _register_attention()
            handle.set_attn_implementation(model.config, ATTN_IMPLEMENTATION)
            for layer in adapter.layers:
                handle.set_instance_attr(layer, "forward", StreamBPLayerForward(layer, layer.forward, cfg.streambp))
        if cfg.mini_seq.enabled:
            for layer in adapter.layers:
                mlp = adapter.mlp(layer)
                handle.set_instance_attr(mlp, "forward", MiniSeqMLPForward(mlp, mlp.forward, cfg.mini_seq.mlp_num_chunks))
        if cfg.lm_head.enabled or cfg.streambp.enabled:
            handle.set_instance_attr(model, "forward", CausalLMForward(model, model.forward, cfg))
        handle.set_instance_attr(model, _HANDLE_ATTR, handle)
    except BaseException:
        handle.undo()
        raise
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable` on ``model`` (a no-op for a model that is not enabled) and return it."""
    handle = model.__dict__.get(_HANDLE_ATTR)
    if handle is not None:
        handle.undo()
    return model


def is_enabled(model: torch.nn.Module) -> bool:
    """Whether :func:`enable` is in effect on ``model``."""
    return _HANDLE_ATTR in model.__dict__


def get_config(model: torch.nn.Module) -> LongSeqConfig | None:
    """The :class:`LongSeqConfig` in effect on ``model``, or None."""
    handle = model.__dict__.get(_HANDLE_ATTR)
    return None if handle is None else handle.config
