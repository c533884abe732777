"""The disk tier (``long_seq.offload.layer_inputs: "disk"``) against keeping the layer inputs in memory, on CPU.

    python -m benchmarks.disk_tier --seq-lens 16384 32768 --hidden 128 --disk-path /var/tmp \
        --out benchmarks/results/disk_tier_cpu

StreamBP on benchmarks.recipes.LLAMA_SMALL's Llama with 8 layers instead of 4 (the layer inputs weigh more against
the chunk's work space) and ``--hidden`` wide (heads of 64; 128 keeps a 32K step near 7 minutes on 2 cores: attention
costs T^2 x d, the layer inputs' I/O T x d, so their ratio does not depend on d), float32, chunks of 1024 tokens, one
sequence per step; each (length, method) in a fresh process, side by side in one run: one warm-up step, then
``--steps`` timed steps. Methods:

    memory   the layer inputs stay in memory (on a CPU model that is the "device")
    disk     layer_inputs="disk" under --disk-path (DeepSpeed's async I/O, O_DIRECT)

Reported per run: step time (median), the step's peak RSS above the RSS before it (``/proc/self/clear_refs``
reset before each timed step; children run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed blocks leave RSS),
the page cache's growth over the timed steps (``Cached`` in /proc/meminfo: O_DIRECT should leave it flat), bytes
written and read per step and the I/O thread's throughput (bytes over the thread's busy time, copies included).
The table then compares: "above the chunk" = disk's peak minus (memory's peak minus the L
layer inputs memory keeps), in layer inputs (L x T x d x 4 bytes / L): the target is at most one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks import harness

MIB = 1024**2
METHODS = ("memory", "disk")


def _cached_mib() -> float:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def shape(hidden: int = 512):
    from benchmarks.recipes import LLAMA_SMALL

    return dataclasses.replace(LLAMA_SMALL, name=f"llama-h{hidden}-8l", num_hidden_layers=8, hidden_size=hidden,
                               intermediate_size=LLAMA_SMALL.intermediate_size * hidden // LLAMA_SMALL.hidden_size,
                               num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)


def measure(seq_len: int, method: str, disk_path: str, steps: int, hidden: int = 512) -> dict:
    """One (length, method) in this process: the numbers the module docstring lists."""
    import ds_longseq
    from benchmarks.recipes import build_model, random_tokens

    torch.set_num_threads(2)
    s = shape(hidden)
    model = build_model(s, dtype="float32", device="cpu", seq_len=seq_len)
    cfg = {"streambp": {"enabled": True, "chunk_size": 1024}, "lm_head": {"enabled": True, "chunk_size": 1024}}
    if method == "disk":
        cfg["offload"] = {"layer_inputs": "disk", "disk_path": disk_path}
    ds_longseq.enable(model, cfg)
    store = None
    if method == "disk":
        from ds_longseq.forwards.layer_input_offload import LayerInputOffload

        (store,) = [h.__self__.store for h in model.model._forward_pre_hooks.values()
                    if isinstance(getattr(h, "__self__", None), LayerInputOffload)]
    ids = random_tokens(s, seq_len)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: first-touch allocations, the staging buffers
    times, peaks = [], []
    cached0 = _cached_mib()
    written0 = store.stats.bytes_written if store else 0
    busy0 = (store.stats.write_seconds, store.stats.read_seconds) if store else (0.0, 0.0)
    for _ in range(steps):
        harness.reset_peak_rss()
        base = harness.rss_mib()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        peaks.append(harness.maxrss_mib() - base)
    row = {"seq_len": seq_len, "method": method, "step_s": statistics.median(times), "peak_mib": max(peaks),
           "page_cache_growth_mib": _cached_mib() - cached0,
           "inputs_mib": s.num_hidden_layers * seq_len * s.hidden_size * 4 / MIB}
    if store is not None:
        written = (store.stats.bytes_written - written0) / steps
        w_s = (store.stats.write_seconds - busy0[0]) / steps
        r_s = (store.stats.read_seconds - busy0[1]) / steps
        row.update(disk_mib_per_step=written / MIB, write_gb_s=written / w_s / 1e9 if w_s else 0.0,
                   read_gb_s=written / r_s / 1e9 if r_s else 0.0, io_thread_s=w_s + r_s)
        ds_longseq.disable(model)
    return row


def paired(seq_len: int, disk_path: str, steps: int, hidden: int) -> dict:
    """Step times of both methods in ONE process, alternating (memory, disk, then disk, memory, ...) after one
    warm-up step each: a slow patch of a shared machine then hits both alike (fresh processes one after the other
    moved the ratio from 0.98x to 1.24x at 16K between two runs here). No memory numbers (the process holds both)."""
    import ds_longseq
    from benchmarks.recipes import build_model, random_tokens

    torch.set_num_threads(2)
    s = shape(hidden)
    models = {}
    for method in METHODS:
        model = build_model(s, dtype="float32", device="cpu", seq_len=seq_len)
        cfg = {"streambp": {"enabled": True, "chunk_size": 1024}, "lm_head": {"enabled": True, "chunk_size": 1024}}
        if method == "disk":
            cfg["offload"] = {"layer_inputs": "disk", "disk_path": disk_path}
        models[method] = ds_longseq.enable(model, cfg)
    ids = random_tokens(s, seq_len)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for rep in range(steps + 1):
        order = METHODS if rep % 2 == 0 else tuple(reversed(METHODS))
        for method in order:
            t0 = time.perf_counter()
            models[method](input_ids=ids, labels=ids).loss.backward()
            models[method].zero_grad(set_to_none=True)
            if rep:
                times[method].append(time.perf_counter() - t0)
    ratio = statistics.median(times["disk"]) / statistics.median(times["memory"])
    return {"seq_len": seq_len, "paired_steps": steps, "times": times, "median_ratio": ratio}


def run_child(seq_len: int, method: str, disk_path: str, steps: int, hidden: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.disk_tier", "--child", str(seq_len), method, "--disk-path", disk_path,
           "--steps", str(steps), "--hidden", str(hidden)]
    # large blocks mmapped and returned at free: RSS then follows live memory instead of keeping what an earlier
    # step freed (which would hide part of a later step's peak)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(64 << 10))
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(rows: list[dict], command: str, hidden: int) -> str:
    s = shape(hidden)
    lines = [f"# The disk tier against layer inputs in memory: {s.describe()}, fp32, StreamBP chunks of 1024, CPU",
             "", "| T | method | step s | vs memory | peak MiB | layer inputs MiB (all L) | above the chunk, in inputs "
             "| page cache growth MiB | disk MiB / step | write GB/s | read GB/s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["seq_len"], r["method"]): r for r in rows}
    for (t, method), r in sorted(by.items()):
        mem = by.get((t, "memory"))
        ratio = r["step_s"] / mem["step_s"] if mem else float("nan")
        one_input = r["inputs_mib"] / s.num_hidden_layers
        above = ""
        if method == "disk" and mem:
            chunk = mem["peak_mib"] - mem["inputs_mib"]  # what memory holds besides its L inputs
            above = f"{(r['peak_mib'] - chunk) / one_input:.2f}"
        io = (f"{r['disk_mib_per_step']:.0f} | {r['write_gb_s']:.2f} | {r['read_gb_s']:.2f}" if method == "disk"
              else "- | - | -")
        lines.append(f"| {t} | {method} | {r['step_s']:.2f} | {ratio:.2f}x | {r['peak_mib']:.0f} | "
                     f"{r['inputs_mib']:.0f} | {above} | {r['page_cache_growth_mib']:.0f} | {io} |")
    lines += ["", *harness.environment([command]), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768])
    p.add_argument("--disk-path", default="/var/tmp", help="a directory on a local disk (not tmpfs)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 64)")
    p.add_argument("--out", default=None, help="write <out>.md and <out>.jsonl")
    p.add_argument("--paired", action="store_true",
                   help="step times only, both methods alternating in one process (see paired())")
    p.add_argument("--child", nargs=2, metavar=("SEQ_LEN", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(int(args.child[0]), args.child[1], args.disk_path, args.steps, args.hidden)))
        return 0
    os.makedirs(args.disk_path, exist_ok=True)
    command = "python -m benchmarks.disk_tier " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.paired:
        rows = [paired(t, args.disk_path, args.steps, args.hidden) for t in args.seq_lens]
        title = ("# The disk tier against layer inputs in memory, paired in one process: "
                 f"{shape(args.hidden).describe()}")
        lines = [f"{title}, fp32, StreamBP chunks of 1024, CPU", "",
                 "| T | memory steps s | disk steps s | median disk / memory |", "|---:|---|---|---:|"]
        lines += [f"| {r['seq_len']} | {', '.join(f'{x:.2f}' for x in r['times']['memory'])} | "
                  f"{', '.join(f'{x:.2f}' for x in r['times']['disk'])} | {r['median_ratio']:.2f}x |" for r in rows]
        harness.write_report(args.out, "\n".join([*lines, "", *harness.environment([command]), ""]), rows)
        return 0
    rows = []
    for t in args.seq_lens:
        for method in METHODS:
            rows.append(run_child(t, method, args.disk_path, args.steps, args.hidden))
            print(json.dumps(rows[-1]), flush=True)
    harness.write_report(args.out, report(rows, command, args.hidden), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
