"""Preference and RL objectives on per-token log-probabilities: DPO and GRPO (TRL's options).

Holds:
    TokenLogprobs: per-token log-probabilities of given targets (what ``chunked_token_logprobs``
        and a model's ``return_token_logprobs=True`` forward return), with sums over the whole
        sequence that stay exact when the sequence is split over sequence-parallel ranks.
    dpo_loss: Direct Preference Optimization on sequence log-probabilities (the sigmoid loss with
        conservative label smoothing), with TRL's reward metrics.
    group_advantages: GRPO advantages from rewards, normalised within each group of completions.
    gather_sequence: every rank's slice of (B, T) per-token values side by side, for callers that compute a
        whole-sequence function on every rank (TRL's DPO trainer under sequence parallelism).
    grpo_loss: the clipped-ratio GRPO objective with an optional k3 KL to a reference, normalised as
        TRL's ``loss_type`` ("grpo", "bnpo", "dr_grpo", "dapo").

Why per-token log-probs: every objective here is a function of per-token log-probabilities, so
once they come out of the chunked LM head with its exact backward, ordinary autograd on (B, T)
tensors gives the exact gradient; no (B, T, V) logits are ever formed. For DPO this is the StreamBP
paper's scheme (Sec. 3.2.1, eqs. 8-10): the per-chunk gradients of the sequence log-probabilities
are accumulated and scaled by one factor, beta * sigmoid(-beta * margin), which autograd applies
through ``logsigmoid`` (tests/test_objectives.py checks the two agree).

Sequence parallelism: each rank holds a slice of every sequence. Sums over the sequence are
all-reduced over the group; the value is the group's total on every rank and the gradient is this
rank's own share (as ``SequenceParallel.token_mean``), so the ranks' gradients summed (DeepSpeed's
reduction) are the gradient of the objective, exactly.

Shape legend: B sequences (rows), T tokens (this rank's slice under sequence parallelism), G
completions per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "TokenLogprobs", "gather_sequence", "dpo_loss", "group_advantages", "grpo_loss", "GRPO_LOSS_TYPES",
    "DPO_LOSS_TYPES",
]

DPO_LOSS_TYPES = ("sigmoid",)
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class TokenLogprobs:
    """Per-token log-probabilities of the targets, (B, T) each.

    Attributes:
        logprobs: log p(target_t | tokens before), differentiable; 0 where ``mask`` is False.
        mask: True where the target is valid (not ``ignore_index``).
        entropy: entropy of the predicted distribution at each valid position (0 elsewhere), when
            requested; differentiable.
        group: the sequence-parallel process group the sequence is split over, or None.
    """

    logprobs: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    group: object | None = None

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """(B,) sums over the whole sequence of ``values`` (B, T) at valid positions.

        Under sequence parallelism the value is the group's total and the gradient this rank's share.
        """
        local = (values * self.mask).sum(-1)
        if self.group is None:
            return local
        total = local.detach().clone()
        dist.all_reduce(total, group=self.group)
        return local - local.detach() + total

    def count(self) -> torch.Tensor:
        """(B,) valid targets over the whole sequence (float, no gradient)."""
        local = self.mask.sum(-1).to(self.logprobs.dtype)
        if self.group is not None:
            dist.all_reduce(local, group=self.group)
        return local

    def sequence_logprobs(self, allow_empty: bool = False) -> torch.Tensor:
        """(B,) log-probability of each row's targets: the sum of its per-token log-probs.

        Raises:
            ValueError: a row has no valid target (an empty completion, or a prompt that fills the
                row), unless ``allow_empty``: its log-probability would be a silent 0.
        """
        if not allow_empty:
            empty = (self.count() == 0).nonzero().flatten().tolist()
            if empty:
                raise ValueError(
                    f"rows {empty} have no target token (an empty completion, or a prompt as long as the row): "
                    "drop them, or give them a completion (allow_empty=True to accept a log-probability of 0)"
                )
        return self.sum(self.logprobs)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 1); backward: this rank's own slice of the gradient."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.width = rank, values.shape[1]
        return _all_gather_seq(values, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width], None, None, None


def _all_gather_seq(values: torch.Tensor, group, size: int) -> torch.Tensor:
    sent = values.to(torch.uint8) if values.dtype == torch.bool else values  # gloo has no bool all-gather
    parts = [torch.empty_like(sent) for _ in range(size)]
    dist.all_gather(parts, sent.contiguous(), group=group)
    return torch.cat(parts, dim=1).to(values.dtype)


def gather_sequence(values: torch.Tensor, group, rank: int, size: int) -> torch.Tensor:
    """(B, P * T) per-token ``values`` of the P ranks of ``group`` side by side, from this rank's (B, T) slice
    (rank ``rank`` of ``size``; every rank's slice the same shape).

    For a caller that then computes the same whole-sequence function on every rank of the group (TRL's DPO loss
    from per-token log-probs): the gradient of the result goes back to this rank's own slice only, not summed over
    the ranks (each computed the whole function), so the ranks' parameter gradients summed (DeepSpeed's
    reduction over the group) are the function's gradient, exactly. Values without gradient (masks, metrics) are
    gathered as they are.
    """
    if values.dim() < 2:
        raise ValueError(f"gather_sequence takes (batch, seq, ...) values, got shape {tuple(values.shape)}")
    if values.requires_grad:
        return _GatherSequence.apply(values, group, rank, size)
    return _all_gather_seq(values, group, size)


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO on (B,) sequence log-probabilities of chosen and rejected completions.

    ``margin = (chosen - ref_chosen) - (rejected - ref_rejected)``; "sigmoid" (Rafailov et al.,
    with conservative label smoothing, cDPO, as TRL's sigmoid loss had it before moving smoothing to
    its "robust" loss): ``-(1 - ls) logsigmoid(beta m) - ls logsigmoid(-beta m)``. Mean over pairs.

    Returns:
        (loss, metrics): metrics hold TRL's detached ``rewards/chosen``, ``rewards/rejected`` (B,),
        ``rewards/accuracies`` and ``rewards/margins`` (scalars).

    Raises:
        ValueError: shapes that do not pair up, reference log-probs that carry gradient, bad options.
    """
    names = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
    tensors = (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    for name, t in zip(names, tensors, strict=True):
        if t is None:
            raise ValueError(
                f"dpo_loss: {name} is missing: pass the reference model's log-probs (or the policy's with its "
                "LoRA adapters disabled, or precomputed ones)"
            )
    shapes = {name: tuple(t.shape) for name, t in zip(names, tensors, strict=True)}
    if len(set(shapes.values())) != 1 or chosen_logps.dim() != 1:
        raise ValueError(f"dpo_loss takes four (B,) tensors, one entry per pair; got shapes {shapes}")
    if ref_chosen_logps.requires_grad or ref_rejected_logps.requires_grad:
        raise ValueError("dpo_loss: the reference log-probs require grad; compute them under torch.no_grad()")
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"dpo_loss: loss_type={loss_type!r}; choose one of {DPO_LOSS_TYPES}")
    if not beta > 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo_loss: label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen = chosen_logps - ref_chosen_logps
    rejected = rejected_logps - ref_rejected_logps
    margin = chosen - rejected
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    metrics = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
    }
    return losses.mean(), metrics


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std ("group"),
    the batch's std ("batch") or nothing ("none"); rows are grouped consecutively.

    Args:
        rewards: (num_groups * G,) one reward per completion.
        group_size: G, completions per prompt.
        scale: "group" | "batch" | "none" (TRL's ``scale_rewards``).

    Returns:
        (num_groups * G,) advantages. Std is the unbiased one, plus 1e-4 (TRL).
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"group_advantages: {rewards.numel()} rewards cannot be split into groups of {group_size}: pass one reward "
            "per completion, grouped consecutively, num_groups * group_size of them"
        )
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"group_advantages: scale={scale!r}; choose 'group', 'batch' or 'none'")
    if scale == "group" and group_size == 1:
        raise ValueError(
            "group_advantages: a group of size 1 has no standard deviation: use group_size >= 2, or scale='none' "
            "(or 'batch')"
        )
    grouped = rewards.view(-1, group_size)
    advantages = (grouped - grouped.mean(-1, keepdim=True)).reshape(-1)
    if scale == "group":
        std = grouped.std(-1, keepdim=True).expand_as(grouped).reshape(-1)
    elif scale == "batch":
        std = rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        return advantages
    return advantages / (std + 1e-4)


def grpo_loss(
    logps: TokenLogprobs,
    advantages: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's clipped surrogate on completion tokens, as TRL's ``GRPOTrainer`` computes it.

    Per token: ``-min(r A, clip(r, 1 - eps, 1 + eps_high) A)`` with ``r = exp(logp - old_logp)``
    (``old_logprobs`` None: the current policy detached, r = 1), plus ``beta * (exp(ref - logp) -
    (ref - logp) - 1)`` (the k3 KL estimator) when ``beta`` != 0. Normalisation (``loss_type``):
    "grpo" mean over each sequence's tokens, then over sequences; "bnpo" sum over all tokens / their
    count; "dr_grpo" sum / (B * max_completion_length); "dapo" sum / ``num_items`` (the valid tokens
    of the whole step, e.g. over gradient accumulation; default: this batch's count, as "bnpo").

    Args:
        logps: the policy's :class:`TokenLogprobs` of the completion tokens (prompt targets masked).
        advantages: (B,) one advantage per row (see :func:`group_advantages`).
        old_logprobs, ref_logprobs: (B, T) detached per-token log-probs of the old and reference
            policies on the same targets.

    Returns:
        (loss, metrics): metrics hold the detached ``kl`` (when beta != 0) and ``clip_ratio`` means.
    """
    lp = logps.logprobs
    B = lp.shape[0]
    if advantages.shape != (B,):
        raise ValueError(f"grpo_loss: advantages must be (B,) = ({B},), got {tuple(advantages.shape)}")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != lp.shape:
            raise ValueError(f"grpo_loss: {name} has shape {tuple(t.shape)}, the policy's log-probs {tuple(lp.shape)}")
        if t is not None and t.requires_grad:
            raise ValueError(f"grpo_loss: {name} requires grad; compute it under torch.no_grad()")
    if beta != 0 and ref_logprobs is None:
        raise ValueError("grpo_loss: beta != 0 needs ref_logprobs (the reference policy's per-token log-probs)")
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo_loss: loss_type={loss_type!r}; choose one of {GRPO_LOSS_TYPES}")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("grpo_loss: loss_type='dr_grpo' needs max_completion_length")
    counts = logps.count()
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(f"grpo_loss: rows {empty} have no completion token (an empty completion): drop them")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    old = lp.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(lp - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    adv = advantages.to(lp.dtype)[:, None]
    per_token = -torch.min(ratio * adv, clipped * adv)
    metrics = {}
    if beta != 0:
        delta = ref_logprobs - lp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        metrics["kl"] = (logps.sum(kl.detach()) / counts).mean()
    metrics["clip_ratio"] = (logps.sum(((ratio * adv) > (clipped * adv)).to(lp.dtype)) / counts).mean().detach()
    sums = logps.sum(per_token)
    if loss_type == "grpo":
        loss = (sums / counts).mean()
    elif loss_type == "dr_grpo":
        loss = sums.sum() / (B * max_completion_length)
    elif loss_type == "bnpo" or num_items is None:
        loss = sums.sum() / counts.sum()
    else:
        loss = sums.sum() / num_items
    return loss, metrics
