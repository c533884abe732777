"""One entry point for the speed, memory and maximum-length benchmarks.

For each method at each sequence length, a fresh child process builds the same model (same seed,
same weights, same random tokens), runs ``--warmup`` full training steps (forward, backward,
optimizer step) and then ``--steps`` timed ones, and reports:
    peak memory: CPU: peak RSS minus the RSS after the model (and optimizer) are built;
                 GPU: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` minus the
                 allocation after build;
    step time:   median of the timed steps; tokens/s = tokens per step / that median.
Then, per method, the longest sequence that completes one training step under a memory budget
(binary search over fresh children; CPU: ``--budget-mib`` enforced with RLIMIT_AS on each child,
GPU: the device's memory).

Suites:
    cpu:   Llama h512 / 4 layers / vocab 32000 (``benchmarks.memory.MODEL_SHAPE``), float32,
           single process, torch AdamW. Methods: stock, hf_gc, alst, mst, streambp.
    gpu:   a Llama-3-8B-shaped model with random weights (no download), bf16, DeepSpeed ZeRO-3 with
           CPU optimizer offload on 1 GPU, the same settings for every method. Methods add
           ``*_offload`` variants (saved activations offloaded to CPU with
           ``torch.autograd.graph.save_on_cpu``, as ALST's checkpoint offload).
    smoke: a tiny model through the same DeepSpeed ZeRO-3 + optimizer-offload path as ``gpu``,
           runnable on CPU in seconds (what the test runs).

Methods:
    stock:    plain Hugging Face model, SDPA attention.
    hf_gc:    HF gradient checkpointing (non-reentrant).
    alst:     hf_gc + DeepSpeed's ``TiledMLP`` + ``TiledFusedLogitsLoss`` (the ALST recipe on one rank).
    mst:      hf_gc + ds_longseq mini-sequence MLP + chunked LM head.
    streambp: ds_longseq StreamBP layers + chunked LM head (no checkpointing).

Examples:
    python -m benchmarks.run --suite cpu --out benchmarks/results/cpu_suite
    python -m benchmarks.run --suite gpu --out benchmarks/results/gpu_suite_h100
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.memory import (
    LOSS_TOKENS_PER_CHUNK,
    MODEL_SHAPE,
    _alst_loss,
    _alst_mlp_forward,
    _maxrss_mib,
    _set_budget,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
SEED = 0
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


@dataclass
class Suite:
    """What one suite runs: model, precision, training engine, lengths, methods and search range."""

    shape: dict
    dtype: str
    engine: str  # "torch" (single process, torch AdamW) or "deepspeed" (ZeRO-3 + CPU optimizer offload)
    seq_lens: tuple
    methods: tuple
    search_range: tuple  # (lo, hi) tokens for the max-length search
    granularity: int  # the search stops at this resolution
    budget_mib: float | None  # CPU budget per child for the search (None on GPU: the device is the budget)
    chunk_size: int = 1024
    warmup: int = 1
    steps: int = 2
    extra: dict = field(default_factory=dict)


SUITES = {
    # Sized for a 2-core CI-class machine: the budget leaves ~500 MiB for activations after the
    # ~520 MiB of gradients and AdamW states, so every search ends below ~32K tokens.
    "cpu": Suite(
        MODEL_SHAPE,
        "float32",
        "torch",
        (1024, 2048, 4096, 8192),
        ("stock", "hf_gc", "alst", "mst", "streambp"),
        (1024, 65536),
        8192,  # coarse: each probe near 32K tokens is a multi-minute CPU step
        1024.0,
    ),
    "gpu": Suite(
        LLAMA3_8B,
        "bfloat16",
        "deepspeed",
        (8192, 16384, 32768, 65536),
        ("hf_gc", "alst", "alst_offload", "mst", "streambp", "streambp_offload"),
        (8192, 1048576),
        4096,
        None,
        chunk_size=4096,
    ),
    # torch's AdamW behind the offload: DeepSpeedCPUAdam would first compile for ~2 minutes
    "smoke": Suite(
        TINY,
        "float32",
        "deepspeed",
        (256, 512),
        ("hf_gc", "alst", "mst", "streambp"),
        (128, 1024),
        128,
        512.0,
        chunk_size=128,
        warmup=0,
        steps=1,
        extra={"torch_adam": True},
    ),
}
CSV_COLUMNS = (
    "kind",
    "method",
    "seq_len",
    "peak_mib",
    "reserved_mib",
    "step_s",
    "tokens_per_s",
    "loss",
    "budget_mib",
    "error",
)


def _long_seq(method: str, suite: Suite, seq_len: int) -> dict:
    base = method.removesuffix("_offload")
    loss = {"enabled": True, "chunk_size": LOSS_TOKENS_PER_CHUNK}
    if base == "mst":
        # as many MLP chunks as ALST's TiledMLP tiles: ceil(T / hidden)
        num_chunks = max(1, math.ceil(seq_len / suite.shape["hidden_size"]))
        return {"mini_seq": {"enabled": True, "mlp_num_chunks": num_chunks}, "lm_head": loss}
    if base == "streambp":
        return {
            "streambp": {"enabled": True, "chunk_size": suite.chunk_size, "kv_block_size": suite.chunk_size},
            "lm_head": loss,
        }
    return {}


def _build(suite: Suite, method: str, seq_len: int):
    """(step function, is_cuda). The step runs forward, backward and the optimizer step, returns the loss."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ds_longseq

    base = method.removesuffix("_offload")
    if base not in ("stock", "hf_gc", "alst", "mst", "streambp"):
        raise ValueError(f"unknown method {method!r}")
    cuda = torch.cuda.is_available()
    dtype = getattr(torch, suite.dtype)
    torch.manual_seed(SEED)
    config = LlamaConfig(**suite.shape, max_position_embeddings=max(seq_len, 4096), attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(dtype)
    model.train()
    if base in ("hf_gc", "alst", "mst"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if base == "alst":
        import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401  (import before the baseline)

        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(_alst_mlp_forward, layer.mlp)
    long_seq = _long_seq(method, suite, seq_len)
    ids = torch.randint(0, suite.shape["vocab_size"], (1, seq_len), generator=torch.Generator().manual_seed(SEED + 1))
    offload = torch.autograd.graph.save_on_cpu(pin_memory=cuda) if method.endswith("_offload") else None

    if suite.engine == "torch":
        if long_seq:
            ds_longseq.enable(model, long_seq)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def forward_backward():
            loss = _alst_loss(model, ids, ids) if base == "alst" else model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss

        def step():
            with offload or contextlib.nullcontext():
                loss = forward_backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

        return step, cuda

    import deepspeed

    import ds_longseq.engine

    os.environ.update(
        {
            k: os.environ.get(k, v)
            for k, v in dict(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(29600 + os.getpid() % 1000),
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
            ).items()
        }
    )
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    ids = ids.to("cuda" if cuda else "cpu")
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": suite.dtype == "bfloat16"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-5, **({"torch_adam": True} if suite.extra.get("torch_adam") else {})},
        },
        "zero_force_ds_cpu_optimizer": not suite.extra.get("torch_adam", False),
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": cuda},
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "steps_per_print": 10**9,
        "long_seq": long_seq,
    }
    engine, *_ = ds_longseq.engine.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step():
        with offload or contextlib.nullcontext():
            if base == "alst":
                loss = _alst_loss(engine.module, ids, ids)
            else:
                loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
        engine.step()
        return float(loss.detach())

    return step, cuda


def run_child(suite_name: str, method: str, seq_len: int, budget_mib: float | None, warmup: int, steps: int) -> dict:
    """Measure in this (fresh) process; an out-of-memory step becomes ``ok: False, error: 'oom'``."""
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    suite = SUITES[suite_name]
    step, cuda = _build(suite, method, seq_len)
    record = {"method": method, "seq_len": seq_len}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_alloc = torch.cuda.memory_allocated()
    base_rss = _maxrss_mib()
    if budget_mib and not cuda:
        _set_budget(budget_mib)
    times, losses = [], []
    try:
        for _ in range(warmup + steps):
            start = time.perf_counter()
            losses.append(step())
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    except (MemoryError, torch.OutOfMemoryError) as err:
        return {**record, "ok": False, "error": f"oom: {type(err).__name__}"}
    except RuntimeError as err:  # CPU allocator failures under RLIMIT_AS are RuntimeErrors
        if "alloc" in str(err) or "out of memory" in str(err):
            return {**record, "ok": False, "error": "oom: " + str(err).splitlines()[0][:120]}
        raise
    timed = times[warmup:]
    step_s = statistics.median(timed)
    if cuda:
        peak = (torch.cuda.max_memory_allocated() - base_alloc) / 2**20
        reserved = torch.cuda.max_memory_reserved() / 2**20
    else:
        peak, reserved = _maxrss_mib() - base_rss, None
    return {
        **record,
        "ok": True,
        "peak_mib": peak,
        "reserved_mib": reserved,
        "step_s": step_s,
        "tokens_per_s": seq_len / step_s,
        "loss": losses[-1],
        "losses": losses,
    }


def spawn(suite_name, method, seq_len, budget_mib, warmup, steps, timeout_s) -> dict:
    """``run_child`` in a fresh interpreter; crashes and timeouts become ``ok: False`` records."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--_child",
        suite_name,
        method,
        str(seq_len),
        "--warmup",
        str(warmup),
        "--steps",
        str(steps),
    ]
    if budget_mib:
        cmd += ["--budget-mib", str(budget_mib)]
    # A fixed mmap threshold keeps glibc from serving big tensors from a heap whose freed pages stay in RSS.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    fail = {"method": method, "seq_len": seq_len, "ok": False}
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**fail, "error": f"timeout after {timeout_s:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    if proc.returncode < 0:
        return {**fail, "error": f"oom: killed by signal {-proc.returncode}"}
    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return {**fail, "error": tail[-1][:200] if tail else f"exit code {proc.returncode}"}


def search_max_len(
    suite_name: str, method: str, budget_mib, timeout_s, log, search_range=None, granularity=None
) -> tuple[int | None, list[dict]]:
    """Largest length (a multiple of the suite's granularity) whose first training step fits the budget.

    Doubles from the range's low end until a step fails or the high end passes, then bisects.
    Only out-of-memory failures count as "too long"; any other error stops the search and is reported.
    """
    suite = SUITES[suite_name]
    lo, hi = search_range or suite.search_range
    g = granularity or suite.granularity
    probes = []

    def fits(n):
        r = spawn(suite_name, method, n, budget_mib, 0, 1, timeout_s)
        probes.append(r)
        log(f"  search {method} @ {n}: " + ("ok" if r["ok"] else r["error"]))
        if not r["ok"] and not r["error"].startswith("oom"):
            raise RuntimeError(f"{method} @ {n}: {r['error']}")
        return r["ok"]

    if not fits(lo):
        return None, probes
    good, bad = lo, None
    while bad is None and good < hi:
        n = min(good * 2, hi)
        if fits(n):
            good = n
        else:
            bad = n
    if bad is None:
        return good, probes  # the whole range fits
    while bad - good > g:
        mid = (good + bad) // 2 // g * g
        if mid <= good:
            break
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, probes


def _row(kind, r, budget_mib=None):
    row = dict.fromkeys(CSV_COLUMNS, "")
    row.update(
        kind=kind,
        method=r["method"],
        seq_len=r["seq_len"],
        budget_mib=budget_mib or "",
        error="" if r.get("ok") else r.get("error", ""),
    )
    if r.get("ok"):
        row.update(
            peak_mib=round(r["peak_mib"], 1),
            reserved_mib="" if r.get("reserved_mib") is None else round(r["reserved_mib"], 1),
            step_s=round(r["step_s"], 3),
            tokens_per_s=round(r["tokens_per_s"], 1),
            loss=round(r["loss"], 5),
        )
    return row


def write_outputs(rows, suite_name, argv, out):
    with open(out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    measured = [r for r in rows if r["kind"] == "step"]
    searched = [r for r in rows if r["kind"] == "max_len"]
    methods = list(dict.fromkeys(r["method"] for r in measured + searched))
    seq_lens = sorted({r["seq_len"] for r in measured})
    _plot(measured, searched, methods, seq_lens, suite_name, out + ".png")
    Path(out + ".md").write_text(report_markdown(measured, searched, methods, seq_lens, suite_name, argv))


def _plot(measured, searched, methods, seq_lens, suite_name, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, ax, label in (("peak_mib", axes[0], "peak memory (MiB, log)"), ("step_s", axes[1], "step time (s, log)")):
        for m in methods:
            pts = [(r["seq_len"], r[key]) for r in measured if r["method"] == m and r[key] != ""]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if seq_lens:
            ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
        ax.set_xlabel("sequence length (tokens, batch 1)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if searched:
        names = [r["method"] for r in searched]
        vals = [r["seq_len"] if r["seq_len"] != "" else 0 for r in searched]
        axes[2].bar(names, vals, color="tab:green")
        for i, v in enumerate(vals):
            axes[2].text(i, v, f"{v:,}", ha="center", va="bottom", fontsize=8)
        budget = searched[0]["budget_mib"]
        axes[2].set_title("max length, one training step" + (f" within {budget} MiB" if budget else ""), fontsize=9)
        axes[2].set_ylabel("tokens")
    else:
        axes[2].set_visible(False)
    fig.suptitle(f"benchmarks.run --suite {suite_name}: {_shape_str(SUITES[suite_name])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shape_str(suite: Suite) -> str:
    s = suite.shape
    return (
        f"Llama h={s['hidden_size']} ffn={s['intermediate_size']} L={s['num_hidden_layers']} "
        f"heads={s['num_attention_heads']}/{s['num_key_value_heads']} vocab={s['vocab_size']}, {suite.dtype}, "
        + ("single process, torch AdamW" if suite.engine == "torch" else "DeepSpeed ZeRO-3 + CPU optimizer offload")
    )


def _versions() -> str:
    from importlib import metadata

    def v(pkg):
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return (
        f"torch {v('torch')}, transformers {v('transformers')}, deepspeed {v('deepspeed')}; device: {device}; "
        f"processor: {platform.processor() or platform.machine()}, cpu_count {os.cpu_count()}"
    )


def report_markdown(measured, searched, methods, seq_lens, suite_name, argv) -> str:
    by = {(r["method"], r["seq_len"]): r for r in measured}

    def table(key, fmt):
        lines = ["| seq_len | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
        for s in seq_lens:
            cells = []
            for m in methods:
                r = by.get((m, s))
                cells.append("" if r is None else (fmt(r[key]) if r[key] != "" else f"failed ({r['error'][:40]})"))
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        return lines

    suite = SUITES[suite_name]
    out = [
        f"# benchmarks.run --suite {suite_name}",
        "",
        f"Model: {_shape_str(suite)}; batch 1; one step = "
        "forward + backward + optimizer step; random weights and tokens, same for every method.",
        "",
        "## Peak memory above the post-build baseline (MiB)",
        "",
    ]
    out += table("peak_mib", lambda x: f"{x:.0f}")
    out += ["", "## Step time (s, median of the timed steps)", ""]
    out += table("step_s", lambda x: f"{x:.2f}")
    out += ["", "## Tokens per second", ""]
    out += table("tokens_per_s", lambda x: f"{x:.0f}")
    if searched:
        budget = searched[0]["budget_mib"]
        out += [
            "",
            "## Maximum sequence length for one training step"
            + (f" within {budget} MiB per process (RLIMIT_AS)" if budget else " on this device"),
            "",
            "| method | max seq_len |",
            "|---|---:|",
        ]
        out += [
            f"| {r['method']} | {r['seq_len'] if r['seq_len'] != '' else 'none: ' + r['error'][:60]} |"
            for r in searched
        ]
    out += ["", f"Command: `python -m benchmarks.run {' '.join(argv)}`", "", f"Versions: {_versions()}", ""]
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    p.add_argument("--methods", nargs="+", default=None, help="default: the suite's methods")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default: the suite's lengths")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: the suite's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: the suite's)")
    p.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="CPU memory budget per child for the max-length search (default: the suite's)",
    )
    p.add_argument("--no-search", action="store_true", help="skip the max-length search")
    p.add_argument("--no-grid", action="store_true", help="only the max-length search")
    p.add_argument(
        "--search-range",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="tokens: the search starts at LO and doubles up to HI (default: the suite's)",
    )
    p.add_argument("--granularity", type=int, default=None, help="search resolution in tokens (default: the suite's)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument(
        "--out", default=None, help="output prefix for .csv/.png/.md (default benchmarks/results/<suite>_suite)"
    )
    p.add_argument("--_child", nargs=3, metavar=("SUITE", "METHOD", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        suite_name, method, seq_len = args._child
        suite = SUITES[suite_name]
        warmup = suite.warmup if args.warmup is None else args.warmup
        steps = suite.steps if args.steps is None else args.steps
        print(json.dumps(run_child(suite_name, method, int(seq_len), args.budget_mib, warmup, steps)), flush=True)
        return 0

    from tqdm import tqdm

    suite = SUITES[args.suite]
    methods = args.methods or list(suite.methods)
    seq_lens = args.seq_lens or list(suite.seq_lens)
    warmup = suite.warmup if args.warmup is None else args.warmup
    steps = suite.steps if args.steps is None else args.steps
    budget = suite.budget_mib if args.budget_mib is None else args.budget_mib
    out = args.out or f"benchmarks/results/{args.suite}_suite"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    points = [] if args.no_grid else [(s, m) for s in seq_lens for m in methods]
    bar = tqdm(points, desc=f"{args.suite} suite", unit="pt")
    for seq_len, method in bar:
        bar.set_postfix_str(f"{method}@{seq_len}")
        r = spawn(args.suite, method, seq_len, None, warmup, steps, args.timeout)
        rows.append(_row("step", r))
        tqdm.write(
            f"{method:>16} {seq_len:>7} "
            + (
                f"peak {r['peak_mib']:.0f} MiB, {r['step_s']:.2f} s/step, "
                f"{r['tokens_per_s']:.0f} tok/s, loss {r['loss']:.4f}"
                if r["ok"]
                else "failed: " + r["error"]
            )
        )
        write_outputs(rows, args.suite, argv, out)
    if not args.no_search:
        for method in tqdm(methods, desc="max-length search", unit="method"):
            best, _ = search_max_len(
                args.suite,
                method,
                None if suite.engine == "deepspeed" and not budget else budget,
                args.timeout,
                tqdm.write,
                args.search_range,
                args.granularity,
            )
            row = dict.fromkeys(CSV_COLUMNS, "")
            row.update(
                kind="max_len",
                method=method,
                seq_len=best or "",
                budget_mib=budget or "",
                error="" if best else "the range's low end does not fit",
            )
            rows.append(row)
            write_outputs(rows, args.suite, argv, out)
    write_outputs(rows, args.suite, argv, out)
    print(f"wrote {out}.csv, {out}.png, {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
