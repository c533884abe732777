"""Crash-safe DeepSpeed checkpoints, resume, and the end-of-run Hugging Face export.

A checkpoint is ``<save_dir>/step<N>/`` plus a ``latest`` file naming the newest COMPLETE one. Every rank writes
into ``step<N>.partial/``, which is renamed to ``step<N>/`` only after every rank has finished (on each node, by its
local rank 0: several nodes without a shared file system each rename their own), and ``latest`` moves after that (an
atomic rename too): a run killed or out of disk mid-save leaves no directory that looks like a checkpoint (its
``step<N>.partial/`` is removed when the next run starts) and resumes from the previous one. A save that fails for
want of space says so, with the bytes it needs and those free. ``metrics.jsonl`` beside them is kept consistent with the
checkpoint a run resumes from. Each rank also writes its random generators' states
(``rng_state_rank<R>.pt``), so the dropout masks after a resume are those the uninterrupted run draws.

Holds:
    write_latest / read_latest: ``latest`` pointed at a checkpoint, atomically, and read (engine.manifest's, shared
        with the Trainer's resume; re-exported here).
    resume: load the checkpoint ``latest`` names (after engine.manifest's check: not a checkpoint, incomplete,
        another model, another shape of run); its step and the metrics rows up to it.
    start_or_resume: the first step to train and the metrics before it (fresh, or resumed).
    agreed_checkpoint: the checkpoint every rank resumes (global rank 0's ``latest``), checked on every rank.
    read_metrics: the rows of a metrics.jsonl, a last line cut short dropped (and said).
    save_checkpoint: every rank writes step<N>.partial/, renamed to step<N>/ when complete, then ``latest`` moves.
    remove_partial_checkpoints: the ``step<N>.partial/`` directories of saves that did not complete, removed at start.
    checkpoint_bytes: about how many bytes one checkpoint takes (measured from the last one, else estimated).
    check_save_space: warn at start when the save directory's free space is short of one checkpoint.
    save_if_due: a checkpoint every ``save_every`` steps and at the last step.
    SaveSchedule: when a run saves: every N steps, every M minutes (the ranks agreeing), after the last step.
    prune_checkpoints: keep only the newest N checkpoints (``--save-total-limit``).
    gathered_state_dict: a model's (or its trainable) weights as CPU copies on rank 0, gathered under ZeRO-3.
    save_streamed: a model in Hugging Face's safetensors format, one decoder layer gathered and written at a time.
    export_hf: ``hf_model/``, or with LoRA ``hf_adapter/`` (and optionally a merged ``hf_model/``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import time
from typing import Callable

import torch

from ds_longseq.compat import (
    full_numel,
    gathered_parameters,
    is_zero3_partitioned,
    keys_ignored_on_save,
    repair_universal_load,
)
from ds_longseq.engine import sequence_parallel_rank_and_size
from ds_longseq.engine.manifest import (
    read_latest,
    read_manifest,
    resume_problem,
    run_facts,
    write_latest,
    write_manifest,
)
from ds_longseq.engine.reshape import UNIVERSAL_SUFFIX, UniversalConversionError, shape_change, to_universal
from ds_longseq.logging import get_logger
from ds_longseq.toolkit import faults
from ds_longseq.toolkit.lora import merge_lora
from ds_longseq.toolkit.quantized import quant_state_left_out
from ds_longseq.toolkit.save_dir import PARTIAL_SUFFIX, SaveDirClaim, checkpoint_run_id, local_leader

__all__ = ["write_latest", "read_latest", "resume", "agreed_checkpoint", "read_metrics", "start_or_resume",
           "save_checkpoint", "save_if_due", "SaveSchedule",
           "prune_checkpoints",
           "checkpoint_bytes", "check_save_space", "remove_partial_checkpoints", "gathered_state_dict", "save_streamed",
           "export_hf"]


logger = get_logger(__name__)


def resume(engine, save_dir: str, metrics_path: str, *, frozen_excluded: bool = False) -> tuple[int, list[dict], str]:
    """Load the checkpoint ``latest`` points at into ``engine``.

    With ``frozen_excluded`` (LoRA: the checkpoint holds the trainable weights only) the frozen weights stay as the
    engine's model has them (the base built from ``--model``).

    Returns:
        (its step, the rows of ``metrics_path`` up to that step, its tag).
    """
    import deepspeed.comm as dist

    facts = run_facts(engine, world=dist.get_world_size(), sp_size=sequence_parallel_rank_and_size()[1])
    tag = agreed_checkpoint(save_dir, facts)  # before DeepSpeed's load, which would fail deep inside or mix steps
    saved = read_manifest(os.path.join(save_dir, tag))
    reshaped, why = (False, None) if saved is None else shape_change(
        saved, facts, checkpoint_dir=os.path.join(save_dir, tag))
    if why is not None:
        raise SystemExit(f"--resume: {why}")
    original = tag
    if reshaped:  # setup_run configured the engine for it (toolkit.run.check_resume_shape)
        if not engine.load_universal_checkpoint():
            raise RuntimeError("resuming on another shape needs the engine built with checkpoint.load_universal "
                               "(toolkit.run.check_resume_shape before deepspeed.initialize)")
        try:  # rank 0 reads every rank's shard
            tag = to_universal(save_dir, tag, leader=dist.get_rank() == 0, saved=saved, now=facts, prefix="--resume")
        except UniversalConversionError as err:
            raise SystemExit(f"--resume: {err}") from None
    _, client_state = engine.load_checkpoint(save_dir, tag=tag, load_module_strict=not frozen_excluded)
    if reshaped:
        repaired = repair_universal_load(engine, os.path.join(save_dir, tag))
        if repaired and dist.get_rank() == 0:
            logger.warning("--resume: after DeepSpeed's ZeRO-3 universal load: %s", "; ".join(repaired))
    else:  # the generators are per rank: another shape starts them afresh (engine.reshape)
        _load_rng_state(os.path.join(save_dir, tag))
    tag = original
    start_step = client_state["step"]
    metrics = [m for m in read_metrics(metrics_path) if m["step"] <= start_step]
    return start_step, metrics, tag


def agreed_checkpoint(save_dir: str, facts: dict) -> str:
    """The checkpoint every rank resumes from: the one global rank 0's ``latest`` names, broadcast (on node-local
    disks each node has its own ``latest``, and a crash between two nodes' updates leaves them naming different
    steps), checked on every rank (:func:`~ds_longseq.engine.manifest.resume_problem`: there, complete, this model);
    every rank calls it.

    Raises:
        SystemExit: on every rank, naming the first rank (and its host) whose copy is missing or wrong, or the
            absence of any checkpoint.
    """
    import socket

    import torch.distributed as tdist

    tag = read_latest(save_dir)
    grouped = tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1
    if grouped:
        shared = [tag]
        tdist.broadcast_object_list(shared, src=0)
        if shared[0] is not None and tag is not None and tag != shared[0]:
            logger.warning("--resume: this rank's %s/latest names %s, global rank 0's names %s: resuming %s on "
                           "every rank", save_dir, tag, shared[0], shared[0])
        tag = shared[0]
    if tag is None:
        raise SystemExit(f"--resume: no checkpoint in {save_dir} (no 'latest' file)")
    problem = resume_problem(os.path.join(save_dir, tag), facts)
    if grouped:
        found = [None] * tdist.get_world_size()
        tdist.all_gather_object(found, None if problem is None else (socket.gethostname(), problem))
        rank = next((r for r, p in enumerate(found) if p is not None), None)
        if rank is not None:
            host, problem = found[rank]
            raise SystemExit(f"--resume: rank {rank} (on {host}): {problem}")
    elif problem is not None:
        raise SystemExit(f"--resume: {problem}")
    return tag


def read_metrics(path: str) -> list[dict]:
    """The rows of a ``metrics.jsonl`` ([] when there is none). A last line cut short (a kill or a full disk during
    its append) is dropped, saying so (its step is trained again); a bad line before the last is a file that was
    edited or mixed up, refused naming the file and line (``SystemExit``)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    rows = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines[: last + 1]):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a row with a step")
        except ValueError:
            if i == last:
                if _rank() == 0:
                    logger.warning("%s: its last line was cut short (%d characters, not a complete JSON row: the run "
                                   "was killed or the disk filled during its append); dropped, that step's row is "
                                   "written again when it trains", path, len(line))
                break
            raise SystemExit(f"--resume: {path}:{i + 1} is not a metrics row ({line[:60]!r}): the file was edited or "
                             "is another run's; move it aside and --resume again (it is rewritten from the "
                             "checkpoint's step on)") from None
        rows.append(row)
    return rows


def start_or_resume(
    engine, save_dir: str, metrics_path: str, *, resume_run: bool, max_steps: int, rank: int,
    frozen_excluded: bool = False, claim: SaveDirClaim | None = None,
) -> tuple[int, list[dict]]:
    """(first step to train, metrics rows of the steps before it); every rank calls it.

    Args:
        engine: the DeepSpeed engine.
        save_dir: where the checkpoints are.
        metrics_path: the run's metrics.jsonl (one JSON row per step, each with a ``step`` key).
        resume_run: --resume: load the checkpoint ``latest`` points at and keep the metrics up to it;
            the rows of later steps (the interrupted run's, trained again now) are dropped from
            ``metrics_path``. Otherwise: step 0 and a fresh ``metrics_path``.
        max_steps: the run's last step; resuming a checkpoint already there is refused.
        rank: this process's global rank.
        frozen_excluded: the checkpoints hold the trainable weights only (:func:`save_checkpoint`).
        claim: the run's claim on ``save_dir`` (``toolkit.save_dir.claim_save_dir``: who owns its directories);
            None: each node's local rank 0.
    """
    import deepspeed.comm as dist

    if claim.owner if claim is not None else local_leader(rank):
        remove_partial_checkpoints(save_dir)
    if not resume_run:
        if rank == 0 and os.path.exists(metrics_path):
            os.remove(metrics_path)
        return 0, []
    start_step, metrics, tag = resume(engine, save_dir, metrics_path, frozen_excluded=frozen_excluded)
    if start_step >= max_steps:
        raise SystemExit(f"--resume: {save_dir}/{tag} is at step {start_step}, and --max-steps is "
                         f"{max_steps}: nothing left to train; raise --max-steps")
    dist.barrier()  # every rank has read the metrics before rank 0 truncates them
    if rank == 0:
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in metrics)
        logger.warning("resumed from %s/%s at step %d", save_dir, tag, start_step)
    return start_step, metrics


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def remove_partial_checkpoints(save_dir: str) -> list[str]:
    """Remove the ``step<N>.partial/`` directories a killed or failed save left in ``save_dir`` (none is a
    checkpoint: ``latest`` never names one); returns their names. Called at the start of a run, before any save."""
    if not os.path.isdir(save_dir):
        return []
    removed = sorted(name for name in os.listdir(save_dir)
                     if name.startswith("step") and name.endswith(PARTIAL_SUFFIX)
                     and os.path.isdir(os.path.join(save_dir, name)))
    for name in removed:
        shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    if removed:
        logger.warning("removed %s in %s: the partial writes of saves that did not complete", removed, save_dir)
    return removed


def save_checkpoint(
    engine, save_dir: str, step: int, rank: int, *, exclude_frozen: bool = False, keep: int = 0,
    claim: SaveDirClaim | None = None,
) -> None:
    """``<save_dir>/step<step>/`` from every rank (written as ``step<step>.partial/``, renamed when complete), then
    ``latest`` moved to it; every rank calls it.

    Args:
        exclude_frozen: write the trainable weights only (LoRA: the adapter and its optimizer state, not the frozen
            base, which a resume rebuilds from ``--model``; a 4-bit base's quantisation state is left out too).
        keep: once ``latest`` has moved, keep only the newest ``keep`` checkpoints of this run (0: all).
        claim: the run's claim on ``save_dir``: its id goes into the manifest, and only its owners rename and prune
            (``toolkit.save_dir``); None: each node's local rank 0, and any run's checkpoints are pruned.

    Raises:
        SystemExit: the disk filled up: the message says so, with the bytes needed and free; the partial
            directory is removed and ``latest`` still names the previous complete checkpoint.
    """
    import deepspeed.comm as dist

    tag = f"step{step}"
    partial = tag + PARTIAL_SUFFIX
    owner = claim.owner if claim is not None else local_leader(rank)
    if owner:  # a partial directory an earlier run left (killed mid-save) is not reused
        shutil.rmtree(os.path.join(save_dir, partial), ignore_errors=True)
    dist.barrier()
    faults.arm_before_save(engine, rank, step)  # test-only: nothing unless DS_LONGSEQ_FAULT_INJECT asks
    # save_latest=False: DeepSpeed would rewrite ``latest`` in place; ours flips it only after
    # every rank has finished writing, so a crash mid-save leaves the previous one in charge.
    try:
        # a 4-bit base's scales are not parameters, so exclude_frozen_parameters alone would keep them
        with quant_state_left_out(engine.module) if exclude_frozen else contextlib.nullcontext():
            engine.save_checkpoint(save_dir, tag=partial, client_state={"step": step}, save_latest=False,
                                   exclude_frozen_parameters=exclude_frozen)
        _save_rng_state(os.path.join(save_dir, partial))
    except (OSError, RuntimeError) as err:
        if not _out_of_space(err):
            raise
        # The partial directory stays: other ranks may still be writing into it (removing it under them would turn
        # their error into a missing directory); it is not a checkpoint, and the next start removes it.
        needed = checkpoint_bytes(engine, save_dir, exclude_frozen=exclude_frozen)
        raise SystemExit(
            f"checkpoint {tag}: no space left on device writing {save_dir} ({_gib(shutil.disk_usage(save_dir).free)} "
            f"free; a checkpoint takes {_gib(needed[0])}, {needed[1]}): free space or pass another --save-dir, then "
            f"--resume; 'latest' still names {read_latest(save_dir) or 'no checkpoint'} ({partial}/ is not one: the "
            "next start removes it)"
        ) from None
    faults.after_save(step)  # test-only: a crash after writing, before ``latest`` moves
    facts = run_facts(engine, world=dist.get_world_size(), sp_size=sequence_parallel_rank_and_size()[1])
    if claim is not None:
        facts["run_id"] = claim.run_id
    dist.barrier()
    if owner:  # every rank has written: the manifest lists the files this owner's file system holds
        write_manifest(os.path.join(save_dir, partial), facts, step)
    dist.barrier()  # every owner's manifest written before any renames
    if owner:
        _complete(save_dir, partial, tag)
        write_latest(save_dir, tag)
        if keep:
            prune_checkpoints(save_dir, keep, run_id=None if claim is None else claim.run_id)
    dist.barrier()


def _complete(save_dir: str, partial: str, tag: str) -> None:
    """Rename ``partial`` to ``tag`` (a stale ``tag`` directory, never the one ``latest`` names, is replaced). On a
    file system several nodes share, another node's leader may have renamed it first."""
    src, dst = os.path.join(save_dir, partial), os.path.join(save_dir, tag)
    if os.path.isdir(dst) and os.path.isdir(src) and read_latest(save_dir) != tag:
        shutil.rmtree(dst)  # an earlier run's step<N>, trained again after a resume from before it
        shutil.rmtree(dst + UNIVERSAL_SUFFIX, ignore_errors=True)  # and its converted form, which is not this one's
    try:
        os.replace(src, dst)
    except FileNotFoundError:
        if not os.path.isdir(dst):
            raise


_OUT_OF_SPACE_WORDS = ("no space left", "file write failed", "unexpected pos")
"""How torch's zip writer reports a full disk (``PytorchStreamWriter failed writing file ...: file write failed``,
``[enforce fail at inline_container.cc] unexpected pos``), besides an ``OSError`` with ``errno.ENOSPC``."""


def _out_of_space(err: BaseException) -> bool:
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(err, RuntimeError) and any(w in str(err).lower() for w in _OUT_OF_SPACE_WORDS)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)"


def checkpoint_bytes(engine, save_dir: str, *, exclude_frozen: bool = False) -> tuple[int, str]:
    """(bytes, how they were found) one checkpoint takes on this node: the size of the one ``latest`` names where
    there is one, else an estimate from the model (its weights as stored, and for each trainable parameter Adam's
    float32 master copy and two moments, 12 bytes)."""
    tag = read_latest(save_dir)
    if tag is not None and os.path.isdir(os.path.join(save_dir, tag)):
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(save_dir, tag))
                   for f in files)
        return size, f"the size of {tag}/"
    params = list(engine.module.parameters())
    weights = sum(full_numel(p) * p.element_size() for p in params if p.requires_grad or not exclude_frozen)
    optimizer = 12 * sum(full_numel(p) for p in params if p.requires_grad)
    return weights + optimizer, "an estimate: its weights and Adam's float32 states"


def check_save_space(engine, save_dir: str, rank: int, *, exclude_frozen: bool = False) -> None:
    """Warn (rank 0) when ``save_dir``'s free space is short of one checkpoint, with both figures."""
    if rank != 0:
        return
    needed, how = checkpoint_bytes(engine, save_dir, exclude_frozen=exclude_frozen)
    existing = os.path.abspath(save_dir)
    while not os.path.isdir(existing):  # not created yet (the scripts create it first): the file system it will be on
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if free < needed:
        logger.warning("--save-dir %s has %s free; a checkpoint takes %s (%s): the first save will fail unless "
                       "space is freed", save_dir, _gib(free), _gib(needed), how)


def _rng_state_path(checkpoint_dir: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return os.path.join(checkpoint_dir, f"rng_state_rank{rank}.pt")


def _save_rng_state(checkpoint_dir: str) -> None:
    """This rank's generators (torch's CPU and CUDA ones, Python's, NumPy's) as the step left them: what the next
    step's dropout masks follow from (``ops.draws`` reads its seeds off torch's CPU generator)."""
    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(state, _rng_state_path(checkpoint_dir))


def _load_rng_state(checkpoint_dir: str) -> None:
    """Restore what :func:`_save_rng_state` wrote for this rank; a checkpoint without it (written before, or by
    another number of ranks) resumes with the generators as they are, said once."""
    import numpy as np

    path = _rng_state_path(checkpoint_dir)
    if not os.path.exists(path):
        logger.warning("%s has no random generator state for this rank (%s): training resumes, with dropout masks "
                       "other than the uninterrupted run's", checkpoint_dir, os.path.basename(path))
        return
    state = torch.load(path, weights_only=False)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def prune_checkpoints(save_dir: str, keep: int, run_id: str | None = None) -> list[str]:
    """Remove all but the newest ``keep`` ``step<N>/`` checkpoints of ``save_dir`` (never the one ``latest`` names);
    with ``run_id``, only that run's count and are removed (another run's checkpoints, or ones from before run ids,
    are left alone). Returns the removed tags. Called after ``latest`` moved, so a crash here loses nothing ``latest``
    needs."""
    latest = read_latest(save_dir)
    tags = sorted((int(name[4:]), name) for name in os.listdir(save_dir)
                  if name.startswith("step") and name[4:].isdigit() and os.path.isdir(os.path.join(save_dir, name))
                  and (run_id is None or checkpoint_run_id(os.path.join(save_dir, name)) == run_id))
    removed = [name for _, name in tags[:-keep] if name != latest]
    for name in removed:
        shutil.rmtree(os.path.join(save_dir, name))
        shutil.rmtree(os.path.join(save_dir, name + UNIVERSAL_SUFFIX), ignore_errors=True)  # its converted form
    if removed:
        logger.info("removed old checkpoints %s (--save-total-limit %d)", removed, keep)
    return removed


def save_if_due(
    engine, save_dir: str, step: int, *, save_every: int, max_steps: int, rank: int, exclude_frozen: bool = False,
    keep: int = 0,
) -> None:
    """After step ``step`` (1-based): a checkpoint every ``save_every`` steps (0: none), the last one included
    (``exclude_frozen`` and ``keep`` as :func:`save_checkpoint` takes them)."""
    if SaveSchedule(save_every, 0, max_steps).due(step):  # the step rule alone (no time rule: no collective)
        save_checkpoint(engine, save_dir, step, rank, exclude_frozen=exclude_frozen, keep=keep)


class SaveSchedule:
    """When a run writes a checkpoint: after every ``every_steps``-th optimizer step, once ``every_minutes`` of wall
    time have passed since the last checkpoint (or the start), and after the last step.

    The time rule is decided collectively: every rank must enter a save together, and their clocks are read at
    slightly different moments, so after each step the ranks agree (one all-reduce of a flag: the furthest clock
    decides) whenever a time rule is set and the step rule does not already save.

    Args:
        every_steps: N (0: no step rule).
        every_minutes: M (0: no time rule).
        max_steps: the last step, always saved.
        agree: ``late -> whether any rank is late``; default an all-reduce (MAX) over the world on ``device``.
        device: where that flag lives (the engine's device: NCCL reduces CUDA tensors only).
    """

    def __init__(self, every_steps: int, every_minutes: float, max_steps: int, *,
                 agree: Callable[[bool], bool] | None = None, device=None):
        self.every_steps, self.every_minutes, self.max_steps = every_steps, every_minutes, max_steps
        self._agree = agree or (lambda late: _any_rank(late, device))
        self._since = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether to save after optimizer step ``step`` (1-based); every rank calls it after every step."""
        if step == self.max_steps or (self.every_steps and step % self.every_steps == 0):
            return True
        if not self.every_minutes:
            return False
        return self._agree(time.monotonic() - self._since >= 60.0 * self.every_minutes)

    def saved(self) -> None:
        """A checkpoint was just written: the time rule counts from now."""
        self._since = time.monotonic()


def _any_rank(flag: bool, device) -> bool:
    """True on every rank if ``flag`` is True on any."""
    import deepspeed.comm as dist

    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gathered_state_dict(model: torch.nn.Module, rank: int, trainable_only: bool = False) -> dict | None:
    """``model.state_dict()`` (or only its trainable parameters) as CPU copies on rank 0; None elsewhere.

    Under ZeRO-3 every rank holds 1/world of each parameter: all ranks must call this, which
    gathers the selected parameters for the copy (and only those: a LoRA export gathers no base weight).
    """
    params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    is_zero3 = is_zero3_partitioned(params[0])
    with gathered_parameters(params, enabled=is_zero3):
        if rank != 0:
            return None
        if trainable_only:
            return {k: v.detach().cpu().clone() for k, v in model.named_parameters() if v.requires_grad}
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _parameter_groups(model: torch.nn.Module) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """The model's parameters (each shared one once, under its first name, as safetensors wants tied weights) in
    order, grouped by decoder layer (a name's prefix through its first numeric part: ``model.layers.3``), the other
    modules one group each."""
    groups: list[list[tuple[str, torch.nn.Parameter]]] = []
    last = None
    for name, param in model.named_parameters():
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        key = ".".join(parts[: index + 1]) if index is not None else ".".join(parts[:-1])
        if key != last:
            groups.append([])
            last = key
        groups[-1].append((name, param))
    return groups


def save_streamed(model: torch.nn.Module, out_dir: str, rank: int) -> list[str]:
    """``model`` (a transformers ``PreTrainedModel``) in Hugging Face's format at ``out_dir``: ``config.json``, the
    generation config, and one safetensors shard per decoder layer and per other module holding weights (the
    embedding, the final norm, the LM head) with ``model.safetensors.index.json``; every rank calls it.

    Under ZeRO-3 one decoder layer is gathered at a time (as DeepSpeed's own 16-bit save gathers per module) and
    rank 0 writes its shard before the next is gathered, so no rank ever holds the whole model: rank 0's host memory
    grows by about one layer. Weights are written as transformers' ``save_pretrained`` writes them (tied weights once,
    ``_keys_to_ignore_on_save`` left out, its load-time weight conversions reverted per layer, e.g. fused MoE experts
    split back), so ``from_pretrained`` loads the directory as it loads transformers' own.

    Returns:
        The shard file names (on rank 0; [] elsewhere).
    """
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    ignored = keys_ignored_on_save(model)
    state_keys = set(model.state_dict().keys())  # persistent buffers are saved too, non-persistent ones are not
    groups = _parameter_groups(model)
    buffers = [(n, b) for n, b in model.named_buffers() if n in state_keys and n not in ignored]
    is_zero3 = any(is_zero3_partitioned(p) for group in groups for _, p in group)
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(out_dir):  # an earlier export's shards would otherwise mix with these
            if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
                os.remove(os.path.join(out_dir, name))
    written: list[tuple[str, list[str], int]] = []  # (temporary file, tensor names, bytes)
    for i, group in enumerate([*groups, []]):
        # the last group: the persistent buffers (never partitioned)
        tensors = group if i < len(groups) else buffers
        with gathered_parameters([p for _, p in group], enabled=is_zero3 and bool(group)):
            if rank != 0:
                continue
            # written while gathered: a CPU tensor is written from where it is, a GPU one through one host copy
            shard = {name: t.detach().to("cpu").contiguous() for name, t in tensors if name not in ignored}
            if not shard:
                continue
            shard = revert_weight_conversion(model, shard)
            path = os.path.join(out_dir, f"model.part{i:05d}.safetensors.tmp")
            save_file(shard, path, metadata={"format": "pt"})
            written.append((path, list(shard), sum(t.numel() * t.element_size() for t in shard.values())))
            del shard
    if rank != 0:
        return []
    names = []
    weight_map = {}
    for k, (path, tensors, _) in enumerate(written):
        name = f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(path, os.path.join(out_dir, name))
        names.append(name)
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(size for _, _, size in written)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out_dir)
    return names


def export_hf(
    model: torch.nn.Module, save_dir: str, rank: int, *, lora: bool = False,
    merge_base: Callable[[], torch.nn.Module] | None = None,
) -> str:
    """The end-of-run export in Hugging Face's formats; every rank calls it (ZeRO-3 gathers).

    Args:
        model: the trained model (``engine.module``; a PeftModel with ``lora``).
        save_dir: the run's output directory.
        rank: this process's global rank.
        lora: ``model`` is a PeftModel: export only its adapter, in PEFT's format, to ``hf_adapter/``.
        merge_base: with ``lora``, builds the base model again: the base with the adapter merged in
            is written to ``hf_model/`` too. None: no merge.

    Returns:
        What was written, for the end-of-run summary: ``"hf_model/"``, ``"hf_adapter/"`` or
        ``"hf_adapter/, hf_model/"``.
    """
    if not lora:
        save_streamed(model, os.path.join(save_dir, "hf_model"), rank)
        if rank == 0:
            _modes_from_umask(os.path.join(save_dir, "hf_model"))
        return "hf_model/"
    state = gathered_state_dict(model, rank, trainable_only=True)
    if rank == 0:
        adapter_dir = os.path.join(save_dir, "hf_adapter")
        # PeftModel.save_pretrained keeps only the adapter's entries of state_dict and writes
        # adapter_config.json + adapter_model.safetensors, PEFT's own format.
        model.save_pretrained(adapter_dir, state_dict=state)
        _modes_from_umask(adapter_dir)
        if merge_base is not None:
            merge_lora(merge_base, adapter_dir, os.path.join(save_dir, "hf_model"))
            _modes_from_umask(os.path.join(save_dir, "hf_model"))
    return "hf_adapter/" + (", hf_model/" if merge_base is not None else "")


def _modes_from_umask(directory: str) -> None:
    """Give the files of an export the mode the process's umask gives new files (0644 under the usual 022):
    safetensors writes its files 0600 whatever the umask, so on a shared file system nobody else could load them."""
    umask = os.umask(0)
    os.umask(umask)  # read, restored at once
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            os.chmod(path, 0o666 & ~umask)
