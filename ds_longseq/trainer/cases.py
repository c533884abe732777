"""One case object per way the Hugging Face Trainer runs under ds_longseq, composed once when it is built.

A case is three parts, chosen by :func:`choose_case` from whether the model runs sequence parallel and which TRL
trainer it is; the mixin (``trainer/mixin.py``) delegates to the case without asking which it is:

- how the training batches are read (``reading``): each rank its own (:class:`OwnBatches`; TRL's GRPO:
  :class:`GeneratedBatches`, each rank generating for its own prompts), the P ranks of a sequence-parallel group the
  same batches (:class:`GroupSharedBatches`), or, under ``parallelism_config``, ALST's semantics: each rank its own,
  the group training on them in turn (:class:`AlstTurns`, :class:`~ds_longseq.trainer.batches.GroupTurnsLoader`);
- how the training loss is formed (``training``): the Trainer's own (:class:`StockLoss`); each sequence cut across
  the group with ``engine.shard_batch`` after the Trainer counted its tokens on the whole sequences, this rank's share
  computed and the values summed over the group, so each rank's loss value is the unsharded batch's and its gradient
  its share's (:class:`ShardedLoss`: the Trainer, TRL's SFT); TRL's DPO, whose model calls take whole sequences and
  run cut across the group (``engine.WholeSequenceCalls``), its loss and metrics whole on every rank and its metric
  gathers keeping one copy per group (:class:`WholeCallsLoss`); TRL's GRPO, the group's P batches trained one after
  the other, each cut across the group, each loss / P, its token-weighted metrics recombined (:class:`TurnsLoss`);
- what evaluation does (``evaluation``): the Trainer's own with the loss recorded by position
  (:class:`StockEvaluation`); the loss of each rank's own batch with the group's P batches run in turn, each cut
  across the group, and whole sequences on each rank where logits are wanted (:class:`ShardedEvaluation`); TRL's DPO
  evaluating as it trains (:class:`WholeEvaluation`).

:class:`CaseShared` holds what every part shares (the Trainer, its own methods, the group). Holds those,
:class:`TrainerCase` and :func:`choose_case`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ds_longseq.compat import (
    accelerator_gather_replaced,
    dataloader_resharded,
    trainer_loss_scale,
    trainer_micro_batch_size,
    trainer_num_items_in_batch,
    trainer_prepared_inputs,
    trl_metrics,
)
from ds_longseq.config import LongSeqConfig
from ds_longseq.engine import WholeSequenceCalls, data_parallel_rank_and_size
from ds_longseq.patch import configure_fused_lm_head, disable, enable, is_enabled, sequence_parallel_of
from ds_longseq.techniques import forward_only_config
from ds_longseq.trainer.batches import GroupTurnsLoader, broadcast_batch, shard_inputs
from ds_longseq.trainer.positions import PositionLosses
from ds_longseq.trainer.trl import (
    check_grpo_sequence_parallel,
    reads_whole_logits,
    recombine_turn_metrics,
    uses_group_turns,
    uses_whole_sequence_calls,
)

__all__ = [
    "CaseShared", "TrainerCase", "choose_case",
    "OwnBatches", "GroupSharedBatches", "AlstTurns", "GeneratedBatches",
    "StockLoss", "ShardedLoss", "WholeCallsLoss", "TurnsLoss",
    "StockEvaluation", "ShardedEvaluation", "WholeEvaluation",
]


class CaseShared:
    """What every part of a case shares.

    Args:
        trainer: the Trainer (with the mixin).
        stock: ``super(LongSeqTrainerMixin, trainer)``: the Trainer's own methods, which the parts call for its steps.
        sp: the model's sequence parallelism (``patch.sequence_parallel_of``), None without.
    """

    def __init__(self, trainer, stock, sp=None):
        self.trainer, self.stock, self.sp = trainer, stock, sp
        self.sps = [] if sp is None else [sp]  # every model's sequence parallelism, paused together (DPO's reference)

    @property
    def sp_size(self) -> int:
        return 1 if self.sp is None else self.sp.size

    def paused(self) -> contextlib.AbstractContextManager:
        """Context in which every model runs whole sequences on each rank (a no-op without sequence parallelism)."""
        stack = contextlib.ExitStack()
        for sp in self.sps:
            stack.enter_context(sp.paused())
        return stack

    def stock_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        return self.stock.compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)

    def stock_prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys):
        return self.stock.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def has_labels(self, inputs) -> bool:
        names = self.trainer.label_names
        return bool(names) and all(inputs.get(k) is not None for k in names)

    def shared_within_groups(self, dataloader, what: str):
        """``dataloader`` sharded over the world / P data-parallel replicas, so that the P ranks of a group read the
        same batches."""
        replica, replicas = data_parallel_rank_and_size(self.sp_size)
        return dataloader_resharded(dataloader, replica, replicas, what)


# How the training batches are read


class OwnBatches:
    """Each rank reads its own batches (no sequence parallelism)."""

    def __init__(self, shared: CaseShared):
        self.shared = shared

    def train(self, dataloader):
        return dataloader

    def total_train_batch_size(self, args) -> int:
        """Sequences per optimizer step: the world / P data-parallel replicas each read their own (P: ranks per
        sequence)."""
        replicas = data_parallel_rank_and_size(self.shared.sp_size, rank=0, world=args.world_size)[1]
        return trainer_micro_batch_size(self.shared.trainer) * args.gradient_accumulation_steps * replicas


class GroupSharedBatches(OwnBatches):
    """The P ranks of a sequence-parallel group read the same batches, cut across the group by the loss."""

    def train(self, dataloader):
        if getattr(self.shared.trainer.args, "train_sampling_strategy", None) == "batch_rebalance":
            raise ValueError(
                "train_sampling_strategy='batch_rebalance' under ds_longseq sequence parallelism: that sampler "
                "shards over every rank, but the ranks of a sequence-parallel group must read the same batches; "
                "use 'random', 'sequential' or 'group_by_length'"
            )
        return self.shared.shared_within_groups(dataloader, "training")


class AlstTurns(OwnBatches):
    """ALST's data semantics (``parallelism_config``): every rank reads its own batches, the group trains on them in
    turn."""

    def train(self, dataloader):
        sp = self.shared.sp
        return GroupTurnsLoader(dataloader, sp.rank, sp.size, sp.group)


class GeneratedBatches(OwnBatches):
    """TRL's GRPO: every rank generates for its own prompts, as TRL does; its group trains on them in turn."""

    def total_train_batch_size(self, args) -> int:
        return self.shared.stock.get_total_train_batch_size(args)


# How the training loss is formed


class StockLoss:
    """The Trainer's own ``compute_loss``."""

    def __init__(self, shared: CaseShared):
        self.shared = shared

    def loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        return self.shared.stock_loss(model, inputs, return_outputs, num_items_in_batch)


class ShardedLoss(StockLoss):
    """This rank's share of the batch's loss, with the group's total as its value."""

    def loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        sp = self.shared.sp
        inputs = shard_inputs(inputs, sp.rank, sp.size, sp.ring)
        with sp.local_losses():
            result = self.shared.stock_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = result[0] if return_outputs else result
        total = loss.detach().clone()
        dist.all_reduce(total, group=sp.group)
        loss = loss - loss.detach() + total  # value: the group's; gradient: this rank's share
        return (loss, *result[1:]) if return_outputs else loss


class WholeCallsLoss(StockLoss):
    """TRL's DPO: whole sequences in, its model calls cut across the group by ``calls``, TRL's loss whole on every
    rank."""

    def __init__(self, shared: CaseShared, calls: WholeSequenceCalls):
        super().__init__(shared)
        self.calls = calls

    def loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        with self.calls, self.metrics_per_group():
            return self.shared.stock_loss(model, inputs, return_outputs, num_items_in_batch)

    def metrics_per_group(self) -> contextlib.AbstractContextManager:
        """TRL gathers its metrics over every rank; under whole-sequence calls the P ranks of a group hold the same
        values, so each gather keeps one copy per group (as one rank per group would log)."""
        size = self.shared.sp_size

        def per_group(gather, tensor):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"ds_longseq: TRL gathered a {type(tensor).__name__} under sequence parallelism, "
                                "where a tensor was expected")
            out = gather(tensor)
            return out.unflatten(0, (dist.get_world_size(), -1))[::size].flatten(0, 1)

        return accelerator_gather_replaced(self.shared.trainer.accelerator, per_group)


class TurnsLoss(StockLoss):
    """TRL's GRPO: each rank generates and scores its own completions (paused, whole, as plain TRL); the P batches of
    the group are broadcast and trained one after the other, each cut across the group by whole-sequence calls, each
    loss / P. Each rank's loss value is the mean of the group's batches', and the gradients summed over the group and
    averaged over the world / P replicas are plain TRL's average over the world's ranks."""

    def __init__(self, shared: CaseShared, calls: WholeSequenceCalls):
        super().__init__(shared)
        self.calls = calls

    def loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        """Every turn but the last is backed up here, through the DeepSpeed engine without a gradient-accumulation
        boundary and scaled as the Trainer scales the loss it returns (the last turn's backward is the Trainer's):
        each turn's graph is freed before the next one runs, and ZeRO-3, whose hooks reduce a parameter once per
        backward, sees each parameter once per backward (DeepSpeed issue 5321). TRL's token-weighted metrics logged
        by the turns are recombined with the batches' token counts."""
        sp, trainer = self.shared.sp, self.shared.trainer
        metrics = trl_metrics(trainer, "train")
        before = {key: len(values) for key, values in metrics.items()}
        engine = trainer.model_wrapped
        total, weights = 0.0, []
        for member in range(sp.size):
            batch, _ = broadcast_batch(inputs, None, member, sp.group)
            mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
            weights.append(mask.sum().float())
            with self.calls:
                loss = self.shared.stock.compute_loss(model, batch, num_items_in_batch=num_items_in_batch) / sp.size
            if member < sp.size - 1 and hasattr(engine, "set_gradient_accumulation_boundary"):
                engine.set_gradient_accumulation_boundary(False)
                engine.backward(loss * trainer_loss_scale(trainer, num_items_in_batch), scale_wrt_gas=False)
                loss = loss.detach()
            total = total + loss
        weights = torch.stack(weights)
        dist.all_reduce(weights)  # each member's tokens over every replica (times P: the same on each group rank)
        token_level = getattr(trainer.args, "importance_sampling_level", "token") == "token"
        recombine_turn_metrics(metrics, before, weights.tolist(), token_level)
        return total


# What evaluation does


class StockEvaluation:
    """The Trainer's own evaluation, its loss recorded by position (``positions``, while an evaluation loop records).

    Args:
        paused_context: run ``Trainer.evaluate`` paused (whole sequences on each rank): where TRL precomputes
            reference log-probs for a new dataset inside it.
    """

    def __init__(self, shared: CaseShared, paused_context: bool = False):
        self.shared, self.paused_context = shared, paused_context

    def dataloader(self, dataloader):
        return dataloader

    def context(self) -> contextlib.AbstractContextManager:
        """Around ``Trainer.evaluate``."""
        return self.shared.paused() if self.paused_context else contextlib.nullcontext()

    def loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        """``compute_loss`` outside training (an evaluation needing outputs)."""
        return self.shared.stock_loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys,
                        positions: PositionLosses | None):
        records = positions is not None and prediction_loss_only and self.shared.has_labels(inputs)
        with positions.recording(inputs) if records else contextlib.nullcontext():
            return self.shared.stock_prediction_step(model, inputs, prediction_loss_only, ignore_keys)


class ShardedEvaluation(StockEvaluation):
    """The loss of each rank's own evaluation batch, computed with the batch cut across the group (the group's P
    batches in turn, each broadcast from its rank); with logits wanted, or outside the evaluation loop, whole
    sequences on each rank."""

    def loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        with self.shared.paused():
            return self.shared.stock_loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys,
                        positions: PositionLosses | None):
        shared = self.shared
        if not (prediction_loss_only and shared.has_labels(inputs)):
            with shared.paused():
                return shared.stock_prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        sp, trainer = shared.sp, shared.trainer
        inputs = trainer_prepared_inputs(trainer, inputs)
        # counted as the stock step counts them (across devices where the Trainer averages tokens so)
        num_items = trainer_num_items_in_batch(trainer, [inputs], trainer.args.device)
        loss = None
        for member in range(sp.size):  # the group's batches in turn, each sharded across the group
            batch, count = broadcast_batch(inputs, num_items, member, sp.group)
            shard = shard_inputs(batch, sp.rank, sp.size, sp.ring)
            recording = positions.recording(batch, sp) if positions is not None else contextlib.nullcontext()
            with torch.no_grad(), trainer.compute_loss_context_manager(), sp.local_losses(), recording:
                share = shared.stock.compute_loss(model, shard, num_items_in_batch=count)
            total = share.detach().clone()
            dist.all_reduce(total, group=sp.group)  # value: that batch's loss, as one rank computes it
            if member == sp.rank:
                loss = total.mean()
        return loss, None, None


class WholeEvaluation(StockEvaluation):
    """TRL's DPO evaluating like it trains: the group's ranks read the same pairs and its loss is ``training``'s, its
    model calls cut across the group; with logits wanted, whole sequences on each rank."""

    def __init__(self, shared: CaseShared, training: WholeCallsLoss):
        super().__init__(shared)
        self.training = training

    def dataloader(self, dataloader):
        return self.shared.shared_within_groups(dataloader, "evaluation")

    def loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        return self.training.loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys,
                        positions: PositionLosses | None):
        if prediction_loss_only:  # TRL's own step, its model calls cut (through compute_loss)
            return self.shared.stock_prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        with self.shared.paused():
            return self.shared.stock_prediction_step(model, inputs, prediction_loss_only, ignore_keys)


class TrainerCase:
    """The parts one Trainer runs with (see the module docstring); what the mixin delegates to.

    Args:
        shared: what the parts share.
        reading: how the training batches are read (``OwnBatches`` and kin).
        training: how the training loss is formed (``StockLoss`` and kin).
        evaluation: what evaluation does (``StockEvaluation`` and kin).
        paused_generation: run the Trainer's ``_prepare_inputs`` paused (TRL's GRPO generates and scores there,
            each rank its own completions, whole).
    """

    def __init__(self, shared: CaseShared, reading: OwnBatches, training: StockLoss, evaluation: StockEvaluation,
                 paused_generation: bool = False):
        self.shared, self.reading, self.training, self.evaluation = shared, reading, training, evaluation
        self.paused_generation = paused_generation

    @property
    def sp_size(self) -> int:
        return self.shared.sp_size

    def paused(self) -> contextlib.AbstractContextManager:
        return self.shared.paused()

    def train_dataloader(self, dataloader):
        return self.reading.train(dataloader)

    def eval_dataloader(self, dataloader):
        return self.evaluation.dataloader(dataloader)

    def total_train_batch_size(self, args) -> int:
        return self.reading.total_train_batch_size(args)

    def prepare_inputs_context(self) -> contextlib.AbstractContextManager:
        """Around the Trainer's ``_prepare_inputs`` (where TRL's GRPO generates)."""
        return self.shared.paused() if self.paused_generation else contextlib.nullcontext()

    def evaluate_context(self) -> contextlib.AbstractContextManager:
        """Around ``Trainer.evaluate``."""
        return self.evaluation.context()

    def compute_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        evaluating = not self.shared.trainer.model.training or not torch.is_grad_enabled()
        part = self.evaluation if evaluating else self.training
        return part.loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys,
                        positions: PositionLosses | None):
        return self.evaluation.prediction_step(model, inputs, prediction_loss_only, ignore_keys, positions)


def _dpo_calls(shared: CaseShared, config: LongSeqConfig, sp_group) -> WholeSequenceCalls:
    """TRL's DPO's model calls cut across the group: the policy's and its reference model's, the reference enabled
    with the same sequence parallelism and chunked head (with PEFT and no reference model, the policy with its
    adapter off is the reference)."""
    trainer, sp = shared.trainer, shared.sp
    if getattr(trainer, "aux_loss_enabled", False):
        raise NotImplementedError(
            f"TRL's DPOTrainer with a MoE load-balancing loss (router_aux_loss_coef={trainer.router_aux_loss_coef})"
            f" under long_seq.sequence_parallel.size={sp.size}: the router loss of a sharded call is not "
            "verified against TRL's. Set router_aux_loss_coef=0 in the DPOConfig, or sequence_parallel.size to 1"
        )
    modules = [trainer.accelerator.unwrap_model(trainer.model)]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        ref = trainer.accelerator.unwrap_model(ref)
        ref_config = forward_only_config(config)  # its calls cut and scored as the policy's, nothing trained
        if is_enabled(ref):
            disable(ref)
        enable(ref, ref_config, sp_group=sp_group)
        configure_fused_lm_head(ref)  # what TRL's DPO asked of the reference's head: add_fused_lm_head(ref_model)
        shared.sps.append(sequence_parallel_of(ref))
        modules.append(ref)
    return WholeSequenceCalls(modules, sp.rank, sp.size, sp.group, ring=sp.ring,
                              whole_logits=reads_whole_logits(trainer))


def choose_case(trainer, stock, config: LongSeqConfig, sp_group, alst: bool) -> TrainerCase:
    """The case of ``trainer`` (its model already enabled with ``config``), composed by whether the model runs
    sequence parallel and which TRL trainer it is. ``alst``: sequence parallelism was asked through
    ``parallelism_config``."""
    sp = sequence_parallel_of(trainer.model)
    shared = CaseShared(trainer, stock, sp)
    if sp is None:
        return TrainerCase(shared, OwnBatches(shared), StockLoss(shared), StockEvaluation(shared))
    precomputed_ref = getattr(trainer.args, "precompute_ref_log_probs", False)
    if uses_group_turns(type(trainer)):  # TRL's GRPO
        check_grpo_sequence_parallel(trainer, sp.size)
        calls = WholeSequenceCalls([trainer.accelerator.unwrap_model(trainer.model)], sp.rank, sp.size, sp.group,
                                   ring=sp.ring, whole_logits=reads_whole_logits(trainer))
        return TrainerCase(shared, GeneratedBatches(shared), TurnsLoss(shared, calls),
                           ShardedEvaluation(shared, paused_context=precomputed_ref), paused_generation=True)
    reading = AlstTurns(shared) if alst else GroupSharedBatches(shared)
    if uses_whole_sequence_calls(type(trainer)):  # TRL's DPO
        training = WholeCallsLoss(shared, _dpo_calls(shared, config, sp_group))
        # with precomputed reference log-probs TRL precomputes them for a new dataset in evaluate, whole pairs per rank
        evaluation = (ShardedEvaluation(shared, paused_context=True) if precomputed_ref
                      else WholeEvaluation(shared, training))
        return TrainerCase(shared, reading, training, evaluation)
    return TrainerCase(shared, reading, ShardedLoss(shared), ShardedEvaluation(shared))
