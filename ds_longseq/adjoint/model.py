"""Deprecated: moved to ``ds_longseq.families.residual_ssm``; this re-export goes in the next release."""

import warnings

from ds_longseq.families.residual_ssm import *  # noqa: F401,F403
from ds_longseq.families.residual_ssm import (  # noqa: F401
    __all__,  # noqa: F401
    causal_lm_loss,
    check_right_padded,
)

warnings.warn(
    "ds_longseq.adjoint.model is deprecated: import from ds_longseq.families.residual_ssm",
    DeprecationWarning,
    stacklevel=2,
)
