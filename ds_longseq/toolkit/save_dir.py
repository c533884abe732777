"""A run's save directory: one run at a time, one owner of its directories per file system, and what an earlier run
left in it.

Holds:
    SaveDirClaim: this process's part in the run's claim on its save directory: the run's id (written into every
        checkpoint's manifest), whether this process owns the directory's renames and removals, rank 0's lock.
    claim_save_dir: every rank, before the model is built: the run id (new, or the resumed checkpoint's), global rank
        0's exclusive lock on the directory (a second run on it while this one goes on is refused in one line), and
        the owners: global rank 0, and on a node that does not see rank 0's lock file (a node-local disk) that node's
        local rank 0 for its own copy.
    checkpoint_run_id: the run id a checkpoint's manifest names.
    earlier_run / clear_earlier_run / start_over: the checkpoints an earlier run left (a new run must ``--resume``
        them or ``--start-over``), and their removal.

Why an owner: a checkpoint is written by every rank into ``step<N>.partial/`` and renamed when complete, old ones are
pruned, a killed save's partial directory is removed at the next start. Done by every node's local rank 0 on a file
system the nodes share, two processes rename and prune the same directories (a prune raced another's into a
FileNotFoundError in 5 of 5 trials, 400 files a step); done by global rank 0 alone on node-local disks, the other
nodes' copies would never complete. So the owners are found by looking: rank 0 writes the lock file with the run's
id, and a node whose local rank 0 sees that file is on rank 0's file system.

The lock is ``fcntl.flock`` on ``<save_dir>/.ds_longseq.lock``, held by global rank 0 for the whole run and released
by the kernel when the process ends (a killed run leaves no stale lock). On NFS without lock support flock may not
exclude another host's run; the run id in every manifest still keeps rotation to this run's checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
import uuid

from ds_longseq.engine.manifest import ManifestError, read_latest, read_manifest
from ds_longseq.engine.reshape import UNIVERSAL_SUFFIX
from ds_longseq.logging import get_logger

__all__ = ["LOCK_NAME", "SaveDirClaim", "claim_save_dir", "checkpoint_run_id", "RUN_OUTPUTS", "PARTIAL_SUFFIX",
           "earlier_run", "clear_earlier_run", "start_over", "local_leader"]

logger = get_logger(__name__)

LOCK_NAME = ".ds_longseq.lock"
"""The save directory's lock file: global rank 0 holds it (flock) and writes the run's id, host, pid and start."""
PARTIAL_SUFFIX = ".partial"
"""What a checkpoint's directory is called until every rank has written it (``step<N>.partial``)."""
RUN_OUTPUTS = ("latest", "latest_universal", "metrics.jsonl", "loss.png", "hf_model", "hf_adapter", "tensorboard",
               "csv_monitor", "wandb")
"""What a run writes into its save directory besides its checkpoints (``step<N>/`` and their forms); the last three
are the monitors' (``--report-to``), which a new run would otherwise append to."""


@dataclasses.dataclass
class SaveDirClaim:
    """This process's part in a run's claim on its save directory (:func:`claim_save_dir`)."""

    save_dir: str
    run_id: str
    """The run's id: every checkpoint's manifest names it, and rotation removes only this run's checkpoints."""
    owner: bool
    """Whether this process renames, prunes and removes checkpoint directories in its view of ``save_dir``."""
    lock_fd: int | None = None
    """Global rank 0's open lock file (the flock lives as long as it; closed by :meth:`release`)."""

    def release(self) -> None:
        """Give the lock up (the run is over); the kernel does it anyway when the process ends."""
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None


def local_leader(rank: int) -> bool:
    """Whether this process is its node's local rank 0 (the launcher's LOCAL_RANK; the global rank without one)."""
    return int(os.environ.get("LOCAL_RANK", rank)) == 0


def checkpoint_run_id(checkpoint_dir: str) -> str | None:
    """The run id ``checkpoint_dir``'s manifest names (None: none, unreadable, or written before run ids)."""
    try:
        manifest = read_manifest(checkpoint_dir)
    except ManifestError:
        return None
    return None if manifest is None else manifest.get("run_id")


def _lock(save_dir: str, run_id: str) -> tuple[int | None, str | None]:
    """(the locked file's descriptor, None), or (None, why not: the other run's description)."""
    import fcntl

    path = os.path.join(save_dir, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with open(path) as f:
            holder = f.read().strip()
        os.close(fd)
        try:
            info = json.loads(holder)
            holder = (f"run {info['run_id']}, pid {info['pid']} on {info['host']}, started "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info['started']))}")
        except (ValueError, KeyError, TypeError):
            holder = "another process"
        return None, (f"--save-dir {save_dir} is in use by another run ({holder}): wait for it to end, or pass "
                      "another --save-dir")
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                             "started": time.time()}).encode())
    os.fsync(fd)
    return fd, None


def claim_save_dir(save_dir: str, rank: int, *, resume: bool = False) -> SaveDirClaim:
    """This run's claim on ``save_dir`` (created if needed); every rank calls it, before the model is built.

    The run id is a new one, or with ``resume`` the one the checkpoint ``latest`` names was written by (a resumed run
    is that run, and rotates its checkpoints). Global rank 0 locks the directory; the other ranks learn whether they
    own their view of it (see the module docstring).

    Raises:
        SystemExit: on every rank, when another run holds the lock (one line naming it).
    """
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    os.makedirs(save_dir, exist_ok=True)
    fd = refusal = None
    if rank == 0:
        tag = read_latest(save_dir) if resume else None
        run_id = (checkpoint_run_id(os.path.join(save_dir, tag)) if tag else None) or uuid.uuid4().hex[:12]
        fd, refusal = _lock(save_dir, run_id)
    else:
        run_id = None
    if grouped:
        shared = [run_id, refusal]
        dist.broadcast_object_list(shared, src=0)
        run_id, refusal = shared
    if refusal is not None:
        raise SystemExit(refusal)
    owner = rank == 0
    if grouped:
        dist.barrier()  # rank 0's lock file is written
        if rank != 0 and local_leader(rank):  # another node: rank 0's file system, or a disk of its own?
            owner = _lock_file_run_id(save_dir) != run_id
    return SaveDirClaim(save_dir, run_id, owner, fd)


def _lock_file_run_id(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, LOCK_NAME)) as f:
            return json.loads(f.read()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


# ---- what an earlier run left ---------------------------------------------------------------------------------


def _is_checkpoint_name(name: str) -> bool:
    """``step<N>``, its converted ``step<N>.universal``, an unfinished ``step<N>.partial``, or a conversion's
    ``step<N>.staging`` and ``step<N>.universal.converting`` / ``.failed`` (``engine.reshape``)."""
    for suffix in (".failed", ".converting", PARTIAL_SUFFIX, ".staging", UNIVERSAL_SUFFIX):
        name = name.removesuffix(suffix)
    stem = name
    return stem.startswith("step") and stem[4:].isdigit()


def earlier_run(save_dir: str) -> list[str]:
    """The complete checkpoints an earlier run left in ``save_dir`` (``step<N>/`` and ``latest``), newest last; []
    for a new or empty directory. A new run there must say whether it continues them (``--resume``) or starts over
    (``--start-over``): training beside them would mix two runs' checkpoints and crash at its last save."""
    if not os.path.isdir(save_dir):
        return []
    tags = sorted((int(name[4:]), name) for name in os.listdir(save_dir)
                  if name.startswith("step") and name[4:].isdigit() and os.path.isdir(os.path.join(save_dir, name)))
    found = [name + "/" for _, name in tags]
    return found + ["latest"] * os.path.isfile(os.path.join(save_dir, "latest"))


def clear_earlier_run(save_dir: str) -> list[str]:
    """Remove what an earlier run wrote into ``save_dir`` (its checkpoints in every form, ``latest``, its metrics,
    plot and export: :data:`RUN_OUTPUTS`) and return the names removed; nothing else in the directory is touched
    (the lock file included)."""
    if not os.path.isdir(save_dir):
        return []
    removed = sorted(name for name in os.listdir(save_dir) if _is_checkpoint_name(name) or name in RUN_OUTPUTS)
    for name in removed:
        path = os.path.join(save_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    return removed


def start_over(save_dir: str, rank: int, claim: SaveDirClaim | None = None) -> None:
    """--start-over: the owners of ``save_dir`` (``claim``; without one each node's local rank 0) remove the earlier
    run's outputs (:func:`clear_earlier_run`; after every check passed, before the model is built), rank 0 saying in
    one line what was removed; every rank waits for it."""
    import deepspeed.comm as dist

    if (claim.owner if claim is not None else local_leader(rank)):
        removed = clear_earlier_run(save_dir)
        if removed and rank == 0:
            logger.warning("--start-over: removed the earlier run's %s from %s", ", ".join(removed), save_dir)
    dist.barrier()
