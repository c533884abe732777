"""The chunked LM head and causal-LM loss (StreamBP Sec. 3.2.1, MsT Alg. 2) as a technique: ``long_seq.lm_head``.

Holds:
    LMHead: installs ``forwards.causal_lm.LMHeadLossForward`` as the LM head's forward, so the loss is
        computed inside the head module's call (ZeRO-3 gathers its weight once per forward and backward)
        without (B x T x V) logits.
"""

from __future__ import annotations

from ds_longseq.config import LMHeadConfig
from ds_longseq.forwards.causal_lm import LMHeadLossForward
from ds_longseq.techniques.base import EnableContext, Technique, register

__all__ = ["LMHead"]


@register
class LMHead(Technique):
    """The loss from chunks of logits, never the whole (B x T x V) tensor."""

    name = "lm_head"
    Config = LMHeadConfig
    run_after = ("approx_bp",)  # after the final norm is folded into the head's weight
    uses_model_forward = True
    forward_only = True  # a DPO reference model's calls are cut and scored as the policy's

    def check(self, ctx: EnableContext) -> list[str]:
        loss_type = getattr(ctx.model, "loss_type", None)
        if loss_type not in (None, "ForCausalLM"):
            return [f"model.loss_type={loss_type!r}: the chunked lm_head computes the causal-LM loss only"]
        return []

    def install(self, ctx: EnableContext) -> None:
        head = ctx.adapter.lm_head
        forward = LMHeadLossForward(
            head, head.forward, ctx.config.lm_head.chunk_size, ctx.adapter.final_logit_softcap, ctx.adapter.logit_scale
        )
        ctx.handle.set_instance_attr(head, "forward", forward)
