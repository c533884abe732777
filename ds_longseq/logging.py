"""Logging helpers: ``get_logger``, ``log_rank0``, ``warn_once``, ``warn_once_rank0``. No handler is configured here."""

from __future__ import annotations

import functools
import logging
import os
import sys

__all__ = ["get_logger", "log_rank0", "warn_once", "warn_once_rank0"]


def get_logger(name: str) -> logging.Logger:
    """The package logger for ``name`` (handlers are configured by entry points only)."""
    return logging.getLogger(name)


_RANK_VARIABLES = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
"""Where a launcher puts the global rank before any process group exists: torch's launchers and DeepSpeed's, Open
MPI, MPICH / Hydra, MVAPICH (an srun task's SLURM_PROCID too, read below)."""


def _rank() -> int:
    """This process's global rank: the process group's once one exists, else the launcher's variables (read without
    importing torch: the planner is torch-free), 0 without any."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in _RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    if "SLURM_STEP_ID" in os.environ and os.environ.get("SLURM_PROCID", "").isdigit():
        return int(os.environ["SLURM_PROCID"])
    return 0


def log_rank0(logger: logging.Logger, msg: str, level: int = logging.INFO) -> None:
    """Log ``msg`` on global rank 0 only."""
    if _rank() == 0:
        logger.log(level, msg)


@functools.lru_cache(maxsize=None)
def warn_once(logger: logging.Logger, msg: str) -> None:
    """Log a warning the first time ``msg`` is seen in this process."""
    logger.warning(msg)


def warn_once_rank0(logger: logging.Logger, msg: str) -> None:
    """:func:`warn_once` on global rank 0 only (a launcher's variables tell the rank before any process group): a
    warning about the run as a whole, said once, not once per rank."""
    if _rank() == 0:
        warn_once(logger, msg)
