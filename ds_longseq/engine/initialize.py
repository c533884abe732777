"""``ds_longseq.engine.initialize``: ``deepspeed.initialize`` plus the ``"long_seq"`` config section.

Holds:
    initialize: same arguments and return value as ``deepspeed.initialize``.
    initialize_with: the same, calling a given ``deepspeed.initialize`` (for a stand-in for it).
    split_config: load a DeepSpeed config (path or dict) and separate its ``long_seq`` section.
    check_sequence_length: the pre-training check of a sequence length (warns when a chunk spans it all).
    MIN_DEEPSPEED_VERSION: the oldest DeepSpeed this package is tested with.

Distributed StreamBP (StreamBP paper App. A.3) needs no DeepSpeed internals here:
- reduce once: every chunk loop (StreamBP layer, MsT MLP, LM head) is one autograd Function that
  sums its parameter gradients over chunks and returns them once, so each parameter's gradient
  accumulates, and DeepSpeed's per-parameter reduction hook fires, once per micro-step;
- gather once (ZeRO-3): decoder layers (MsT: MLPs) are ZeRO-3 leaf modules, so their weights are
  gathered by the module's own hooks for the whole chunk loop; the loss runs inside the LM head's
  module call, so its weight is gathered once in forward and once in backward;
- no collective runs inside a chunk loop, so ranks may hold different numbers of chunks (for
  example different numbers of valid tokens for the LM head) without deadlock.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
from typing import Any, Callable, Mapping

import torch

from ds_longseq.compat import TESTED_VERSIONS, fix_zero3_sequence_parallel_average, zero_flat_buffers_detached
from ds_longseq.config import LongSeqConfig
from ds_longseq.engine.sp_groups import sequence_parallel_groups
from ds_longseq.logging import get_logger
from ds_longseq.patch import enable, get_config, is_enabled, mark_zero3_leaves
from ds_longseq.processes.process_group import DEFAULT_DISTRIBUTED_PORT
from ds_longseq.processes.watchdog import start_watchdog, started_by_launcher
from ds_longseq.resolver import Launch, RunShape, resolve, zero_stage
from ds_longseq.techniques import active_techniques

__all__ = [
    "initialize",
    "initialize_with",
    "split_config",
    "zero_stage",
    "check_sequence_length",
    "MIN_DEEPSPEED_VERSION",
    "DEFAULT_DISTRIBUTED_PORT",
]

logger = get_logger(__name__)

MIN_DEEPSPEED_VERSION = TESTED_VERSIONS["deepspeed"][0]


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        match = re.match(r"\d+", piece)  # "0rc1" -> 0: a pre-release sorts with its release
        parts.append(int(match.group()) if match else 0)
    return tuple(parts)


def _check_deepspeed():
    try:
        import deepspeed
    except ImportError as err:  # pragma: no cover - deepspeed is an install requirement
        raise ImportError(
            f"ds_longseq.engine needs DeepSpeed: pip install 'deepspeed>={MIN_DEEPSPEED_VERSION}'") from err
    if _version_tuple(deepspeed.__version__) < _version_tuple(MIN_DEEPSPEED_VERSION):
        raise RuntimeError(
            f"DeepSpeed {deepspeed.__version__} is older than {MIN_DEEPSPEED_VERSION}, the oldest version "
            f"ds_longseq is tested with: pip install 'deepspeed>={MIN_DEEPSPEED_VERSION}'"
        )
    return deepspeed


def split_config(config: str | os.PathLike | Mapping[str, Any]) -> tuple[dict[str, Any], LongSeqConfig]:
    """Load a DeepSpeed config and split off its ``long_seq`` section: :func:`ds_longseq.resolver.resolve` with
    nothing known of the launch or the run yet.

    Args:
        config: path to a JSON file (or the name of a shipped one: :func:`~ds_longseq.config_files.find_ds_config`), or
            a dict (not modified) whose ``long_seq`` is a dict, or the :class:`LongSeqConfig` a caller parsed
            already (validated, not parsed again).

    Returns:
        (DeepSpeed config without ``long_seq``, validated :class:`LongSeqConfig`).

    Raises:
        LongSeqConfigError: the ``long_seq`` section or the ZeRO stage is invalid (all problems at once; a
            :class:`~ds_longseq.resolver.RunCannotStart`, each problem with its rule).
        ConfigFileError: the file cannot be read or is not a JSON object (naming the file, line and column).
    """
    resolved = resolve(config)
    return resolved.ds_config, resolved.long_seq


def check_sequence_length(config: LongSeqConfig, seq_len: int) -> None:
    """Raise before training if ``seq_len`` cannot be trained with ``config``; warn about no-op chunking: the
    start rules that read the length (:func:`ds_longseq.resolver.resolve` with ``RunShape(seq_len=...)``).

    A chunk size larger than the (local) sequence is legal: the whole sequence becomes one chunk, so short-sequence
    runs with the shipped configs work. It is worth one warning, because the chunking then does nothing (StreamBP
    becomes plain per-layer recompute), but not an error.

    Raises:
        LongSeqConfigError: ``seq_len`` is not positive, or (under sequence parallelism) not a length the ranks
            can cut.
    """
    resolve({"long_seq": config}, run=RunShape(seq_len=seq_len))


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with long-sequence training applied from the config's ``long_seq``.

    Takes ``deepspeed.initialize``'s arguments, plus two of its own: ``seq_len=N`` runs the memory preflight
    (:func:`ds_longseq.engine.memory_preflight`: the planner's estimate of one step of N tokens per sequence
    against this machine's free memory, refusing with :class:`PreflightError` only a run that cannot fit) before
    DeepSpeed allocates anything, and ``skip_preflight=True`` turns its refusal into a warning. ``config`` (or
    ``config_params``, or
    ``args.deepspeed_config``) may hold a ``"long_seq"`` section (see :class:`LongSeqConfig`),
    which is validated and removed before DeepSpeed sees the config. The model is patched with
    :func:`ds_longseq.enable` (unless it already is, with the same settings) and, under ZeRO-3,
    its layers become ZeRO-3 leaf modules. On a job of 2+ ranks started by a launcher, the peer
    watchdog (``long_seq.watchdog``, :mod:`ds_longseq.processes.watchdog`) starts: a dead rank stops the
    job within a bounded time, named.

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` from ``deepspeed.initialize``.
    """
    return initialize_with(_check_deepspeed().initialize, *args, **kwargs)


def initialize_with(
    ds_initialize: Callable,
    args=None,
    model: torch.nn.Module | None = None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int | None = None,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    config_params: Mapping[str, Any] | None = None,
    **kwargs,
):
    """:func:`initialize` that calls ``ds_initialize`` (``deepspeed.initialize``'s signature) in its place.

    For a caller that stands in for ``deepspeed.initialize`` itself (``ds_longseq.trainer`` routes the
    one accelerate calls through here) and so must reach the original function.
    """
    deepspeed = _check_deepspeed()
    seq_len, skip_preflight = kwargs.pop("seq_len", None), kwargs.pop("skip_preflight", False)
    if model is None:
        raise ValueError("ds_longseq.engine.initialize needs model=")
    if config is None and config_params is not None:
        config = config_params
    if config is None and getattr(args, "deepspeed_config", None):
        config = args.deepspeed_config
        # deepspeed.initialize refuses a config given both ways; ours is the cleaned dict.
        args = copy.copy(args)
        args.deepspeed_config = None
    if config is None:
        raise ValueError("ds_longseq.engine.initialize needs a DeepSpeed config: pass config= (path or dict)")
    # the processes are DeepSpeed's; the length, when given, is the preflight's (an engine user cuts and pads their
    # own batches: shard_batch(pad=True)), so the rules that read it are the scripts' (toolkit.start_distributed)
    resolved = resolve(config, launch=Launch(deepspeed=True))
    ds_config, long_seq = resolved.ds_config, resolved.long_seq
    if seq_len is not None:
        from ds_longseq.engine.preflight import memory_preflight

        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        memory_preflight(getattr(model, "config", None), {**ds_config, "long_seq": long_seq},  # parsed: read as is
                         seq_len, trainable_params=trainable, override=skip_preflight)
    stage = zero_stage(ds_config)
    sp_group = None
    if long_seq.sequence_parallel.enabled and mpu is not None:
        raise ValueError(
            "ds_longseq.engine.initialize builds DeepSpeed's sequence-parallel groups itself "
            "(long_seq.sequence_parallel / sequence_parallel_size): do not pass mpu="
        )
    port = distributed_port if distributed_port is not None else DEFAULT_DISTRIBUTED_PORT
    if any(t.needs_process_group for t in active_techniques(long_seq)) and not torch.distributed.is_initialized():
        deepspeed.init_distributed(distributed_port=port)  # before enable, which reads the world / the groups
    if long_seq.sequence_parallel.enabled:
        # the ranks are known now: the resolver's rule checks them against the size (sequence_parallel.divides_world)
        if torch.distributed.is_initialized():
            resolved.check(launch=Launch(world=torch.distributed.get_world_size(), deepspeed=True))
        mpu = sequence_parallel_groups(long_seq.sequence_parallel.size)
        sp_group = mpu.get_sequence_parallel_group()
    if is_enabled(model):
        if get_config(model) != long_seq:
            raise ValueError(
                "the model was enabled with a different long_seq config than the DeepSpeed config's: "
                "call ds_longseq.disable(model) first, or pass the same settings"
            )
    elif long_seq.any_enabled:
        enable(model, long_seq, sp_group=sp_group)
    if long_seq.any_enabled and stage == 3:
        mark_zero3_leaves(model)
    outputs = ds_initialize(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        distributed_port=port,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=ds_config,
        **kwargs,
    )
    if stage in (1, 2):
        zero_flat_buffers_detached(outputs[0].optimizer)
    if long_seq.sequence_parallel.enabled and stage == 3:
        fix_zero3_sequence_parallel_average(outputs[0].optimizer, long_seq.sequence_parallel.size)
    if long_seq.watchdog.enabled and started_by_launcher():
        # After deepspeed.initialize, which started the process group: a collective on every rank.
        start_watchdog(heartbeat_s=long_seq.watchdog.heartbeat_s, peer_timeout_s=long_seq.watchdog.peer_timeout_s)
    return outputs


# initialize takes exactly deepspeed.initialize's arguments: show them (help(), IDEs)
initialize.__signature__ = inspect.Signature(list(inspect.signature(initialize_with).parameters.values())[1:])
