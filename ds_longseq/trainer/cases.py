"""One strategy object per way the Hugging Face Trainer runs under ds_longseq, chosen once when it is built.

Each case supplies the Trainer's dataloaders, ``compute_loss`` and ``prediction_step`` for its arrangement, so the
mixin (``trainer/mixin.py``) delegates without asking which case it is in:

- :class:`TrainerCase`: no sequence parallelism: the Trainer's own steps (plus the evaluation loss by position).
- :class:`ShardedSequences`: each sequence cut across its sequence-parallel group (the Trainer, TRL's SFT): the
  P ranks of a group read the same batches; ``compute_loss`` cuts the batch with ``engine.shard_batch`` after the
  Trainer counted its tokens on the whole sequences, computes this rank's share and sums the values over the group
  (each rank's loss value is the unsharded batch's, its gradient its share's). Under ``parallelism_config``
  (``alst=True``) the data keeps ALST's semantics instead: each rank reads its own batches, the group trains on
  them in turn (:class:`~ds_longseq.trainer.batches.GroupTurnsLoader`). Evaluation of the loss runs the group's P
  batches one after the other, each cut across the group; evaluation that needs logits runs paused.
- :class:`WholeSequences`: TRL's DPO: its model calls take whole sequences and run cut across the group
  (``engine.WholeSequenceCalls``), so its loss and metrics are computed whole on every rank; its metric gathers
  keep one copy per group; the reference model gets the same sequence parallelism.
- :class:`GroupTurns`: TRL's GRPO: each rank generates for its own prompts (paused, as plain TRL); the group trains
  on its ranks' batches in turn, each cut across the group by whole-sequence calls, each loss / P; TRL's
  token-weighted metrics recombined over the turns.

Holds those four and :func:`choose_case`.
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
    recombine_turn_metrics,
    uses_group_turns,
    uses_whole_sequence_calls,
)

__all__ = ["TrainerCase", "ShardedSequences", "WholeSequences", "GroupTurns", "choose_case"]

class TrainerCase:
    """Without sequence parallelism: the Trainer's own steps, the evaluation loss recorded by position.

    Args:
        trainer: the Trainer (with the mixin).
        stock: ``super(LongSeqTrainerMixin, trainer)``: the Trainer's own methods, which a case calls for its steps.
    """

    def __init__(self, trainer, stock):
        self.trainer, self.stock = trainer, stock

    def paused(self) -> contextlib.AbstractContextManager:
        """Context in which the model runs whole sequences on each rank (a no-op without sequence parallelism)."""
        return contextlib.nullcontext()

    def train_dataloader(self, dataloader):
        return dataloader

    def eval_dataloader(self, dataloader):
        return dataloader

    def total_train_batch_size(self, args) -> int:
        """Sequences per optimizer step: the world / P data-parallel replicas each read their own (P: ranks per
        sequence, 1 here)."""
        replicas = data_parallel_rank_and_size(self.sp_size, rank=0, world=args.world_size)[1]
        return trainer_micro_batch_size(self.trainer) * args.gradient_accumulation_steps * replicas

    @property
    def sp_size(self) -> int:
        return 1

    def prepare_inputs_context(self) -> contextlib.AbstractContextManager:
        """Around the Trainer's ``_prepare_inputs`` (where TRL's GRPO generates)."""
        return contextlib.nullcontext()

    def evaluate_context(self) -> contextlib.AbstractContextManager:
        """Around ``Trainer.evaluate``."""
        return contextlib.nullcontext()

    def compute_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        return self.stock.compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys,
                        positions: PositionLosses | None):
        """The Trainer's step; its loss recorded by position (``positions``, while an evaluation loop records)."""
        records = positions is not None and prediction_loss_only and self.has_labels(inputs)
        with positions.recording(inputs) if records else contextlib.nullcontext():
            return self.stock.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    def has_labels(self, inputs) -> bool:
        names = self.trainer.label_names
        return bool(names) and all(inputs.get(k) is not None for k in names)


class ShardedSequences(TrainerCase):
    """Each sequence cut across its sequence-parallel group ``sp`` (the Trainer, TRL's SFT); ``alst``: the training
    data with ALST's semantics (``parallelism_config``). See the module docstring."""

    def __init__(self, trainer, stock, sp, alst: bool = False):
        super().__init__(trainer, stock)
        self.sp, self.alst = sp, alst
        self.sps = [sp]  # every model's sequence parallelism, paused together (DPO adds its reference's)

    def paused(self):
        stack = contextlib.ExitStack()
        for sp in self.sps:
            stack.enter_context(sp.paused())
        return stack

    def train_dataloader(self, dataloader):
        if self.alst:  # every rank reads its own batches, the group trains on them in turn
            return GroupTurnsLoader(dataloader, self.sp.rank, self.sp.size, self.sp.group)
        if getattr(self.trainer.args, "train_sampling_strategy", None) == "batch_rebalance":
            raise ValueError(
                "train_sampling_strategy='batch_rebalance' under ds_longseq sequence parallelism: that sampler "
                "shards over every rank, but the ranks of a sequence-parallel group must read the same batches; "
                "use 'random', 'sequential' or 'group_by_length'"
            )
        return self.shared_within_groups(dataloader, "training")

    def shared_within_groups(self, dataloader, what: str):
        """``dataloader`` sharded over the world / P data-parallel replicas, so that the P ranks of a group read the
        same batches."""
        replica, replicas = data_parallel_rank_and_size(self.sp.size)
        return dataloader_resharded(dataloader, replica, replicas, what)

    @property
    def sp_size(self) -> int:
        return self.sp.size

    def compute_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        evaluating = not self.trainer.model.training or not torch.is_grad_enabled()
        loss = self.evaluation_loss if evaluating else self.training_loss
        return loss(model, inputs, return_outputs, num_items_in_batch)

    def evaluation_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        """``compute_loss`` outside training (an evaluation needing outputs): whole sequences on each rank."""
        with self.paused():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def training_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        """This rank's share of the batch's loss, with the group's total as its value."""
        sp = self.sp
        inputs = shard_inputs(inputs, sp.rank, sp.size, sp.ring)
        with sp.local_losses():
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = result[0] if return_outputs else result
        total = loss.detach().clone()
        dist.all_reduce(total, group=sp.group)
        loss = loss - loss.detach() + total  # value: the group's; gradient: this rank's share
        return (loss, *result[1:]) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys,
                        positions: PositionLosses | None):
        """The loss of each rank's own evaluation batch, computed with the batch cut across the group (the group's P
        batches in turn, each broadcast from its rank); with logits wanted, whole sequences on each rank."""
        if not (prediction_loss_only and self.has_labels(inputs)):
            with self.paused():
                return self.stock.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        sp, trainer = self.sp, self.trainer
        inputs = trainer._prepare_inputs(inputs)
        # counted as the stock step counts them (across devices where the Trainer averages tokens so)
        num_items = trainer_num_items_in_batch(trainer, [inputs], trainer.args.device)
        loss = None
        for member in range(sp.size):  # the group's batches in turn, each sharded across the group
            batch, count = broadcast_batch(inputs, num_items, member, sp.group)
            shard = shard_inputs(batch, sp.rank, sp.size, sp.ring)
            recording = positions.recording(batch, sp) if positions is not None else contextlib.nullcontext()
            with torch.no_grad(), trainer.compute_loss_context_manager(), sp.local_losses(), recording:
                share = self.stock.compute_loss(model, shard, num_items_in_batch=count)
            total = share.detach().clone()
            dist.all_reduce(total, group=sp.group)  # value: that batch's loss, as one rank computes it
            if member == sp.rank:
                loss = total.mean()
        return loss, None, None


class WholeSequences(ShardedSequences):
    """TRL's DPO under sequence parallelism: its model calls take whole sequences and run cut across the group
    (:class:`~ds_longseq.engine.WholeSequenceCalls`), so TRL's loss and metrics see whole sequences. Its reference
    model is enabled with the same sequence parallelism (and chunked head), so its calls are cut too (with PEFT and
    no reference model, the policy with its adapter off is the reference). It evaluates like it trains (the group's
    ranks reading the same pairs), except with precomputed reference log-probs: then paused."""

    def __init__(self, trainer, stock, sp, alst: bool, config: LongSeqConfig, sp_group):
        super().__init__(trainer, stock, sp, alst)
        self.whole_eval = not getattr(trainer.args, "precompute_ref_log_probs", False)
        self.calls = self._calls(config, sp_group)

    def _calls(self, config: LongSeqConfig, sp_group) -> WholeSequenceCalls:
        trainer = self.trainer
        if getattr(trainer, "aux_loss_enabled", False):
            raise NotImplementedError(
                f"TRL's DPOTrainer with a MoE load-balancing loss (router_aux_loss_coef={trainer.router_aux_loss_coef})"
                f" under long_seq.sequence_parallel.size={self.sp.size}: the router loss of a sharded call is not "
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
            self.sps.append(sequence_parallel_of(ref))
            modules.append(ref)
        return WholeSequenceCalls(modules, self.sp.rank, self.sp.size, self.sp.group, ring=self.sp.ring)

    def eval_dataloader(self, dataloader):
        return self.shared_within_groups(dataloader, "evaluation") if self.whole_eval else dataloader

    def evaluate_context(self):
        # with precomputed reference log-probs TRL precomputes them for a new dataset in evaluate, whole pairs per rank
        return contextlib.nullcontext() if self.whole_eval else self.paused()

    def metrics_per_group(self) -> contextlib.AbstractContextManager:
        """TRL gathers its metrics over every rank; under whole-sequence calls the P ranks of a group hold the same
        values, so each gather keeps one copy per group (as one rank per group would log)."""
        size = self.sp.size

        def per_group(gather, tensor):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"ds_longseq: TRL gathered a {type(tensor).__name__} under sequence parallelism, "
                                "where a tensor was expected")
            out = gather(tensor)
            return out.unflatten(0, (dist.get_world_size(), -1))[::size].flatten(0, 1)

        return accelerator_gather_replaced(self.trainer.accelerator, per_group)

    def evaluation_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        if not self.whole_eval:
            return super().evaluation_loss(model, inputs, return_outputs, num_items_in_batch)
        return self.training_loss(model, inputs, return_outputs, num_items_in_batch)  # cut like its training

    def training_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        with self.calls, self.metrics_per_group():  # whole sequences in, TRL's loss whole on every rank
            return self.stock.compute_loss(model, inputs, return_outputs=return_outputs,
                                           num_items_in_batch=num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys,
                        positions: PositionLosses | None):
        if self.whole_eval and prediction_loss_only:  # TRL's own step, its model calls cut (compute_loss)
            return self.stock.prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, positions)


class GroupTurns(WholeSequences):
    """TRL's GRPO under sequence parallelism: each rank generates and scores its own completions (paused, whole, as
    plain TRL); the P batches of the group are broadcast and trained one after the other, each cut across the group by
    whole-sequence calls, each loss / P. Each rank's loss value is the mean of the group's batches', and the gradients
    summed over the group and averaged over the world / P replicas are plain TRL's average over the world's ranks."""

    def __init__(self, trainer, stock, sp, alst: bool, config: LongSeqConfig, sp_group):
        check_grpo_sequence_parallel(trainer, sp.size)
        super().__init__(trainer, stock, sp, alst, config, sp_group)
        self.whole_eval = False

    def _calls(self, config: LongSeqConfig, sp_group) -> WholeSequenceCalls:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        return WholeSequenceCalls([model], self.sp.rank, self.sp.size, self.sp.group, ring=self.sp.ring)

    def train_dataloader(self, dataloader):
        return dataloader  # every rank generates for its own prompts, as TRL does

    def total_train_batch_size(self, args) -> int:
        return self.stock.get_total_train_batch_size(args)  # every rank its own, trained by its group in turn

    def prepare_inputs_context(self):
        return self.paused()  # generation and scoring: each rank its own completions, whole

    def evaluate_context(self):
        return self.paused() if getattr(self.trainer.args, "precompute_ref_log_probs", False) else (
            contextlib.nullcontext())

    def training_loss(self, model, inputs, return_outputs: bool, num_items_in_batch):
        """Every turn but the last is backed up here, through the DeepSpeed engine without a gradient-accumulation
        boundary and scaled as the Trainer scales the loss it returns (the last turn's backward is the Trainer's):
        each turn's graph is freed before the next one runs, and ZeRO-3, whose hooks reduce a parameter once per
        backward, sees each parameter once per backward (DeepSpeed issue 5321). TRL's token-weighted metrics logged
        by the turns are recombined with the batches' token counts."""
        sp, trainer = self.sp, self.trainer
        metrics = trl_metrics(trainer, "train")
        before = {key: len(values) for key, values in metrics.items()}
        engine = trainer.model_wrapped
        total, weights = 0.0, []
        for member in range(sp.size):
            batch, _ = broadcast_batch(inputs, None, member, sp.group)
            mask = batch["completion_mask"] * batch["tool_mask"] if "tool_mask" in batch else batch["completion_mask"]
            weights.append(mask.sum().float())
            with self.calls:
                loss = self.stock.compute_loss(model, batch, num_items_in_batch=num_items_in_batch) / sp.size
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


def choose_case(trainer, stock, config: LongSeqConfig, sp_group, alst: bool) -> TrainerCase:
    """The case of ``trainer`` (its model already enabled with ``config``): by whether the model runs sequence
    parallel and which TRL trainer it is. ``alst``: sequence parallelism was asked through ``parallelism_config``."""
    sp = sequence_parallel_of(trainer.model)
    if sp is None:
        return TrainerCase(trainer, stock)
    if uses_group_turns(type(trainer)):
        return GroupTurns(trainer, stock, sp, alst, config, sp_group)
    if uses_whole_sequence_calls(type(trainer)):
        return WholeSequences(trainer, stock, sp, alst, config, sp_group)
    return ShardedSequences(trainer, stock, sp, alst)
