"""Step times of several methods, interleaved step by step: the speed targets' measurement.

    python -m benchmarks.paired --suite cpu --seq-lens 2048 4096 8192 16384 \
        --methods hf_gc alst streambp_auto streambp --steps 5 --out benchmarks/results/paired_cpu

Timing on a shared machine drifts (0.98-1.24x between runs of the same thing), so the methods are not timed one
after the other: each method lives in its own process (model, optimizer and tokens built once, as
``benchmarks.run`` builds them), and the parent asks them for one training step each in turn, ``--steps`` rounds
after ``--warmup`` untimed ones, rotating which method goes first. Round r of a method and round r of the baseline
ran seconds apart, so their ratio sees the same machine; per method it reports the median step time, the median
of the per-round ratios to ``--baseline`` and the WORST round's ratio (a target counts as met only if the worst
round meets it). Only one process computes at a time; the others wait on their pipe.

Two versions of the code side by side (a refactor's "no slower than before"): ``--tree before=DIR`` names a
checkout (e.g. ``git worktree add DIR <commit>``) and ``method@before`` runs that method from it (its own
``ds_longseq`` and ``benchmarks.run``), interleaved with the current tree's methods::

    python -m benchmarks.paired --tree before=/tmp/before --methods streambp_auto@before streambp_auto \
        --baseline streambp_auto@before --seq-lens 4096 8192 --steps 7

Outputs ``<out>.md`` and ``<out>.jsonl`` (one row per method and length, with every round's time).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time


def _child(conn, suite_name: str, method: str, seq_len: int, tree: str | None = None) -> None:
    if tree is not None:  # this method runs from another checkout: its ds_longseq, its benchmarks.run
        import benchmarks

        sys.path.insert(0, tree)
        benchmarks.__path__.insert(0, os.path.join(tree, "benchmarks"))
    import torch

    from benchmarks.run import SUITES, build_step, resolve_device

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    suite = SUITES[suite_name]
    device = resolve_device(suite)
    step = build_step(suite, method, seq_len, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    import ds_longseq

    conn.send(("ready", os.path.dirname(os.path.dirname(ds_longseq.__file__))))  # which checkout it runs
    while conn.recv() == "step":
        start = time.perf_counter()
        step()
        sync()
        conn.send(time.perf_counter() - start)


def paired(suite: str, methods: list[str], seq_len: int, warmup: int, steps: int, log=print,
           trees: dict[str, str] | None = None) -> dict[str, list[float]]:
    """{method: [seconds of each timed round]} with the methods' steps interleaved; ``method@name`` runs from the
    checkout ``trees[name]``."""
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    try:
        for m in methods:
            parent, child = ctx.Pipe()
            method, _, tree = m.partition("@")
            if tree and tree not in (trees or {}):
                raise ValueError(f"{m}: no --tree {tree}=DIR given")
            args = (child, suite, method, seq_len, (trees or {}).get(tree))
            procs[m] = ctx.Process(target=_child, args=args, daemon=True)
            procs[m].start()
            conns[m] = parent
        for m in methods:
            ready = conns[m].recv()
            if not (isinstance(ready, tuple) and ready[0] == "ready"):
                raise RuntimeError(f"{m} did not start")
            if trees:
                log(f"  {m}: ds_longseq from {ready[1]}")
        times = {m: [] for m in methods}
        for r in range(warmup + steps):
            order = methods[r % len(methods):] + methods[: r % len(methods)]
            for m in order:
                conns[m].send("step")
                t = conns[m].recv()
                if r >= warmup:
                    times[m].append(t)
            if r >= warmup:
                log(f"  {seq_len} round {r - warmup + 1}: " + ", ".join(f"{m} {times[m][-1]:.2f}s" for m in methods))
        return times
    finally:
        for c in conns.values():
            try:
                c.send("stop")
            except (BrokenPipeError, OSError):
                pass
        for p in procs.values():
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def summarize(times: dict[str, list[float]], baseline: str, seq_len: int) -> list[dict]:
    rows = []
    for m, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times[baseline], strict=True)] if baseline in times else []
        rows.append({"method": m, "seq_len": seq_len, "median_s": statistics.median(ts), "times_s": ts,
                     "median_ratio": statistics.median(ratios) if ratios else None,
                     "worst_ratio": max(ratios) if ratios else None, "best_ratio": min(ratios) if ratios else None})
    return rows


def report_markdown(rows: list[dict], baseline: str, command: str) -> str:
    lines = ["# Step times, methods interleaved step by step", "", f"Command: `{command}`", "",
             f"Ratios are per round against {baseline}'s step of the same round; a target is met only if the worst "
             "round meets it.", "",
             f"| tokens | method | median step (s) | median vs {baseline} | worst round | best round |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        ratio = lambda x: "-" if x is None else f"{x:.3f}x"  # noqa: E731
        lines.append(f"| {r['seq_len']} | {r['method']} | {r['median_s']:.2f} | {ratio(r['median_ratio'])} | "
                     f"{ratio(r['worst_ratio'])} | {ratio(r['best_ratio'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", default="cpu")
    p.add_argument("--methods", nargs="+", default=["hf_gc", "alst", "streambp_auto", "streambp"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096])
    p.add_argument("--baseline", default="hf_gc")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help="output prefix (.md, .jsonl)")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="another checkout, for methods written method@NAME")
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree)
    command = "python -m benchmarks.paired " + " ".join(argv)
    rows = []
    for seq_len in args.seq_lens:
        times = paired(args.suite, args.methods, seq_len, args.warmup, args.steps, trees=trees)
        rows += summarize(times, args.baseline, seq_len)
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out + ".md", "w") as f:
                f.write(report_markdown(rows, args.baseline, command))
            with open(args.out + ".jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    print(report_markdown(rows, args.baseline, command))
    return rows


if __name__ == "__main__":
    main()
