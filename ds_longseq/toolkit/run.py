"""A started training run: DeepSpeed up, the model built (with LoRA if asked) and wrapped in the engine.

Holds:
    Run: the engine around the model and where this rank stands (data-parallel replica, sequence-parallel shard).
    setup_run: start DeepSpeed, check the config against the arguments, build the model and its engine.
    startup_summary: what the run is about to do (model, a 4-bit base's quantisation and bytes, ranks, tokens per
        step, memory, checkpoints), logged.
    finish: the end-of-run HF export, after every rank is done.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

import ds_longseq.engine
from ds_longseq import compat
from ds_longseq.batch_size import BatchSize, BatchSizeError, read_batch_size
from ds_longseq.config import LongSeqConfig
from ds_longseq.engine import data_parallel_rank_and_size, sequence_parallel_rank_and_size, sp_layout_of
from ds_longseq.engine.manifest import ManifestError, read_latest, read_manifest
from ds_longseq.engine.reshape import optimizer_on_nvme, planned_shape, shape_change
from ds_longseq.logging import get_logger
from ds_longseq.resolver import RunShape
from ds_longseq.toolkit.args import DoesNotFit
from ds_longseq.toolkit.checkpoint import SaveSchedule, check_save_space, export_hf, save_checkpoint
from ds_longseq.toolkit.distributed import resolve_or_exit, set_learning_rate, start_resolved, to_rank_batch
from ds_longseq.toolkit.lora import add_lora
from ds_longseq.toolkit.quantized import FourBit, dequantized, logical_numel
from ds_longseq.toolkit.quantized import describe as describe_4bit
from ds_longseq.toolkit.report_to import report_to_config
from ds_longseq.toolkit.save_dir import SaveDirClaim, claim_save_dir, start_over
from ds_longseq.toolkit.tasks import build_model, model_config

logger = get_logger(__name__)

__all__ = ["Run", "setup_run", "finish"]


@dataclasses.dataclass
class Run:
    """A started run: the engine around the model and where this rank stands.

    ``args`` is the namespace of :func:`~ds_longseq.toolkit.args.add_common_args`'s flags.
    """

    args: argparse.Namespace
    engine: object
    """The DeepSpeed engine (ds_longseq's :func:`~ds_longseq.engine.initialize`)."""
    model: torch.nn.Module
    """The model the engine wraps (a PeftModel with --lora-rank)."""
    long_seq: LongSeqConfig
    dtype: torch.dtype
    rank: int
    world: int
    sp_rank: int
    """This rank's place in its sequence-parallel group."""
    sp_size: int
    """P, the sequence-parallel size (1: none)."""
    batch: BatchSize
    """DeepSpeed's batch triple as DeepSpeed resolves it (``batch_size.read_batch_size``)."""

    @property
    def micro_bs(self) -> int:
        """Items per micro-batch (``train_micro_batch_size_per_gpu``)."""
        return self.batch.micro_batch

    @property
    def gas(self) -> int:
        """Micro-batches per optimizer step (``gradient_accumulation_steps``, given or derived from
        ``train_batch_size``): a loop calls ``engine.step()`` this many times per optimizer step."""
        return self.batch.gradient_accumulation

    @property
    def ring(self) -> int:
        """The ring degree of the model's sequence parallelism (Ulysses x ring; 1: Ulysses alone or none), which
        :meth:`prepare` cuts batches by (the model's layout: ``engine.sp_layout_of``)."""
        layout = sp_layout_of(self.model)
        return 1 if layout is None else layout.ring

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica (the ranks of a sequence-parallel group share one)."""
        return data_parallel_rank_and_size(self.sp_size, self.rank, self.world)[0]

    @property
    def num_replicas(self) -> int:
        return data_parallel_rank_and_size(self.sp_size, self.rank, self.world)[1]

    @property
    def four_bit(self) -> FourBit | None:
        """The base's 4-bit quantisation (``--load-in-4bit``), or None."""
        return FourBit.from_args(self.args)

    def build_base(self) -> torch.nn.Module:
        """The model as it was before training: --model, or the seeded built-in model, without LoRA (quantised as
        for training with --load-in-4bit)."""
        return build_model(self.args.model, self.dtype, seq_len=self.args.seq_len, seed=self.args.seed,
                           four_bit=self.four_bit)

    def build_merge_base(self) -> torch.nn.Module:
        """The base the adapter is merged into for the export: :meth:`build_base`, a 4-bit one dequantized to the
        run's dtype (the adapter was trained against dequant(W4), not the original floats)."""
        base = self.build_base()
        return dequantized(base) if self.four_bit is not None else base

    @property
    def checkpoint_options(self) -> dict:
        """How this run's checkpoints are written: LoRA runs leave the frozen base out (a resume rebuilds it from
        --model), and ``--save-total-limit`` keeps the newest N (0: all)."""
        return {"exclude_frozen": bool(self.args.lora_rank), "keep": getattr(self.args, "save_total_limit", 0) or 0,
                "claim": self.claim}

    schedule: SaveSchedule | None = None
    """When checkpoints are written (--save-every, --save-every-minutes, the last step); set by :func:`setup_run`."""
    claim: SaveDirClaim | None = None
    """The run's claim on --save-dir (its id, the lock, who owns the directories: ``toolkit.save_dir``)."""

    def save_if_due(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): a checkpoint if --save-every, --save-every-minutes or the last
        step asks for one (every rank calls this after every step)."""
        if self.schedule.due(step):
            save_checkpoint(self.engine, self.args.save_dir, step, self.rank, **self.checkpoint_options)
            self.schedule.saved()

    def prepare(self, batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
        """This rank's shard of ``batch`` (whole rows without sequence parallelism), on its device."""
        return to_rank_batch(batch, self.engine.device, self.sp_rank, self.sp_size, pad=self.args.pad_for_sp,
                             pad_token_id=pad_id, layout=sp_layout_of(self.model))


def check_memory(args: argparse.Namespace, ds_config: dict):
    """The memory preflight (:func:`ds_longseq.engine.memory_preflight`) for this run, before any weight is
    allocated or file written: an impossible --seq-len stops here with the planner's numbers and what would fit,
    unless --no-preflight. Returns the planner's plan (None for a model it does not describe)."""
    try:  # ds_config: start_resolved's, with the run's bf16 section and the parsed long_seq
        return ds_longseq.engine.memory_preflight(model_config(args.model, args.seq_len), ds_config, args.seq_len,
                                                  lora_rank=args.lora_rank or None,
                                                  override=getattr(args, "no_preflight", False),
                                                  load_in_4bit=getattr(args, "load_in_4bit", None),
                                                  double_quant=not getattr(args, "no_double_quant", False))
    except ds_longseq.engine.PreflightError as err:
        raise DoesNotFit(f"preflight: {err}") from None


def check_resume_shape(args: argparse.Namespace, ds_config: dict, world: int, sp_size: int) -> None:
    """With --resume from a checkpoint written by another number of ranks or sequence-parallel size: refuse what
    cannot continue (a ZeRO stage change, NVMe, another global batch), naming it, before the model is built;
    else configure the engine to load DeepSpeed's universal form of it (``checkpoint.load_universal``)."""
    if not getattr(args, "resume", False):
        return
    tag = read_latest(args.save_dir)
    if tag is None:
        return  # resume() names it
    checkpoint = os.path.join(args.save_dir, tag)
    try:
        saved = read_manifest(checkpoint)
    except ManifestError as err:
        raise SystemExit(f"--resume: {err}") from None
    if saved is None:
        return
    changed, why = shape_change(saved, planned_shape(ds_config, world=world, sp_size=sp_size),
                                checkpoint_dir=checkpoint, nvme=optimizer_on_nvme(ds_config))
    if why is not None:
        raise SystemExit(f"--resume: {why}")
    if changed:
        ds_config.setdefault("checkpoint", {})["load_universal"] = True


def startup_summary(run: Run, plan) -> str:
    """What a run is about to do, in a few lines (rank 0 logs it before the first step): the model and its
    parameters, the ranks and the tokens per optimizer step, the techniques on, the planner's estimate against the
    memory this machine has, and when checkpoints are written."""
    from ds_longseq.config import registered_techniques

    args = run.args
    total = sum(logical_numel(p) for p in run.model.parameters())  # a packed 4-bit weight: its weights, not bytes
    trainable = sum(compat.full_numel(p) for p in run.model.parameters() if p.requires_grad)
    model = type(getattr(run.model, "base_model", run.model)).__name__ if args.lora_rank else type(run.model).__name__
    name = args.model or "the built-in tiny Llama (from scratch)"
    rows = run.micro_bs * run.gas * run.num_replicas
    on = [n for n, technique in registered_techniques().items() if technique.active(run.long_seq)] or ["none"]
    streambp = run.long_seq.streambp
    if "streambp" in on:  # what it keeps between forward and backward
        kept = {True: "kept", False: "recomputed", "auto": "kept where memory allows (decided each step: the log "
                "says which)"}[streambp.keep_attention_output]
        on[on.index("streambp")] = (f"streambp (chunk_size {streambp.chunk_size}; attention outputs {kept}, "
                                    "streambp.keep_attention_output)")
    parallel = (f"sequence parallel {run.sp_size} x data parallel {run.num_replicas}" if run.sp_size > 1
                else f"data parallel {run.num_replicas}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = [
        f"model: {name} ({model}), {total / 1e6:,.1f}M parameters, {trainable / 1e6:,.1f}M trained, "
        f"{str(run.dtype).replace('torch.', '')}",
        *([describe_4bit(run.model, run.four_bit)] if run.four_bit is not None else []),
        f"run: {run.world} rank(s) on {device} ({parallel}); {args.seq_len:,} tokens per sequence, {rows} "
        f"sequence(s) per optimizer step ({run.micro_bs} per micro-batch x {run.gas} accumulated x "
        f"{run.num_replicas} replica(s)): {rows * args.seq_len:,} tokens; {args.max_steps} steps",
        f"long_seq: {', '.join(on)}",
    ]
    if plan is not None:
        lines.append(f"memory: the planner's estimate {plan.estimate.device_total / 2**30:.2f} GiB per "
                     f"{'GPU' if device == 'cuda' else 'rank'} against {plan.device_bytes / 2**30:.1f} GiB available "
                     f"now (an estimate, within its {plan.margin:.0%} measured error); longest that fits: "
                     f"{plan.longest:,} tokens")
    schedule = run.schedule
    steps = "every step" if schedule.every_steps == 1 else f"every {schedule.every_steps} steps"
    every = [steps] * bool(schedule.every_steps) + [
        f"every {schedule.every_minutes:g} min"] * bool(schedule.every_minutes)
    keep = args.save_total_limit
    lines.append(f"checkpoints: {' and '.join(every + ['after the last step'])}, in {args.save_dir}/ "
                 f"({'keeping the newest ' + str(keep) if keep else 'keeping all'})")
    return "start-up summary:\n  " + "\n  ".join(lines)


def setup_run(args: argparse.Namespace, before_model=None) -> Run:
    """Start DeepSpeed, check the config against the arguments, build the model and its engine.

    Args:
        args: the namespace of :func:`~ds_longseq.toolkit.args.add_common_args`'s flags.
        before_model: runs after the config checks and before the model is built: the place to
            read and validate data, so that bad input fails before any weight is allocated.
    """
    rank, world, resolved, use_bf16 = start_resolved(
        args.ds_config, seq_len=args.seq_len, pad_for_sp=args.pad_for_sp, dtype=args.dtype
    )
    long_seq = resolved.long_seq
    # the section parsed once, by start_resolved: the preflight and engine.initialize read this object
    ds_config = {**resolved.ds_config, "long_seq": long_seq}
    set_learning_rate(ds_config, args.lr if args.lr is not None else (None if args.model else args.default_lr))
    ds_config = report_to_config(ds_config, getattr(args, "report_to", None), args.save_dir)  # --report-to
    try:  # as DeepSpeed will read it (any two of the three keys): the loops step the optimizer by it
        batch = read_batch_size(ds_config, world // long_seq.sequence_parallel.size)
    except BatchSizeError as err:
        raise SystemExit(f"--ds_config {args.ds_config}: {err}") from None
    plan = check_memory(args, ds_config)
    # one run at a time in --save-dir, and who renames and prunes its checkpoints (before anything is removed)
    claim = claim_save_dir(args.save_dir, rank, resume=getattr(args, "resume", False))
    check_resume_shape(args, ds_config, world, long_seq.sequence_parallel.size)
    if before_model is not None:
        before_model()
    if getattr(args, "start_over", False):
        start_over(args.save_dir, rank, claim)

    dtype = torch.bfloat16 if use_bf16 else torch.float32
    model = build_model(args.model, dtype, seq_len=args.seq_len, seed=args.seed, four_bit=FourBit.from_args(args))
    if args.lora_rank:
        model = add_lora(model, args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets, seed=args.seed,
                         dropout=args.lora_dropout or 0.0)
    # Frozen weights (the base under LoRA) get no optimizer state.
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = ds_longseq.engine.initialize(model=model, model_parameters=trainable, config=ds_config)
    check_save_space(engine, args.save_dir, rank, exclude_frozen=bool(args.lora_rank))
    sp_rank, sp_size = sequence_parallel_rank_and_size()
    if sp_size > 1:  # the ring degree chosen from the model's heads (Ulysses x ring): a ring needs 2 P | --seq-len
        resolve_or_exit(args.ds_config, lambda: resolved.check(run=RunShape(
            seq_len=args.seq_len, pad_for_sp=args.pad_for_sp, ring=sp_layout_of(model).ring)))
    schedule = SaveSchedule(args.save_every, getattr(args, "save_every_minutes", 0.0), args.max_steps,
                            device=engine.device)
    run = Run(args, engine, model, long_seq, dtype, rank, world, sp_rank, sp_size, batch, schedule, claim)
    if rank == 0:
        logger.info("%s", startup_summary(run, plan))
    return run


def finish(run: Run) -> str:
    """The HF export (the final checkpoint was written by ``save_if_due``); returns what was exported."""
    import deepspeed.comm as dist

    merge = run.build_merge_base if run.args.lora_rank and run.args.merge_lora else None
    exported = export_hf(run.model, run.args.save_dir, run.rank, lora=bool(run.args.lora_rank), merge_base=merge)
    dist.barrier()
    if run.claim is not None:  # the run's writes are done: another run may use the directory
        run.claim.release()
    return exported
