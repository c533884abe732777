"""The search behind ``ds-longseq plan --write-config``: every setting that fits, ranked by a step-time model.

Built on the memory model (``plan_memory``); torch-free, as the whole planner. The command line is
``ds_longseq.plan``'s, which also re-exports these names.

Holds:
    Speeds / SPEEDS / StepTime / step_time: the step-time model (ASSUMED speeds: it ranks settings, it does not
        predict).
    Candidate / SETTINGS / SEARCHED_FIELDS / search: every setting of the searched ones for the launch, each with its
        estimate and step time, the fastest that fits with the held-out error as headroom first.
    explain: one line per setting of the chosen candidate saying why.
    written_config: the DeepSpeed config written from a candidate's settings over a base config.
    Written / choose_config / MAX_REFUSED: the fastest candidate whose written config the resolver accepts, or the
        nearest and what it needs.
"""

from __future__ import annotations

import copy
import itertools
import math
import typing
from dataclasses import dataclass, replace
from typing import Mapping

from ds_longseq.families.dims import ModelDims
from ds_longseq.ops.sp_layout import sp_degrees
from ds_longseq.plan_memory import (
    FITTED_CHUNK,
    GIB,
    HELD_OUT_ERROR,
    Estimate,
    Setup,
    estimate,
    longest_fit,
    sp_split,
    trainable_count,
)
from ds_longseq.resolver import Launch, RunShape, resolve

__all__ = [
    "Speeds",
    "SPEEDS",
    "StepTime",
    "step_time",
    "Candidate",
    "SETTINGS",
    "SEARCHED_FIELDS",
    "search",
    "explain",
    "written_config",
    "Written",
    "choose_config",
    "MAX_REFUSED",
]


@dataclass(frozen=True)
class Speeds:
    """What the step-time model assumes of the machine: ASSUMED round numbers, neither measured nor fitted. The model
    ranks settings against each other by what each adds (recompute, transfers, collectives); its seconds are not a
    prediction to hold a run to."""

    flops: float
    """Sustained training FLOP/s per device (GPU: 400 TFLOP/s, about 40% of an H100's dense bf16 peak)."""
    host_link: float
    """Bytes/s between one GPU and host memory (pinned copies over PCIe 4 x16)."""
    intra_node: float
    """Bytes/s per GPU in collectives within a node (NVLink)."""
    inter_node: float
    """Bytes/s per GPU in collectives across nodes (one 200 Gb/s NIC per GPU)."""
    disk: float
    """Bytes/s of one host's local disk, shared by its ranks (one NVMe drive)."""
    cpu_adam: float
    """Parameters/s one host's DeepSpeed CPU Adam updates."""
    chunk_overhead_tokens: int
    """A StreamBP chunk's fixed cost (kernel launches, the prefix's keys read again), in tokens of work."""


SPEEDS: dict[str, Speeds] = {
    "cuda": Speeds(flops=400e12, host_link=20e9, intra_node=150e9, inter_node=25e9, disk=2e9, cpu_adam=1e9,
                   chunk_overhead_tokens=256),
    "cpu": Speeds(flops=50e9, host_link=10e9, intra_node=5e9, inter_node=1e9, disk=1e9, cpu_adam=1e9,
                  chunk_overhead_tokens=64),
}


@dataclass(frozen=True)
class StepTime:
    """One step's seconds per rank by component (:func:`step_time`), and the sequences the step trains."""

    seconds: dict[str, float]
    samples: int

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def per_sample(self) -> float:
        """Seconds per trained sequence: what the search minimises (data-parallel replicas x micro-batch)."""
        return self.total / self.samples


def step_time(dims: ModelDims, setup: Setup, seq_len: int, speeds: Speeds | None = None) -> StepTime:
    """The step-time model: one step's seconds per rank, by component (ASSUMED ``speeds``, default ``SPEEDS``'
    for the setup's device; not checked against a measured step).

    compute: matmul FLOPs (2 per weight a token passes; causal attention 2 T x T_local x H x D per layer) of the
        forward, the backward (input gradients; weight gradients too unless LoRA), the recompute of each layer by
        the methods that keep layer inputs (without the attention when StreamBP keeps its output), the blocks
        ``keep_every`` rebuilds, and StreamBP's per-chunk overhead;
    offload: the layer inputs (and kept outputs) out in forward and back in backward, over the host link or the
        disk; overlapped with the compute, so only what exceeds it counts;
    sp_comm: the Ulysses all-to-alls (q, k, v in, the output back) and the ring's K/V passes (and their gradients'),
        in the forward, the recompute and the backward; not overlapped;
    zero_comm: the gradients' all-reduce (reduce-scatter under ZeRO-3) and the parameters' gathers (each forward,
        recompute and backward under ZeRO-3; the updated ones after the step under ZeRO-1/2); not overlapped;
    optimizer_offload: DeepSpeed's CPU Adam on this host's share, its gradients down and parameters up.
    """
    speeds = speeds or SPEEDS[setup.device]
    sp, b, k, layers = setup.sequence_parallel, setup.dtype_bytes, setup.keep_every, dims.num_layers
    u, r = sp_split(dims, setup)
    n = math.ceil(seq_len / sp) * setup.batch_size  # tokens per rank
    d, dh, q = dims.hidden_size, dims.head_dim, dims.num_heads * dims.head_dim
    layer_fwd = 2 * n * d * (2 * q + 2 * dims.num_kv_heads * dh + 3 * dims.token_mlp_width)
    attn_fwd = 2 * n * seq_len * q  # QK^T and PV over the causal half of the whole sequence, this rank's tokens
    head_fwd = 2 * n * d * dims.vocab_size
    frozen = setup.lora_rank is not None  # LoRA: no weight gradients of the base (the adapters' are negligible)
    recompute = setup.keeps_layer_inputs
    forward = layers * (layer_fwd + attn_fwd) + head_fwd
    backward = (layers * layer_fwd + head_fwd) * (1 if frozen else 2) + layers * 2.5 * attn_fwd  # flash: 5 vs 2
    again = layers * (layer_fwd + (0 if setup.keeps_attention_outputs else attn_fwd)) if recompute else 0
    rebuilt = layers * (k - 1) / k * (layer_fwd + attn_fwd)
    flops = forward + backward + again + rebuilt
    if setup.method == "streambp":
        chunk = setup.chunk_size or FITTED_CHUNK["cpu" if setup.device == "cpu" else "gpu"]
        flops *= 1 + speeds.chunk_overhead_tokens / min(chunk, n)
    compute = flops / speeds.flops

    kept = -(-layers // k) * n * (d * b + (dims.attention_output_bytes(b) if setup.keeps_attention_outputs else 0))
    offload = 0.0
    if setup.offload_layer_inputs and setup.keeps_layer_inputs:
        moved = 2 * kept  # out in the forward, back in the backward
        seconds = moved / speeds.host_link
        if setup.disk_layer_inputs:  # the node's ranks share its disk
            seconds = max(seconds, moved * setup.gpus_per_node / speeds.disk)
        offload = max(0.0, seconds - compute)

    passes = 1 + (1 if recompute else 0) + (k - 1) / k  # forward, recompute, rebuilt blocks
    sp_bytes = 0.0
    if u > 1:  # q, k, v (kv heads replicated up to u) in and the output back, and the same again in the backward
        exchanged = n * (q + 2 * max(dims.num_kv_heads, u) * dh + q) * b * (u - 1) / u
        sp_bytes += layers * exchanged * (passes + 1)
    if r > 1:  # the K/V shard passed r - 1 times a pass; the backward passes K/V and their gradients
        shard = n * max(dims.num_kv_heads, u) * dh * b
        sp_bytes += layers * 2 * (r - 1) * shard * (passes + 2)
    within = sp <= setup.gpus_per_node
    sp_comm = sp_bytes / (speeds.intra_node if within else speeds.inter_node)

    world, trainable = setup.gpus, trainable_count(dims, setup)
    zero_comm = 0.0
    if world > 1:
        f = (world - 1) / world
        if setup.zero_stage >= 3:
            zero_bytes = trainable * b * f + (passes + 1) * dims.num_params * b * f
        else:
            zero_bytes = 2 * trainable * b * f + (trainable * b * f if setup.zero_stage >= 1 else 0)
        zero_comm = zero_bytes / (speeds.inter_node if setup.nodes > 1 else speeds.intra_node)

    optimizer = 0.0
    if setup.offload_optimizer:
        share = trainable / (world if setup.zero_stage >= 1 else 1)
        optimizer = share * setup.gpus_per_node / speeds.cpu_adam + share * (4 + b) / speeds.host_link
    seconds = {"compute": compute, "offload": offload, "sp_comm": sp_comm, "zero_comm": zero_comm,
               "optimizer_offload": optimizer}
    return StepTime(seconds, (setup.gpus // sp) * setup.batch_size)


@dataclass(frozen=True)
class Candidate:
    """One searched setting: its setup, memory estimate and step time."""

    setup: Setup
    estimate: Estimate
    time: StepTime
    need: float
    """The estimate raised by the planner's held-out error over the memory, the larger of per GPU and per host:
    at most 1 fits with that error as headroom."""

    @property
    def fits(self) -> bool:
        return self.need <= 1


SETTINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("zero_optimization.stage", ("zero_stage",)),
    ("long_seq.sequence_parallel", ("sequence_parallel", "ring")),
    ("long_seq.streambp.chunk_size", ("chunk_size",)),
    ("long_seq.offload.layer_inputs", ("offload_layer_inputs", "disk_layer_inputs")),
    ("long_seq.offload.keep_every", ("keep_every",)),
    ("zero_optimization.offload_optimizer", ("offload_optimizer",)),
    ("long_seq.streambp.keep_attention_output", ("keep_attention_output",)),
)
"""The settings ``--write-config`` searches: the config key each is written to, and the ``Setup`` fields it sets."""
SEARCHED_FIELDS = frozenset(f for _, fields in SETTINGS for f in fields)


def _divisors(n: int) -> list[int]:
    return [i for i in range(1, n + 1) if n % i == 0]


def _rings(dims: ModelDims, sp: int) -> list[int]:
    """The ring degrees a sequence-parallel size of ``sp`` can run on this model (each leaves a Ulysses degree the
    heads fit)."""
    rings = []
    for r in _divisors(sp):
        try:
            sp_degrees(sp, dims.num_heads, r, dims.num_kv_heads)
        except ValueError:
            continue
        rings.append(r)
    return rings


def _search_space(dims: ModelDims, base: Setup, seq_len: int, disk: bool) -> typing.Iterator[Setup]:
    """Every combination of the searched settings for ``base``'s launch: ZeRO-2 (and 3 on more than one GPU), each
    SP size dividing the GPUs and the length with each ring
    split the heads allow, chunks of the fitted size down to an eighth of it, the layer inputs on the device, in host
    memory (GPU only: on CPU the host is the device) or on disk (with a disk path), keep_every 1, 2, 4, 8 and
    sqrt(L), the optimizer on the device or offloaded (GPU only), the attention outputs kept or not."""
    cuda = base.device == "cuda"
    fitted = FITTED_CHUNK["gpu" if cuda else "cpu"]
    stages = (2,) if base.gpus == 1 else (2, 3)
    tiers = [(False, False)] + ([(True, False)] if cuda else []) + ([(True, True)] if disk else [])
    layers = dims.num_layers
    keeps = sorted({k for k in (1, 2, 4, 8, round(math.sqrt(layers))) if 1 <= k <= layers})
    for sp in _divisors(base.gpus):
        if seq_len % sp:
            continue
        chunks = sorted({min(fitted >> i, seq_len // sp) for i in range(4)}, reverse=True)
        for ring, zero, chunk, (offload, on_disk), keep_every, opt, keep in itertools.product(
                _rings(dims, sp), stages, chunks, tiers, keeps, (False, True) if cuda else (False,), (True, False)):
            yield replace(base, method="streambp", zero_stage=zero, sequence_parallel=sp,
                          ring=ring if sp > 1 else None, chunk_size=chunk,
                          offload_layer_inputs=offload, disk_layer_inputs=on_disk, keep_every=keep_every,
                          offload_optimizer=opt, keep_attention_output=keep)


def _simplicity(setup: Setup) -> tuple:
    """Between settings equally fast by the model: fewer moving parts first."""
    return (setup.offload_layer_inputs + setup.disk_layer_inputs, setup.offload_optimizer, setup.keep_every,
            setup.zero_stage, setup.sequence_parallel, setup.ring or 1, -setup.chunk_size,
            not setup.keep_attention_output)


def search(dims: ModelDims, base: Setup, seq_len: int, device_bytes: float, host_bytes: float | None = None, *,
           disk: bool = False) -> list[Candidate]:
    """Every setting of :data:`SETTINGS` for ``base``'s launch (GPUs, nodes, LoRA, dtype, batch, 4-bit weights), with
    StreamBP: those that fit ``device_bytes`` per GPU and ``host_bytes`` per host with the planner's held-out error as
    headroom first, fastest per sequence by :func:`step_time` (ties: the simpler), then the rest, nearest first.
    ``disk``: the layer inputs may go to disk (the caller has a disk path)."""
    margin = 1 + HELD_OUT_ERROR["cpu" if base.device == "cpu" else "gpu"]
    out = []
    for setup in _search_space(dims, base, seq_len, disk):
        e = estimate(dims, setup, seq_len)
        need = max(e.device_total * margin / device_bytes, e.host_total * margin / host_bytes if host_bytes else 0)
        out.append(Candidate(setup, e, step_time(dims, setup, seq_len), need))
    return sorted(out, key=lambda c: (not c.fits, c.time.per_sample if c.fits else c.need, _simplicity(c.setup)))


def _value(name: str, dims: ModelDims, setup: Setup) -> str:
    """A searched setting's value as the written config says it."""
    match name:
        case "zero_optimization.stage":
            return str(setup.zero_stage)
        case "long_seq.sequence_parallel":
            u, r = sp_split(dims, setup)
            return f"size {setup.sequence_parallel}" + (f" (Ulysses {u} x ring {r})" if setup.sequence_parallel > 1
                                                        else " (off)")
        case "long_seq.streambp.chunk_size":
            return str(setup.chunk_size)
        case "long_seq.offload.layer_inputs":
            return "disk" if setup.disk_layer_inputs else "cpu" if setup.offload_layer_inputs else "unset (device)"
        case "long_seq.offload.keep_every":
            return str(setup.keep_every)
        case "zero_optimization.offload_optimizer":
            return "cpu" if setup.offload_optimizer else "unset (device)"
        case "long_seq.streambp.keep_attention_output":
            return "true" if setup.keep_attention_output else "false"
    raise ValueError(f"unknown setting {name!r}")


def _need_text(c: Candidate, device_bytes: float, host_bytes: float | None) -> str:
    """What ``c`` needs against the memory, with the held-out error added (the larger of per GPU and per host)."""
    margin = 1 + HELD_OUT_ERROR["cpu" if c.setup.device == "cpu" else "gpu"]
    where = "GPU" if c.setup.device == "cuda" else "process"
    device = f"{c.estimate.device_total * margin / GIB:.1f} GiB per {where} of {device_bytes / GIB:.1f}"
    if host_bytes and c.estimate.host_total * margin / host_bytes > c.estimate.device_total * margin / device_bytes:
        return f"{c.estimate.host_total * margin / GIB:.1f} GiB per host of {host_bytes / GIB:.1f}"
    return device


def explain(dims: ModelDims, best: Candidate, candidates: list[Candidate], device_bytes: float,
            host_bytes: float | None) -> list[str]:
    """One line per searched setting of ``best``: its value and why, against the values that differ from it in that
    setting alone (those that do not fit, with what they need; those that fit, how much slower and where)."""
    lines = []
    for name, fields in SETTINGS:
        rest = SEARCHED_FIELDS - set(fields)
        others = [c for c in candidates if c.setup != best.setup
                  and all(getattr(c.setup, f) == getattr(best.setup, f) for f in rest)]
        value = _value(name, dims, best.setup)
        if not others:
            lines.append(f"{name} = {value}: the only value this launch allows")
            continue
        notes = []
        for c in others[:4]:  # already ordered: fitting ones fastest first, then the nearest to fitting
            other = _value(name, dims, c.setup)
            if not c.fits:
                notes.append(f"{other} does not fit ({_need_text(c, device_bytes, host_bytes)})")
                continue
            slower = c.time.per_sample / best.time.per_sample - 1
            if slower < -5e-4:  # the search goes fastest first: a faster one was refused (choose_config)
                notes.append(f"{other} fits and is faster by the model, but the resolver refuses it")
                continue
            if slower < 5e-4:
                notes.append(f"{other} fits and is as fast by the model (the simpler is written)")
                continue
            why = max(c.time.seconds, key=lambda k: c.time.seconds[k] / c.time.samples
                      - best.time.seconds.get(k, 0.0) / best.time.samples)
            notes.append(f"{other} fits but is {slower:.1%} slower per sequence (more {why})")
        head = "fastest that fits" if any(c.fits for c in others) else "needed to fit"
        lines.append(f"{name} = {value}: {head}; " + "; ".join(notes))
    return lines


def written_config(base: Mapping, setup: Setup, disk_path: str | None = None) -> dict:
    """``base`` (a DeepSpeed config with its ``long_seq`` section, not modified) with the searched settings of
    ``setup`` written over it; keys the settings make wrong are dropped (ZeRO-3's under ZeRO-2, the automatic chunk's
    budget under a fixed chunk, DeepSpeed's own ``sequence_parallel_size``)."""
    config = copy.deepcopy(dict(base))
    config.pop("sequence_parallel_size", None)  # the long_seq section's size is the one written
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = setup.zero_stage
    if setup.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    else:
        zero.pop("offload_optimizer", None)
    if setup.zero_stage < 3:
        for key in [k for k in zero if k.startswith("stage3_") or k == "offload_param"]:
            del zero[key]
    long_seq = config.setdefault("long_seq", {})
    streambp = {k: v for k, v in (long_seq.get("streambp") or {}).items()
                if k not in ("auto_budget_gib", "auto_free_fraction")}
    long_seq["streambp"] = {**streambp, "enabled": True, "chunk_size": setup.chunk_size,
                            "keep_attention_output": bool(setup.keep_attention_output)}
    offload = {k: v for k, v in (long_seq.get("offload") or {}).items()
               if k not in ("layer_inputs", "keep_every", "disk_path")}
    if setup.offload_layer_inputs:
        offload["layer_inputs"] = "disk" if setup.disk_layer_inputs else "cpu"
    if setup.disk_layer_inputs:
        offload["disk_path"] = disk_path
    if setup.keep_every > 1:
        offload["keep_every"] = setup.keep_every
    long_seq.pop("offload", None)
    if offload:
        long_seq["offload"] = offload
    sp = {k: v for k, v in (long_seq.pop("sequence_parallel", None) or {}).items() if k not in ("size", "ring")}
    if setup.sequence_parallel > 1:
        long_seq["sequence_parallel"] = {**sp, "size": setup.sequence_parallel, "ring": setup.ring}
    return config


MAX_REFUSED = 64
"""Fitting settings the resolver may refuse before ``choose_config`` stops trying the next."""


@dataclass
class Written:
    """What ``--write-config`` found: the chosen candidate (None when nothing fits), the config written from it, the
    nearest candidate when nothing fits, and the lines that say why."""

    chosen: Candidate | None
    config: dict | None
    nearest: Candidate | None
    lines: list[str]


def choose_config(dims: ModelDims, base_config: Mapping, base: Setup, seq_len: int, device_bytes: float,
                  host_bytes: float | None = None, *, disk_path: str | None = None) -> Written:
    """The fastest setting that fits (:func:`search`) whose written config passes the resolver for ``base.gpus`` ranks
    at ``seq_len`` tokens, and one line per setting saying why; else the nearest and what it needs."""
    candidates = search(dims, base, seq_len, device_bytes, host_bytes, disk=disk_path is not None)
    refused = []
    for c in (c for c in candidates if c.fits):
        if len(refused) >= MAX_REFUSED:  # the resolver refuses them all for one reason: say it, not loop on
            break
        config = written_config(base_config, c.setup, disk_path)
        try:
            resolve(config, launch=Launch(world=base.gpus), run=RunShape(seq_len=seq_len))
        except ValueError as err:  # RunCannotStart: a rule the planner does not model; the next one
            refused.append(str(err).splitlines()[-1])
            continue
        margin = HELD_OUT_ERROR["cpu" if base.device == "cpu" else "gpu"]
        e, t = c.estimate, c.time
        lines = [
            f"searched {len(candidates):,} settings with StreamBP for {seq_len:,} tokens on {base.gpus} "
            f"{'GPU' if base.device == 'cuda' else 'rank'}(s), {sum(x.fits for x in candidates):,} fit with the "
            f"{margin:.0%} error as headroom; the fastest per sequence by the step-time model:",
            *(f"  {line}" for line in explain(dims, c, candidates, device_bytes, host_bytes)),
            f"predicted peak: {e.device_total / GIB:.2f} GiB per {'GPU' if base.device == 'cuda' else 'process'}, "
            f"{e.host_total / GIB:.2f} GiB per host (the memory model: within {margin:.0%} on held-out measurements)",
            f"predicted step: {t.total:.3g} s for {t.samples} sequence(s) ("
            + ", ".join(f"{k} {v:.3g}" for k, v in t.seconds.items() if v)
            + "; the step-time model's ASSUMED speeds rank the settings, they are not a measurement)",
            *([f"skipped {len(refused)} faster setting(s) the resolver refuses: {refused[0]}"] if refused else []),
        ]
        return Written(c, config, None, lines)
    nearest = min(candidates, key=lambda c: (c.need, _simplicity(c.setup)), default=None)
    if nearest is None:
        return Written(None, None, None, [f"no setting to search: no sequence-parallel size divides {seq_len:,} tokens "
                                          f"over {base.gpus} GPU(s)"])
    margin = 1 + HELD_OUT_ERROR["cpu" if base.device == "cpu" else "gpu"]
    longest = longest_fit(dims, nearest.setup, device_bytes / margin, host_bytes / margin if host_bytes else None)
    summary = ", ".join(f"{name} = {_value(name, dims, nearest.setup)}" for name, _ in SETTINGS)
    lines = [
        f"nothing fits {seq_len:,} tokens: of {len(candidates):,} settings searched the nearest ({summary}) needs "
        f"{_need_text(nearest, device_bytes, host_bytes)} (with the {margin - 1:.0%} error); "
        + (f"it fits up to {longest:,} tokens" if longest else "not even 1,024 tokens fit it")
        + (f"; refused by the resolver: {refused[0]}" if refused else "")]
    # the nearest launch that would: as many GPUs per node on more nodes (sequence parallelism over them)
    for factor in (2, 4, 8, 16, 32, 64):
        more = replace(base, gpus=base.gpus * factor, nodes=base.nodes * factor)
        found = next((c for c in search(dims, more, seq_len, device_bytes, host_bytes, disk=disk_path is not None)
                      if c.fits), None)
        if found is not None:
            what = ", ".join(f"{name} = {_value(name, dims, found.setup)}" for name, fields in SETTINGS
                             if any(getattr(found.setup, f) != getattr(nearest.setup, f) for f in fields))
            lines.append(f"it would fit on {more.gpus} GPUs ({more.nodes} nodes) of this memory, with "
                         f"{what or 'the same settings'}: plan again with --gpus {more.gpus} --nodes {more.nodes}")
            break
    else:
        lines.append("not even 64 times the GPUs would fit it: more memory per GPU or host, or a disk path "
                     "(--disk-path), or LoRA (--lora-rank)")
    return Written(None, None, nearest, lines)
