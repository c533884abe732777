"""Memory preflight: the planner's estimate of one step against the memory this machine has, before the first step.

Holds ``memory_preflight`` (what ``ds_longseq.engine.initialize(..., seq_len=N)`` and the examples run) and
``available_memory`` (free device memory per GPU, host memory per host). The estimate and its error come from
:mod:`ds_longseq.plan`; a run is refused only when even an estimate low by the planner's measured held-out error
would not fit (``PreflightError``, naming the numbers and what would fit), else it proceeds, with a warning when
the estimate is above the memory. Nothing is allocated or written before the check.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Mapping

import torch

from ds_longseq import plan as planner
from ds_longseq.config import LongSeqConfig
from ds_longseq.ops.host_store import host_available_bytes, ranks_on_this_host

__all__ = ["memory_preflight", "available_memory", "PreflightError"]

PreflightError = planner.PreflightError
logger = logging.getLogger("ds_longseq")


def available_memory(device: str) -> tuple[float, float]:
    """(bytes one rank may use on its device, bytes free on this host). On CPU the device is the host, shared
    by the host's ranks."""
    host = float(host_available_bytes())
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return float(free), host
    return host / ranks_on_this_host(), host


def memory_preflight(model_config, ds_config: Mapping, seq_len: int, *, trainable_params: int | None = None,
                     lora_rank: int | None = None, override: bool = False, device: str | None = None,
                     memory: tuple[float, float] | None = None, load_in_4bit: str | None = None,
                     double_quant: bool = True) -> planner.Plan | None:
    """Check one step of ``seq_len`` tokens of the model (its HF config) under ``ds_config`` (with ``long_seq``: the
    parsed :class:`~ds_longseq.config.LongSeqConfig`, as ``engine.initialize`` and the examples pass it, or a dict).

    ``trainable_params``: the parameters the optimizer trains (default: all, or LoRA's on the seven projections at
    ``lora_rank``);
    ``override``: warn instead of refusing; ``memory``: (per-device, per-host) bytes instead of reading them;
    ``load_in_4bit`` ("nf4" / "fp4") and ``double_quant``: a QLoRA base, its decoder linears counted 4-bit.
    Returns the plan, or None for a model the planner does not describe (logged, not refused).
    Raises PreflightError when the run cannot fit."""
    try:
        dims = planner.ModelDims.from_config(model_config)
    except ValueError as err:
        logger.info("preflight skipped: %s", err)
        return None
    long_seq = LongSeqConfig.of((ds_config or {}).get("long_seq"))  # the caller's parsed section, or its dict parsed
    if long_seq.adjoint.enabled:
        logger.info("preflight skipped: the planner has no model of adjoint sharding's memory")
        return None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local = min(ranks_on_this_host(), world)
    setup = planner.Setup.from_configs(ds_config, long_seq=long_seq, device=device, gpus=world,
                                       nodes=max(world // local, 1), trainable_params=trainable_params,
                                       lora_rank=lora_rank, load_in_4bit=load_in_4bit, double_quant=double_quant)
    if device == "cpu":  # the device is the host: offloading moves nothing out of it
        setup = replace(setup, offload_layer_inputs=False)
    per_device, per_host = memory if memory is not None else available_memory(device)
    return planner.preflight(dims, setup, seq_len, device_bytes=per_device,
                             host_bytes=None if device == "cpu" else per_host, override=override,
                             log=logger.warning)
