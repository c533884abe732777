"""Layer-input offload to host memory (ALST-style) or to disk, as a technique: ``long_seq.offload``.

Holds:
    Offload: installs ``forwards.layer_input_offload.LayerInputOffload`` (a forward pre-hook and a forward hook on the
        decoder stack: host memory checked, a fresh offloader per training forward) and frees its pooled
        host memory on undo. StreamBP and mini_seq read it from the ``EnableContext``.
"""

from __future__ import annotations

import os

from ds_longseq.config import LongSeqConfig, LongSeqConfigError, OffloadConfig
from ds_longseq.forwards.layer_input_offload import LayerInputOffload
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["Offload"]


def _rank() -> int:
    """This process's rank in the job (0 alone): the launcher's ``RANK``, else torch.distributed's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


@register
class Offload(Technique):
    """Each layer's input, the one activation kept from forward to backward, lives in pinned host memory."""

    name = "offload"
    Config = OffloadConfig
    # after the sequence-parallel hook (registration order of the hooks), so it sees the local shard's shape
    run_after = ("sequence_parallel",)
    needs_one_of = ("streambp", "mini_seq")
    # one rule for both settings (keep_every > 1 alone makes the technique active too): one mistake, one message
    needs_reason = (
        "only those keep just each layer's input for backward (the stock model keeps every activation), and "
        "rebuild a dropped one by re-running its layers; enable one of them, or turn the offload off "
        "(long_seq.offload.layer_inputs null, keep_every 1)"
    )
    uses_model_forward = True  # a training call defaults to use_cache=False, or layers run their stock forward

    @classmethod
    def active(cls, config: LongSeqConfig) -> bool:
        return config.offload.layer_inputs is not None or config.offload.keep_every != 1

    @classmethod
    def describe(cls, config: LongSeqConfig) -> str:
        o = config.offload
        if o.layer_inputs is None:
            return f"long_seq.offload.keep_every={o.keep_every}"
        return f"long_seq.offload.layer_inputs={o.layer_inputs!r}" + (
            f" with keep_every={o.keep_every}" if o.keep_every != 1 else "")

    def install(self, ctx: EnableContext) -> None:
        adapter = ctx.adapter
        cfg = ctx.config.offload
        if cfg.keep_every > len(adapter.layers):
            n = len(adapter.layers)
            raise LongSeqConfigError([
                f"long_seq.offload.keep_every={cfg.keep_every} is larger than the model's {n} decoder layers: use 1 "
                f"to {n} (k keeps every k-th layer's input)"])
        offload = LayerInputOffload(len(adapter.layers), ctx.model.config.get_text_config().hidden_size,
                                    layer_inputs=cfg.layer_inputs, keep_every=cfg.keep_every,
                                    disk_path=cfg.disk_path, rank=_rank())
        ctx.handle.add_undo(offload.close)
        base = adapter.base_model
        ctx.handle.add_hook(base.register_forward_pre_hook(offload.before_forward, with_kwargs=True))
        ctx.handle.add_hook(base.register_forward_hook(offload.after_forward, with_kwargs=True, always_call=True))
        ctx.offload = offload
