"""The per-token path of a causal-LM forward: log-probs, entropies and TRL's fused-LM-head output.

Holds:
    TokenOutputs: the per-token outputs of the LM head for given targets, chunked (``long_seq.lm_head``)
        or from the stock head's logits; TRL's fused-head output built from them.
    FusedHeadSettings, FusedLMHeadOutput, FUSED_HEAD_OUTPUTS: what a TRL fused-head call computes and returns.
    LossStatisticsOutput: a loss call's output with the sums TRL 1.9's SFTTrainer reads (``loss_type="chunked_nll"``).
    check_token_outputs_call: the refusal of a per-token call that cannot be answered.

``forwards.causal_lm.CausalLMForward`` dispatches here for ``return_token_logprobs`` /
``return_token_entropy`` and TRL's ``fused_lm_head=True`` calls, and for loss calls that report TRL 1.9's statistics;
its plain loss path stays there.

Shape legend: B batch, T tokens, V vocab.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, ModelOutput

from ds_longseq.ops.lm_head_loss import TokenHeadOutputs, softcap_logits

__all__ = ["TokenOutputs", "FusedHeadSettings", "FusedLMHeadOutput", "FUSED_HEAD_OUTPUTS", "LossStatisticsOutput",
           "check_token_outputs_call"]

FUSED_HEAD_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""The per-token fields of TRL's fused head (``add_fused_lm_head(outputs=...)``) ds_longseq computes."""

# TRL's field names -> the chunked head's (``ops.lm_head_loss.TOKEN_HEAD_OUTPUTS``)
_HEAD_OUTPUT_NAMES = {"entropy": "entropy", "is_top1": "top1", "mean_logits": "mean_logits",
                      "log_sum_sq_probs": "log_sum_sq_probs"}


@dataclass(frozen=True)
class FusedHeadSettings:
    """What a fused-LM-head call computes: TRL's ``add_fused_lm_head`` arguments.

    Attributes:
        temperature: the logits (after the final-logit softcap) are divided by it before the softmax;
            every field, the loss and the gradients are those of the scaled distribution.
        outputs: the per-token fields of :data:`FUSED_HEAD_OUTPUTS` to compute (``log_probs`` always is;
            the others are None when not listed, as in TRL).
        cast_lm_head_to_fp32: project the final hidden states through the head in float32, outside
            autocast (GRPO's ``cast_lm_head_to_fp32``).
    """

    temperature: float = 1.0
    outputs: tuple[str, ...] = ("log_probs", "entropy", "is_top1")  # what TRL's SFTTrainer reads
    cast_lm_head_to_fp32: bool = False

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
            self.temperature > 0
        ):
            raise ValueError(f"fused LM head temperature must be a positive number, got {self.temperature!r}")
        if isinstance(self.outputs, str):
            raise ValueError(f"fused LM head outputs must be a tuple of field names, got the string {self.outputs!r}")
        unknown = [name for name in self.outputs if name not in FUSED_HEAD_OUTPUTS]
        if unknown:
            raise ValueError(
                f"fused LM head outputs {unknown} not computed by ds_longseq: choose among {list(FUSED_HEAD_OUTPUTS)}"
            )
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "outputs", tuple(self.outputs))

    @property
    def head_outputs(self) -> tuple[str, ...]:
        """The requested optional fields under the chunked head's names."""
        return tuple(_HEAD_OUTPUT_NAMES[name] for name in self.outputs if name != "log_probs")


@dataclass
class FusedLMHeadOutput(ModelOutput):
    """What TRL's fused-LM-head call (``fused_lm_head=True``) returns, field for field.

    Shapes: (B, T - 1) with ``labels`` (shifted as the loss shifts them), (B, T) with pre-shifted
    ``shift_labels``; every per-token field is 0 / False where the label is ignored.

    Attributes:
        loss: the mean negative log-likelihood (over ``num_items_in_batch`` when given, else the
            valid tokens; the group's under sequence parallelism), plus the weighted MoE
            load-balancing loss when router logits are requested.
        log_probs: log-probability of each next-token label, differentiable.
        entropy: entropy of each next-token distribution, differentiable.
        is_top1: whether the label has the largest logit.
        label_mask: whether the label is valid.
        aux_loss: the MoE load-balancing loss, when requested.
        log_sum_sq_probs: log sum_v p_v^2 of each next-token distribution, no gradient.
        mean_logits: mean over the vocabulary of each position's logits (after the final-logit
            softcap, divided by the temperature), no gradient.

    ``entropy``, ``is_top1``, ``log_sum_sq_probs`` and ``mean_logits`` are computed when requested
    (:class:`FusedHeadSettings` ``outputs``, as TRL's ``add_fused_lm_head(outputs=...)``), else None.
    Every field and the loss are those of the temperature-scaled distribution.
    """

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


@dataclass
class LossStatisticsOutput(CausalLMOutputWithPast):
    """A loss call's output (``model(..., labels=...)``) with the sums TRL 1.9's SFTTrainer reads from it under
    ``loss_type="chunked_nll"``: the fields of the output of the forward TRL 1.9 patches in for that loss type (its
    ``_ChunkedCELMHeadOutput``), which ds_longseq's forward shadows (``trainer/trl.py``).

    Attributes (besides ``loss``; ``logits`` is None):
        num_correct_tokens: how many valid labels have the largest logit (float32, no gradient).
        entropy_sum: the entropies of the next-token distributions at the valid labels, summed (no gradient).
        num_valid_tokens: how many labels are valid (not ``ignore_index``).
        aux_loss: the MoE load-balancing loss, when router logits are requested (already in ``loss``, weighted).

    Each sum is over this call's tokens (this rank's shard under sequence parallelism): TRL gathers them over the ranks.
    """

    num_correct_tokens: torch.Tensor | None = None
    entropy_sum: torch.Tensor | None = None
    num_valid_tokens: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class TokenOutputs:
    """Per-token outputs of one model's LM head.

    Args:
        head: the LM head module (with ``long_seq.lm_head`` its forward is ``LMHeadLossForward``).
        chunked: whether the head computes them chunk by chunk (``long_seq.lm_head.enabled``).
        softcap: the family's final-logit softcap, or None.
        logit_scale: the family's factor on the logits right after the head (before the softcap), or 1.0.
    """

    def __init__(self, head: torch.nn.Module, chunked: bool, softcap: float | None, logit_scale: float = 1.0):
        self.head = head
        self.chunked = chunked
        self.softcap = softcap
        self.logit_scale = logit_scale
        self.settings = FusedHeadSettings()
        """What TRL's fused-head calls compute (``CausalLMForward.configure_fused_head``)."""

    def per_token(self, hidden, targets, ignore_index: int, outputs: tuple[str, ...], temperature: float = 1.0):
        """``TokenHeadOutputs`` of ``targets``, (B, T) each, with the ``outputs`` requested (names of
        ``ops.lm_head_loss.TOKEN_HEAD_OUTPUTS``): chunked, or from the stock head's logits."""
        if self.chunked:
            return self.head(hidden, targets=targets, ignore_index=ignore_index, per_token=True, outputs=outputs,
                             temperature=temperature)
        # the stock head: (B, T, V) logits, as the user configured
        logits = self.head(hidden)
        if self.logit_scale != 1.0:  # as the stock forward, right after its head
            logits = logits * self.logit_scale
        if self.softcap is not None:
            logits = softcap_logits(logits, self.softcap)
        targets = targets.to(logits.device)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if temperature != 1.0:
            logits = logits / temperature
        log_p = torch.log_softmax(logits, dim=-1)
        mask = targets != ignore_index
        index = targets.clamp_min(0).unsqueeze(-1)
        logps = log_p.gather(-1, index).squeeze(-1) * mask
        ent = -(log_p.exp() * log_p).sum(-1) * mask if "entropy" in outputs else None
        hit = None
        if "top1" in outputs:
            hit = (logits.gather(-1, index).squeeze(-1) >= logits.amax(dim=-1)) & mask
        with torch.no_grad():  # statistics without gradient, as TRL's
            mean = logits.mean(-1) * mask if "mean_logits" in outputs else None
            sq = None
            if "log_sum_sq_probs" in outputs:
                sq = (torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1)) * mask
        return TokenHeadOutputs(logps, mask, ent, hit, mean, sq)

    def fused(self, hidden, targets, ignore_index: int, trim: bool, token_mean: Callable, aux_loss=None,
              aux_coef: float = 0.0) -> FusedLMHeadOutput:
        """TRL's fused-LM-head output, as :attr:`settings` configure it. ``trim``: the targets came
        from unshifted ``labels``, so the last position (never a target) is dropped, as TRL's own
        head returns (B, T - 1). ``token_mean(loss_sum, num_valid)``: the caller's mean (the sequence-parallel
        group's, or over ``num_items_in_batch``)."""
        if trim:
            hidden, targets = hidden[:, :-1], targets[:, :-1]
        settings = self.settings
        precision = contextlib.nullcontext()
        if settings.cast_lm_head_to_fp32:  # as TRL's head: float32 projection outside autocast
            hidden = hidden.float()
            precision = torch.autocast(hidden.device.type, enabled=False)
        with precision:
            out = self.per_token(hidden, targets, ignore_index, settings.head_outputs, settings.temperature)
        # no valid token: a finite 0 as TRL's own head gives, not 0 / 0
        loss = token_mean(-out.log_probs.sum(), out.mask.sum())
        if aux_loss is not None:
            loss = loss + aux_coef * aux_loss.to(loss.device)
        return FusedLMHeadOutput(
            loss=loss, log_probs=out.log_probs, entropy=out.entropy, log_sum_sq_probs=out.log_sum_sq_probs,
            mean_logits=out.mean_logits, is_top1=out.top1, label_mask=out.mask, aux_loss=aux_loss,
        )


    def loss_statistics(self, hidden, targets, ignore_index: int, token_mean: Callable, aux_loss=None,
                        aux_coef: float = 0.0) -> tuple[LossStatisticsOutput, torch.Tensor, torch.Tensor]:
        """(a loss call's :class:`LossStatisticsOutput`, its targets' log-probs, their valid mask), from the per-token
        log-probs, entropies and top-1 hits of ``targets`` ((B, T), already shifted). ``token_mean(loss_sum,
        num_valid)``: the caller's mean, as for :meth:`fused`."""
        out = self.per_token(hidden, targets, ignore_index, ("entropy", "top1"))
        loss = token_mean(-out.log_probs.sum(), out.mask.sum())
        if aux_loss is not None:
            loss = loss + aux_coef * aux_loss.to(loss.device)
        result = LossStatisticsOutput(
            loss=loss, num_correct_tokens=out.top1.sum().float(), entropy_sum=out.entropy.detach().sum(),
            num_valid_tokens=out.mask.sum(), aux_loss=aux_loss,
        )
        return result, out.log_probs, out.mask


def check_token_outputs_call(generating: bool, has_targets: bool) -> None:
    if generating:
        raise ValueError(
            "return_token_logprobs with a KV cache (past_key_values / use_cache=True): log-probs are for training "
            "and scoring; pass use_cache=False"
        )
    if not has_targets:
        raise ValueError(
            "return_token_logprobs needs the targets: pass labels= (shift_labels= under sequence parallelism) with "
            "-100 where no log-prob is wanted (the prompt, padding)"
        )
