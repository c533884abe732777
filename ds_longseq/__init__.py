"""ds_longseq: exact long-sequence training of Hugging Face causal LMs (StreamBP, MsT) with DeepSpeed.

Public surface: ``enable`` / ``disable`` a model in place, the ``LongSeqConfig`` type, ``__version__``.
DeepSpeed: ``ds_longseq.engine.initialize``. The Hugging Face Trainer and TRL's SFTTrainer:
``ds_longseq.trainer`` (imported on its own, as it pulls in the Trainer).
"""

from ds_longseq.config import LongSeqConfig, LongSeqConfigError
from ds_longseq.families import SUPPORTED_MODEL_TYPES, UnsupportedModelError
from ds_longseq.patch import disable, enable, get_config, is_enabled

__version__ = "0.1.0"

__all__ = [
    "enable",
    "disable",
    "is_enabled",
    "get_config",
    "LongSeqConfig",
    "LongSeqConfigError",
    "UnsupportedModelError",
    "SUPPORTED_MODEL_TYPES",
    "__version__",
]
