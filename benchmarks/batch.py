"""Spend the memory on speed: each method's largest micro-batch at one length, and its time per sample there.

    python -m benchmarks.batch --suite cpu --seq-len 2048 --methods hf_gc alst streambp_auto streambp \
        --out benchmarks/results/batch_cpu

As the StreamBP paper's table 2: a method that needs less memory per sequence fits more sequences in one step,
and a larger batch amortises the per-step work (the optimizer step, the weights read once per layer pass), so the
fair speed comparison is per sample, each method at the largest batch it fits. For each method, in fresh child
processes (``benchmarks.run``'s ``measure``): batch sizes doubled from 1 until one runs out of memory, then
bisected (a probe is one training step under the suite's memory budget: CPU, ``--budget-mib`` per child through
RLIMIT_AS; GPU, the device's memory), then ``--warmup`` + ``--steps`` steps at the largest batch that fit, timed.
Reports per method: largest batch, median step time, seconds per sample, and per-sample time against
``--baseline`` (HF checkpointing) at its own largest batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks import harness
from benchmarks.run import SUITES

MODULE = "benchmarks.run"


def largest_batch(suite: str, method: str, seq_len: int, max_batch: int, budget_mib, timeout_s: float, spawn,
                  log=print) -> harness.SearchResult:
    """The suite searches' doubling then bisection (``harness.search_max_len``) over batch sizes 1..``max_batch``:
    ``best`` is the largest batch whose step fit (None: not even 1). Only "oom" means too big: a crash or timeout
    ends the search at the last batch that fit (``stop`` says why)."""

    def probe(batch: int) -> dict:
        spec = {"suite": suite, "method": method, "seq_len": seq_len, "batch_size": batch, "warmup": 0, "steps": 1,
                "budget_mib": budget_mib}
        record = {**spawn(MODULE, spec, timeout_s=timeout_s)[0], "method": method, "batch_size": batch}
        log(f"  {method} batch {batch}: {record.get('status')}")
        return record

    return harness.search_max_len(probe, lo=1, hi=max_batch, granularity=1)


def report_markdown(rows: list[dict], baseline: str, command: str, seq_len: int, budget) -> str:
    base = next((r for r in rows if r["method"] == baseline and r.get("step_s")), None)
    lines = [f"# Largest micro-batch and time per sample at {seq_len} tokens", "", f"Command: `{command}`", "",
             f"Memory per probe: {'the device' if budget is None else f'{budget:.0f} MiB per child (RLIMIT_AS)'}.",
             "", f"| method | largest batch | step (s) | s per sample | per sample vs {baseline} at its largest | "
             "tokens/s |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r.get("step_s"):
            lines.append(f"| {r['method']} | {r['batch_size']} | - | - | - | - |")
            continue
        per = r["step_s"] / r["batch_size"]
        vs = f"{per / (base['step_s'] / base['batch_size']):.2f}x" if base else "-"
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['step_s']:.2f} | {per:.3f} | {vs} | "
                     f"{r['tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None, spawn=harness.spawn) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="cpu")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--methods", nargs="+", default=["hf_gc", "alst", "streambp_auto", "streambp"])
    p.add_argument("--baseline", default="hf_gc")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--budget-mib", type=float, default=None, help="CPU memory per probe (default: the suite's)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--out", default=None, help="output prefix (.md, .json)")
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    budget = args.budget_mib if args.budget_mib is not None else suite.budget_mib
    command = "python -m benchmarks.batch " + " ".join(argv)
    rows, probes = [], []
    for method in args.methods:
        found = largest_batch(args.suite, method, args.seq_len, args.max_batch, budget, args.timeout_s, spawn)
        probes += found.probes
        batch = found.best or 0
        row = {"method": method, "seq_len": args.seq_len, "batch_size": batch, "stop": found.stop}
        if batch:
            spec = {"suite": args.suite, "method": method, "seq_len": args.seq_len, "batch_size": batch,
                    "warmup": args.warmup, "steps": args.steps}
            r = spawn(MODULE, spec, timeout_s=args.timeout_s)[0]
            row.update({k: r.get(k) for k in ("status", "step_s", "tokens_per_s", "peak_mib", "error")})
        rows.append(row)
        print(f"{method}: largest batch {batch}, step {row.get('step_s')}", flush=True)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out + ".json", "w") as f:
                json.dump({"rows": rows, "probes": probes}, f, indent=1)
            with open(args.out + ".md", "w") as f:
                f.write(report_markdown(rows, args.baseline, command, args.seq_len, budget))
    print(report_markdown(rows, args.baseline, command, args.seq_len, budget))
    return rows


if __name__ == "__main__":
    main()
