"""Deprecated: moved to ``ds_longseq.families`` (model knowledge) and ``ds_longseq.techniques`` (what each
technique checks on a model); this re-export goes in the next release."""

import warnings

from ds_longseq.families.decoder import *  # noqa: F401,F403
from ds_longseq.families.decoder import DecoderLMAdapter
from ds_longseq.families.decoder import __all__ as _moved

__all__ = [*_moved, "get_adapter"]

warnings.warn(
    "ds_longseq.models is deprecated: import from ds_longseq.families (UnsupportedModelError also from ds_longseq)",
    DeprecationWarning,
    stacklevel=2,
)


def get_adapter(model, config) -> DecoderLMAdapter:
    """Check that ``config`` can be applied to ``model`` exactly (every reason in one error); its adapter."""
    from ds_longseq.patch import check_model

    return check_model(model, config)
