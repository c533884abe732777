"""Layer-input offload to host memory (ALST-style) as a technique: ``long_seq.offload``.

Holds:
    Offload: installs ``modules.offload.LayerInputOffload`` (a forward pre-hook and a forward hook on the
        decoder stack: host memory checked, a fresh offloader per training forward) and frees its pooled
        host memory on undo. StreamBP and mini_seq read it from the ``EnableContext``.
"""

from __future__ import annotations

from ds_longseq.config import LongSeqConfig, OffloadConfig
from ds_longseq.modules.offload import LayerInputOffload
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["Offload"]


@register
class Offload(Technique):
    """Each layer's input, the one activation kept from forward to backward, lives in pinned host memory."""

    name = "offload"
    Config = OffloadConfig
    # after the sequence-parallel hook (registration order of the hooks), so it sees the local shard's shape
    run_after = ("sequence_parallel",)
    needs_one_of = ("streambp", "mini_seq")
    needs_reason = (
        "only those keep just each layer's input for backward (the stock model keeps every activation); enable "
        "one of them, or remove long_seq.offload.layer_inputs"
    )
    uses_model_forward = True  # a training call defaults to use_cache=False, or layers run their stock forward

    @classmethod
    def active(cls, config: LongSeqConfig) -> bool:
        return config.offload.layer_inputs is not None

    @classmethod
    def describe(cls, config: LongSeqConfig) -> str:
        return f"long_seq.offload.layer_inputs={config.offload.layer_inputs!r}"

    def install(self, ctx: EnableContext) -> None:
        adapter = ctx.adapter
        offload = LayerInputOffload(len(adapter.layers), ctx.model.config.get_text_config().hidden_size)
        ctx.handle.add_undo(offload.close)
        base = adapter.base_model
        ctx.handle.add_hook(base.register_forward_pre_hook(offload.before_forward, with_kwargs=True))
        ctx.handle.add_hook(base.register_forward_hook(offload.after_forward, with_kwargs=True, always_call=True))
        ctx.offload = offload
