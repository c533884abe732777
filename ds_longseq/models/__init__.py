"""Model adapters: supported architectures and their checks."""

from ds_longseq.models.adapters import SUPPORTED_MODEL_TYPES, DecoderLMAdapter, UnsupportedModelError, get_adapter

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderLMAdapter", "UnsupportedModelError", "get_adapter"]
