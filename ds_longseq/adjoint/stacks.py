"""Deprecated: moved to ``ds_longseq.families.ssm``; this re-export goes in the next release."""

import warnings

from ds_longseq.adjoint.hf_forward import HFAdjointForward  # noqa: F401
from ds_longseq.families.ssm import *  # noqa: F401,F403
from ds_longseq.families.ssm import __all__  # noqa: F401

warnings.warn(
    "ds_longseq.adjoint.stacks is deprecated: import from ds_longseq.families.ssm "
    "(HFAdjointForward: from ds_longseq.adjoint)",
    DeprecationWarning,
    stacklevel=2,
)
