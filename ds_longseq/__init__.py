"""ds_longseq: exact long-sequence training of Hugging Face causal LMs (StreamBP, MsT) with DeepSpeed.

Public surface: ``enable`` / ``disable`` a model in place, the ``LongSeqConfig`` type, ``resolve`` (whether a run
can start: a DeepSpeed config against the launch and the run, every problem at once), ``__version__``.
DeepSpeed: ``ds_longseq.engine.initialize``. The Hugging Face Trainer and TRL's SFTTrainer:
``ds_longseq.trainer`` (imported on its own, as it pulls in the Trainer).

Imported lazily (``ds_longseq.lazy``): ``import ds_longseq`` and ``ds_longseq.plan`` load neither torch nor
transformers until a name that needs them is used.
"""

from typing import TYPE_CHECKING

from ds_longseq.lazy import lazy_exports

if TYPE_CHECKING:  # the names below, imported on first use (ds_longseq.lazy)
    from ds_longseq.config import LongSeqConfig, LongSeqConfigError
    from ds_longseq.families import SUPPORTED_MODEL_TYPES, UnsupportedModelError
    from ds_longseq.patch import disable, enable, get_config, is_enabled
    from ds_longseq.resolver import Launch, Resolved, RunCannotStart, RunShape, resolve

__getattr__, __dir__ = lazy_exports(__name__, __file__)

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
    "resolve",
    "Resolved",
    "RunCannotStart",
    "Launch",
    "RunShape",
    "__version__",
]
