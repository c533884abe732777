"""Hugging Face ``Trainer`` and TRL's SFT / DPO / GRPO trainers with ds_longseq: one class line in user code.

Holds:
    LongSeqTrainerMixin: put it first among the bases of ``transformers.Trainer`` or a subclass.
    LongSeqTrainer: ``LongSeqTrainerMixin`` + ``transformers.Trainer``.
    with_long_seq: ``with_long_seq(SFTTrainer)`` builds that subclass for any Trainer class.

Usage (the DeepSpeed JSON carries a ``"long_seq"`` section, as for ``ds_longseq.engine.initialize``)::

    args = TrainingArguments(..., deepspeed="ds_configs/zero2_streambp.json")
    trainer = LongSeqTrainer(model=model, args=args, train_dataset=data)   # or with_long_seq(SFTTrainer)(...)
    trainer.train()

In the Trainer, ``deepspeed.initialize`` is called by accelerate, not by the user, so the mixin does
what ``engine.initialize`` would, at these points:

- ``__init__`` (after the Trainer's own): takes ``long_seq`` out of the DeepSpeed config the Trainer
  was given and validates it with ``engine.split_config`` (the same errors, before any training),
  builds DeepSpeed's sequence-parallel groups (on the process group the Trainer's accelerator started, adopted for
  DeepSpeed's collectives by ``engine.process_group``: the script starts none itself) and enables the model.
  It enables on top of TRL's fused-LM-head forward, so TRL's ``fused_lm_head=True`` calls are served by
  ds_longseq's chunked head (``modules.causal_lm.FusedLMHeadOutput``), configured as the TRL trainer configured its own
  (``patch.configure_fused_lm_head``: GRPO's temperature and ``cast_lm_head_to_fp32``, the fields
  DPO reads). TRL's reference model (DPO; GRPO with ``beta > 0``) keeps TRL's own fused head, except under
  sequence parallelism (DPO), where it is enabled with the policy's sequence parallelism.
- ``train`` / ``evaluate`` / ``predict``: inside them ``deepspeed.initialize`` is
  ``engine.initialize_with`` (``compat.deepspeed_initialize_replaced``), so the engine gets the
  sequence-parallel groups (``mpu``), ZeRO-3 leaf modules and the ZeRO-3 average fix.
- data under sequence parallelism (P ranks per sequence): the P ranks of a group read the same
  batches; accelerate's batch sampler is sharded over the world / P data-parallel replicas.
- ``compute_loss`` of TRL's ``GRPOTrainer`` under sequence parallelism: each rank generated for its own prompts (as
  plain TRL, sequence parallelism paused in ``_prepare_inputs``); the group trains on its ranks' batches in turn,
  each cut across the group by whole-sequence calls, each loss / P; TRL's token-weighted metrics recombined.
- ``compute_loss`` of TRL's ``DPOTrainer`` in training under sequence parallelism: TRL's model calls take the
  whole batch and run cut across the group (``engine.WholeSequenceCalls``), so TRL's loss and metrics are computed
  from whole sequences on every rank, each rank's gradient its slice's; TRL's metric gathers keep one copy per group.
- ``compute_loss`` (other trainers) in training under sequence parallelism: the Trainer has counted the batch's
  tokens (``num_items_in_batch``) on the whole sequences; the batch is then cut with
  ``engine.shard_batch``, the loss computed with this rank's share as its value, and the values
  summed over the group. So each rank's loss value is that of the unsharded batch (what the Trainer
  logs) and its gradient this rank's share (DeepSpeed sums the shares over the group).
- ``parallelism_config`` with ``sp_size`` P > 1 (a script written the ALST way): sets the sequence-parallel
  size; accelerate's and the Trainer's ALST machinery is hidden from the run (``_accelerate_sp_hidden``) and
  the training data keeps ALST's semantics: each rank reads its own batches, the group trains on the P batches
  in turn (``_GroupTurns``), so steps per epoch and samples per step are ALST's.
- evaluation under sequence parallelism (issue 29 item 4), for the loss (``prediction_loss_only``, i.e. no
  ``compute_metrics``): each rank's evaluation batch is run sharded across its sequence-parallel group like a
  training batch, the group's P batches one after the other (each broadcast from its rank), so an
  evaluation sequence is as long as a training one can be; each rank's loss is the one the stock step
  computes on its own batch (the same token count, ``num_items_in_batch``), so the Trainer's gathering and
  averaging are unchanged. Evaluation that needs logits (``compute_metrics``), prediction and generation
  pause sequence parallelism (``SequenceParallel.paused``): each rank runs its own whole sequences.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Mapping

import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_utils import unwrap_peft_model

from ds_longseq.compat import deepspeed_initialize_replaced
from ds_longseq.config import LongSeqConfig, LongSeqConfigError
from ds_longseq.engine import (
    WholeSequenceCalls,
    data_parallel_rank_and_size,
    initialize_with,
    sequence_parallel_groups,
    shard_batch,
    split_config,
)
from ds_longseq.engine.sequence_parallel import SHARDED_KEYS
from ds_longseq.logging import get_logger
from ds_longseq.patch import (
    configure_fused_lm_head,
    disable,
    enable,
    get_config,
    is_enabled,
    recording_tokens,
    sequence_parallel_of,
)

__all__ = ["LongSeqTrainerMixin", "LongSeqTrainer", "with_long_seq"]

logger = get_logger(__name__)

POSITION_BUCKETS = 8
"""Evaluation reports the loss in this many buckets of each document's length (``eval_loss_pos_1of8`` ...)."""

# TRL trainers integrated (their fused-LM-head calls served by ds_longseq's head); the others
# (KTO, RLOO, ...) are refused until their losses are checked against TRL's.
_TRL_SUPPORTED = {"SFTTrainer", "DPOTrainer", "GRPOTrainer", "_BaseTrainer", "BaseTrainer"}
# Their losses are functions of whole-sequence sums of per-token log-probs (DPO: each completion's
# log-likelihood; GRPO: each completion's token count and, for its sequence-level loss types, sums),
# which TRL computes over the tokens it is given. So under sequence parallelism their model calls take whole
# sequences (engine.WholeSequenceCalls). DPO: the ranks of a group read the same batches. GRPO generates and scores
# its completions per rank as without sequence parallelism, and the group trains on its ranks' batches in turn.
_TRL_WHOLE_SEQUENCE_CALLS = {"DPOTrainer", "GRPOTrainer"}
_TRL_GROUP_TURNS = {"GRPOTrainer"}
# TRL GRPO's metrics that are token-weighted means over the world's batch (its global_masked_mean): under group turns
# each turn logs its batch's, so the group's turns are recombined with the batches' token counts; the clip-ratio
# ones only when importance sampling is per token (per sequence every batch weighs the same)
_GRPO_TOKEN_MEANS = ("entropy", "kl")
_GRPO_CLIP_MEANS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "cispo_clip_ratio")
_GRPO_EXTREMES = {"clip_ratio/low_min": min, "clip_ratio/high_max": max}


def _trl_trainer_names(cls: type) -> set[str]:
    return {b.__name__ for b in cls.__mro__ if b.__module__.split(".")[0] == "trl" and b.__name__.endswith("Trainer")}


def _trl_fused_head(trainer) -> dict[str, Any] | None:
    """The arguments the TRL trainer gave ``add_fused_lm_head`` for its policy (TRL 1.16), read back
    from the trainer's own attributes; None for a non-TRL trainer."""
    names = _trl_trainer_names(type(trainer))
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


class LongSeqTrainerMixin:
    """ds_longseq in a Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``);
    list it first among the bases.

    Args:
        long_seq: the ``long_seq`` section (dict or :class:`LongSeqConfig`) for a run WITHOUT a
            DeepSpeed config (one process). With DeepSpeed, put it in the DeepSpeed JSON instead.
        *args, **kwargs: the Trainer's own.

    Raises (from ``__init__``, before any training):
        LongSeqConfigError: the ``long_seq`` section or the ZeRO stage is invalid.
        ValueError: the sequence-parallel size does not divide the world size; ``parallelism_config``'s
            ``sp_size`` and ``long_seq.sequence_parallel.size`` disagree; ``long_seq`` given twice.
        UnsupportedModelError: the model family or one of its settings is not supported.
        NotImplementedError: a TRL trainer other than ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``;
            under sequence parallelism, a DPO MoE router loss, and the GRPO options that span the group's turns
            (``top_entropy_quantile``, an entropy bonus, a router loss, ``vespo``, vLLM).
    """

    def __init__(self, *args, long_seq: Mapping[str, Any] | LongSeqConfig | None = None, **kwargs):
        self._check_trainer_class()
        super().__init__(*args, **kwargs)
        self._long_seq_routing = False
        self._long_seq_section, self.long_seq_config = self._take_long_seq_section(long_seq)
        cfg = self.long_seq_config
        sp_group = None
        if cfg.sequence_parallel.enabled:
            # the process group accelerate started (or the launcher's environment describes): DeepSpeed's groups
            # need deepspeed.comm to know it, which on CPU ranks it does not until deepspeed.initialize
            sp_group = sequence_parallel_groups(cfg.sequence_parallel.size).get_sequence_parallel_group()
            self._check_world_matches_accelerate()
        if is_enabled(self.model):
            if get_config(self.model) != cfg:
                raise ValueError(
                    "the model was enabled with a different long_seq config than the Trainer's: call "
                    "ds_longseq.disable(model) first, or pass the same settings"
                )
            # re-enabled on top of whatever the Trainer (TRL's fused head) put over it
            disable(self.model)
        model_checkpointing = getattr(self.model, "is_activation_checkpointing", False)
        checkpointing = model_checkpointing or any(
            getattr(self.args, name, False) for name in ("activation_checkpointing", "gradient_checkpointing")
        )
        if cfg.streambp.enabled and checkpointing:
            # TRL's SFTConfig turns it on by default (the Trainer applies it in train()); StreamBP
            # already keeps only each layer's input
            if model_checkpointing:
                self.model.activation_checkpointing_disable()
            for name in ("activation_checkpointing", "gradient_checkpointing"):
                if getattr(self.args, name, None):
                    setattr(self.args, name, False)
            logger.warning(
                "ds_longseq: activation checkpointing turned off: StreamBP already recomputes each layer from its "
                "input (pass activation_checkpointing=False to silence this)"
            )
        if cfg.any_enabled:
            enable(self.model, cfg, sp_group=sp_group)
            fused_head = _trl_fused_head(self)
            if fused_head is not None:
                configure_fused_lm_head(self.model, **fused_head)
        self._sp = sequence_parallel_of(self.model)
        self._sps = [] if self._sp is None else [self._sp]  # every model's, paused together
        self._whole_calls = None
        names = _trl_trainer_names(type(self))
        self._group_turns = self._sp is not None and bool(names & _TRL_GROUP_TURNS)
        if self._group_turns:
            self._check_grpo_sequence_parallel()
            self._whole_calls = WholeSequenceCalls([self.accelerator.unwrap_model(self.model)], self._sp.rank,
                                                   self._sp.size, self._sp.group)
        elif self._sp is not None and names & _TRL_WHOLE_SEQUENCE_CALLS:
            self._whole_calls = self._whole_sequence_calls(cfg, sp_group)

    # ---- set-up ---------------------------------------------------------------------------------

    def _check_world_matches_accelerate(self) -> None:
        """accelerate must see the ranks DeepSpeed's groups span (it shards the data over them): under a bare
        mpirun on GPUs it does not (it reads LOCAL_RANK, which MPI does not set), and would train every rank on
        the same batches."""
        world, seen = dist.get_world_size(), self.accelerator.num_processes
        if seen != world:
            raise RuntimeError(
                f"this process is one of {world} ranks but accelerate set up {seen} process(es) (under mpirun it reads "
                "RANK / LOCAL_RANK / WORLD_SIZE, which MPI does not set): launch through SCRIPT=your_script.py bash "
                "launch/mpirun.sh, which sets them, or with deepspeed / torchrun / accelerate launch"
            )

    def _take_long_seq_section(self, long_seq) -> tuple[dict[str, Any] | None, LongSeqConfig]:
        """(the raw section for engine.initialize_with, validated config); removes it from the
        DeepSpeed config, which DeepSpeed itself must not see."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None:
            if dist.is_initialized() and dist.get_world_size() > 1 and long_seq is not None:
                raise ValueError(
                    "ds_longseq's Trainer integration runs several processes through DeepSpeed: pass "
                    "TrainingArguments(deepspeed=<config with a 'long_seq' section>) instead of long_seq="
                )
            cfg = LongSeqConfig.from_dict(long_seq)
            if cfg.sequence_parallel.enabled:
                raise LongSeqConfigError(
                    ["sequence_parallel needs DeepSpeed: pass TrainingArguments(deepspeed=<config>) with the section"]
                )
            return None, cfg
        ds_config = plugin.deepspeed_config
        section = ds_config.pop("long_seq", None)
        hf_config = getattr(getattr(self.args, "hf_deepspeed_config", None), "config", None)
        if hf_config is not None and hf_config is not ds_config:
            hf_config.pop("long_seq", None)
        if long_seq is not None:
            if section is not None:
                raise ValueError("long_seq is in the DeepSpeed config and passed as long_seq=: keep only one")
            section = long_seq.to_dict() if isinstance(long_seq, LongSeqConfig) else dict(long_seq)
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and getattr(pc, "sp_enabled", False):
            section = self._take_parallelism_config(pc, section)
        _, cfg = split_config({**ds_config, "long_seq": section})
        return section, cfg

    def _take_parallelism_config(self, pc, section: dict | None) -> dict:
        """The long_seq section with its sequence-parallel size from ``parallelism_config`` (the ALST way to
        ask for it: ``ParallelismConfig(sp_backend="deepspeed", sp_size=P, sp_handler=...)``). accelerate's
        own Ulysses (its attention, its dataloader adapter, the Trainer's loss) is then kept out of the run and
        ds_longseq's does the work, with ALST's data semantics (:class:`_GroupTurns`)."""
        section = dict(section or {})
        ours = dict(section.get("sequence_parallel") or {})
        if ours.get("size", 1) not in (1, pc.sp_size):
            raise ValueError(
                f"parallelism_config sp_size={pc.sp_size} and long_seq.sequence_parallel.size={ours['size']} disagree: "
                "set one of them (or both to the same size)"
            )
        handler = getattr(pc, "sp_handler", None)
        knobs = {name: getattr(handler, name, None) for name in ("sp_seq_length", "sp_attn_implementation")}
        set_knobs = {name: value for name, value in knobs.items() if value is not None}
        if set_knobs:
            logger.warning(
                "ds_longseq: parallelism_config's sp_handler settings %s are ignored: ds_longseq's own attention "
                "runs every layer (its kernel choice: long_seq.attention) and takes any sequence length (a batch is "
                "padded to a multiple of sp_size)", set_knobs,
            )
        self._accelerate_sp = pc
        # The Trainer turned model_accepts_loss_kwargs off for ALST, whose loss counts each shard's tokens itself; ours
        # takes the batch's count (num_items_in_batch) as without parallelism_config, so the loss is token-weighted over
        # the accumulation window and TRL's trainers (which divide by that count) sum exactly over the group
        self.model_accepts_loss_kwargs = _accepts_loss_kwargs(self.accelerator.unwrap_model(self.model))
        section["sequence_parallel"] = {**ours, "size": pc.sp_size}
        return section

    @property
    def _whole_eval(self) -> bool:
        """TRL's DPO under sequence parallelism evaluates with its model calls cut across the group (the group's
        ranks reading the same pairs); with precomputed reference log-probs it evaluates paused."""
        return (self._whole_calls is not None and not self._group_turns
                and not getattr(self.args, "precompute_ref_log_probs", False))

    def _whole_sequence_calls(self, cfg: LongSeqConfig, sp_group) -> WholeSequenceCalls:
        """TRL's DPO under sequence parallelism: its model calls take whole sequences and run sharded
        (:class:`~ds_longseq.engine.WholeSequenceCalls`), so TRL's loss and metrics see whole sequences. Its
        reference model is enabled with the same sequence parallelism (and chunked head), so its calls are cut too
        (with PEFT and no reference model, the policy with its adapter off is the reference)."""
        if getattr(self, "aux_loss_enabled", False):
            raise NotImplementedError(
                f"TRL's DPOTrainer with a MoE load-balancing loss (router_aux_loss_coef={self.router_aux_loss_coef}) "
                f"under long_seq.sequence_parallel.size={cfg.sequence_parallel.size}: the router loss of a sharded "
                "call is not verified against TRL's. Set router_aux_loss_coef=0 in the DPOConfig, or "
                "sequence_parallel.size to 1"
            )
        modules = [self.accelerator.unwrap_model(self.model)]
        ref = getattr(self, "ref_model", None)
        if ref is not None:
            ref = self.accelerator.unwrap_model(ref)
            ref_cfg = LongSeqConfig.from_dict({
                name: getattr(cfg, name).__dict__ for name in ("sequence_parallel", "lm_head", "attention", "watchdog")
            })
            if is_enabled(ref):
                disable(ref)
            enable(ref, ref_cfg, sp_group=sp_group)
            configure_fused_lm_head(ref)  # what TRL's DPO asked of the reference's head: add_fused_lm_head(ref_model)
            self._sps.append(sequence_parallel_of(ref))
            modules.append(ref)
        return WholeSequenceCalls(modules, self._sp.rank, self._sp.size, self._sp.group)

    def _group_turns_loss(self, model, inputs, return_outputs, num_items_in_batch):
        """TRL's GRPO under sequence parallelism: the P batches of the group (each rank generated its own) are broadcast
        and trained one after the other, each cut across the group by its model calls (whole-sequence calls), each
        loss / P. Each rank's loss value is the mean of the group's batches' and the gradients summed over the group
        and averaged over the world / P replicas are plain TRL's average over the world's ranks. TRL's token-weighted
        metrics logged by the turns are recombined with the batches' token counts (:meth:`_recombine_turn_metrics`).

        Every turn but the last is backed up here, through the DeepSpeed engine without a gradient-accumulation
        boundary and scaled as the Trainer scales the loss it returns (the last turn's backward is the Trainer's):
        each turn's graph is freed before the next one runs, and ZeRO-3, whose hooks reduce a parameter once per
        backward, sees each parameter once per backward (DeepSpeed issue 5321)."""
        sp = self._sp
        metrics = self._metrics["train"]
        before = {key: len(values) for key, values in metrics.items()}
        engine = self.model_wrapped
        total, weights = 0.0, []
        for member in range(sp.size):
            batch, _ = _broadcast_batch(inputs, None, member, sp.group)
            mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
            weights.append(mask.sum().float())
            with self._whole_calls:
                loss = super().compute_loss(model, batch, num_items_in_batch=num_items_in_batch) / sp.size
            if member < sp.size - 1 and hasattr(engine, "set_gradient_accumulation_boundary"):
                engine.set_gradient_accumulation_boundary(False)
                engine.backward(loss * self._trainer_loss_scale(num_items_in_batch), scale_wrt_gas=False)
                loss = loss.detach()
            total = total + loss
        weights = torch.stack(weights)
        dist.all_reduce(weights)  # each member's tokens over every replica (times P: the same on each group rank)
        self._recombine_turn_metrics(metrics, before, weights.tolist())
        return total

    def _trainer_loss_scale(self, num_items_in_batch) -> float:
        """The factor ``Trainer.training_step`` puts on the loss ``compute_loss`` returns before its backward
        (transformers 5.24: 1 / the accumulation steps unless the loss is already scaled for them)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None)
        return 1.0 if scaled else 1.0 / self.current_gradient_accumulation_steps

    def _recombine_turn_metrics(self, metrics: dict, before: dict, weights: list[float]) -> None:
        """The P values each of TRL's token-weighted metrics got from the turns, replaced by P copies of their
        token-weighted mean (TRL averages a logging window's values: the window then holds the world's mean over all
        the group's tokens, as one call over every rank's batch gives it); min / max metrics by the extreme."""
        size = self._sp.size
        token_level = getattr(self.args, "importance_sampling_level", "token") == "token"
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

    @contextlib.contextmanager
    def _metrics_per_group(self):
        """TRL gathers its metrics over every rank; under whole-sequence calls the P ranks of a sequence-parallel
        group hold the same values, so each gather keeps one copy per group (as one rank per group would log)."""
        accelerator, size = self.accelerator, self._sp.size
        gather = accelerator.gather

        def per_group(tensor):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"ds_longseq: TRL gathered a {type(tensor).__name__} under sequence parallelism, "
                                "where a tensor was expected")
            out = gather(tensor)
            return out.unflatten(0, (dist.get_world_size(), -1))[::size].flatten(0, 1)

        accelerator.gather = per_group
        try:
            yield
        finally:
            del accelerator.gather

    @contextlib.contextmanager
    def _paused(self):
        """Every model's sequence parallelism paused (the policy's and the reference's)."""
        with contextlib.ExitStack() as stack:
            for sp in self._sps:
                stack.enter_context(sp.paused())
            yield

    @classmethod
    def _check_trainer_class(cls) -> None:
        for name in sorted(_trl_trainer_names(cls) - _TRL_SUPPORTED):
            raise NotImplementedError(
                f"ds_longseq's Trainer integration supports transformers' Trainer and TRL's SFTTrainer, "
                f"DPOTrainer and GRPOTrainer, not TRL's {name} yet: use the plain TRL trainer, or "
                "examples/dpo.py / examples/grpo.py (ds_longseq's exact chunked DPO / GRPO)"
            )

    def _check_grpo_sequence_parallel(self) -> None:
        """TRL's GRPO options whose state or statistics span the group's turns are refused under sequence
        parallelism, each naming the option."""
        size, args = self._sp.size, self.args
        refused = {
            "top_entropy_quantile < 1 (its entropy threshold is a quantile over every rank's tokens)":
                getattr(args, "top_entropy_quantile", 1.0) < 1.0,
            "an entropy bonus (entropy_coef / use_adaptive_entropy: its running statistics update once per call)":
                getattr(self, "_entropy_bonus_enabled", False),
            "a MoE load-balancing loss (router_aux_loss_coef; not verified under sequence parallelism)":
                getattr(self, "aux_loss_enabled", False),
            "loss_type='vespo' (not verified under sequence parallelism)": getattr(args, "loss_type", "") == "vespo",
            "use_vllm (generation outside this process)": getattr(args, "use_vllm", False),
        }
        for what, given in refused.items():
            if given:
                raise NotImplementedError(
                    f"TRL's GRPOTrainer under long_seq.sequence_parallel.size={size} with {what}: drop it, or set "
                    "sequence_parallel.size to 1"
                )

    @property
    def long_seq_sp_size(self) -> int:
        """Ranks per sequence (1 without sequence parallelism)."""
        return self.long_seq_config.sequence_parallel.size

    def _deepspeed_initialize(self, original, **kwargs):
        """Stands in for ``deepspeed.initialize`` while the Trainer runs: ``engine.initialize_with``."""
        config = dict(kwargs.pop("config_params", None) or kwargs.pop("config", None) or {})
        if self._long_seq_section is not None:
            # the parsed object, not the raw section: split_config passes it through unparsed
            config["long_seq"] = self.long_seq_config
        sp = self.long_seq_sp_size
        if sp > 1 and "train_batch_size" in config and dist.is_initialized():
            # accelerate counts every rank as a data-parallel replica; DeepSpeed checks world / P
            config["train_batch_size"] = (
                config["train_micro_batch_size_per_gpu"]
                * config.get("gradient_accumulation_steps", 1)
                * data_parallel_rank_and_size(sp)[1]
            )
        return initialize_with(original, config=config, **kwargs)

    @contextlib.contextmanager
    def _long_seq_engine(self):
        if self._long_seq_routing or getattr(self.accelerator.state, "deepspeed_plugin", None) is None:
            yield
            return
        self._long_seq_routing = True
        try:
            with deepspeed_initialize_replaced(self._deepspeed_initialize), self._accelerate_sp_hidden():
                yield
        finally:
            self._long_seq_routing = False

    @contextlib.contextmanager
    def _accelerate_sp_hidden(self):
        """With ``parallelism_config`` asking for sequence parallelism, accelerate and the Trainer would each do
        their part of ALST (register DeepSpeed's Ulysses attention, wrap the dataloader, compute the loss over the
        group): all of it is ds_longseq's here, so the config is out of their sight while the run goes on."""
        pc = getattr(self, "_accelerate_sp", None)
        if pc is None:
            yield
            return
        state = self.accelerator.state
        state.parallelism_config = None
        try:
            yield
        finally:
            state.parallelism_config = pc

    def train(self, *args, **kwargs):
        with self._long_seq_engine():
            return super().train(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        # TRL's DPO with precomputed reference log-probs precomputes them for a new dataset here, whole pairs per rank
        precompute = self._whole_calls is not None and getattr(self.args, "precompute_ref_log_probs", False)
        paused = self._paused() if precompute else contextlib.nullcontext()
        with self._long_seq_engine(), paused:
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self._long_seq_engine():
            return super().predict(*args, **kwargs)

    # ---- data -----------------------------------------------------------------------------------

    def get_train_dataloader(self):
        dataloader = super().get_train_dataloader()
        if self._sp is None or self._group_turns:  # GRPO: every rank generates for its own prompts, as TRL does
            return dataloader
        if getattr(self, "_accelerate_sp", None) is not None:
            # parallelism_config's (ALST's) data: every rank reads its own batches, the group trains on them in turn
            return _GroupTurns(dataloader, self._sp.rank, self._sp.size, self._sp.group)
        if getattr(self.args, "train_sampling_strategy", None) == "batch_rebalance":
            raise ValueError(
                "train_sampling_strategy='batch_rebalance' under ds_longseq sequence parallelism: that sampler "
                "shards over every rank, but the ranks of a sequence-parallel group must read the same batches; "
                "use 'random', 'sequential' or 'group_by_length'"
            )
        return self._shared_within_groups(dataloader, "training")

    def get_eval_dataloader(self, eval_dataset=None):
        dataloader = super().get_eval_dataloader(eval_dataset)
        if not self._whole_eval:
            return dataloader
        # TRL's DPO evaluates like it trains: the ranks of a group read the same pairs, cut across the group
        return self._shared_within_groups(dataloader, "evaluation")

    def _shared_within_groups(self, dataloader, what: str):
        """``dataloader`` (accelerate's, sharded over every rank) sharded over the world / P data-parallel replicas
        instead, so that the P ranks of a sequence-parallel group read the same batches."""
        replica, replicas = data_parallel_rank_and_size(self.long_seq_sp_size)
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        dataset = getattr(dataloader, "dataset", None)
        if type(dataloader).__name__ == "DataLoaderDispatcher":
            raise ValueError(
                "accelerate dispatches batches from rank 0 (an iterable dataset, or dispatch_batches=True): under "
                "ds_longseq sequence parallelism every rank reads its group's batches itself. Pass "
                "TrainingArguments(accelerator_config={'dispatch_batches': False})"
            )
        if hasattr(batch_sampler, "num_processes") and hasattr(batch_sampler, "process_index"):
            batch_sampler.num_processes, batch_sampler.process_index = replicas, replica
        elif hasattr(dataset, "num_processes") and hasattr(dataset, "process_index"):  # IterableDatasetShard
            dataset.num_processes, dataset.process_index = replicas, replica
        elif dist.get_world_size() > 1:
            raise ValueError(
                f"cannot share the {what} batches within sequence-parallel groups: unknown dataloader "
                f"{type(dataloader).__name__} (expected accelerate's DataLoaderShard)"
            )
        return dataloader

    def get_total_train_batch_size(self, args) -> int:
        """Sequences per optimizer step: the world / P data-parallel replicas each read their own (GRPO: every rank
        its own, trained by its group in turn)."""
        if self._group_turns:
            return super().get_total_train_batch_size(args)
        replicas = data_parallel_rank_and_size(self.long_seq_sp_size, rank=0, world=args.world_size)[1]
        return self._train_batch_size * args.gradient_accumulation_steps * replicas

    # ---- loss -----------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        sp = self._sp
        if sp is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        evaluating = not self.model.training or not torch.is_grad_enabled()
        if evaluating and self._whole_eval:
            with self._whole_calls, self._metrics_per_group():  # TRL's DPO evaluation, cut like its training
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
        if evaluating:
            with self._paused():
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
        if self._group_turns:  # TRL's GRPO: the group's P batches in turn, each whole on every rank of the group
            return self._group_turns_loss(model, inputs, return_outputs, num_items_in_batch)
        if self._whole_calls is not None:  # TRL's DPO: whole sequences in, its loss whole on every rank
            with self._whole_calls, self._metrics_per_group():
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
        inputs = _shard_inputs(inputs, sp.rank, sp.size)
        with sp.local_losses():
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
        loss = result[0] if return_outputs else result
        total = loss.detach().clone()
        dist.all_reduce(total, group=sp.group)
        loss = loss - loss.detach() + total  # value: the group's; gradient: this rank's share
        return (loss, *result[1:]) if return_outputs else loss

    def _prepare_inputs(self, inputs):
        # TRL's GRPO generates and scores here (and computes the old / reference log-probs): each rank its own
        # completions, whole, as without sequence parallelism
        if self._group_turns:
            with self._paused():
                return super()._prepare_inputs(inputs)
        return super()._prepare_inputs(inputs)

    def sequence_parallel_paused(self):
        """Context in which the model runs whole sequences on each rank (no sequence parallelism),
        e.g. for ``trainer.model.generate(...)``; a no-op without sequence parallelism."""
        return self._paused()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        sp = self._sp
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        records = self._position_sums is not None and prediction_loss_only and has_labels
        if sp is None:
            with self._recording(inputs if records else None):
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self._whole_eval and prediction_loss_only:  # TRL's DPO: its own step, the model calls cut (compute_loss)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if not (prediction_loss_only and has_labels):  # logits wanted: whole sequences on each rank
            with self._paused():
                return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        # counted as the stock step counts them (across devices where the Trainer averages tokens so)
        num_items = self._get_num_items_in_batch([inputs], self.args.device)
        loss = None
        for member in range(sp.size):  # the group's batches in turn, each sharded across the group
            batch, count = _broadcast_batch(inputs, num_items, member, sp.group)
            shard = _shard_inputs(batch, sp.rank, sp.size)
            with torch.no_grad(), self.compute_loss_context_manager(), sp.local_losses(), \
                    self._recording(batch if records else None, sp):
                share = super().compute_loss(model, shard, num_items_in_batch=count)
            total = share.detach().clone()
            dist.all_reduce(total, group=sp.group)  # value: that batch's loss, as one rank computes it
            if member == sp.rank:
                loss = total.mean()
        return loss, None, None

    # ---- evaluation by position -------------------------------------------------------------------

    _position_sums: torch.Tensor | None = None  # (2, POSITION_BUCKETS): loss sums and token counts, while evaluating

    @contextlib.contextmanager
    def _recording(self, batch: Mapping[str, Any] | None, sp=None):
        """Around one evaluation forward of ``batch`` (whole; None: nothing recorded): the loss of its targets added
        to :attr:`_position_sums` by where each target sits in its document (this rank's shard under ``sp``)."""
        if batch is None:
            yield
            return
        with recording_tokens(self.model) as records:
            yield
        targets = _target_buckets(batch, POSITION_BUCKETS)  # (B, T): the bucket of the token each position predicts
        if sp is not None:  # cut like the batch: padded to a multiple of P, this rank's 1/P
            pad = -targets.shape[1] % sp.size
            targets = torch.nn.functional.pad(targets, (0, pad), value=-1)
            local = targets.shape[1] // sp.size
            targets = targets[:, sp.rank * local:(sp.rank + 1) * local]
        for logprobs, mask in records:
            width = logprobs.shape[1]  # T - 1 from a fused call given unshifted labels
            buckets = targets[:, :width].to(logprobs.device)
            valid = mask & (buckets >= 0)
            index = buckets[valid]
            sums = torch.zeros(2, POSITION_BUCKETS, dtype=torch.float64, device=logprobs.device)
            sums[0].index_add_(0, index, -logprobs[valid].double())
            sums[1].index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
            self._position_sums += sums.cpu()

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's, plus the loss by position when ds_longseq's forward serves the model: ``<prefix>_loss_pos_
        <b>of8``, the token-mean loss over the targets in the b-th eighth of their document (a row, or a packed
        document; padding left out), summed over every rank (so under sequence parallelism too)."""
        self._position_sums = torch.zeros(2, POSITION_BUCKETS, dtype=torch.float64) if is_enabled(self.model) else None
        try:
            output = super().evaluation_loop(*args, **kwargs)
            sums = self._position_sums
        finally:
            self._position_sums = None
        if sums is None or output.metrics is None:
            return output
        if dist.is_initialized():
            sums = sums.to(self.args.device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        for b in range(POSITION_BUCKETS):
            if sums[1, b] > 0:
                output.metrics[f"{prefix}_loss_pos_{b + 1}of{POSITION_BUCKETS}"] = (sums[0, b] / sums[1, b]).item()
        return output


def _target_buckets(batch: Mapping[str, Any], buckets: int) -> torch.Tensor:
    """(B, T) long: for each position, the bucket (0 .. buckets - 1) of the token it predicts (the next one) by that
    token's place in its document, floor(buckets x place / document length); -1 where no token is predicted (the
    last position) or the next token is padding. Documents: rows (right or left padded by ``attention_mask``), or the
    packed documents of rows without a mask whose ``position_ids`` restart at 0."""
    ids = batch["input_ids"]
    mask, pos = batch.get("attention_mask"), batch.get("position_ids")
    if mask is None and pos is not None:  # packed rows: a document starts where the positions restart
        pos = pos.expand_as(ids).long()
        doc = (pos == 0).long().cumsum(-1)
        counts = pos.new_zeros(pos.shape[0], pos.shape[1] + 1).scatter_add_(1, doc, torch.ones_like(pos))
        length = counts.gather(1, doc)
        place, real = pos, torch.ones_like(pos, dtype=torch.bool)
    else:
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        place = real.long().cumsum(-1) - 1
        length = real.long().sum(-1, keepdim=True).expand_as(place)
    bucket = torch.where(real, (buckets * place) // length.clamp_min(1), torch.full_like(place, -1))
    return torch.cat([bucket[:, 1:], bucket.new_full((bucket.shape[0], 1), -1)], dim=1)


class _GroupTurns:
    """A training dataloader under ``parallelism_config``'s sequence parallelism, with ALST's semantics
    (DeepSpeed's ``UlyssesSPDataLoaderAdapter``): every rank reads its own batches, and for each of them the group's
    P batches are trained on one after the other, rank 0's first, each whole on every rank of the group
    (``compute_loss`` cuts it). So an epoch has P times the wrapped loader's batches, as the Trainer counts it
    under ALST, and every step sees the same samples as under ALST."""

    def __init__(self, dataloader, rank: int, size: int, group):
        self.dataloader, self.rank, self.size, self.group = dataloader, rank, size, group

    def __len__(self) -> int:
        return len(self.dataloader) * self.size

    def __iter__(self):
        for batch in self.dataloader:
            for member in range(self.size):
                yield _broadcast_batch(batch, None, member, self.group)[0]

    def __getattr__(self, name: str):  # set_epoch, sampler, dataset, ...: the wrapped loader's
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)


def _accepts_loss_kwargs(model) -> bool:
    """Whether the Trainer passes ``num_items_in_batch`` to ``model`` (its own test, without parallelism_config)."""
    base = unwrap_peft_model(model)
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


def _broadcast_batch(inputs: Mapping[str, Any], num_items, member: int, group) -> tuple[dict[str, Any], Any]:
    """Rank ``member`` (of ``group``)'s evaluation batch and token count, on every rank of the group: its tensors
    broadcast (shapes and dtypes first), its other values as they are."""
    src = dist.get_global_rank(group, member)
    device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    meta = [{k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
            num_items.item() if isinstance(num_items, torch.Tensor) else num_items]
    dist.broadcast_object_list(meta, src=src, group=group,
                               device=device if device.type == "cuda" else None)
    batch = {}
    for key, value in meta[0].items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], torch.dtype):
            tensor = inputs[key].contiguous() if dist.get_rank() == src else torch.empty(
                value[0], dtype=value[1], device=device)
            dist.broadcast(tensor, src=src, group=group)
            batch[key] = tensor
        else:
            batch[key] = value
    count = meta[1]
    if isinstance(num_items, torch.Tensor):
        count = torch.tensor(count, dtype=num_items.dtype, device=num_items.device)
    return batch, count


def _shard_inputs(inputs: Mapping[str, Any], sp_rank: int, sp_size: int) -> dict[str, Any]:
    """This rank's part of a Trainer batch: the sequence tensors cut by ``shard_batch`` (labels become
    ``shift_labels``), flags and other non-sequence values passed on unchanged."""
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("ds_longseq sequence parallelism in the Trainer needs (batch, seq) input_ids in each batch")
    seq = {k: v for k, v in inputs.items() if k in SHARDED_KEYS}
    # seq_idx (TRL's padding-free collator: each token's document) is read only by the fused short-convolution
    # kernels of linear-attention layers; ds_longseq refuses packed rows on those families (it finds the
    # documents from the restarting position ids, which the collator also sends).
    rest = {k: v for k, v in inputs.items() if k not in SHARDED_KEYS and k != "seq_idx"}
    for key, value in rest.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == tuple(ids.shape):
            raise ValueError(
                f"batch key {key!r} is a per-token tensor that ds_longseq cannot cut by sequence: drop it from the "
                f"collator's output (keys it cuts: {sorted(SHARDED_KEYS)})"
            )
    return {**rest, **shard_batch(seq, sp_rank, sp_size, pad=True)}


class LongSeqTrainer(LongSeqTrainerMixin, Trainer):
    """``transformers.Trainer`` with ds_longseq (see :class:`LongSeqTrainerMixin`)."""


_CLASSES: dict[type, type] = {}


def with_long_seq(trainer_cls: type) -> type:
    """The subclass of ``trainer_cls`` (a Trainer class, e.g. TRL's ``SFTTrainer``) with
    :class:`LongSeqTrainerMixin` first; the same class for the same argument."""
    if not isinstance(trainer_cls, type):
        raise TypeError(f"with_long_seq takes a Trainer class, got {trainer_cls!r}")
    if issubclass(trainer_cls, LongSeqTrainerMixin):
        return trainer_cls
    if trainer_cls not in _CLASSES:
        _CLASSES[trainer_cls] = type(f"LongSeq{trainer_cls.__name__}", (LongSeqTrainerMixin, trainer_cls), {
            "__doc__": f"{trainer_cls.__name__} with ds_longseq (see LongSeqTrainerMixin).",
            "__module__": __name__,
        })
    return _CLASSES[trainer_cls]
