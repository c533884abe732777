"""DeepSpeed ZeRO-3 checks shared by the forwards that run a module's submodules chunk by chunk.

Holds:
    check_zero3_leaf: raise if a module with ZeRO-3 partitioned weights is not a ZeRO-3 leaf module
        (the StreamBP layer, the mini-sequence MLP and the layer checkpoint all need it to be).
"""

from __future__ import annotations

import torch

from ds_longseq.compat import Z3_LEAF_ATTR, is_zero3_partitioned

__all__ = ["check_zero3_leaf"]


def check_zero3_leaf(module: torch.nn.Module) -> None:
    """Raise if ``module`` has ZeRO-3 partitioned weights but is not a ZeRO-3 leaf module.

    Its chunk loop calls the submodules many times; without the leaf flag (set before
    ``deepspeed.initialize``) DeepSpeed releases their weights between chunks and the backward
    fails deep inside DeepSpeed ("invalid gradient ... expected shape compatible with [0]").
    """
    if getattr(module, Z3_LEAF_ATTR, False):
        return
    if any(is_zero3_partitioned(p) for p in module.parameters(recurse=True)):
        raise RuntimeError(
            f"{type(module).__name__} has DeepSpeed ZeRO-3 partitioned weights but was not marked as a ZeRO-3 "
            "leaf module: create the engine with ds_longseq.engine.initialize(...), or call "
            "ds_longseq.patch.mark_zero3_leaves(model) before deepspeed.initialize(...)"
        )
