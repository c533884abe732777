"""Hugging Face ``Trainer`` and TRL's SFT / DPO / GRPO trainers with ds_longseq: one class line in user code.

Usage (the DeepSpeed JSON carries a ``"long_seq"`` section, as for ``ds_longseq.engine.initialize``)::

    args = TrainingArguments(..., deepspeed="ds_configs/zero2_streambp.json")
    trainer = LongSeqTrainer(model=model, args=args, train_dataset=data)   # or with_long_seq(SFTTrainer)(...)
    trainer.train()

In the Trainer, ``deepspeed.initialize`` is called by accelerate, not by the user, so the mixin does what
``engine.initialize`` would: ``__init__`` (after the Trainer's own) takes ``long_seq`` out of the DeepSpeed config
and validates it (``ds_longseq.resolve``: the same errors, before any training), builds DeepSpeed's
sequence-parallel groups on the process group accelerate started, and enables the model on top of TRL's fused LM
head (configured as the TRL trainer configured its own); inside ``train`` / ``evaluate`` / ``predict``,
``deepspeed.initialize`` is ``engine.initialize_with``. How batches, losses and evaluation run depends on the case,
composed once (``cases.py``: how batches are read, how the loss is formed, what evaluation does): no sequence
parallelism; each sequence cut across its group (the Trainer, TRL's SFT; with ALST's data semantics under
``parallelism_config``); TRL's DPO with whole-sequence calls; TRL's GRPO with the group's batches in turn.

The package:
    mixin.py: LongSeqTrainerMixin, LongSeqTrainer, with_long_seq (the shell the user sees).
    cases.py: a case composed of its parts, supplying the dataloaders, compute_loss and prediction_step.
    batches.py: batches cut across a group, broadcast from one rank, read in turns (ALST's data).
    positions.py: the evaluation loss by where each target sits in its document.
    trl.py: what ds_longseq knows of TRL's trainers.
Every touch of the Trainer's, TRL's or accelerate's internals goes through named functions in ``ds_longseq.compat``.
"""

from ds_longseq.trainer.mixin import LongSeqTrainer, LongSeqTrainerMixin, TrainerConfigError, with_long_seq

__all__ = ["LongSeqTrainerMixin", "LongSeqTrainer", "with_long_seq", "TrainerConfigError"]
