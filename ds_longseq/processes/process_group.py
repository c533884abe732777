"""The process group DeepSpeed's collectives run on: adopted where a launcher or accelerate started one, started
the way DeepSpeed's own launchers expect where only the launcher's variables are there.

Holds:
    LAUNCHER_VARIABLES: environment variables that only a launcher sets, by launcher.
    launcher_environment: which launcher started this process (None: none).
    ensure_process_group: ``deepspeed.comm`` ready on the world's process group, or a one-line refusal.
    start_process_group: ``deepspeed.init_distributed`` as every launcher-started path here calls it.
    DEFAULT_DISTRIBUTED_PORT: the rendezvous port when ``MASTER_PORT`` is not set.
    free_port: a local port nothing listens on (a one-process run's rendezvous).
    slurm_environment / first_host: an srun task's torch variables from SLURM's (no mpi4py, no PMI).

Why this exists: DeepSpeed's sequence-parallel groups (``parallel_state_sp``) and its collectives go through
``deepspeed.comm``, which knows a process group only once ``deepspeed.init_distributed`` has run. accelerate
starts the group with ``torch.distributed.init_process_group`` itself on CPU ranks (``use_cpu=True``: its
MULTI_CPU path) and whenever the DeepSpeed plugin is not in play when its state is built, so a Trainer script
can reach ds_longseq with a torch process group that DeepSpeed does not know yet (DeepSpeed's engine adopts it
later, inside ``deepspeed.initialize``; the sequence-parallel groups are needed before that).
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from ds_longseq.logging import get_logger

__all__ = ["LAUNCHER_VARIABLES", "DEFAULT_DISTRIBUTED_PORT", "launcher_environment", "ensure_process_group",
           "start_process_group", "free_port", "slurm_environment", "first_host"]

logger = get_logger(__name__)

LAUNCHER_VARIABLES: dict[str, tuple[str, ...]] = {
    "deepspeed": ("CROSS_RANK",),  # DeepSpeed's launch.py (also RANK, LOCAL_RANK, ...)
    "torchrun": ("TORCHELASTIC_RUN_ID",),  # torchrun and accelerate launch (which runs torchrun)
    # a task of an srun job step (not the batch script itself, which has SLURM_PROCID but no step); before mpirun:
    # srun --mpi=pmi2 also sets PMI_RANK, and SLURM's own variables need no mpi4py
    "srun": ("SLURM_STEP_ID",),
    "mpirun": ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK"),  # Open MPI, MPICH / Hydra, MVAPICH
}
"""Variables only a launcher sets (a plain ``python script.py`` has none of them)."""

_TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_DISTRIBUTED_PORT = 29500  # deepspeed.initialize's own default, passed explicitly by the launcher-less paths

HOW_TO_LAUNCH = (
    "deepspeed --num_gpus {n} script.py, torchrun --nproc_per_node {n} script.py, accelerate launch "
    "--num_processes {n} script.py, or SCRIPT=script.py NP={n} bash launch/mpirun.sh (docs/LAUNCHING.md)"
)


def launcher_environment() -> str | None:
    """The launcher whose variables this process has ('deepspeed', 'torchrun', 'mpirun', 'srun'), 'env' for
    the bare torch variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set by hand, None for none."""
    for name, variables in LAUNCHER_VARIABLES.items():
        if any(v in os.environ for v in variables):
            return name
    if all(v in os.environ for v in _TORCH_VARIABLES):
        return "env"
    return None


def ensure_process_group(world_size_needed: int = 1, *, backend: str | None = None) -> bool:
    """Make ``deepspeed.comm`` usable: adopt torch's default process group if one exists (accelerate's, the
    user's), else start one from the launcher's environment as ``deepspeed.init_distributed`` does (MPI discovery
    under mpirun). Nothing is started for one process without a launcher.

    Args:
        world_size_needed: the ranks the caller needs (a sequence-parallel size); > 1 with no process group and
            no launcher environment is refused, naming the launch commands.
        backend: for a new group; default gloo on CPU, nccl with CUDA.

    Returns:
        True if a process group is in place afterwards.

    Raises:
        RuntimeError: more than one rank needed, none started and no launcher environment.
    """
    import deepspeed
    import deepspeed.comm as ds_dist

    if ds_dist.is_initialized():
        return True
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # deepspeed.init_distributed wraps an existing torch group without starting another one
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
        return True
    launcher = launcher_environment()
    if launcher is None:
        if world_size_needed > 1:
            raise RuntimeError(
                f"{world_size_needed} ranks are needed (long_seq.sequence_parallel.size={world_size_needed}) but this "
                "process was not started by a launcher and no process group exists: launch it with "
                + HOW_TO_LAUNCH.format(n=world_size_needed)
            )
        return False
    logger.info("ds_longseq: starting the process group from the %s launcher's environment", launcher)
    start_process_group(backend, verbose=False)
    return True


def start_process_group(backend: str | None = None, *, verbose: bool = True) -> None:
    """``deepspeed.init_distributed`` with ``backend`` (default gloo on CPU, nccl with CUDA) and MPI discovery, on
    the environment's ``MASTER_PORT``: DeepSpeed's MPI discovery would otherwise set it to its own default, and two
    mpirun jobs on one machine would collide there.

    Without a launcher (``python script.py``) the process is the whole world, rank 0 of 1, on a free local port:
    DeepSpeed's MPI discovery would otherwise try mpi4py and fail with its raw ``ModuleNotFoundError`` where mpi4py
    is not installed (the README's environment), naming none of this."""
    import deepspeed

    launcher = launcher_environment()
    if launcher == "srun":  # the torch variables from SLURM's own, without mpi4py or PMI
        for name, value in slurm_environment(os.environ).items():
            os.environ.setdefault(name, value)
    if launcher is None and not {"RANK", "WORLD_SIZE"} & os.environ.keys():  # a MASTER_PORT kept
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                            ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(name, value)
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(free_port())
        logger.warning("ds_longseq: no launcher: running as one process (rank 0 of 1). For N ranks: ds-longseq "
                       "train --num_gpus N, or " + HOW_TO_LAUNCH.format(n="N"))
    deepspeed.init_distributed(
        dist_backend=backend or ("nccl" if torch.cuda.is_available() else "gloo"), auto_mpi_discovery=True,
        verbose=verbose, distributed_port=int(os.environ.get("MASTER_PORT", DEFAULT_DISTRIBUTED_PORT)),
    )


def slurm_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The torch process-group variables of a task started by ``srun`` (one task per rank), from SLURM's:
    RANK = SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS, LOCAL_RANK = SLURM_LOCALID, LOCAL_WORLD_SIZE = this
    node's entry of SLURM_STEP_TASKS_PER_NODE (``2(x3)`` or ``3,2`` forms), MASTER_ADDR = the step's first host
    (SLURM_STEP_NODELIST, a compressed host list), MASTER_PORT = 20000 + SLURM_JOB_ID mod 20000 (every task
    computes the same one; jobs sharing a node get different ones), unless the job exports its own."""
    node = int(env.get("SLURM_NODEID", "0"))
    world = env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]
    per_node = _expand_counts(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or world)
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    return {
        "RANK": env["SLURM_PROCID"], "WORLD_SIZE": world, "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(per_node[min(node, len(per_node) - 1)]), "MASTER_ADDR": first_host(nodes),
        "MASTER_PORT": str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000),
    }


def _expand_counts(text: str) -> list[int]:
    """SLURM's per-node counts, expanded: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for item in text.split(","):
        value, _, times = item.partition("(x")
        counts += [int(value)] * int(times.rstrip(")") or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a SLURM compressed host list (what ``scontrol show hostnames`` prints first):
    ``gpu[003-005,9],cpu1`` -> ``gpu003``; ``a,b`` -> ``a``."""
    head = nodelist.strip()
    depth = 0
    for i, char in enumerate(head):  # the first top-level item
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            head = head[:i]
            break
    if "[" not in head:
        return head
    prefix, _, rest = head.partition("[")
    ranges, _, suffix = rest.partition("]")
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no process listens on now (the OS's choice)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
