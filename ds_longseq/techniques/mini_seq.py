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
        if not all(adapter.mlp_parts(layer) for i, layer in enumerate(adapter.layers) if i not in mlp_free):
            what = "the MLP" if adapter.spec.mlp_attr is None else f".{adapter.spec.mlp_attr}"
            problems.append(f"{adapter.where}[i]: {what} is not one module in every layer (nor a sum of MLP blocks); "
                            "mini_seq chunks the MLP")
        return problems

    def install(self, ctx: EnableContext) -> None:
        taps = ctx.router_taps()
        num_chunks = ctx.config.mini_seq.mlp_num_chunks
        for i, layer in enumerate(ctx.adapter.layers):
            parts = ctx.adapter.mlp_parts(layer)  # none: a token mixer only (FamilySpec.mlp_free_layers), stock
            router = ctx.adapter.router(layer)
            for mlp in parts:
                # the router tap goes to the one part holding the router (Granite's MoE block, not its shared MLP)
                tap = taps.get(layer) if router is not None and any(m is router for m in mlp.modules()) else None
                name = f"{ctx.adapter.where}[{i}]" + ("" if len(parts) == 1 else f".{_attr(layer, mlp)}")
                ctx.handle.set_instance_attr(mlp, "forward", MiniSeqMLPForward(
                    mlp, mlp.forward, num_chunks, router_tap=tap, name=name
                ))
            if parts and ctx.offload is not None:
                ctx.handle.set_instance_attr(
                    layer, "forward", CheckpointLayerForward(layer, layer.forward, ctx.offload, moe=layer in taps)
                )

    def zero3_leaves(self, ctx: EnableContext) -> list[torch.nn.Module]:
        parts = [ctx.adapter.mlp_parts(layer) for layer in ctx.adapter.layers]
        if ctx.config.offload.layer_inputs is None and ctx.config.offload.keep_every == 1:  # no layer checkpoint
            return [mlp for mlps in parts for mlp in mlps]
        # The layer checkpoint passes all the layer's weights to one Function, so the whole layer is
        # gathered for it; its MLP is marked too only to pass the MLP's own leaf check (DeepSpeed never
        # looks at the children of a leaf).
        return [m for layer, mlps in zip(ctx.adapter.layers, parts, strict=True) for m in (layer, *mlps)]


def _attr(layer: torch.nn.Module, child: torch.nn.Module) -> str:
    """The attribute of ``layer`` holding ``child``."""
    return next(name for name, c in layer.named_children() if c is child)
