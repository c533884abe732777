"""What ds_longseq knows of TRL's trainers: which are integrated, how each calls the model and what it reads back,
which GRPO options span a sequence-parallel group's turns, how GRPO's token-weighted metrics recombine over the turns.

Holds:
    trl_trainer_names: the TRL trainer classes among a class's bases.
    check_trainer_class: refuse a TRL trainer whose loss was not checked against TRL's.
    fused_head_settings: the arguments a TRL trainer gave ``add_fused_lm_head`` for its policy.
    reads_loss_statistics / reads_whole_logits / check_loss_calls: TRL 1.9's calls (below).
    uses_whole_sequence_calls / uses_group_turns: which TRL trainers run whole-sequence calls, group turns.
    check_grpo_sequence_parallel: refuse the GRPO options that span a group's turns.
    recombine_turn_metrics: GRPO's token-weighted metrics over a group's turns.

How the trainers call the model, by TRL release (``compat.trl_makes_fused_head_calls`` tells the two apart):

* TRL 1.16 (1.16.0 checked): SFT, DPO and GRPO make fused-LM-head calls (``model(..., labels=...,
  fused_lm_head=True)``), answered by ds_longseq's forward with the settings :func:`fused_head_settings` reads back;
  under sequence parallelism DPO's and GRPO's are cut across the group and their per-token outputs made whole
  (``engine.WholeSequenceCalls``).
* TRL 1.9 (1.9.0 checked): no fused-LM-head calls. SFT with ``loss_type="chunked_nll"`` (its default; TRL 1.16 reads it
  as ``"nll"``) patches its own chunked forward in and reads ``num_valid_tokens`` / ``entropy_sum`` /
  ``num_correct_tokens`` from each loss call: ds_longseq's forward, which shadows TRL's, returns them
  (:func:`reads_loss_statistics`, ``patch.configure_loss_statistics``). SFT with ``loss_type="nll"`` reads the logits
  of its loss calls, which the chunked head does not form (refused: :func:`check_loss_calls`). DPO and GRPO call the
  model without labels and read ``outputs.logits``: whole-sequence calls gather the logits back whole on every rank
  of the group (:func:`reads_whole_logits`; exact, each rank then holding the call's whole (B, T, V) logits, as plain
  TRL 1.9's DPO does; its GRPO asks for the completions' only, ``logits_to_keep``, cut from the whole).
"""

from __future__ import annotations

from typing import Any

from ds_longseq.compat import trl_entropy_bonus_enabled, trl_makes_fused_head_calls

__all__ = [
    "trl_trainer_names",
    "check_trainer_class",
    "fused_head_settings",
    "reads_loss_statistics",
    "reads_whole_logits",
    "check_loss_calls",
    "uses_whole_sequence_calls",
    "uses_group_turns",
    "check_grpo_sequence_parallel",
    "recombine_turn_metrics",
]

# TRL trainers integrated (their fused-LM-head calls served by ds_longseq's head); the others
# (KTO, RLOO, ...) are refused until their losses are checked against TRL's.
_SUPPORTED = {"SFTTrainer", "DPOTrainer", "GRPOTrainer", "_BaseTrainer", "BaseTrainer"}
# Their losses are functions of whole-sequence sums of per-token log-probs (DPO: each completion's
# log-likelihood; GRPO: each completion's token count and, for its sequence-level loss types, sums),
# which TRL computes over the tokens it is given. So under sequence parallelism their model calls take whole
# sequences (engine.WholeSequenceCalls). DPO: the ranks of a group read the same batches. GRPO generates and scores
# its completions per rank as without sequence parallelism, and the group trains on its ranks' batches in turn.
_WHOLE_SEQUENCE_CALLS = {"DPOTrainer", "GRPOTrainer"}
_GROUP_TURNS = {"GRPOTrainer"}
# TRL GRPO's metrics that are token-weighted means over the world's batch (its global_masked_mean): under group turns
# each turn logs its batch's, so the group's turns are recombined with the batches' token counts; the clip-ratio
# ones only when importance sampling is per token (per sequence every batch weighs the same)
_GRPO_TOKEN_MEANS = ("entropy", "kl")
_GRPO_CLIP_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")
_GRPO_EXTREMES = {"clip_ratio/low_min": min, "clip_ratio/high_max": max}


def trl_trainer_names(cls: type) -> set[str]:
    """The names of the TRL ``...Trainer`` classes among ``cls``'s bases."""
    return {b.__name__ for b in cls.__mro__ if b.__module__.split(".")[0] == "trl" and b.__name__.endswith("Trainer")}


def check_trainer_class(cls: type) -> None:
    """Raise NotImplementedError for a TRL trainer ds_longseq has not checked against TRL (KTO, RLOO, ...)."""
    for name in sorted(trl_trainer_names(cls) - _SUPPORTED):
        raise NotImplementedError(
            f"ds_longseq's Trainer integration supports transformers' Trainer and TRL's SFTTrainer, "
            f"DPOTrainer and GRPOTrainer, not TRL's {name} yet: use the plain TRL trainer, or "
            "examples/dpo.py / examples/grpo.py (ds_longseq's exact chunked DPO / GRPO)"
        )


def uses_whole_sequence_calls(cls: type) -> bool:
    """Whether the TRL trainer's model calls take whole sequences under sequence parallelism (DPO, GRPO)."""
    return bool(trl_trainer_names(cls) & _WHOLE_SEQUENCE_CALLS)


def uses_group_turns(cls: type) -> bool:
    """Whether the TRL trainer's group trains on its ranks' batches in turn under sequence parallelism (GRPO)."""
    return bool(trl_trainer_names(cls) & _GROUP_TURNS)


def fused_head_settings(trainer) -> dict[str, Any] | None:
    """The arguments the TRL trainer gave ``add_fused_lm_head`` for its policy (TRL 1.16), read back
    from the trainer's own attributes; None for a non-TRL trainer."""
    names = trl_trainer_names(type(trainer))
    if "DPOTrainer" in names:  # mean_logits and is_top1 feed its metrics, log_sum_sq_probs the WPO weights
        weighting = ("log_sum_sq_probs",) if trainer.use_weighting else ()
        return {"outputs": ("log_probs", "entropy", "mean_logits", "is_top1", *weighting)}
    if "GRPOTrainer" in names:
        return {
            "temperature": trainer.temperature,
            "cast_lm_head_to_fp32": bool(trainer.args.cast_lm_head_to_fp32),
            "outputs": ("log_probs", "entropy"),
        }
    if "SFTTrainer" in names:
        return {"outputs": ("log_probs", "entropy", "is_top1")}
    return None


def reads_loss_statistics(trainer) -> bool:
    """Whether the TRL trainer reads TRL 1.9's chunked-NLL sums from its loss calls' outputs (SFT with
    ``loss_type="chunked_nll"`` on a TRL without fused-LM-head calls)."""
    return ("SFTTrainer" in trl_trainer_names(type(trainer)) and not trl_makes_fused_head_calls()
            and getattr(trainer.args, "loss_type", None) == "chunked_nll")


def reads_whole_logits(trainer) -> bool:
    """Whether the TRL trainer's whole-sequence calls (DPO, GRPO) read ``outputs.logits`` (TRL 1.9) rather than
    fused-LM-head per-token outputs (TRL 1.16)."""
    return uses_whole_sequence_calls(type(trainer)) and not trl_makes_fused_head_calls()


def check_loss_calls(trainer, lm_head_chunked: bool) -> None:
    """Refuse TRL 1.9's SFTTrainer with ``loss_type="nll"`` under ds_longseq's chunked LM head
    (``lm_head_chunked``): it reads the full logits of its loss calls, which the chunked head never forms.

    Raises:
        NotImplementedError: naming the TRL release and the ways out.
    """
    if not lm_head_chunked or trl_makes_fused_head_calls() or "SFTTrainer" not in trl_trainer_names(type(trainer)):
        return
    # a compute_loss_func or a label smoother takes the labels out first: the call then returns the logits
    labels_call = (getattr(trainer, "compute_loss_func", None) is None
                   and getattr(trainer, "label_smoother", None) is None)
    if getattr(trainer.args, "loss_type", None) == "nll" and labels_call:
        import trl

        raise NotImplementedError(
            f"TRL {trl.__version__}'s SFTTrainer with loss_type='nll' reads the logits of its loss calls (for its "
            "entropy and token-accuracy metrics), which long_seq.lm_head's chunked head never forms: use "
            f"loss_type='chunked_nll' (TRL {trl.__version__}'s default, the same loss), set long_seq.lm_head.enabled "
            "to false, or pip install 'trl>=1.16'"
        )


def check_grpo_sequence_parallel(trainer, size: int) -> None:
    """TRL's GRPO options whose state or statistics span the group's turns are refused under sequence
    parallelism (``size`` ranks per sequence), each naming the option."""
    args = trainer.args
    refused = {
        "top_entropy_quantile < 1 (its entropy threshold is a quantile over every rank's tokens)":
            getattr(args, "top_entropy_quantile", 1.0) < 1.0,
        "an entropy bonus (entropy_coef / use_adaptive_entropy: its running statistics update once per call)":
            trl_entropy_bonus_enabled(trainer),
        "a MoE load-balancing loss (router_aux_loss_coef; not verified under sequence parallelism)":
            getattr(trainer, "aux_loss_enabled", False),
        "loss_type='vespo' (not verified under sequence parallelism)": getattr(args, "loss_type", "") == "vespo",
        "use_vllm (generation outside this process)": getattr(args, "use_vllm", False),
    }
    for what, given in refused.items():
        if given:
            raise NotImplementedError(
                f"TRL's GRPOTrainer under long_seq.sequence_parallel.size={size} with {what}: drop it, or set "
                "sequence_parallel.size to 1"
            )


def recombine_turn_metrics(metrics: dict, before: dict, weights: list[float], token_level: bool) -> None:
    """The P values each of TRL GRPO's token-weighted metrics got from a group's P turns
    (``metrics[key][before[key]:]``), replaced by P copies of their mean weighted by the turns' token counts
    ``weights`` (TRL averages a logging window's values: the window then holds the world's mean over all the group's
    tokens, as one call over every rank's batch gives it); min / max metrics by the extreme. ``token_level``:
    importance sampling per token."""
    size = len(weights)
    pooled = set(_GRPO_TOKEN_MEANS) | (set(_GRPO_CLIP_MEANS) if token_level else set())
    for key, values in metrics.items():
        new = values[before.get(key, 0):]
        if len(new) != size or not (key in pooled or key in _GRPO_EXTREMES):
            continue
        if key in pooled:
            value = sum(v * w for v, w in zip(new, weights, strict=True)) / max(sum(weights), 1.0)
        else:
            value = _GRPO_EXTREMES[key](new)
        values[before.get(key, 0):] = [value] * size
