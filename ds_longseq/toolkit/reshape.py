"""Resuming a checkpoint on another shape of run: another number of ranks or sequence-parallel size.

DeepSpeed's ZeRO checkpoints are cut by data-parallel rank and load only at the world size that wrote them
(``ZeRORuntimeException: The checkpoint being loaded used a DP world size of 4 but the current world size is 2``).
Its universal checkpoint is cut by parameter instead: ``deepspeed.checkpoint.ds_to_universal`` converts one
(``--inject_missing_state``: Hugging Face models carry no ``universal_checkpoint_info``), and an engine configured
with ``"checkpoint": {"load_universal": true}`` loads it at any world size, fp32 master weights and Adam's
``exp_avg`` / ``exp_avg_sq`` included. Here the conversion goes to ``step<N>.universal/`` beside the original, which
stays untouched, and is reused by a later resume.

What stays refused, before compute and naming why: a ZeRO stage change and NVMe optimizer offload (DeepSpeed's
universal load does not cover them), LoRA checkpoints (they leave the frozen weights out, which the conversion
needs), and a global batch (micro-batch x accumulation x data-parallel replicas) other than the checkpoint's: the
data position is the number of samples consumed, step x global batch, so the message names the accumulation that
keeps it. The random generators' states are per rank: a reshaped resume starts them afresh (dropout masks then
differ from the uninterrupted run's; runs without dropout continue exactly).

Holds:
    UNIVERSAL_SUFFIX: the converted directory's suffix.
    planned_shape: the shape a run is about to have, from its DeepSpeed config and world size (before the engine).
    shape_change: whether a checkpoint's shape differs from the run's, and what refuses the change.
    to_universal: convert a checkpoint once (global rank 0), every rank waiting; returns the tag to load.

Used by ``toolkit.run.check_resume_shape`` (refusals, and ``checkpoint.load_universal`` set before the engine is built)
and ``toolkit.checkpoint.resume`` (the conversion and the load).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

__all__ = ["UNIVERSAL_SUFFIX", "planned_shape", "shape_change", "to_universal"]

UNIVERSAL_SUFFIX = ".universal"


def planned_shape(ds_config: dict, *, world: int, sp_size: int) -> dict[str, Any]:
    """The shape keys of :func:`~ds_longseq.toolkit.manifest.run_facts` for a run about to start with
    ``ds_config`` on ``world`` ranks at sequence-parallel size ``sp_size``."""
    return {"world_size": world, "sequence_parallel_size": sp_size,
            "zero_stage": int(ds_config.get("zero_optimization", {}).get("stage", 0)),
            "micro_batch": int(ds_config.get("train_micro_batch_size_per_gpu", 1)),
            "gradient_accumulation": int(ds_config.get("gradient_accumulation_steps", 1))}


def _describe(shape: dict[str, Any]) -> str:
    return (f"{shape['world_size']} ranks (sequence parallel {shape['sequence_parallel_size']} x data parallel "
            f"{shape['world_size'] // shape['sequence_parallel_size']}), ZeRO-{shape['zero_stage']}")


def _global_batch(shape: dict[str, Any]) -> int:
    replicas = shape["world_size"] // shape["sequence_parallel_size"]
    return shape["micro_batch"] * shape["gradient_accumulation"] * replicas


def shape_change(saved: dict[str, Any], now: dict[str, Any], *, checkpoint_dir: str, lora: bool = False,
                 nvme: bool = False) -> tuple[bool, str | None]:
    """(whether the ranks / sequence-parallel size differ, what refuses resuming across the change or None).

    Args:
        saved: the checkpoint's manifest; now: :func:`planned_shape` (or the run's facts).
        checkpoint_dir: named in the messages.
        lora: the checkpoints leave the frozen weights out; nvme: the optimizer is offloaded to NVMe.
    """
    changed = any(saved[k] != now[k] for k in ("world_size", "sequence_parallel_size"))
    where = f"{checkpoint_dir} was written by {_describe(saved)}; this run has {_describe(now)}"
    if saved["zero_stage"] != now["zero_stage"]:
        return changed, (f"{where}: a ZeRO stage change cannot be resumed (DeepSpeed's universal checkpoint keeps "
                         f"the stage): use ZeRO-{saved['zero_stage']}")
    if not changed:
        return False, None
    if lora:
        return True, (f"{where}: a LoRA checkpoint leaves the frozen weights out, which DeepSpeed's conversion to "
                      f"another shape needs: launch {saved['world_size']} ranks at sequence-parallel size "
                      f"{saved['sequence_parallel_size']}")
    if nvme:
        return True, (f"{where}: DeepSpeed's universal load skips an optimizer offloaded to NVMe: launch "
                      f"{saved['world_size']} ranks, or offload to the CPU")
    before, after = _global_batch(saved), _global_batch(now)
    if before != after:
        per_step = now["micro_batch"] * (now["world_size"] // now["sequence_parallel_size"])
        fix = (f"set gradient_accumulation_steps to {before // per_step}" if before % per_step == 0
               else f"choose a micro-batch and accumulation whose product with the {per_step // now['micro_batch']} "
                    f"replica(s) is {before}")
        return True, (f"{where}: its global batch was {before} sequences per step, this run's is {after}; the data "
                      f"position is counted in samples, so keep the global batch: {fix}")
    return True, None


def to_universal(save_dir: str, tag: str, *, leader: bool) -> str:
    """``<save_dir>/<tag>.universal/``, converted by ``deepspeed.checkpoint.ds_to_universal`` on one process
    (``leader``: global rank 0, which reads every rank's shard; written beside as ``.partial`` and renamed, so a
    killed conversion is redone; an existing one is reused), every rank waiting at a barrier; returns its tag. The
    original ``<tag>/`` is only read. A rank that then cannot see the converted directory (nodes without a shared
    file system) stops, saying so."""
    import shutil

    import deepspeed.comm as dist

    target = tag + UNIVERSAL_SUFFIX
    out = os.path.join(save_dir, target)
    if leader and not os.path.isdir(out):
        partial = out + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   os.path.join(save_dir, tag), "--output_folder", partial, "--inject_missing_state",
                   "--num_extract_workers", "1", "--num_merge_workers", "1"]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {save_dir}/{tag} (status {proc.returncode}):\n"
                               + proc.stderr[-3000:])
        os.replace(partial, out)
    dist.barrier()
    if not os.path.isdir(out):
        raise SystemExit(f"--resume: {out} (DeepSpeed's universal form of {tag}, written by rank 0) is not visible "
                         "here: resuming on another shape needs a file system every node shares")
    return target
