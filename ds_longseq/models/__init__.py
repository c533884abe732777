"""Deprecated: moved to ``ds_longseq.families``; this re-export goes in the next release."""

from ds_longseq.models.adapters import SUPPORTED_MODEL_TYPES, DecoderLMAdapter, UnsupportedModelError, get_adapter

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderLMAdapter", "UnsupportedModelError", "get_adapter"]
