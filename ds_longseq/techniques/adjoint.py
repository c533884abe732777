"""Adjoint sharding of residual SSM stacks (paper 002) as a technique: ``long_seq.adjoint``.

Holds:
    Adjoint: sets the adjoint plan of a ``ResidualSSMForCausalLM`` (its training forward reads it), or
        installs ``adjoint.HFAdjointForward`` on a transformers Mamba-1/2 model. In a distributed job every
        process is one stage of the layer split; gradients are scaled by the world size, because each
        parameter's gradient is produced on one rank and the data-parallel reduction (DeepSpeed's, or
        DDP's) averages over all of them.
"""

from __future__ import annotations

from ds_longseq.adjoint import HFAdjointForward, make_plan
from ds_longseq.config import AdjointConfig, LongSeqConfig
from ds_longseq.families import ResidualSSMForCausalLM, ssm_stack
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["Adjoint"]

_TRANSFORMER_ONLY = (
    "adjoint sharding trains residual SSM models, and {other} is one of the options that patch transformer layers; "
    "disable {other} "
    "(long_seq.lm_head is not needed either: the adjoint path always chunks the LM head by adjoint.chunk_size)"
)


@register
class Adjoint(Technique):
    """Gradients of a residual SSM stack from an adjoint scan and per-token vector-Jacobian products."""

    name = "adjoint"
    Config = AdjointConfig
    model_kind = "ssm"
    needs_process_group = True  # the layer split is over the world
    conflicts_with = {
        **{other: _TRANSFORMER_ONLY.format(other=f"long_seq.{other}")
           for other in ("streambp", "mini_seq", "sequence_parallel", "approx_bp", "offload")},
        "lm_head": "the adjoint path already chunks the LM head (by long_seq.adjoint.chunk_size); remove "
        "long_seq.lm_head",
    }

    def engine_problems(self, config: LongSeqConfig, zero_stage: int) -> list[str]:
        if zero_stage != 3:
            return []
        return [
            "long_seq.adjoint with ZeRO stage 3: each rank already holds only its own layers' activations "
            "and computes only their gradients, and the adjoint backward reads whole layer weights; use "
            "zero_optimization.stage 0, 1 or 2 (ZeRO-2 partitions the optimizer states and gradients)"
        ]

    def install(self, ctx: EnableContext) -> None:
        import torch.distributed as dist

        model, cfg = ctx.model, ctx.config.adjoint
        stack = ssm_stack(model)  # raises for a model that is not a residual SSM stack, naming why
        world_size, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        plan = make_plan(
            len(stack.layers),
            chunk_size=cfg.chunk_size,
            truncation=cfg.truncation,
            layer_split=cfg.layer_split,
            world_size=world_size,
            rank=rank,
            grad_scale=float(world_size),
        )
        if isinstance(model, ResidualSSMForCausalLM):
            ctx.handle.set_instance_attr(model, "adjoint_plan", plan)
        else:  # a transformers SSM: its training forward is replaced on this instance
            ctx.handle.set_instance_attr(model, "forward", HFAdjointForward(model, model.forward, plan))
