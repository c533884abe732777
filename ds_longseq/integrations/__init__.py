"""ds_longseq inside other training frameworks, each named in that framework's own config.

    axolotl:  ``plugins: [ds_longseq.integrations.axolotl.LongSeqPlugin]`` and a ``long_seq:`` block in the YAML
              (docs/AXOLOTL.md).

Holds:
    axolotl.py: LongSeqPlugin, axolotl's plugin (its hooks: the block checked, the model enabled, the Trainer class
        wrapped with ``trainer.with_long_seq``); imports axolotl.
    axolotl_config.py: what the plugin checks, without axolotl: LongSeqArgs (the ``long_seq:`` block as axolotl's
        pydantic schema declares it), read_long_seq (the block through ``resolver.resolve``, as everywhere else, and
        where the Trainer finds it), axolotl_problems (the axolotl settings refused beside it), AxolotlConfigError.

Names are imported on first use (``ds_longseq.lazy``): importing this package imports no framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_longseq.lazy import lazy_exports

if TYPE_CHECKING:
    from ds_longseq.integrations.axolotl import LongSeqPlugin
    from ds_longseq.integrations.axolotl_config import AxolotlConfigError, LongSeqArgs

__all__ = ["LongSeqPlugin", "LongSeqArgs", "AxolotlConfigError"]

__getattr__, __dir__ = lazy_exports(__name__, __file__)
