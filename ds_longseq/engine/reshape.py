"""Resuming a checkpoint on another shape of run: another number of ranks or sequence-parallel size.

DeepSpeed's ZeRO checkpoints are cut by data-parallel rank and load only at the world size that wrote them
(``ZeRORuntimeException: The checkpoint being loaded used a DP world size of 4 but the current world size is 2``).
Its universal checkpoint is cut by parameter instead: ``deepspeed.checkpoint.ds_to_universal`` converts one
(``--inject_missing_state``: Hugging Face models carry no ``universal_checkpoint_info``), and an engine configured
with ``"checkpoint": {"load_universal": true}`` loads it at any world size, fp32 master weights and Adam's
``exp_avg`` / ``exp_avg_sq`` included. Here the conversion goes to ``step<N>.universal/`` beside the original, which
stays untouched, and is reused by a later resume.

LoRA checkpoints (the trainable weights only) convert too: the conversion and the universal load cover the
parameters the optimizer holds, and the frozen base is rebuilt from the model as on any LoRA resume. What stays
refused, before compute and naming why: a ZeRO stage change and NVMe optimizer offload (DeepSpeed's universal load
does not cover them), an optimizer without Adam's moments (:func:`conversion_failure`), and a global batch
(micro-batch x accumulation x data-parallel replicas) other than the checkpoint's: the
data position is the number of samples consumed, step x global batch, so the message names the accumulation that
keeps it. The random generators' states are per rank: a reshaped resume starts them afresh (dropout masks then
differ from the uninterrupted run's; runs without dropout continue exactly).

Holds:
    UNIVERSAL_SUFFIX: the converted directory's suffix.
    planned_shape: the shape a run is about to have, from its DeepSpeed config and world size (before the engine).
    optimizer_on_nvme: whether a DeepSpeed config offloads the optimizer to NVMe.
    shape_change: whether a checkpoint's shape differs from the run's, and what refuses the change.
    to_universal: convert a checkpoint once (global rank 0), every rank waiting; returns the tag to load.
    zero_shard_ranks: how many ranks wrote a ZeRO checkpoint (for checkpoints without the manifest).
    UniversalConversionError, conversion_failure: a failed conversion, and the one line it comes to.

Used by ``toolkit.run.check_resume_shape`` (refusals, and ``checkpoint.load_universal`` set before the engine is built),
``toolkit.checkpoint.resume`` (the conversion and the load) and ``trainer.resume`` (the Trainer's
``resume_from_checkpoint``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
from typing import Any

from ds_longseq.batch_size import read_batch_size
from ds_longseq.compat import checkpoint_parallel_dims_keys
from ds_longseq.engine.manifest import MANIFEST, MODEL_STATES, write_latest
from ds_longseq.logging import get_logger

__all__ = ["UNIVERSAL_SUFFIX", "planned_shape", "optimizer_on_nvme", "shape_change", "to_universal",
           "zero_shard_ranks", "UniversalConversionError", "conversion_failure"]

logger = get_logger(__name__)

UNIVERSAL_SUFFIX = ".universal"


def planned_shape(ds_config: dict, *, world: int, sp_size: int, micro_batch: int | None = None,
                  gradient_accumulation: int | None = None) -> dict[str, Any]:
    """The shape keys of :func:`~ds_longseq.engine.manifest.run_facts` for a run about to start with
    ``ds_config`` on ``world`` ranks at sequence-parallel size ``sp_size``; ``micro_batch`` and
    ``gradient_accumulation`` given by the Trainer (from its TrainingArguments: what its config's "auto" stands
    for), else read from the config's batch keys as DeepSpeed reads them (``batch_size.read_batch_size``: any two
    of the three)."""
    if micro_batch is None or gradient_accumulation is None:  # the config's triple, as DeepSpeed reads it
        batch = read_batch_size(ds_config, world // sp_size, micro_batch=micro_batch,
                                gradient_accumulation=gradient_accumulation)
        micro_batch, gradient_accumulation = batch.micro_batch, batch.gradient_accumulation
    return {"world_size": world, "sequence_parallel_size": sp_size,
            "zero_stage": int(ds_config.get("zero_optimization", {}).get("stage", 0)),
            "micro_batch": int(micro_batch), "gradient_accumulation": int(gradient_accumulation)}


def optimizer_on_nvme(ds_config: dict) -> bool:
    """Whether ``ds_config`` offloads the optimizer to NVMe (which :func:`shape_change` refuses to reshape)."""
    return ds_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "nvme"


def _describe(shape: dict[str, Any]) -> str:
    return (f"{shape['world_size']} ranks (sequence parallel {shape['sequence_parallel_size']} x data parallel "
            f"{shape['world_size'] // shape['sequence_parallel_size']}), ZeRO-{shape['zero_stage']}")


def _batch_text(shape: dict[str, Any]) -> str:
    replicas = shape["world_size"] // shape["sequence_parallel_size"]
    return f"{shape['micro_batch']} x {shape['gradient_accumulation']} accumulated x {replicas} replica(s)"


def _global_batch(shape: dict[str, Any]) -> int:
    replicas = shape["world_size"] // shape["sequence_parallel_size"]
    return shape["micro_batch"] * shape["gradient_accumulation"] * replicas


def shape_change(saved: dict[str, Any], now: dict[str, Any], *, checkpoint_dir: str,
                 nvme: bool = False) -> tuple[bool, str | None]:
    """(whether the ranks / sequence-parallel size differ, what refuses resuming across the change or None).

    Args:
        saved: the checkpoint's manifest; now: :func:`planned_shape` (or the run's facts).
        checkpoint_dir: named in the messages.
        nvme: the optimizer is offloaded to NVMe.
    """
    changed = any(saved[k] != now[k] for k in ("world_size", "sequence_parallel_size"))
    where = f"{checkpoint_dir} was written by {_describe(saved)}; this run has {_describe(now)}"
    if saved["zero_stage"] != now["zero_stage"]:
        return changed, (f"{where}: a ZeRO stage change cannot be resumed (DeepSpeed's universal checkpoint keeps "
                         f"the stage): use ZeRO-{saved['zero_stage']}")
    # the data position is step x global batch: a change of the global batch, on the same ranks too (accumulation
    # 4 -> 2 would re-read samples already trained), cannot continue the same data
    before, after = _global_batch(saved), _global_batch(now)
    if before != after:
        per_step = now["micro_batch"] * (now["world_size"] // now["sequence_parallel_size"])
        fix = (f"set gradient_accumulation_steps to {before // per_step}" if before % per_step == 0
               else f"choose a micro-batch and accumulation whose product with the {per_step // now['micro_batch']} "
                    f"replica(s) is {before}")
        return changed, (f"{where}: its global batch was {before} sequences per step ({_batch_text(saved)}), this "
                         f"run's is {after} ({_batch_text(now)}); the data position is counted in samples, so keep "
                         f"the global batch: {fix}")
    if not changed:
        return False, None
    if nvme:
        return True, (f"{where}: DeepSpeed's universal load skips an optimizer offloaded to NVMe: launch "
                      f"{saved['world_size']} ranks, or offload to the CPU")
    return True, None


class UniversalConversionError(RuntimeError):
    """DeepSpeed's conversion of a checkpoint to its universal form failed: one line naming the checkpoint and why
    (raised on every rank, the converting one having said why to the others)."""


def conversion_failure(checkpoint: str, returncode: int, stderr: str) -> str:
    """The one line a failed ``ds_to_universal`` of ``checkpoint`` comes to: an optimizer without Adam's moments
    (the conversion reads ``exp_avg`` / ``exp_avg_sq``: SGD and the like cannot be reshaped), else the status and
    DeepSpeed's last line."""
    if "KeyError: 'exp_avg'" in stderr:
        return (f"{checkpoint} holds no Adam moments (exp_avg): DeepSpeed's universal checkpoint, which another shape "
                "of run loads, converts the states of Adam-family optimizers only; resume it on the number of ranks "
                "and sequence-parallel size that wrote it")
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "no output")
    return f"DeepSpeed's ds_to_universal failed on {checkpoint} (status {returncode}): {last.strip()}"


SOURCE_STAMP = "ds_longseq_source"
"""The file in a converted ``<tag>.universal/`` naming the checkpoint it came from (:func:`source_stamp`)."""


def source_stamp(checkpoint_dir: str) -> str:
    """What identifies one checkpoint's contents: its manifest's SHA-256 (the run, the step, every file and its size),
    or for a checkpoint from before manifests its model states file's size and modification time."""
    manifest = os.path.join(checkpoint_dir, MANIFEST)
    if os.path.isfile(manifest):
        with open(manifest, "rb") as f:
            return "manifest sha256 " + hashlib.sha256(f.read()).hexdigest()
    states = os.path.join(checkpoint_dir, MODEL_STATES)
    if os.path.isfile(states):
        info = os.stat(states)
        return f"model states {info.st_size} bytes, mtime {info.st_mtime_ns}"
    return "unknown"


def _read_stamp(universal_dir: str) -> str | None:
    path = os.path.join(universal_dir, SOURCE_STAMP)
    if not os.path.isfile(path):
        return None  # converted before stamps: not known to be this checkpoint's
    with open(path) as f:
        return f.read()


def _staged_for_conversion(checkpoint_dir: str, saved: dict[str, Any]) -> str | None:
    """What ``ds_to_universal`` can read of a ZeRO-1/2 checkpoint written under sequence parallelism, or None where
    it reads the checkpoint as it is.

    DeepSpeed's sequence-parallel groups (``parallel_state_sp``, the engine's ``mpu``) answer the model-parallel size
    with the sequence-parallel size, so the engine records that as the checkpoint's tensor-parallel degree; the ranks
    of a sequence-parallel group hold the same model, and only ``mp_rank_00``'s model states are written. The
    converter then refuses the checkpoint (one model-state file for a tensor-parallel degree of P). Staged here: a
    directory beside it whose files are links to the checkpoint's, but for the model-state file, copied with the
    degree it has (1). The checkpoint itself is only read; the caller removes the staging directory.
    """
    import glob

    import torch
    keys = checkpoint_parallel_dims_keys()
    if keys is None:
        return None  # DeepSpeed 0.18 counts model-state files (one here), reading the checkpoint as it is
    dims_key, tp_key = keys
    states = glob.glob(os.path.join(checkpoint_dir, "mp_rank_*_model_states.pt"))
    size = saved.get("sequence_parallel_size", 1)
    if len(states) != 1 or size <= 1 or saved.get("zero_stage", 0) >= 3:
        return None
    state = torch.load(states[0], map_location="cpu", weights_only=False)
    dims = state.get(dims_key)
    if not isinstance(dims, dict) or dims.get(tp_key) != size:
        return None  # a degree that is not the sequence-parallel size: real tensor parallelism, left to DeepSpeed
    staging = checkpoint_dir.rstrip(os.sep) + ".staging"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    for name in os.listdir(checkpoint_dir):
        if os.path.join(checkpoint_dir, name) != states[0]:
            os.symlink(os.path.abspath(os.path.join(checkpoint_dir, name)), os.path.join(staging, name))
    state[dims_key] = {**dims, tp_key: 1}
    torch.save(state, os.path.join(staging, os.path.basename(states[0])))
    return staging


CONVERSION_WAIT_S = float(os.environ.get("DS_LONGSEQ_CONVERSION_TIMEOUT_S", 4 * 3600))
"""How long the other ranks wait for rank 0's conversion (``DS_LONGSEQ_CONVERSION_TIMEOUT_S``; default 4 hours, a
conversion of a checkpoint far larger than docs/LAUNCHING.md's measured rate makes likely) before stopping."""
VISIBLE_WITHIN_S = 120.0
"""How long a rank waits to see any sign of rank 0's conversion in the save directory before concluding that it does
not share rank 0's file system."""


def _write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _await_conversion(out: str, source: str, prefix: str, tag: str) -> str | None:
    """On a rank other than the converting one: wait for ``out`` (converted from ``source``: its stamp) or for rank
    0's failure, polling the file system (a collective would time out under a conversion that outlasts it, e.g. 30
    minutes under NCCL's default); returns the failure's message, or None once ``out`` is there. Logs every minute.

    Raises:
        SystemExit: nothing of rank 0's conversion is visible after :data:`VISIBLE_WITHIN_S` (no shared file system),
            or it has not finished after :data:`CONVERSION_WAIT_S`.
    """
    import time

    start = last_said = time.monotonic()
    seen = False
    while True:
        if os.path.isdir(out) and _read_stamp(out) == source:
            return None
        failed = _read_text(out + ".failed")
        if failed is not None and failed.split("\n", 1)[0] == source:
            return failed.split("\n", 1)[1]
        seen = seen or _read_text(out + ".converting") == source
        waited = time.monotonic() - start
        if not seen and waited > VISIBLE_WITHIN_S:
            raise SystemExit(f"{prefix}: {out} (DeepSpeed's universal form of {tag}, written by rank 0) is not visible "
                             "here: resuming on another shape needs a file system every node shares")
        if waited > CONVERSION_WAIT_S:
            raise SystemExit(f"{prefix}: rank 0's conversion of {tag} has not finished after {waited / 60:.0f} "
                             "minutes: convert it beforehand (python -m deepspeed.checkpoint.ds_to_universal ...), or "
                             "raise DS_LONGSEQ_CONVERSION_TIMEOUT_S")
        if time.monotonic() - last_said > 60:
            last_said = time.monotonic()
            logger.info("%s: waiting for rank 0's conversion of %s (%.0f min so far)", prefix, tag, waited / 60)
        time.sleep(1.0)


def to_universal(save_dir: str, tag: str, *, leader: bool, saved: dict[str, Any], now: dict[str, Any], prefix: str,
                 pointer: str | None = None) -> str:
    """``<save_dir>/<tag>.universal/``, converted by ``deepspeed.checkpoint.ds_to_universal`` on one process
    (``leader``: global rank 0, which reads every rank's shard; written beside as ``.partial`` and renamed, so a
    killed conversion is redone; an existing one is reused when it was converted from this very checkpoint,
    :data:`SOURCE_STAMP`, else converted again), every rank waiting; returns its tag. The original ``<tag>/`` is only
    read. The leader says so in one line that starts with ``prefix`` (``--resume``,
    ``resume_from_checkpoint``) and names the ``saved`` and ``now`` shapes. With ``pointer``, the leader also writes
    the tag into ``<save_dir>/<pointer>`` (``latest_universal``, which DeepSpeed's load reads when no tag is given:
    the Trainer's way).

    The other ranks watch the save directory for the result instead of waiting in a collective (a long conversion
    would outlast its timeout): ``<tag>.universal.converting`` while rank 0 converts, then the directory or
    ``<tag>.universal.failed``, each naming the checkpoint it is of (:func:`_await_conversion`); one barrier after.

    Raises:
        UniversalConversionError: on every rank, when the conversion failed (:func:`conversion_failure`).
        SystemExit: a rank that cannot see rank 0's conversion (nodes without a shared file system), or one that has
            waited :data:`CONVERSION_WAIT_S` for it.
    """
    import torch.distributed as dist

    target = tag + UNIVERSAL_SUFFIX
    out = os.path.join(save_dir, target)
    failure = None
    source = source_stamp(os.path.join(save_dir, tag))
    if leader and os.path.isdir(out) and _read_stamp(out) != source:
        # converted from another checkpoint of that name (a later run wrote <tag>/ over the one converted): stale
        logger.warning("%s: %s/ was converted from an earlier %s/ than the one there now: converting again", prefix,
                       target, tag)
        shutil.rmtree(out)
    converting, failed = out + ".converting", out + ".failed"
    if leader and not os.path.isdir(out):
        partial = out + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        for path in (failed, converting):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        _write_text(converting, source)  # the other ranks watch for it: rank 0 converts this very checkpoint
        source_dir = os.path.join(save_dir, tag)
        staged = _staged_for_conversion(source_dir, saved)  # ZeRO-1/2 under sequence parallelism
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   staged or source_dir, "--output_folder", partial, "--inject_missing_state",
                   "--num_extract_workers", "1", "--num_merge_workers", "1"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True)
        finally:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
        if proc.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            failure = conversion_failure(os.path.join(save_dir, tag), proc.returncode, proc.stderr)
            _write_text(failed, f"{source}\n{failure}")
        else:
            _write_text(os.path.join(partial, SOURCE_STAMP), source)
            os.replace(partial, out)
        os.remove(converting)
    if leader and pointer is not None and failure is None:
        write_latest(save_dir, target, name=pointer)
    if not leader:  # watch the file system, not a collective, which would time out under a long conversion
        failure = _await_conversion(out, source, prefix, tag)
    if dist.is_initialized():  # torch's own group: the Trainer calls this before deepspeed.comm is up
        dist.barrier()  # every rank has the result: rank 0 is done, so nobody waits long here
    if failure is not None:
        raise UniversalConversionError(failure)
    if leader:
        logger.warning("%s: %s was written by %d ranks at sequence-parallel size %d, this run has %d at %d: loading "
                       "DeepSpeed's universal form of it, %s/ (converted once; %s/ untouched)", prefix,
                       os.path.join(save_dir, tag), saved["world_size"], saved["sequence_parallel_size"],
                       now["world_size"], now["sequence_parallel_size"], target, tag)
    return target


def zero_shard_ranks(checkpoint_dir: str) -> int:
    """How many ranks wrote a DeepSpeed ZeRO checkpoint directory (its ``*zero_pp_rank_<r>_*optim_states.pt``
    files; 0 where it has none): the world size of a checkpoint without ds_longseq's manifest."""
    pattern = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
    if not os.path.isdir(checkpoint_dir):
        return 0
    return len({m.group(1) for name in os.listdir(checkpoint_dir) if (m := pattern.search(name))})
