"""The Trainer family: transformers' Trainer, TRL's trainers and accelerate, the Trainer integration's only way in
(ds_longseq/trainer/ goes through these).

Each is a private name, or a change to an object the Trainer, TRL or accelerate owns, written against transformers
5.24, TRL 1.16 and accelerate 1.x; where TRL 1.9 differs, the function says so (trl_makes_fused_head_calls).

Holds:
    trainer_checkpointing_turned_off, trainer_counts_batch_tokens, trainer_micro_batch_size,
    trainer_num_items_in_batch, trainer_prepared_inputs, trainer_loss_scale: the Hugging Face Trainer's internals.
    trl_metrics, trl_entropy_bonus_enabled, trl_makes_fused_head_calls: TRL's trainers' (TRL 1.16's fused-LM-head
        calls, or TRL 1.9's logits and chunked-NLL calls).
    accelerator_gather_replaced, accelerate_parallelism_hidden, dataloader_resharded: accelerate's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

from ds_longseq.compat.transformers_shims import activation_checkpointing_on, set_activation_checkpointing

__all__ = [
    "trainer_checkpointing_turned_off",
    "trainer_counts_batch_tokens",
    "trainer_micro_batch_size",
    "trainer_num_items_in_batch",
    "trainer_prepared_inputs",
    "trainer_loss_scale",
    "trl_metrics",
    "trl_entropy_bonus_enabled",
    "trl_makes_fused_head_calls",
    "accelerator_gather_replaced",
    "accelerate_parallelism_hidden",
    "dataloader_resharded",
]


def trainer_checkpointing_turned_off(trainer: Any) -> bool:
    """Turn the Trainer's activation checkpointing off (the model's, and ``TrainingArguments``' flags, which the
    Trainer applies in ``train()``); whether any was on."""
    model_on = activation_checkpointing_on(trainer.model)
    names = [name for name in ("activation_checkpointing", "gradient_checkpointing")
             if getattr(trainer.args, name, False)]
    if model_on:
        set_activation_checkpointing(trainer.model, False)
    for name in names:
        setattr(trainer.args, name, False)
    return bool(model_on or names)


def trainer_counts_batch_tokens(trainer: Any) -> None:
    """Give the model the batch's token count again (``num_items_in_batch``), which the Trainer withholds under
    ``parallelism_config``'s sequence parallelism (its ALST loss counts each shard's tokens itself): the Trainer's own
    test of whether the model takes loss kwargs, without parallelism_config."""
    from transformers.trainer_utils import unwrap_peft_model

    base = unwrap_peft_model(trainer.accelerator.unwrap_model(trainer.model))
    if hasattr(base, "accepts_loss_kwargs"):
        accepts = bool(base.accepts_loss_kwargs)
    else:
        params = inspect.signature(base.forward).parameters.values()
        accepts = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    trainer.model_accepts_loss_kwargs = accepts


def trainer_micro_batch_size(trainer: Any) -> int:
    """Sequences per rank per micro-step, as the Trainer sized its dataloader (its ``_train_batch_size``)."""
    return trainer._train_batch_size


def trainer_num_items_in_batch(trainer: Any, batches: list, device: Any) -> Any:
    """The token count the Trainer's own step gives the loss for ``batches`` (its ``_get_num_items_in_batch``)."""
    return trainer._get_num_items_in_batch(batches, device)


def trainer_prepared_inputs(trainer: Any, inputs: Any) -> Any:
    """``inputs`` as the Trainer's own step prepares them (its ``_prepare_inputs``: moved to the device, and where
    TRL's trainers generate, generated; ds_longseq's mixin override included)."""
    return trainer._prepare_inputs(inputs)


def trainer_loss_scale(trainer: Any, num_items_in_batch: Any) -> float:
    """The factor ``Trainer.training_step`` puts on the loss ``compute_loss`` returns before its backward
    (transformers 5.24's four lines: 1 / the accumulation steps unless the loss is already scaled for them)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None)
    return 1.0 if scaled else 1.0 / trainer.current_gradient_accumulation_steps


def trl_metrics(trainer: Any, mode: str) -> dict[str, list[float]]:
    """A TRL trainer's metric values logged so far in this logging window (``"train"`` or ``"eval"``), by key."""
    return trainer._metrics[mode]


def trl_entropy_bonus_enabled(trainer: Any) -> bool:
    """Whether TRL's GRPO trainer adds an entropy bonus (``entropy_coef`` / ``use_adaptive_entropy``)."""
    return bool(getattr(trainer, "_entropy_bonus_enabled", False))


def trl_makes_fused_head_calls() -> bool:
    """Whether the installed TRL's trainers read their per-token outputs from fused-LM-head calls
    (``model(..., labels=..., fused_lm_head=True)``, the protocol of ``trl.trainer.utils.add_fused_lm_head``).

    TRL 1.16 (1.16.0 checked): yes, SFT, DPO and GRPO make only such calls for their losses. TRL 1.9 (1.9.0 checked):
    there is no ``add_fused_lm_head``; DPO and GRPO call the model without labels and read ``outputs.logits``, SFT
    (``loss_type="chunked_nll"``, its default) makes ``labels=`` calls and reads the sums of the forward it patches in
    (``trainer/trl.py`` says what ds_longseq answers each with). Decided on the function's presence."""
    import trl.trainer.utils

    return hasattr(trl.trainer.utils, "add_fused_lm_head")


@contextlib.contextmanager
def accelerator_gather_replaced(accelerator: Any, gather: Callable[[Callable, Any], Any]) -> Iterator[None]:
    """Inside: ``accelerator.gather(t)`` is ``gather(original_gather, t)`` on this accelerator only; restored on
    exit."""
    original = accelerator.gather
    accelerator.gather = functools.partial(gather, original)
    try:
        yield
    finally:
        del accelerator.gather  # the instance attribute: the class's method shows through again


@contextlib.contextmanager
def accelerate_parallelism_hidden(accelerator: Any, hidden: bool = True) -> Iterator[None]:
    """Inside: accelerate's state has no ``parallelism_config`` (so neither accelerate nor the Trainer does its part
    of ALST); restored on exit. A no-op with ``hidden=False``."""
    if not hidden:
        yield
        return
    state = accelerator.state
    config = state.parallelism_config
    state.parallelism_config = None
    try:
        yield
    finally:
        state.parallelism_config = config


def dataloader_resharded(dataloader: Any, replica: int, replicas: int, what: str) -> Any:
    """``dataloader`` (accelerate's, sharded over every rank) sharded over ``replicas`` instead, this process being
    ``replica``: its batch sampler's (or its iterable dataset shard's) process count and index are set.

    Raises:
        ValueError: accelerate dispatches batches from rank 0, or the dataloader is not one of accelerate's.
    """
    import torch.distributed as dist

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
