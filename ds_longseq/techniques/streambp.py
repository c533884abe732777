"""StreamBP over whole decoder layers (StreamBP paper, Sec. 3.2.2) as a technique: ``long_seq.streambp``.

Holds:
    StreamBP: checks that every layer can be replayed chunk by chunk and installs
        ``forwards.streambp_layer.StreamBPLayerForward`` as each decoder layer's forward, with
        attention routed through ds_longseq's chunked attention function (and, for a mixer whose scan restarts
        from zeros, ``forwards.scan_from_state_forward.ScanFromStateForward`` as its forward); with
        ``chunk_size: "auto"``, the base model's forward pre-hook that picks the chunk size for each training forward
        (``forwards.auto_chunk``); with ``keep_attention_output: "auto"``, the one that decides for each training
        forward whether the attention layers keep their outputs (``forwards.keep_attention``).
"""

from __future__ import annotations

import torch

from ds_longseq.config import StreamBPConfig
from ds_longseq.families.decoder import softcap_under_sdpa_problem
from ds_longseq.families.dims import ModelDims
from ds_longseq.forwards.attn_spec import AttentionSettings
from ds_longseq.forwards.auto_chunk import AutoChunkSettings, AutoChunkSize
from ds_longseq.forwards.keep_attention import KeepAttentionOutput
from ds_longseq.forwards.scan_from_state_forward import ScanFromStateForward
from ds_longseq.forwards.streambp_layer import LayerParts, StreamBPLayerForward
from ds_longseq.forwards.unread_outputs import UnreadLinear
from ds_longseq.logging import get_logger, warn_once
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["StreamBP"]

logger = get_logger(__name__)


@register
class StreamBP(Technique):
    """Every decoder layer keeps only its input in forward and is re-forwarded chunk by chunk in backward."""

    name = "streambp"
    Config = StreamBPConfig
    # the layer forward reads the offload installed before it; the automatic chunk size's hook must see the local
    # shard (after the sequence-parallel hook, by registration order)
    run_after = ("approx_bp", "offload", "sequence_parallel")
    uses_model_forward = True  # the model forward finds packed documents once and passes them to every layer

    def check(self, ctx: EnableContext) -> list[str]:
        if ctx.adapter.spec.attention_problem:
            return [f"long_seq.streambp: {ctx.adapter.spec.attention_problem}"]
        softcap = softcap_under_sdpa_problem(ctx.model)
        return [] if softcap is None else [f"long_seq.streambp: {softcap}"]

    def install(self, ctx: EnableContext) -> None:
        ctx.use_longseq_attention()
        taps = ctx.router_taps()
        sharing = ctx.adapter.kv_sharing()
        reused = {key for role, key in sharing.values() if role == "reuse"}
        streams = ctx.adapter.stacked_streams()
        attention = AttentionSettings.from_config(ctx.config.attention)
        keep, chunks = self._per_forward_choices(ctx)
        for i, layer in enumerate(ctx.adapter.layers):
            role, key = sharing.get(i, (None, None))
            recurrent = ctx.adapter.mixer(layer) is not None
            mixer = None if not recurrent else ("both" if ctx.adapter.attention(layer) is not None else "recurrent")
            if ctx.adapter.token_wise(layer):
                mixer = "token_wise"
            parts = LayerParts(
                name=f"{ctx.adapter.where}[{i}]", router_tap=taps.get(layer),
                kv_sharing=None if role is None else (role, key, key in reused), streams=streams, mixer=mixer,
                mixer_module=ctx.adapter.mixer(layer),
                query_proj=_unread(ctx, ctx.adapter.query_projection(layer)),
                output_proj=_unread(ctx, ctx.adapter.mlp_output_projection(layer)),
                kv_projs=_unread_pair(ctx, ctx.adapter.key_value_projections(layer)),
            )
            forward = StreamBPLayerForward(layer, layer.forward, chunks, attention, ctx.offload, parts,
                                           keep if mixer is None else None)
            ctx.handle.set_instance_attr(layer, "forward", forward)
            scan = ctx.adapter.spec.mixer_scan_function
            if recurrent and scan is not None:  # its multi-token scan continued from the carried state
                module = ctx.adapter.mixer(layer)
                ctx.handle.set_instance_attr(module, "forward", ScanFromStateForward(module, module.forward, scan))

    @staticmethod
    def _per_forward_choices(ctx: EnableContext) -> tuple[KeepAttentionOutput, int | AutoChunkSize]:
        """(whether the attention layers keep their outputs, the chunk size), each asked by the layers at every
        forward; under "auto" decided by the base model's forward pre-hooks, the keeping first (the automatic chunk
        size then counts what it keeps on the device)."""
        cfg, base = ctx.config, ctx.adapter.base_model
        setting = cfg.streambp.keep_attention_output
        try:
            dims = ModelDims.from_config(ctx.model.config)
        except ValueError as err:  # sizes the memory model cannot read: "auto" cannot decide on memory
            if cfg.streambp.chunk_size == "auto":
                raise
            if setting == "auto":
                warn_once(logger, f"streambp.keep_attention_output auto: not kept ({err}); set it to true to keep them")
            dims, setting = None, setting is True
        estimator = None if dims is None else AutoChunkSize(dims, AutoChunkSettings.of(cfg), ctx.model)
        attention_layers = sum(1 for layer in ctx.adapter.layers
                               if ctx.adapter.mixer(layer) is None and not ctx.adapter.token_wise(layer))
        keep = KeepAttentionOutput(setting, dims, attention_layers, estimator, cfg.streambp.chunk_size, ctx.offload)
        if setting == "auto":
            ctx.handle.add_hook(base.register_forward_pre_hook(keep.before_forward, with_kwargs=True))
        if cfg.streambp.chunk_size != "auto":
            return keep, cfg.streambp.chunk_size
        estimator.keep = keep
        ctx.handle.add_hook(base.register_forward_pre_hook(estimator.before_forward, with_kwargs=True))
        return keep, estimator

    def zero3_leaves(self, ctx: EnableContext) -> list[torch.nn.Module]:
        return ctx.adapter.layers


def _unread_pair(ctx: EnableContext, linears: tuple[torch.nn.Linear, torch.nn.Linear] | None
                 ) -> tuple[UnreadLinear, UnreadLinear] | None:
    return None if linears is None else (_unread(ctx, linears[0]), _unread(ctx, linears[1]))


def _unread(ctx: EnableContext, linear: torch.nn.Linear | None) -> UnreadLinear | None:
    """``linear``'s forward replaced (undoably) by an ``UnreadLinear``, which StreamBP skips where unread."""
    if linear is None:
        return None
    unread = UnreadLinear(linear, linear.forward)
    ctx.handle.set_instance_attr(linear, "forward", unread)
    return unread
