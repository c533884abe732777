"""One entry point for full-training-step benchmarks: memory, speed and maximum length per method.

For each method at each sequence length, a fresh child process (``benchmarks.harness.spawn``) builds
the same model (same seed, same weights, same random tokens), runs ``--warmup`` full training steps
(forward, backward, optimizer step) and then ``--steps`` timed ones, and reports:
    peak memory: CPU: peak RSS minus the RSS after the model (and optimizer) are built (the peak counted
                 from there: ``harness.reset_peak_rss``, so a transient during the build does not hide growth);
                 GPU: ``max_memory_allocated`` and ``max_memory_reserved``, each minus its value after
                 build, and the host RSS growth (what offloading moves to the host);
    step time:   median of the timed steps; tokens/s = tokens per step / that median.
Then, per method, the longest sequence whose first training step fits (CPU: ``--budget-mib`` per
child, enforced with RLIMIT_AS; GPU: the device's memory): probes of explicit ``--search-lengths``
(the GPU suites' default: few, chosen lengths) or doubling + bisection over ``--search-range``. Only
running out of memory means "too long"; a probe that times out or crashes is recorded with its error
and ends that method's search (reporting the last length that fit and why it stopped), never the
suite. On GPU the timed points count as probes (same device, same step), and a method's longer
points are skipped once a shorter one ran out of memory.

``--time-budget-min``: no point starts once the budget is spent (a running child is cut at it); the
rest are recorded as "not run: time budget". The CSV, PNG and markdown are rewritten after every
point, so a killed run leaves usable partial results; ``--append`` merges runs of different
methods into one result file.

Holds: Suite and SUITES, the child's ``build_step`` / ``measure``, the parent's ``Runner`` (points,
searches, time budget, outputs), ``report_markdown`` and the CLI (``main``).

Suites (models and methods from ``benchmarks.recipes``):
    cpu:        Llama h512 / 4 layers / vocab 32000, float32, single process, torch AdamW.
                Methods: stock, hf_gc, alst, mst, streambp.
    gpu_full:   Qwen3-4B shape, bf16, full fine-tuning, DeepSpeed ZeRO-3 with CPU optimizer offload
                (DeepSpeedCPUAdam, compiled once before the points), 1 GPU.
    gpu_lora:   Llama-3-8B shape, frozen bf16 base + PEFT LoRA (rank 16, alpha 32, q/k/v/o/gate/up/down),
                torch AdamW on the adapters only, single process (no DeepSpeed engine).
                GPU methods: hf_gc, alst, alst_offload, mst, streambp, streambp_offload.
    smoke:      the gpu_full path (ZeRO-3 + optimizer offload, torch's AdamW behind it) with a tiny Qwen3,
                on CPU in seconds (what the test runs); on a GPU machine it runs there.
    smoke_lora: the gpu_lora path with a tiny Llama (needs peft).
    gpu_qlora:  gpu_lora on a 4-bit base (bitsandbytes nf4, double quantization, bf16 compute): QLoRA.
    smoke_qlora: the gpu_qlora path with a tiny Llama on CPU (needs peft and bitsandbytes).
    approx_cpu: the cpu suite's model and engine, lengths 1024-4096, each of stock, hf_gc, mst, streambp
                without and with ds_longseq's Approx-BP (``<m>_approx``: ReSiLU2 + MS-RMSNorm), plus
                streambp_2x / streambp_approx_2x (StreamBP chunk doubled). No max-length search unless --search.

Examples:
    python -m benchmarks.run --suite cpu --out benchmarks/results/cpu_suite
    python -m benchmarks.run --suite gpu_lora --time-budget-min 9 --out benchmarks/results/gpu_lora_h100
    python -m benchmarks.run --suite approx_cpu --no-search --out benchmarks/results/approx_cpu
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Literal

from benchmarks import harness
from benchmarks.recipes import (
    ALLOC_CONF,
    LLAMA3_8B,
    LLAMA_SMALL,
    LLAMA_TINY,
    LOSS_TOKENS_PER_CHUNK,
    QWEN3_4B,
    QWEN3_TINY,
    ModelShape,
    apply_lora,
    build_model,
    compute_loss,
    exact_counterpart,
    get_recipe,
    long_seq_config,
    prepare,
    quantize_4bit,
    random_tokens,
    step_context,
)

MODULE = "benchmarks.run"
GPU_METHODS = ("hf_gc", "alst", "alst_offload", "mst", "streambp", "streambp_offload", "streambp_auto",
               "streambp_auto_offload")


@dataclass(frozen=True)
class Suite:
    """What one suite runs: model, precision, training engine, lengths, methods and max-length search."""

    description: str
    shape: ModelShape
    dtype: str
    device: Literal["cpu", "auto"]  # auto: CUDA when the child sees a GPU, else CPU
    engine: Literal["torch", "deepspeed"]  # torch: one process, torch AdamW; deepspeed: ZeRO-3 + CPU optimizer
    seq_lens: tuple
    methods: tuple
    search_range: tuple = (1024, 65536)  # doubling from LO up to HI, then bisection to ``granularity``
    granularity: int = 1024
    search_lengths: tuple | None = None  # explicit probes instead of doubling + bisection
    budget_mib: float | None = None  # CPU memory budget per search child (None: the device is the budget)
    lora: bool = False
    quantize: bool = False  # QLoRA: the decoder's linears 4-bit (nf4, double quantization) under the LoRA adapter
    chunk_size: int = 1024  # StreamBP chunk and key-block tokens
    loss_chunk_size: int = LOSS_TOKENS_PER_CHUNK  # chunked LM head / ALST loss tile tokens
    # streambp.auto_budget_gib of the "auto" chunk methods (None: 80% of the free memory): on the GPU suites a target
    # that keeps the memory lead (issue 61 item 3): 10 GiB of one chunk's work is one 32K-token chunk of the 8B
    # shape by the analytic count (ModelDims.chunk_work_per_token, 1.3x the CPU-measured slope), four at 128K
    auto_budget_gib: float | None = None
    warmup: int = 1
    steps: int = 2
    timeout_s: float = 3600.0
    torch_adam: bool = False  # deepspeed engine: torch's AdamW behind the offload (no DeepSpeedCPUAdam build)
    lr: float = 1e-5
    search: bool = True  # run the max-length search unless --no-search (False: only with --search)


SUITES = {
    # Sized for a 2-core CI-class machine: the budget leaves ~500 MiB for activations after the
    # ~520 MiB of gradients and AdamW states, so every search ends below ~32K tokens.
    "cpu": Suite(
        "Full training steps on CPU, single process, torch AdamW.",
        LLAMA_SMALL,
        "float32",
        "cpu",
        "torch",
        (1024, 2048, 4096, 8192),
        ("stock", "hf_gc", "alst", "mst", "streambp"),
        search_range=(1024, 65536),
        granularity=8192,  # coarse: each probe near 32K tokens is a multi-minute CPU step
        budget_mib=1024.0,
    ),
    # 4B bf16 weights (8 GiB) and gradients stay on the GPU; fp32 master weights, Adam moments and
    # fp32 gradients (~64 GiB) live in pinned host memory, which fits a 128 GiB host.
    "gpu_full": Suite(
        "Full fine-tuning, DeepSpeed ZeRO-3 with CPU optimizer offload (DeepSpeedCPUAdam), 1 GPU.",
        QWEN3_4B,
        "bfloat16",
        "auto",
        "deepspeed",
        (8192, 16384, 32768, 65536),
        GPU_METHODS,
        search_lengths=(131072, 196608, 262144),
        chunk_size=4096,
        auto_budget_gib=10.0,
        timeout_s=540.0,  # under a 10-minute device command, with room to write the outputs
    ),
    "gpu_lora": Suite(
        "LoRA fine-tuning (PEFT, rank 16, alpha 32, q/k/v/o/gate/up/down), frozen bf16 base, torch AdamW "
        "on the adapters, single process.",
        LLAMA3_8B,
        "bfloat16",
        "auto",
        "torch",
        (8192, 16384, 32768, 65536),
        GPU_METHODS,
        search_lengths=(131072, 196608, 262144),
        lora=True,
        chunk_size=4096,
        auto_budget_gib=10.0,
        timeout_s=540.0,
        lr=1e-4,
    ),
    "smoke": Suite(
        "The gpu_full path (ZeRO-3 + optimizer offload) with a tiny model: seconds on CPU.",
        QWEN3_TINY,
        "float32",
        "auto",
        "deepspeed",
        (256, 512),
        GPU_METHODS,
        search_range=(128, 1024),
        granularity=128,
        budget_mib=512.0,
        chunk_size=128,
        loss_chunk_size=128,
        warmup=0,
        steps=1,
        timeout_s=600.0,
        torch_adam=True,  # DeepSpeedCPUAdam would first compile for ~2 minutes
    ),
    # Approx-BP on and off on every path, at the cpu suite's shape. The methods come in pairs (exact,
    # approx) so each pair differs only in long_seq.approx_bp; the 2x pair shows what a doubled
    # StreamBP chunk costs with and without it. Search: the cpu suite's budget, if asked for.
    "approx_cpu": Suite(
        "Full training steps on CPU, single process, torch AdamW: each method without and with Approx-BP "
        "(ReSiLU2 + MS-RMSNorm).",
        LLAMA_SMALL,
        "float32",
        "cpu",
        "torch",
        (1024, 2048, 4096),
        ("stock", "stock_approx", "hf_gc", "hf_gc_approx", "mst", "mst_approx", "streambp", "streambp_approx",
         "streambp_2x", "streambp_approx_2x"),
        search_range=(1024, 65536),
        granularity=8192,
        budget_mib=1024.0,
        search=False,  # 10 methods x minutes-long probes near 32K: ask for it with --search
    ),
    "smoke_lora": Suite(
        "The gpu_lora path (PEFT LoRA on a frozen base, torch AdamW) with a tiny model: seconds on CPU.",
        LLAMA_TINY,
        "float32",
        "auto",
        "torch",
        (256, 512),
        GPU_METHODS,
        search_range=(128, 1024),
        granularity=128,
        budget_mib=512.0,
        lora=True,
        chunk_size=128,
        loss_chunk_size=128,
        warmup=0,
        steps=1,
        timeout_s=600.0,
        lr=1e-4,
    ),
}
# QLoRA (issue 63): gpu_lora's and smoke_lora's model, adapter, engine and lengths on a 4-bit base, for the rows
# beside theirs
SUITES["gpu_qlora"] = dataclasses.replace(
    SUITES["gpu_lora"], quantize=True, search_lengths=(131072, 196608, 262144, 393216),
    description="QLoRA fine-tuning: gpu_lora's PEFT LoRA on the decoder's linears quantized 4-bit by bitsandbytes "
                "(nf4, double quantization, bf16 compute and storage), torch AdamW on the adapters, single process.")
SUITES["smoke_qlora"] = dataclasses.replace(
    SUITES["smoke_lora"], quantize=True,
    description="The gpu_qlora path (PEFT LoRA on a 4-bit base, torch AdamW) with a tiny Llama: seconds on CPU (needs "
                "peft and bitsandbytes).")


# ---------------------------------------------------------------------------------------------
# Child: build and measure one point
# ---------------------------------------------------------------------------------------------


def resolve_device(suite: Suite) -> str:
    import torch

    return "cuda" if suite.device == "auto" and torch.cuda.is_available() else "cpu"


def build_step(suite: Suite, method: str, seq_len: int, device: str, batch_size: int = 1) -> Callable[[], float]:
    """The model, recipe and optimizer of one point; returns a step (forward, backward, optimizer
    step on ``batch_size`` sequences) that returns the loss. ``step(label)`` runs each phase inside
    ``label("forward" | "backward" | "optimizer")`` (a context); ``step.model`` is the model."""
    import torch

    import ds_longseq

    recipe = get_recipe(method)
    cuda = device == "cuda"
    model = build_model(suite.shape, dtype=suite.dtype, device=device, seq_len=seq_len)
    if suite.quantize:
        quantize_4bit(model)
    if suite.lora:
        _, model = apply_lora(model)  # the recipe goes on the inner *ForCausalLM, which we call directly
    prepare(model, recipe, frozen_inputs=suite.lora)
    long_seq = long_seq_config(
        recipe, suite.shape, seq_len, chunk_size=suite.chunk_size, loss_chunk_size=suite.loss_chunk_size,
        auto_budget_gib=suite.auto_budget_gib
    )
    ids = random_tokens(suite.shape, seq_len, device, batch_size=batch_size)
    loss_kwargs = dict(loss_chunk_size=suite.loss_chunk_size, pin_memory=cuda)

    if suite.engine == "torch":
        if long_seq:
            ds_longseq.enable(model, long_seq)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=suite.lr)

        def step(label=_unlabelled):
            with step_context(recipe, pin_memory=cuda):
                with label("forward"):
                    loss = compute_loss(recipe, model, ids, **loss_kwargs)
                with label("backward"):
                    loss.backward()
            with label("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

        step.model = model
        return step

    import deepspeed

    import ds_longseq.engine

    for key, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(harness.free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
    ).items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", auto_mpi_discovery=False)
    ds_config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": suite.dtype == "bfloat16"},
        "optimizer": {"type": "AdamW", "params": {"lr": suite.lr, "torch_adam": suite.torch_adam}},
        "zero_force_ds_cpu_optimizer": not suite.torch_adam,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": cuda},
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "steps_per_print": 10**9,
        "long_seq": long_seq,
    }
    engine, *_ = ds_longseq.engine.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    def step(label=_unlabelled):
        with step_context(recipe, pin_memory=cuda):
            with label("forward"):
                loss = compute_loss(recipe, engine.module, ids, call=engine, **loss_kwargs)
            with label("backward"):
                engine.backward(loss)
        with label("optimizer"):
            engine.step()
        return float(loss.detach())

    step.model = engine.module
    return step


def _unlabelled(name: str):
    """No profiler range around a step's phase (``benchmarks.profile`` passes ``record_function``)."""
    return contextlib.nullcontext()


def measure(spec: dict) -> dict:
    """One point in this fresh process (``spec``: suite, method, seq_len, warmup, steps, budget_mib)."""
    import torch

    if spec.get("setup") == "cpu_adam":
        start = time.perf_counter()
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
        return {"step_s": time.perf_counter() - start}

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    suite = SUITES[spec["suite"]]
    device = resolve_device(suite)
    cuda = device == "cuda"
    batch_size = spec.get("batch_size", 1)
    step = build_step(suite, spec["method"], spec["seq_len"], device, batch_size)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    # The baseline is the RSS after the build, and the peak the steps' own: a transient during the build
    # (approx_bp's norm fold makes a temporary copy of each weight it folds, 62.5 MiB for this LM head)
    # would otherwise raise the cumulative peak that serves as baseline and hide part of the step's growth.
    base_rss = harness.rss_mib() if harness.reset_peak_rss() else harness.maxrss_mib()
    if spec.get("budget_mib") and not cuda:
        harness.set_address_space_budget(spec["budget_mib"])
    times, losses = [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        start = time.perf_counter()
        losses.append(step())
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[spec["warmup"] :])
    host = harness.maxrss_mib() - base_rss
    record = {"step_s": step_s, "tokens_per_s": batch_size * spec["seq_len"] / step_s, "loss": losses[-1],
              "losses": losses}
    if cuda:
        peak, reserved = harness.gpu_memory_above_baseline(
            base_allocated, base_reserved, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        )
        alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"
        record.update(peak_mib=peak, reserved_mib=reserved, host_peak_mib=host,
                      device=f"{torch.cuda.get_device_name()} (PYTORCH_CUDA_ALLOC_CONF={alloc})")
    else:
        record.update(peak_mib=host, device="cpu")
    if not all(math.isfinite(x) for x in losses):
        record["error"] = "non-finite loss"
    return record


# ---------------------------------------------------------------------------------------------
# Parent: points, searches, time budget, outputs
# ---------------------------------------------------------------------------------------------


def _round(value, digits=1):
    return "" if value is None else round(value, digits)


def record_row(suite_name: str, kind: str, r: dict, *, budget_mib=None, command="") -> dict:
    """A CSV row for one child's record."""
    ok = r.get("status") == "ok"
    return harness.new_row(
        suite=suite_name,
        kind=kind,
        method=r["method"],
        seq_len=r["seq_len"],
        status=r.get("status", "crash"),
        repeats=1 if ok else 0,
        peak_mib=_round(r.get("peak_mib")) if ok else "",
        reserved_mib=_round(r.get("reserved_mib")) if ok else "",
        host_peak_mib=_round(r.get("host_peak_mib")) if ok else "",
        step_s=_round(r.get("step_s"), 3) if ok else "",
        tokens_per_s=_round(r.get("tokens_per_s")) if ok else "",
        loss=_round(r.get("loss"), 5) if ok else "",
        budget_mib=budget_mib,
        device=r.get("device", ""),
        error=r.get("error", ""),
        command=command,
    )


class Runner:
    """Runs one suite's points and searches through fresh children, recording every outcome."""

    def __init__(self, suite_name: str, args, argv, rows=(), spawn=harness.spawn, clock=time.monotonic, log=print):
        self.suite_name, self.suite, self.args = suite_name, SUITES[suite_name], args
        self.command = "python -m benchmarks.run " + " ".join(argv)
        self.rows = list(rows)
        self.spawn, self.log = spawn, log
        self.budget = harness.TimeBudget(args.time_budget_min, clock=clock)
        self.timeout_s = args.timeout or self.suite.timeout_s
        self.points: dict[str, list[dict]] = {}  # this run's timed-point records per method

    # -- outputs
    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write()

    def write(self) -> None:
        """Rewrite the CSV, markdown and plot from every row so far."""
        if self.args.out:
            harness.write_outputs(
                self.rows,
                self.args.out,
                report_markdown(self.rows, self.suite_name),
                lambda path: harness.plot(
                    self.rows,
                    path,
                    f"benchmarks.run --suite {self.suite_name}: {self.suite.shape.describe()}, {self.suite.dtype}",
                    peak_label=_peak_label(self.rows),
                ),
            )

    def not_run(self, kind, method, seq_len, why, budget_mib=None):
        self.add(
            harness.new_row(
                suite=self.suite_name, kind=kind, method=method, seq_len=seq_len, status="not_run",
                budget_mib=budget_mib, error=why, command=self.command,
            )
        )

    # -- one child
    def child(self, method, seq_len, *, warmup, steps, budget_mib) -> dict | None:
        """One point in a fresh child; None when the time budget is spent (nothing started)."""
        if self.budget.spent():
            return None
        spec = dict(suite=self.suite_name, method=method, seq_len=seq_len, warmup=warmup, steps=steps,
                    budget_mib=budget_mib)
        # A fixed mmap threshold keeps glibc from serving big tensors from a heap whose freed pages stay in RSS.
        env = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
        # every method, on CUDA, with ALST's allocator setting (set before the child touches CUDA); a
        # user's own PYTORCH_CUDA_ALLOC_CONF wins, and the report names the one used
        env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
        (record,) = self.spawn(MODULE, spec, timeout_s=self.budget.timeout(self.timeout_s), env=env)
        if record.get("status") == "timeout" and self.budget.spent():
            record["error"] += " (cut at the time budget)"
        return record

    def unsupported(self, method) -> str | None:
        """Why ``method`` cannot run with this checkout, or None."""
        from benchmarks.recipes import offload_supported

        if get_recipe(method).offload_layer_inputs and not offload_supported():
            return "not run: this ds_longseq has no long_seq.offload section (OffloadConfig)"
        return None

    # -- the suite
    def setup(self) -> None:
        """Compile DeepSpeedCPUAdam once, so no point's timeout or time pays for it."""
        if self.suite.engine != "deepspeed" or self.suite.torch_adam or self.budget.spent():
            return
        self.log("building DeepSpeedCPUAdam (once; cached for the points)...")
        (r,) = self.spawn(MODULE, {"setup": "cpu_adam"}, timeout_s=self.budget.timeout(900.0))
        self.log(f"  {r['status']} {r.get('error', '')} ({r.get('step_s', 0):.0f} s)")
        self.add(harness.new_row(suite=self.suite_name, kind="setup", method="cpu_adam_build", status=r["status"],
                                 step_s=_round(r.get("step_s"), 1), error=r.get("error", ""), command=self.command))

    def run_points(self, methods, seq_lens, warmup, steps) -> None:
        from tqdm import tqdm

        oom_at: dict[str, int] = {}
        bar = tqdm([(s, m) for s in seq_lens for m in methods], desc=f"{self.suite_name} points", unit="pt")
        for seq_len, method in bar:
            bar.set_postfix_str(f"{method}@{seq_len}")
            why = self.unsupported(method)
            if why:
                self.not_run("step", method, seq_len, why)
                continue
            if method in oom_at and self.device_is_budget:
                self.not_run("step", method, seq_len, f"not run: oom at {oom_at[method]}")
                continue
            r = self.child(method, seq_len, warmup=warmup, steps=steps, budget_mib=None)
            if r is None:
                self.not_run("step", method, seq_len, harness.NOT_RUN_BUDGET)
                continue
            if r["status"] == "oom":
                oom_at.setdefault(method, seq_len)
            self.points.setdefault(method, []).append(r)
            self.log(_describe(method, seq_len, r))
            self.add(record_row(self.suite_name, "step", r, command=self.command))

    @property
    def device_is_budget(self) -> bool:
        """Whether the timed points ran under the search's memory limit (GPU suites: the device)."""
        return self.budget_mib is None

    @property
    def budget_mib(self):
        b = self.suite.budget_mib if self.args.budget_mib is None else self.args.budget_mib
        return b or None

    def run_search(self, method) -> None:
        why = self.unsupported(method)
        if why:
            self.not_run("max_len", method, "", why, self.budget_mib)
            return
        # The timed points ran one step or more under the same memory limit (the device): reuse them.
        known = self.points.get(method, []) if self.device_is_budget else []

        def probe(n):
            r = self.child(method, n, warmup=0, steps=1, budget_mib=self.budget_mib)
            if r is not None:
                self.log("  search " + _describe(method, n, r))
                self.add(record_row(self.suite_name, "probe", r, budget_mib=self.budget_mib, command=self.command))
            return r

        lo, hi = self.args.search_range or self.suite.search_range
        lengths = self.args.search_lengths
        if lengths is None and self.args.search_range is None:
            lengths = self.suite.search_lengths
        result = harness.search_max_len(
            probe, lo=lo, hi=hi, granularity=self.args.granularity or self.suite.granularity, lengths=lengths,
            known=known,
        )
        self.log(f"  {method}: longest that fit {result.best}; stopped: {result.stop}")
        self.add(
            harness.new_row(
                suite=self.suite_name, kind="max_len", method=method, seq_len=result.best, status=_status_of(result),
                budget_mib=self.budget_mib, error=result.stop, command=self.command,
            )
        )


def _status_of(result: harness.SearchResult) -> str:
    if result.best is not None:
        return "ok"
    head = result.stop.split(" ")[0]
    return {"time": "not_run"}.get(head, head if head in harness.STATUSES else "crash")


def _describe(method, seq_len, r) -> str:
    if r["status"] != "ok":
        return f"{method:>16} {seq_len:>7} {r['status']}: {r.get('error', '')}"
    reserved = f", reserved {r['reserved_mib']:.0f}" if r.get("reserved_mib") is not None else ""
    return (
        f"{method:>16} {seq_len:>7} peak {r['peak_mib']:.0f} MiB{reserved}, {r['step_s']:.2f} s/step, "
        f"{r['tokens_per_s']:.0f} tok/s, loss {r['loss']:.4f}"
    )


def _peak_label(rows) -> str:
    gpu = any(r["reserved_mib"] != "" for r in rows)
    return "peak allocated above post-build" if gpu else "peak RSS above post-build"


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def report_markdown(rows: list[dict], suite_name: str) -> str:
    suite = SUITES[suite_name]
    points = [r for r in rows if r["kind"] == "step"]
    searched = [r for r in rows if r["kind"] == "max_len"]
    methods = list(dict.fromkeys(r["method"] for r in points + searched))
    seq_lens = sorted({int(r["seq_len"]) for r in points})
    gpu = any(r["reserved_mib"] != "" for r in rows)
    devices = sorted({r["device"] for r in rows if r["device"]})
    out = [
        f"# benchmarks.run --suite {suite_name}",
        "",
        suite.description,
        "",
        f"Model: {suite.shape.describe()}, {suite.dtype}, random weights and tokens (the same for every method); "
        "batch 1; one step = forward + backward + optimizer step; a fresh process per point.",
        "",
    ]
    if gpu:
        out += ["## Peak allocated GPU memory above the post-build allocation (MiB)", ""]
        out += harness.grid_table(points, methods, seq_lens, "peak_mib", lambda x: f"{x:.0f}")
        out += ["", "## Peak reserved GPU memory above the post-build reservation (MiB)", ""]
        out += harness.grid_table(points, methods, seq_lens, "reserved_mib", lambda x: f"{x:.0f}")
        out += ["", "## Host memory: peak RSS above the post-build RSS (MiB)", ""]
        out += harness.grid_table(points, methods, seq_lens, "host_peak_mib", lambda x: f"{x:.0f}")
    else:
        out += ["## Peak memory above the post-build baseline (MiB)", ""]
        out += harness.grid_table(points, methods, seq_lens, "peak_mib", lambda x: f"{x:.0f}")
    out += ["", "## Step time (s, median of the timed steps)", ""]
    out += harness.grid_table(points, methods, seq_lens, "step_s", lambda x: f"{x:.2f}")
    out += ["", "## Tokens per second", ""]
    out += harness.grid_table(points, methods, seq_lens, "tokens_per_s", lambda x: f"{x:.0f}")
    pairs = [(exact_counterpart(m), m) for m in methods if exact_counterpart(m) in methods]
    if pairs:
        out += ["", "## Approx-BP against the same method without it", "",
                "Peak memory change, approx - exact (MiB, and % of the exact method's peak), and step time "
                "(approx / exact).", ""]
        out += approx_pairs_table(points, pairs, seq_lens, "peak_mib")
    if searched:
        budget = searched[0]["budget_mib"]
        out += [
            "",
            "## Maximum sequence length for one training step"
            + (f" within {budget} MiB per process (RLIMIT_AS)" if budget else " on this device"),
            "",
        ]
        out += harness.max_len_table(rows, methods)
        probes = harness.probes_table(rows)
        if probes:
            out += ["", "Probes (one training step each, in order):", ""] + probes
    setup = [r for r in rows if r["kind"] == "setup"]
    if setup:
        out += ["", "Setup: " + "; ".join(f"{r['method']} {r['status']} in {r['step_s']} s {r['error']}".rstrip()
                                         for r in setup) + "."]
    not_run = [r for r in rows if r["status"] == "not_run"]
    if not_run:
        out += ["", f"Not run: {len(not_run)} point(s), " + "; ".join(
            f"{r['method']}@{r['seq_len'] or 'search'}: {r['error']}" for r in not_run) + "."]
    out += [""] + harness.environment([r["command"] for r in rows], device=", ".join(devices) or None) + [""]
    return "\n".join(out)


def approx_pairs_table(points: list[dict], pairs: list[tuple[str, str]], seq_lens, peak_key: str) -> list[str]:
    """One row per length, one column per (exact, approx) pair: ``-saved MiB (-%) / time ratio``."""
    by = {(r["method"], int(r["seq_len"])): r for r in points if r["status"] == "ok"}
    lines = ["| seq_len | " + " | ".join(f"{a} vs {e}" for e, a in pairs) + " |", "|---:|" + "---:|" * len(pairs)]
    for s in seq_lens:
        cells = []
        for e, a in pairs:
            re, ra = by.get((e, s)), by.get((a, s))
            pe, pa = (harness.num(r[peak_key]) if r else None for r in (re, ra))
            te, ta = (harness.num(r["step_s"]) if r else None for r in (re, ra))
            if None in (pe, pa, te, ta) or not pe or not te:
                cells.append("")
                continue
            cells.append(f"{pa - pe:+.0f} MiB ({100 * (pa - pe) / pe:+.0f}%), time x{ta / te:.2f}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="cpu")
    p.add_argument("--methods", nargs="+", default=None, help="default: the suite's methods")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default: the suite's lengths")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: the suite's)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: the suite's)")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="CPU memory budget per child for the max-length search (default: the suite's)")
    p.add_argument("--no-search", action="store_true", help="skip the max-length search")
    p.add_argument("--search", action="store_true",
                   help="run the max-length search also for a suite that skips it by default (approx_cpu)")
    p.add_argument("--no-grid", action="store_true", help="only the max-length search")
    p.add_argument("--search-range", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="tokens: double from LO up to HI, then bisect to --granularity (default: the suite's)")
    p.add_argument("--granularity", type=int, default=None, help="bisection resolution in tokens")
    p.add_argument("--search-lengths", type=int, nargs="+", default=None, metavar="N",
                   help="probe exactly these lengths (ascending, stop at the first that does not fit) instead of "
                        "doubling + bisection; default: the suite's, if it has them")
    p.add_argument("--timeout", type=float, default=None, help="seconds per child (default: the suite's)")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="start no point after this many minutes (a running child is cut there); the rest are "
                        "recorded as 'not run: time budget'")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in <out>.csv that this run does not measure again "
                        "(e.g. one method per command)")
    p.add_argument("--out", default=None,
                   help="output prefix for .csv/.png/.md (default benchmarks/results/<suite>_suite)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None, spawn=harness.spawn, clock=time.monotonic):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args._child:
        return harness.child_main(measure, args._child)

    from pathlib import Path

    from tqdm import tqdm

    suite = SUITES[args.suite]
    methods = args.methods or list(suite.methods)
    for m in methods:
        get_recipe(m)  # an unknown name fails here, before any child starts
    seq_lens = args.seq_lens or list(suite.seq_lens)
    warmup = suite.warmup if args.warmup is None else args.warmup
    steps = suite.steps if args.steps is None else args.steps
    args.out = args.out or f"benchmarks/results/{args.suite}_suite"
    search = not args.no_search and (suite.search or args.search)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    kept = []
    if args.append:
        grid = not args.no_grid
        kept = harness.keep_rows(
            harness.read_csv(args.out + ".csv"),
            lambda r: r["suite"] != args.suite  # another suite's file: replace it
            or r["kind"] == "setup"
            or (grid and r["kind"] == "step" and r["method"] in methods and int(r["seq_len"]) in seq_lens)
            or (search and r["kind"] in ("probe", "max_len") and r["method"] in methods),
        )
    runner = Runner(args.suite, args, argv, rows=kept, spawn=spawn, clock=clock, log=tqdm.write)
    runner.setup()
    if not args.no_grid:
        runner.run_points(methods, seq_lens, warmup, steps)
    if search:
        for method in methods:
            runner.run_search(method)
    runner.write()  # also when nothing ran (e.g. --no-grid --no-search): the files reflect the CSV
    print(f"wrote {args.out}.csv, {args.out}.png, {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
