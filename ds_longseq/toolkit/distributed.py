"""Start-up of a DeepSpeed training process, and the small collectives a training loop needs.

Holds:
    configure_logging: show ds_longseq's log records on stderr, tagged with the rank (entry points only).
    init_process_group: DeepSpeed's process group, rank-0 logging and the GPU, before anything else.
    read_ds_config: the --ds_config file split into DeepSpeed's config and the long_seq section, or one line why not.
    resolve_or_exit: ``ds_longseq.resolver``'s refusal as the script's one-line exit.
    start_distributed: the process group, logging, and the config resolved against the arguments and the ranks
        (``ds_longseq.resolver``: every rule at once).
    cpu_tuned_config_hint: on a GPU, a hint when the config carries the CPU presets' tile sizes.
    ops_to_build: the DeepSpeed ops the run will compile first (logged: the first launch's minutes of silence).
    set_learning_rate: a peak learning rate into the config's optimizer and WarmupLR scheduler.
    mean_over_ranks: a dict of floats averaged over all ranks.
    to_rank_batch: this rank's shard of a batch (under sequence parallelism), on its device.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Literal

import torch

from ds_longseq.config import LongSeqConfigError
from ds_longseq.config_files import ConfigFileError
from ds_longseq.engine import shard_batch
from ds_longseq.logging import get_logger
from ds_longseq.processes.process_group import start_process_group
from ds_longseq.resolver import Launch, Resolved, RunShape, resolve
from ds_longseq.toolkit import faults

__all__ = [
    "configure_logging",
    "init_process_group",
    "read_ds_config",
    "resolve_or_exit",
    "start_distributed",
    "start_resolved",
    "set_learning_rate",
    "mean_over_ranks",
    "to_rank_batch",
]


logger = get_logger(__name__)


def configure_logging(rank: int) -> None:
    """Show ds_longseq's log records (INFO and up) on stderr, tagged with the rank.

    The package configures no handler (no import-time side effects); an entry point does.
    """
    package_logger = logging.getLogger("ds_longseq")
    if not package_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


def init_process_group() -> tuple[int, int]:
    """Start DeepSpeed's process group (gloo on CPU, nccl on GPUs; MPI discovery under mpirun), set up
    rank-0 logging and this rank's GPU; return (rank, world). A malformed test-only fault variable
    (``training.faults``) fails here, before any training."""
    import deepspeed.comm as dist

    faults.active_fault()
    # As ALST's published recipe and the GPU benchmarks: expandable segments fragment less at long lengths (the
    # memory planner models allocated memory, which the default allocator can exceed by 10+ GB). Set before the
    # first CUDA allocation; a setting of the user's own wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    start_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    configure_logging(rank)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return rank, world


def read_ds_config(path: str):
    """``engine.split_config`` of the ``--ds_config`` file: (DeepSpeed config dict, LongSeqConfig). An unreadable or
    malformed file (named with its line and column) or an invalid ``long_seq`` section stops the script with that
    message alone (``SystemExit``), no traceback."""
    resolved = resolve_or_exit(path, lambda: resolve(path))
    return resolved.ds_config, resolved.long_seq


def resolve_or_exit(path: str, resolving: Callable[[], Resolved]) -> Resolved:
    """``resolving()`` (a :func:`~ds_longseq.resolver.resolve` or a :meth:`Resolved.check`), its refusal turned into
    the script's one-line exit: the file named, every problem listed, no traceback."""
    try:
        return resolving()
    except ConfigFileError as err:
        raise SystemExit(str(err)) from None
    except LongSeqConfigError as err:
        raise SystemExit(f"--ds_config {path}: {err}") from None


def start_distributed(
    ds_config: str, *, seq_len: int, pad_for_sp: bool = False, dtype: Literal["auto", "fp32", "bf16"] = "auto"
):
    """Start DeepSpeed's process group and check the config against the arguments before any
    training starts (:func:`start_resolved`, its result as plain values).

    Returns:
        (rank, world, ds_config dict with its bf16 section set and ``long_seq`` the parsed LongSeqConfig (what
        ``engine.initialize`` takes as it is), that LongSeqConfig, use_bf16).
    """
    rank, world, resolved, use_bf16 = start_resolved(ds_config, seq_len=seq_len, pad_for_sp=pad_for_sp, dtype=dtype)
    return rank, world, {**resolved.ds_config, "long_seq": resolved.long_seq}, resolved.long_seq, use_bf16


def start_resolved(
    ds_config: str, *, seq_len: int, pad_for_sp: bool = False, dtype: Literal["auto", "fp32", "bf16"] = "auto"
) -> tuple[int, int, Resolved, bool]:
    """Start DeepSpeed's process group and resolve the config against the arguments and the ranks before any
    training starts.

    Args:
        ds_config: path of the DeepSpeed JSON config, with an optional ``long_seq`` section.
        seq_len: tokens per sequence (checked against long_seq and the sequence-parallel size).
        pad_for_sp: --pad-for-sp: sequences will be padded to what sequence parallelism cuts, so any length fits.
        dtype: "auto" (bf16 on GPU, fp32 on CPU), "fp32" or "bf16"; overrides the config's bf16 section.

    Returns:
        (rank, world, the :class:`Resolved` config (its DeepSpeed part with the bf16 section set), use_bf16); a
        later check (the ring degree once the model is built: ``setup_run``) runs only what it changes.
    """
    # first, the config alone: a bad file fails naming it, before DeepSpeed starts
    resolved = resolve_or_exit(ds_config, lambda: resolve(ds_config, run=RunShape(seq_len=seq_len,
                                                                                   pad_for_sp=pad_for_sp)))
    config, long_seq = resolved.ds_config, resolved.long_seq
    if os.environ.get("RANK", "0") == "0":  # the one rank that speaks, before the group that says which exists
        for op, why in ops_to_build(config, on_cuda=torch.cuda.is_available()):
            logger.warning("building DeepSpeed's %s op (%s): the first launch on this machine compiles it (an "
                           "estimate: 1-3 minutes on a small machine), later ones load it from %s", op, why,
                           _extensions_dir())
    rank, world = init_process_group()
    # then against the ranks and DeepSpeed (the monitor section); a ring forced in the config is checked here, one
    # chosen from the model's heads once it is built (setup_run)
    resolved = resolve_or_exit(ds_config, lambda: resolved.check(launch=Launch(world=world, deepspeed=True)))
    use_bf16 = dtype == "bf16" or (dtype == "auto" and torch.cuda.is_available())
    config["bf16"] = {"enabled": use_bf16}
    config.pop("fp16", None)
    if not torch.cuda.is_available():
        for key in ("offload_optimizer", "offload_param"):  # nothing to pin without a GPU
            if key in config.get("zero_optimization", {}):
                config["zero_optimization"][key]["pin_memory"] = False
    hint = cpu_tuned_config_hint(long_seq, on_cuda=torch.cuda.is_available())
    if hint is not None and rank == 0:
        logger.warning("%s: %s", ds_config, hint)
    return rank, world, resolved, use_bf16


def _extensions_dir() -> str:
    """Where torch keeps compiled extensions (DeepSpeed's JIT-built ops) for this Python and device kind."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    kind = "cu" + torch.version.cuda.replace(".", "") if torch.cuda.is_available() and torch.version.cuda else "cpu"
    return os.path.join(root, f"py{sys.version_info.major}{sys.version_info.minor}_{kind}")


def ops_to_build(config: dict, *, on_cuda: bool) -> list[tuple[str, str]]:
    """[(op, why)] of the DeepSpeed ops this run will compile because they are not built yet: the CPU shared-memory
    communication op of CPU ranks (about 100 s on the project's 2-core machine, the first launch's silence), CPU
    Adam for an optimizer offloaded to host memory or NVMe, async I/O for NVMe; prebuilt ops are not listed."""
    zero = config.get("zero_optimization", {})
    wanted = []
    if not on_cuda:
        wanted.append(("deepspeed_shm_comm", "the CPU ranks' communication"))
    if zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme"):
        wanted.append(("cpu_adam", "Adam on the host for the offloaded optimizer"))
    if "nvme" in (zero.get("offload_optimizer", {}).get("device"), zero.get("offload_param", {}).get("device")):
        wanted.append(("async_io", "NVMe offload's file I/O"))
    from deepspeed.git_version_info import installed_ops  # the ops built into the wheel (DS_BUILD_OPS=1)

    built = _extensions_dir()
    return [(op, why) for op, why in wanted
            if not installed_ops.get(op) and not os.path.isdir(os.path.join(built, op))]


GPU_CHUNK_TOKENS = 4096
"""The StreamBP chunk the GPU measurements used (benchmarks/RESULTS.md section 5); below it a GPU run is hinted at the
presets (which choose theirs, "auto", within a budget)."""


def cpu_tuned_config_hint(long_seq, *, on_cuda: bool) -> str | None:
    """On a GPU, a hint when the long_seq section carries the CPU presets' tiles (a 1024-key attention tile, chunks
    under 4096 tokens), which cost speed there; None otherwise."""
    if not on_cuda:
        return None
    tile = long_seq.attention.kv_block_size
    chunk = long_seq.streambp.chunk_size
    small = long_seq.streambp.enabled and chunk != "auto" and chunk < GPU_CHUNK_TOKENS
    if tile is None and not small:
        return None
    found = ", ".join(part for part in (
        f"attention.kv_block_size {tile}" if tile is not None else "",
        f"streambp.chunk_size {long_seq.streambp.chunk_size}" if small else "",
    ) if part)
    return (
        f"{found}: sizes tuned for CPU. On GPUs the measured best is the whole prefix per attention tile (leave "
        f"attention.kv_block_size unset) and StreamBP chunks of {GPU_CHUNK_TOKENS} tokens or more (the "
        "ds_configs/gpu*.json and multinode_*.json presets choose them: chunk_size 'auto' within a budget; "
        "ds_configs/README.md)"
    )


def set_learning_rate(ds_config: dict, lr: float | None) -> None:
    """Put ``lr`` (None: keep the config's) into the optimizer and a WarmupLR scheduler's peak."""
    if lr is not None:
        ds_config.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"]["lr"] = lr
        if ds_config.get("scheduler", {}).get("type") == "WarmupLR":
            ds_config["scheduler"]["params"]["warmup_max_lr"] = lr


def mean_over_ranks(values: dict[str, float], world: int) -> dict[str, float]:
    """Every value averaged over all ``world`` ranks (ranks of a sequence-parallel group hold the same one).

    One all-reduce of a float64 vector for the whole dict, in sorted key order on every rank.
    """
    import deepspeed.comm as dist

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: v / world for k, v in zip(keys, t.tolist(), strict=True)}


def to_rank_batch(
    batch: dict[str, torch.Tensor], device, sp_rank: int, sp_size: int, *, pad: bool = False, pad_token_id: int = 0,
    layout=None,
) -> dict[str, torch.Tensor]:
    """This rank's part of ``batch`` on ``device``: whole rows, or under sequence parallelism
    (``sp_size`` > 1) its 1/P shard of each row (:func:`~ds_longseq.engine.shard_batch`, labels shifted first).

    Args:
        batch: (B, T) tensors, the same on every rank of the sequence-parallel group.
        device: this rank's device.
        sp_rank, sp_size: this rank's place in its sequence-parallel group, and P.
        pad: --pad-for-sp: pad T on the right to a multiple of P (else T must divide).
        pad_token_id: the id the padding uses.
        layout: how the group holds the sequence: the model's ``ops.sp_layout.SPLayout`` (``engine.sp_layout_of``),
            or the model or engine itself; None: Ulysses alone (contiguous shards).
    """
    if sp_size > 1:
        batch = shard_batch(batch, sp_rank, sp_size, pad=pad, pad_token_id=pad_token_id, layout=layout)
    return {k: v.to(device) for k, v in batch.items()}
