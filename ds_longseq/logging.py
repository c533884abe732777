"""Logging helpers: ``get_logger``, ``log_rank0``, ``warn_once``. No handler is configured here."""

from __future__ import annotations

import functools
import logging
import os

__all__ = ["get_logger", "log_rank0", "warn_once"]


def get_logger(name: str) -> logging.Logger:
    """The package logger for ``name`` (handlers are configured by entry points only)."""
    return logging.getLogger(name)


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log_rank0(logger: logging.Logger, msg: str, level: int = logging.INFO) -> None:
    """Log ``msg`` on global rank 0 only."""
    if _rank() == 0:
        logger.log(level, msg)


@functools.lru_cache(maxsize=None)
def warn_once(logger: logging.Logger, msg: str) -> None:
    """Log a warning the first time ``msg`` is seen in this process."""
    logger.warning(msg)
