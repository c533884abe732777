"""``trainer.train(resume_from_checkpoint=...)`` on the shape of run that wrote the checkpoint, or on another.

A Trainer checkpoint is ``<output_dir>/checkpoint-<N>/``: DeepSpeed's ``global_step<N>/`` (cut by rank) and its
``latest``, the Trainer's state, each process's random generators. ds_longseq adds its manifest
(``engine.manifest``: the model, the run's shape, every file with its size) once every rank has written its part.
On resume, before the engine is built, the manifest tells a checkpoint of another model or a half-copied one (refused,
naming the directory and what is wrong) and a run of another shape: another number of ranks or sequence-parallel
size continues from DeepSpeed's universal form of ``global_step<N>/`` (``engine.reshape.to_universal``: converted
once into ``checkpoint-<N>/global_step<N>.universal/`` beside the original, which is only read, with a
``checkpoint-<N>/latest_universal`` that DeepSpeed's load reads), the engine built with ``checkpoint.load_universal``.
What DeepSpeed cannot continue is refused as the scripts refuse it (a ZeRO stage change, NVMe, another global
batch: ``engine.reshape.shape_change``; an optimizer without Adam's moments). The Trainer's own data position is a
count of micro-batches per rank (optimizer steps x accumulation), which the kept global batch makes the same samples.

A checkpoint without the manifest (a stock Trainer's, or ds_longseq's before it) resumes on its own world size as
before; on another, the error names DeepSpeed's conversion command and the config key that loads its output.

Holds:
    ResumeError: a checkpoint this run cannot resume from, and why (before any weight is loaded).
    CheckpointCallback: the Trainer callback that writes each checkpoint's manifest and puts right what DeepSpeed's
        ZeRO-3 universal load leaves wrong.
    prepare_resume: check a checkpoint against this run; convert it when the shape differs (every rank calls it).
"""

from __future__ import annotations

import os

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ds_longseq.compat import repair_universal_load
from ds_longseq.engine.manifest import (
    MANIFEST,
    ManifestError,
    model_facts,
    read_latest,
    read_manifest,
    resume_problem,
    run_facts,
    write_manifest,
)
from ds_longseq.engine.reshape import (
    UNIVERSAL_SUFFIX,
    UniversalConversionError,
    optimizer_on_nvme,
    planned_shape,
    shape_change,
    to_universal,
    zero_shard_ranks,
)
from ds_longseq.logging import get_logger

__all__ = ["ResumeError", "CheckpointCallback", "prepare_resume", "UNIVERSAL_POINTER"]

logger = get_logger("ds_longseq.trainer")

UNIVERSAL_POINTER = "latest_universal"
"""The file in ``checkpoint-<N>/`` naming the universal tag: DeepSpeed's ``load_checkpoint`` reads it (instead of
``latest``) when the engine has ``checkpoint.load_universal``."""


class ResumeError(ValueError):
    """``resume_from_checkpoint`` names a checkpoint this run cannot continue from: one line naming the directory,
    what is wrong and the fix. Raised by ``train()`` before any weight is loaded."""


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class CheckpointCallback(TrainerCallback):
    """The Trainer's checkpoints, ds_longseq's part: after each save (``on_save``, every rank, once the Trainer has
    written ``<output_dir>/checkpoint-<step>/``) the manifest, once every rank has written its part (by the process
    that saves for its node); after a load of DeepSpeed's universal form (``on_train_begin``, which the Trainer calls
    after loading), what DeepSpeed's ZeRO-3 load leaves wrong in the optimizer put right
    (``compat.repair_universal_load``). Nothing without DeepSpeed."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.universal_dir: str | None = None
        """Set by ``train()`` when it resumes from a converted checkpoint (:func:`prepare_resume`)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if self.universal_dir is None:
            return
        repaired = repair_universal_load(self.trainer.model_wrapped, self.universal_dir)
        if repaired and _rank_and_world()[0] == 0:
            logger.warning("resume_from_checkpoint: after DeepSpeed's ZeRO-3 universal load: %s", "; ".join(repaired))
        self.universal_dir = None

    def on_save(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        checkpoint_dir = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not hasattr(engine, "zero_optimization_stage") or not os.path.isdir(checkpoint_dir):
            return
        if dist.is_initialized():
            dist.barrier()  # every rank's shard is on disk before the file list is taken
        if args.should_save:
            facts = run_facts(engine, world=_rank_and_world()[1], sp_size=self.trainer.long_seq_sp_size)
            write_manifest(checkpoint_dir, facts, state.global_step)


def _conversion_command(checkpoint_dir: str, tag: str) -> str:
    source = os.path.join(checkpoint_dir, tag)
    return (f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {source} --output_folder "
            f"{source}{UNIVERSAL_SUFFIX} --inject_missing_state && echo {tag}{UNIVERSAL_SUFFIX} > "
            f"{os.path.join(checkpoint_dir, UNIVERSAL_POINTER)}, then add \"checkpoint\": {{\"load_universal\": true}} "
            "to the DeepSpeed config")


def prepare_resume(trainer, checkpoint_dir: str) -> str | None:
    """Check ``checkpoint_dir`` against this run before the engine is built; returns the directory of DeepSpeed's
    universal form of it when the engine must load that (the shape differs; converted here, once, by global rank
    0), else None.

    Raises:
        ResumeError: another model, an incomplete copy, a change DeepSpeed cannot continue across, or a checkpoint
            without the manifest written by another number of ranks (naming the conversion command).
    """
    args = trainer.args
    ds_config = args.hf_deepspeed_config.config
    if ds_config.get("checkpoint", {}).get("load_universal"):
        return None  # the user converted it (as the error below says): DeepSpeed's load does the rest
    tag = read_latest(checkpoint_dir)  # DeepSpeed's, written by its save_checkpoint
    if not tag:
        return None  # not a DeepSpeed checkpoint: the Trainer says so
    rank, world = _rank_and_world()
    now = planned_shape(ds_config, world=world, sp_size=trainer.long_seq_sp_size,
                        micro_batch=args.per_device_train_batch_size,
                        gradient_accumulation=args.gradient_accumulation_steps)  # the config's may be "auto"
    try:
        saved = read_manifest(checkpoint_dir)
    except ManifestError as err:
        raise ResumeError(f"resume_from_checkpoint: {err}") from None
    if saved is None:
        written = zero_shard_ranks(os.path.join(checkpoint_dir, tag))
        if written and written != world:
            raise ResumeError(
                f"resume_from_checkpoint: {checkpoint_dir}/{tag} was written by {written} ranks (its ZeRO shards) and "
                f"has no {MANIFEST} to tell its shape; this run has {world}. "
                f"Launch {written} ranks, or convert it with DeepSpeed: {_conversion_command(checkpoint_dir, tag)}")
        return None
    problem = resume_problem(checkpoint_dir, {**model_facts(trainer.model), **now},
                             other_model_fix="Load the model that run trained, or resume another checkpoint")
    if problem is not None:
        raise ResumeError(f"resume_from_checkpoint: {problem}")
    changed, why = shape_change(saved, now, checkpoint_dir=checkpoint_dir, nvme=optimizer_on_nvme(ds_config))
    if why is not None:
        raise ResumeError(f"resume_from_checkpoint: {why}")
    if not changed:
        return None
    try:
        target = to_universal(checkpoint_dir, tag, leader=rank == 0, saved=saved, now=now,
                              prefix="resume_from_checkpoint", pointer=UNIVERSAL_POINTER)
    except UniversalConversionError as err:
        raise ResumeError(f"resume_from_checkpoint: {err}") from None
    return os.path.join(checkpoint_dir, target)
