"""Run any training script under mpirun as if torchrun had started it: ``python -m ds_longseq.processes.mpi_env
script.py [args...]`` (what ``launch/mpirun.sh`` runs on every rank).

Holds:
    mpi_environment: this rank's torch launcher variables, found through MPI.
    main: set them, then run the script as ``__main__``.

Why: under a bare mpirun, MPI sets its own variables (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ...) and none of
torch's (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). DeepSpeed's
``init_distributed`` finds them itself (MPI discovery), but a Hugging Face Trainer script never gets there:
accelerate builds its state when ``TrainingArguments`` is made, reads ``LOCAL_RANK`` to decide that a GPU run is
distributed (so a bare mpirun trains every rank alone, all on GPU 0) and on CPU ranks starts gloo without a
``MASTER_ADDR`` (which fails). With the variables set first, the same unmodified script runs under mpirun as
under the ``deepspeed`` launcher or torchrun.

Variables already set are kept (a hostfile's ``MASTER_ADDR``, the caller's ``MASTER_PORT``).
"""

from __future__ import annotations

import os
import runpy
import socket
import sys

from ds_longseq.processes.process_group import DEFAULT_DISTRIBUTED_PORT

__all__ = ["mpi_environment", "main"]


def _host_address() -> str:
    """This host's address that other nodes reach: the first of ``hostname -I`` (as DeepSpeed's MPI discovery
    takes it), else what the host name resolves to."""
    import subprocess

    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    return out[0] if out else socket.gethostbyname(socket.gethostname())


def mpi_environment() -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (ranks sharing this host, counted by MPI processor name),
    MASTER_ADDR (rank 0's host address) and MASTER_PORT (the environment's, else 29500) for this rank."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    hosts = comm.allgather(MPI.Get_processor_name())
    master = comm.bcast(os.environ.get("MASTER_ADDR") or _host_address() if rank == 0 else None, root=0)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(hosts[:rank].count(hosts[rank])),
        "LOCAL_WORLD_SIZE": str(hosts.count(hosts[rank])),
        "MASTER_ADDR": master,
        "MASTER_PORT": os.environ.get("MASTER_PORT", str(DEFAULT_DISTRIBUTED_PORT)),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0])
        raise SystemExit(0 if argv else 2)
    for name, value in mpi_environment().items():
        os.environ.setdefault(name, value)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
