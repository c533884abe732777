"""transformers: the private names and release differences of its models, configs, masks and caches.

Holds:
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
    keys_ignored_on_save: the state-dict keys a transformers model leaves out of ``save_pretrained``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

__all__ = [
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
    "keys_ignored_on_save",
]


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


def keys_ignored_on_save(model: Any) -> set[str]:
    """The state-dict keys a transformers model leaves out of ``save_pretrained`` (its ``_keys_to_ignore_on_save``)."""
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())
