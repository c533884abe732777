"""What a checkpoint holds, written beside DeepSpeed's files, and the check a resume runs before it loads anything.

``<save_dir>/step<N>/ds_longseq_checkpoint.json`` (written by each node's local rank 0 once every rank has finished
writing, before the directory is renamed into place) records the model's parameters (name and full shape), the shape
of the run (ranks, sequence-parallel size, ZeRO stage, micro-batch, accumulation) and every file with its size (the
random generators' states aside: optional, a checkpoint without them resumes with other dropout masks). ``--resume``
reads it first and stops, naming the directory and what is wrong, on a directory that is not a checkpoint, a
half-written or partly copied one, or one written by another model (which DeepSpeed would refuse deep inside its
load with a raw traceback, or load); another shape of run is :mod:`ds_longseq.engine.reshape`'s.

Holds:
    MANIFEST: the file's name.
    model_facts: the model's class and parameters.
    run_facts: the facts of this run that a checkpoint must agree with.
    write_manifest: write the manifest into a checkpoint directory (each node's local rank 0).
    read_manifest: a checkpoint directory's manifest (None: written before manifests; ManifestError: cut short, or
        another format).
    write_latest / read_latest: the ``latest`` file that names the newest complete checkpoint, written atomically
        and read.
    resume_problem: what is wrong with resuming this run's model from a checkpoint directory (None: nothing); a
        change of shape is engine.reshape's.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import torch

__all__ = ["MANIFEST", "model_facts", "run_facts", "write_manifest", "read_manifest", "resume_problem", "write_latest",
           "read_latest", "ManifestError"]

MANIFEST = "ds_longseq_checkpoint.json"
FORMAT = 1
MODEL_STATES = "mp_rank_00_model_states.pt"
"""DeepSpeed's file of the model states (every checkpoint of a data- / sequence-parallel run has it)."""


def model_facts(model: torch.nn.Module) -> dict[str, Any]:
    """The model's class and parameters ({name: full shape}; ZeRO-3's partitioned ones by their ``ds_shape``): what
    tells one model from another (before its engine exists too)."""
    return {"model_class": type(model).__name__,
            "parameters": {name: list(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters()}}


def run_facts(engine, *, world: int, sp_size: int) -> dict[str, Any]:
    """:func:`model_facts` of the engine's model, and the run's shape: ranks, sequence-parallel size, ZeRO stage,
    micro-batch, gradient accumulation."""
    return {
        **model_facts(engine.module),
        "world_size": world, "sequence_parallel_size": sp_size, "zero_stage": int(engine.zero_optimization_stage()),
        "micro_batch": int(engine.train_micro_batch_size_per_gpu()),
        "gradient_accumulation": int(engine.gradient_accumulation_steps()),
    }


def write_manifest(checkpoint_dir: str, facts: dict[str, Any], step: int) -> None:
    """``checkpoint_dir/MANIFEST``: ``facts`` (:func:`run_facts`), the step and every file below the directory with
    its size (this node's view: nodes without a shared file system each write their own)."""
    files = {}
    for root, _, names in os.walk(checkpoint_dir):
        for name in names:
            path = os.path.join(root, name)
            # the generators' states are optional (a checkpoint without them resumes, with other dropout masks)
            if name != MANIFEST and not name.startswith("rng_state_rank") and ".tmp." not in name:
                files[os.path.relpath(path, checkpoint_dir)] = os.path.getsize(path)
    tmp = os.path.join(checkpoint_dir, f"{MANIFEST}.tmp.{socket.gethostname()}.{os.getpid()}")  # per node
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "step": step, **facts, "files": dict(sorted(files.items()))}, f, indent=1)
    os.replace(tmp, os.path.join(checkpoint_dir, MANIFEST))


def write_latest(save_dir: str, tag: str, name: str = "latest") -> None:
    """Point ``<save_dir>/<name>`` (``latest``; DeepSpeed's load reads ``latest_universal`` too) at a COMPLETE
    checkpoint: written to a temp file, then renamed (atomic). The temp file is this process's own, so nodes sharing
    the directory never write into one another's."""
    tmp = os.path.join(save_dir, f"{name}.tmp.{socket.gethostname()}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, name))


def read_latest(save_dir: str) -> str | None:
    """The tag ``<save_dir>/latest`` names (ds_longseq's, or DeepSpeed's in a Trainer's ``checkpoint-<N>/``), or None
    without a ``latest`` file."""
    path = os.path.join(save_dir, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip()


class ManifestError(ValueError):
    """A checkpoint's manifest that cannot be read: cut short, or written in a format this version does not know."""


def read_manifest(checkpoint_dir: str) -> dict[str, Any] | None:
    """The manifest of ``checkpoint_dir``, or None where there is none.

    Raises:
        ManifestError: the file is not a JSON object (cut short), or its ``format`` is not this version's.
    """
    path = os.path.join(checkpoint_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ManifestError(f"{path} is not valid JSON ({err.__class__.__name__} at byte {getattr(err, 'pos', '?')}: "
                            "cut short or overwritten): point 'latest' at an earlier complete step") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ManifestError(f"{path} has checkpoint format {found!r}; this ds_longseq reads format {FORMAT}: resume it "
                            "with the ds_longseq version that wrote it, or start over (--start-over)")
    return manifest


def resume_problem(checkpoint_dir: str, facts: dict[str, Any], *,
                   other_model_fix: str = "Pass the --model (and LoRA flags) of that run, or another --save-dir",
                   ) -> str | None:
    """What is wrong with resuming a run with ``facts`` (:func:`run_facts`) from ``checkpoint_dir``, in one line that
    names the directory; None when nothing is (or, for a checkpoint from before manifests, nothing can be told).
    ``other_model_fix`` ends the message about a checkpoint of another model (the scripts' flags by default)."""
    if not os.path.isdir(checkpoint_dir):
        return f"{checkpoint_dir} is not there ('latest' names it): the directory was moved or deleted"
    try:
        saved = read_manifest(checkpoint_dir)
    except ManifestError as err:
        return str(err)
    if saved is None:
        if not os.path.isfile(os.path.join(checkpoint_dir, MODEL_STATES)):
            return (f"{checkpoint_dir} is not a DeepSpeed checkpoint (no {MODEL_STATES}, no {MANIFEST}): pass the "
                    "--save-dir of the run to continue")
        return None  # written before manifests: DeepSpeed's own checks are all there is
    missing = [(name, size) for name, size in saved["files"].items()
               if not os.path.isfile(os.path.join(checkpoint_dir, name))
               or os.path.getsize(os.path.join(checkpoint_dir, name)) != size]
    if missing:
        name, size = missing[0]
        there = os.path.join(checkpoint_dir, name)
        now = f"{os.path.getsize(there)} bytes of {size}" if os.path.isfile(there) else "missing"
        return (f"{checkpoint_dir} is incomplete: {len(missing)} of its {len(saved['files'])} files missing or cut "
                f"short ({name}: {now}; copied in part, or the disk lost it): copy it whole, or point 'latest' at an "
                "earlier complete step")
    ours, theirs = facts["parameters"], saved["parameters"]
    if ours != theirs:
        differ = sorted(set(ours) ^ set(theirs)) or [n for n in ours if ours[n] != theirs[n]]
        name = differ[0]
        return (f"{checkpoint_dir} was written by another model ({saved['model_class']}, {len(theirs)} parameters; "
                f"this run: {facts['model_class']}, {len(ours)}): {name} is {theirs.get(name, 'absent')} there, "
                f"{ours.get(name, 'absent')} here. {other_model_fix}")
    return None
