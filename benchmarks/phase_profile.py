"""Where one steady-state training step's device time goes: per ds_longseq phase, and by kernel class.

    python -m benchmarks.phase_profile --suite gpu_lora --method streambp_auto_offload --seq-len 65536 \\
        --out OUT_DIR/phase_65536

For one method and length, in a fresh child process (``benchmarks.harness.spawn``, the environment
``benchmarks.run`` gives its points): the step ``benchmarks.run.build_step`` builds, ``--warmup`` untimed steps,
then
    the phase step:    every ``ds_longseq.ops.phases.phase`` range (and benchmarks.run's step.forward /
                       step.backward / step.optimizer) timed with CUDA events recorded at its entry and exit on
                       the current stream, summed per name after one ``torch.cuda.synchronize()``; the host time
                       (``time.perf_counter``) of each range beside it. Phases nest (attention.* inside
                       streambp.forward / replay / grad, offload.wait inside streambp's backward, streambp.grad
                       around the replayed chunk's backward), and are reported as they are: the rows do not add up
                       to the step, the three step.* rows do. A range whose host side blocks (offload.wait waiting
                       for a copy) measures the stream's time between its two markers, stall included. The
                       step's tokens/s and peak memory (above the post-build values, as benchmarks.run) come
                       from this step and the warm-ups.
    the profiled step: one more step under ``torch.profiler`` with ``activities=[ProfilerActivity.CUDA]`` only,
                       aggregated by ``prof.key_averages()`` (no walk over the events in Python: what made
                       ``benchmarks/profile.py`` time out at 128K), into KERNEL_CLASSES: count and device time per
                       class, and the GPU idle share, 1 - (compute kernel time) / (the step's wall time by CUDA
                       events around it). Host <-> device copies run on the copy engines beside the compute, so
                       they get their own row and are left out of the busy time (counting them would hide the
                       overlap offloading is built for).
On the CPU (the smoke mode) the same code runs: the phase times are host times (``time.perf_counter``; there are
no CUDA events), and the mix is the CPU operator mix from ``key_averages()`` of a CPU-only profile (self CPU time
per operator; "idle" is then the host time outside any operator: Python and the framework). The output says which.

Outputs: ``<out>.json`` (the whole record), ``<out>.csv`` (one row per phase, kernel class and step total) and
``<out>.md``, written after the phase step and again after the profiled step, so a cut run keeps the first; and a
short table printed last.

Holds: PhaseTimer (the timing wrapper and its undoable patch of ``phase``), KERNEL_CLASSES, kernel_class,
kernel_mix, measure (the child), write_outputs, report_markdown and the CLI (``main``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks import harness

MODULE = "benchmarks.phase_profile"
STEP_PREFIX = "step."  # benchmarks.run's three parts of a step, through its ``label`` argument
KERNEL_CLASSES = ("attention", "GEMM", "elementwise/reduction", "other", "memcpy host<->device")
BUSY_CLASSES = KERNEL_CLASSES[:-1]  # the compute: what the idle share is measured against
IDLE = "idle"
CSV_COLUMNS = ("section", "name", "count", "device_ms", "host_ms", "share", "note")

# Kernel / operator names by class, matched in this order on the lower-cased name: attention before GEMM, since
# cuDNN's attention kernels carry "sm90" and "flash" in theirs. CUDA: FlashAttention ("flash"), cuDNN's SDPA
# ("cudnn", "sdpa"), the memory-efficient kernel ("efficient_attention", "fmha"); cuBLAS / CUTLASS GEMMs
# ("gemm", "nvjet" is cuBLAS's Hopper kernel family, "cutlass", "cublas", "sm90_xmma"). CPU: the aten
# operators of the same work (``aten::_scaled_dot_product_flash_attention_for_cpu``, ``aten::mm``).
_ATTENTION = ("flash", "cudnn", "sdpa", "efficient_attention", "fmha", "scaled_dot_product", "attention")
_GEMM = ("gemm", "nvjet", "cutlass", "cublas", "sm90_xmma", "gemv")
_CPU_GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_addmm")
_ELEMENTWISE = ("elementwise", "reduce", "reduction", "softmax", "norm", "catarray", "copy_kernel", "fill",
                "cross_entropy", "nll_loss", "scatter", "gather", "index", "silu", "rope", "adam", "foreach")
_HOST_COPY = ("memcpy htod", "memcpy dtoh", "memcpy ptod", "memcpy dtop")
# CPU operators that only make views or allocate: no arithmetic, so not "elementwise/reduction"
_CPU_NO_MATH = ("view", "reshape", "transpose", "permute", "expand", "as_strided", "empty", "slice", "select",
                "unsqueeze", "squeeze", "detach", "alias", "split", "chunk", "narrow", "resize_", "unbind", "t",
                "lift_fresh", "set_", "is_nonzero", "item", "_local_scalar_dense", "result_type")


def kernel_class(name: str, cuda: bool) -> str:
    """The KERNEL_CLASSES entry of one CUDA kernel / copy (``cuda``) or one CPU operator."""
    low = name.lower()
    if any(k in low for k in _HOST_COPY):
        return "memcpy host<->device"
    if any(k in low for k in _ATTENTION):
        return "attention"
    if any(k in low for k in _GEMM) or (not cuda and low.split(".")[0] in _CPU_GEMM):
        return "GEMM"
    if cuda:
        return "elementwise/reduction" if any(k in low for k in _ELEMENTWISE) else "other"
    if low.startswith("aten::"):
        op = low.removeprefix("aten::").split(".")[0]
        return "other" if op.lstrip("_") in _CPU_NO_MATH or op in _CPU_NO_MATH else "elementwise/reduction"
    return "other"  # the autograd engine's own nodes, optimizer glue


def kernel_mix(averages, cuda: bool, wall_ms: float) -> dict:
    """{class: {"count", "ms"}} over ``prof.key_averages()``, plus the idle row and the share of each.

    CUDA: device-side entries only (kernels, copies, memsets; the CUDA runtime calls the profiler records on the
    host are not device work), their self device time. CPU: every operator's self CPU time. Profiler ranges
    (ds_longseq's phases, record_function) are not work of their own and are skipped; on the CPU their self time
    is host time outside any operator, which lands in the idle row."""
    from torch.autograd import DeviceType

    from ds_longseq.ops.phases import PREFIX

    classes = {c: {"count": 0, "ms": 0.0} for c in KERNEL_CLASSES}
    for avg in averages:
        name = avg.key or ""
        if getattr(avg, "is_user_annotation", False) or name.startswith((PREFIX, STEP_PREFIX)):
            continue
        if cuda:
            if avg.device_type == DeviceType.CPU:
                continue
            us = avg.self_device_time_total
        else:
            us = avg.self_cpu_time_total
        if us <= 0:
            continue
        cell = classes[kernel_class(name, cuda)]
        cell["count"] += avg.count
        cell["ms"] += us / 1e3
    busy = sum(classes[c]["ms"] for c in BUSY_CLASSES)
    # Kernels on several streams (or operators on several host threads) can overlap: idle is then 0, not negative
    classes[IDLE] = {"count": "", "ms": max(0.0, wall_ms - busy)}
    for cell in classes.values():
        cell["share"] = cell["ms"] / wall_ms if wall_ms > 0 else 0.0
    return {"classes": classes, "wall_ms": wall_ms, "busy_ms": busy, "idle_share": classes[IDLE]["share"],
            "overlap": busy > wall_ms}


class PhaseTimer:
    """Times named ranges: CUDA events at entry and exit on the current stream (``cuda``), and host time.

    ``patched()`` swaps ``ds_longseq.ops.phases.phase`` (and every ds_longseq module's imported ``phase``) for
    one that opens the original profiler range and times it, and puts the originals back on exit. Ranges may be
    entered from the autograd engine's device thread (a CUDA backward): each range keeps its own events, so
    nothing here is shared across threads but the append to a list."""

    def __init__(self, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda
        self.spans: dict[str, list] = defaultdict(list)  # name -> [(start event, end event, host seconds)]

    def range(self, name: str):
        return _TimedRange(self, name)

    def patched(self):
        return _PhasePatch(self)

    def totals(self) -> dict[str, dict]:
        """{name: calls, device_ms (None on the CPU), host_ms}; synchronizes once first."""
        if self.cuda:
            self.torch.cuda.synchronize()
        out = {}
        for name, spans in self.spans.items():
            device = sum(s.elapsed_time(e) for s, e, _ in spans) if self.cuda else None
            out[name] = {"calls": len(spans), "device_ms": device, "host_ms": 1e3 * sum(h for _, _, h in spans)}
        return out


class _TimedRange:
    def __init__(self, timer: PhaseTimer, name: str, inner=None):
        self.timer, self.name, self.inner = timer, name, inner

    def __enter__(self):
        if self.inner is not None:
            self.inner.__enter__()
        self.start = self._event()
        self.host = time.perf_counter()
        return self

    def __exit__(self, *exc):
        host = time.perf_counter() - self.host
        self.timer.spans[self.name].append((self.start, self._event(), host))
        if self.inner is not None:
            return self.inner.__exit__(*exc)
        return False

    def _event(self):
        if not self.timer.cuda:
            return None
        event = self.timer.torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class _PhasePatch:
    def __init__(self, timer: PhaseTimer):
        self.timer, self.swapped = timer, []

    def __enter__(self):
        from ds_longseq.ops import phases

        original, timer = phases.phase, self.timer

        def timed_phase(name: str):
            return _TimedRange(timer, name, inner=original(name))  # the original checks the name

        # every module that did ``from ds_longseq.ops.phases import phase`` holds its own reference
        for module in [m for n, m in sys.modules.items() if n == "ds_longseq" or n.startswith("ds_longseq.")]:
            if getattr(module, "phase", None) is original:
                self.swapped.append((module, original))
                module.phase = timed_phase
        return timer

    def __exit__(self, *exc):
        for module, original in self.swapped:
            module.phase = original
        self.swapped.clear()
        return False


def _sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def _timed_step(step, cuda: bool, label=None) -> tuple[float, float | None]:
    """(host wall seconds with a final synchronize, as benchmarks.run times a step; device ms by CUDA events)."""
    import torch

    start = end = None
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    step() if label is None else step(label)
    if cuda:
        end.record()
    _sync(cuda)
    return time.perf_counter() - t0, (start.elapsed_time(end) if cuda else None)


def measure(spec: dict) -> dict:
    """One point in this fresh child (``spec``: suite, method, seq_len, warmup, out)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.run import SUITES, build_step, resolve_device
    from ds_longseq.ops.phases import PHASES

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    suite = SUITES[spec["suite"]]
    device = resolve_device(suite)
    cuda = device == "cuda"
    step = build_step(suite, spec["method"], spec["seq_len"], device)
    _sync(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_allocated, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    base_rss = harness.rss_mib() if harness.reset_peak_rss() else harness.maxrss_mib()
    warmup_s = [_timed_step(step, cuda)[0] for _ in range(spec["warmup"])]

    timer = PhaseTimer(cuda)
    with timer.patched():
        step_s, step_device_ms = _timed_step(step, cuda, label=lambda name: timer.range(STEP_PREFIX + name))
    record = {
        "suite": spec["suite"], "method": spec["method"], "seq_len": spec["seq_len"], "warmup": spec["warmup"],
        "steps": 1, "cuda": cuda, "timing": "device (CUDA events)" if cuda else "host (time.perf_counter)",
        "warmup_s": warmup_s, "step_s": step_s, "step_device_ms": step_device_ms,
        "tokens_per_s": spec["seq_len"] / step_s, "host_peak_mib": harness.maxrss_mib() - base_rss,
        "phases": timer.totals(), "phase_notes": {k: v for k, v in PHASES.items()},
    }
    if cuda:
        peak, reserved = harness.gpu_memory_above_baseline(
            base_allocated, base_reserved, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        )
        alloc = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default"
        record.update(peak_mib=peak, reserved_mib=reserved,
                      device=f"{torch.cuda.get_device_name()} (PYTORCH_CUDA_ALLOC_CONF={alloc})")
    else:
        record.update(peak_mib=record["host_peak_mib"], reserved_mib=None, device="cpu")
    if spec.get("out"):
        write_outputs(record, spec["out"])  # the phase table survives a cut profiled step

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        profiled_s, profiled_device_ms = _timed_step(step, cuda)
    start = time.perf_counter()
    averages = prof.key_averages()
    wall_ms = profiled_device_ms if cuda else 1e3 * profiled_s
    record["kernel_mix"] = kernel_mix(averages, cuda, wall_ms)
    record["kernel_mix"].update(profiled_step_s=profiled_s, aggregate_s=time.perf_counter() - start,
                                source="CUDA kernels and copies (device time)" if cuda
                                else "CPU operators (self CPU time)")
    if spec.get("out"):
        write_outputs(record, spec["out"])
    return record


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def _ms(x) -> str:
    return "" if x is None or x == "" else f"{x:.1f}"


def _phase_rows(record: dict) -> list[dict]:
    """CSV rows: the step total, benchmarks.run's step.* parts, then ds_longseq's phases by time."""
    cuda = record["cuda"]
    step_ms = record["step_device_ms"] if cuda else 1e3 * record["step_s"]
    key = "device_ms" if cuda else "host_ms"
    rows = [dict(section="step", name="step (phase-timed)", count=1, device_ms=record["step_device_ms"],
                 host_ms=1e3 * record["step_s"], share=1.0, note=f"{record['timing']}; the whole step")]
    phases = record["phases"]
    parts = [n for n in phases if n.startswith(STEP_PREFIX)]
    ours = sorted((n for n in phases if not n.startswith(STEP_PREFIX)), key=lambda n: -phases[n][key])
    for name in parts + ours:
        p = phases[name]
        note = "benchmarks.run's part of the step" if name in parts else record["phase_notes"].get(name, "")
        rows.append(dict(section="step part" if name in parts else "phase", name=name, count=p["calls"],
                         device_ms=p["device_ms"], host_ms=p["host_ms"], share=p[key] / step_ms if step_ms else 0.0,
                         note=note))
    return rows


def _mix_rows(record: dict) -> list[dict]:
    mix = record.get("kernel_mix")
    if not mix:
        return []
    rows = []
    cuda = record["cuda"]
    for name, cell in mix["classes"].items():
        note = ""
        if name == IDLE:
            note = "no kernel running" if cuda else "host time outside any operator (Python, the framework)"
        elif name == "memcpy host<->device" and cuda:
            note = "copy engines, beside the compute: not in the busy sum"
        rows.append(dict(section="kernel mix", name=name, count=cell["count"],
                         device_ms=cell["ms"] if cuda else "", host_ms="" if cuda else cell["ms"],
                         share=cell["share"], note=note))
    rows.append(dict(section="kernel mix", name="profiled step", count="",
                     device_ms=mix["wall_ms"] if cuda else "", host_ms=1e3 * mix["profiled_step_s"], share=1.0,
                     note=f"{mix['source']}; the busy classes and idle add up to it"
                          + ("; kernels overlapped (busy > wall)" if mix["overlap"] else "")))
    return rows


def report_markdown(record: dict) -> str:
    cuda = record["cuda"]
    unit = "device ms (CUDA events)" if cuda else "host ms (time.perf_counter: no CUDA events on the CPU)"
    warm = ", ".join(f"{s:.2f}" for s in record["warmup_s"]) or "none"
    lines = [
        f"# Phase profile: {record['method']}, {record['seq_len']} tokens, suite {record['suite']}", "",
        f"Device: {record['device']}. Steady state: {record['warmup']} warm-up step(s) ({warm} s) before the "
        f"phase-timed step ({record['step_s']:.3f} s, {record['tokens_per_s']:.0f} tokens/s).", "",
        f"## Phases ({unit})", "",
        "Phases nest (attention.* inside streambp.*, offload.wait inside streambp's backward): they are reported as "
        "they are and do not add up to the step; the step.* rows (benchmarks.run's forward / backward / optimizer) "
        "do. Share: of the phase-timed step.", "",
        "| phase | calls | device ms | host ms | share of step | covers |", "|---|---:|---:|---:|---:|---|",
    ]
    for r in _phase_rows(record):
        lines.append(f"| {r['name']} | {r['count']} | {_ms(r['device_ms'])} | {_ms(r['host_ms'])} | "
                     f"{r['share']:.1%} | {r['note']} |")
    mix = record.get("kernel_mix")
    if mix:
        title = "Kernel mix (CUDA kernels, device time)" if cuda else "Operator mix (CPU operators, self CPU time)"
        lines += ["", f"## {title} of one profiled step", "",
                  f"`torch.profiler` with {'CUDA' if cuda else 'CPU'} activity only, aggregated by "
                  f"`key_averages()` in {mix['aggregate_s']:.1f} s. Idle share: {mix['idle_share']:.1%} "
                  f"({'the GPU ran no compute kernel' if cuda else 'host time outside any operator'}).", "",
                  "| class | count | ms | share of step | note |", "|---|---:|---:|---:|---|"]
        for r in _mix_rows(record):
            ms = r["device_ms"] if cuda else r["host_ms"]
            lines.append(f"| {r['name']} | {r['count']} | {_ms(ms)} | {r['share']:.1%} | {r['note']} |")
    else:
        lines += ["", "Kernel mix: not measured (the profiled step did not finish)."]
    return "\n".join(lines) + "\n"


def write_outputs(record: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(record, f, indent=1)
    with open(out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in _phase_rows(record) + _mix_rows(record):
            writer.writerow({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    with open(out + ".md", "w") as f:
        f.write(report_markdown(record))


def short_table(record: dict) -> str:
    """The printed summary: the step, the five longest phases, the kernel mix."""
    cuda = record["cuda"]
    key = "device_ms" if cuda else "host_ms"
    rows = [r for r in _phase_rows(record) if r["section"] == "phase"][:5]
    lines = [f"{record['method']} @ {record['seq_len']}: {record['tokens_per_s']:.0f} tokens/s, "
             f"step {record['step_s']:.3f} s ({record['timing']})"]
    lines += [f"  {r['name']:<20} {r['count']:>6} calls {r[key]:>10.1f} ms {r['share']:>7.1%}" for r in rows]
    for r in _mix_rows(record):
        ms = r["device_ms"] if cuda else r["host_ms"]
        lines.append(f"  [{r['name']:<22}] {str(r['count']):>7} {ms:>10.1f} ms {r['share']:>7.1%}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="gpu_lora", help="a suite of benchmarks.run (model, dtype, chunk sizes)")
    p.add_argument("--method", default="streambp_auto_offload")
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=170.0, help="the child's limit (its files are kept)")
    p.add_argument("--out", default=None, help="output prefix (.json, .csv, .md); required")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None, spawn=harness.spawn) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args._child:
        return harness.child_main(measure, args._child)
    if not args.out:
        raise SystemExit("phase_profile: --out PREFIX is required (the files are written as the child goes)")
    from benchmarks.recipes import ALLOC_CONF, get_recipe

    get_recipe(args.method)  # an unknown name fails here, before the child starts
    spec = {"suite": args.suite, "method": args.method, "seq_len": args.seq_len, "warmup": args.warmup,
            "out": os.path.abspath(args.out)}
    # the environment benchmarks.run's points run in (its Runner.child): the same allocator for every method
    env = {"MALLOC_MMAP_THRESHOLD_": "1048576",
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)}
    start = time.monotonic()
    (record,) = spawn(MODULE, spec, timeout_s=args.timeout_s, env=env)
    took = time.monotonic() - start
    if record.get("status") != "ok":
        print(f"phase profile {args.method} @ {args.seq_len}: {record.get('status')}: {record.get('error', '')} "
              f"after {took:.0f} s" + (f" (what it wrote: {args.out}.md)" if Path(args.out + ".md").exists() else ""))
        return 1
    print(f"wrote {args.out}.json, {args.out}.csv, {args.out}.md in {took:.0f} s "
          f"(warm-up steps {statistics.fmean(record['warmup_s']) if record['warmup_s'] else 0:.2f} s)")
    print(short_table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
