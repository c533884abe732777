"""The MsT mini-sequence MLP (MsT paper, Alg. 1 and App. B) as a technique: ``long_seq.mini_seq``.

Holds:
    MiniSeq: installs ``forwards.mlp.MiniSeqMLPForward`` as every decoder layer's MLP forward; with
        layer-input offload, also a per-layer checkpoint (``forwards.checkpoint_layer.CheckpointLayerForward``)
        whose saved input is the offloaded one.
"""

from __future__ import annotations

import torch

from ds_longseq.config import MiniSeqConfig
from ds_longseq.forwards.checkpoint_layer import CheckpointLayerForward
from ds_longseq.forwards.mlp import MiniSeqMLPForward
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["MiniSeq"]


@register
class MiniSeq(Technique):
    """Each MLP runs in ``mlp_num_chunks`` sequence chunks, forward and backward."""

    name = "mini_seq"
    Config = MiniSeqConfig
    run_after = ("approx_bp", "offload")
    conflicts_with = {
        "streambp": "StreamBP already runs each layer's MLP on chunk_size tokens at a time, so mini_seq would "
        "only add overhead; set long_seq.mini_seq.enabled=false (or disable streambp to use MsT alone)"
    }
    uses_model_forward = True

    def check(self, ctx: EnableContext) -> list[str]:
        adapter = ctx.adapter
        problems = []
        mlp_free = set(adapter.spec.mlp_free_layers)
        if not all(isinstance(adapter.mlp(layer), torch.nn.Module)
                   for i, layer in enumerate(adapter.layers) if i not in mlp_free):
            what = "the MLP" if adapter.spec.mlp_attr is None else f".{adapter.spec.mlp_attr}"
            problems.append(f"{adapter.where}[i]: {what} is not one module in every layer; mini_seq chunks the MLP")
        return problems

    def install(self, ctx: EnableContext) -> None:
        taps = ctx.router_taps()
        num_chunks = ctx.config.mini_seq.mlp_num_chunks
        for i, layer in enumerate(ctx.adapter.layers):
            mlp = ctx.adapter.mlp(layer)
            if mlp is None:  # a token mixer only (FamilySpec.mlp_free_layers): runs stock
                continue
            ctx.handle.set_instance_attr(mlp, "forward", MiniSeqMLPForward(
                mlp, mlp.forward, num_chunks, router_tap=taps.get(layer), name=f"{ctx.adapter.where}[{i}]"
            ))
            if ctx.offload is not None:
                ctx.handle.set_instance_attr(
                    layer, "forward", CheckpointLayerForward(layer, layer.forward, ctx.offload, moe=layer in taps)
                )

    def zero3_leaves(self, ctx: EnableContext) -> list[torch.nn.Module]:
        mlps = [ctx.adapter.mlp(layer) for layer in ctx.adapter.layers]
        if ctx.config.offload.layer_inputs is None and ctx.config.offload.keep_every == 1:  # no layer checkpoint
            return [mlp for mlp in mlps if mlp is not None]
        # The layer checkpoint passes all the layer's weights to one Function, so the whole layer is
        # gathered for it; its MLP is marked too only to pass the MLP's own leaf check (DeepSpeed never
        # looks at the children of a leaf).
        return [m for layer, mlp in zip(ctx.adapter.layers, mlps, strict=True) for m in (layer, mlp) if m is not None]
