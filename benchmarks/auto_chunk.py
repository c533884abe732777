"""How well ``streambp.chunk_size: "auto"``'s memory model predicts a chunk's work, measured on CPU.

    python -m benchmarks.auto_chunk --seq-len 4096 --out benchmarks/results/auto_chunk_cpu

StreamBP on benchmarks.recipes.LLAMA_SMALL (Llama h512, 4 layers, float32), one sequence of ``--seq-len`` tokens,
fixed chunk sizes from 256 up to the whole sequence, each in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536``, so
freed blocks leave RSS): one warm-up step, then the peak RSS of one step above the RSS before it. The LM head's chunk
is 128 tokens, so the layers' chunk work is what grows with the chunk. A least-squares line through (chunk, peak)
gives the measured bytes per chunk token, against ``ModelDims.chunk_work_per_token`` (ANALYTIC, what "auto" budgets
with). Then, for a few budgets, the chunk "auto" picks and the work the measured line gives it: at most the budget
when the model is not optimistic.

Speed (auto at short lengths against HF checkpointing and fixed chunks) is benchmarks.run's:

    python -m benchmarks.run --suite cpu --methods hf_gc streambp streambp_auto --seq-lens 2048 4096 8192 \\
        --no-search --out benchmarks/results/auto_chunk_speed_cpu
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks import harness

MIB = 1024**2
HEAD_CHUNK = 128


def _work_per_token(seq_len: int) -> float:
    from benchmarks.recipes import LLAMA_SMALL
    from ds_longseq.families.dims import ModelDims

    dims = ModelDims.from_config(LLAMA_SMALL.config(max_position_embeddings=max(seq_len, 4096)))
    return dims.chunk_work_per_token(4, min(1024, seq_len), 4)  # (Llama: no softcap, so no score tile counts)


def measure(spec: dict) -> dict:
    import ds_longseq
    from benchmarks.recipes import LLAMA_SMALL, build_model, random_tokens

    torch.set_num_threads(2)
    seq_len, chunk = spec["seq_len"], spec["chunk"]
    model = build_model(LLAMA_SMALL, dtype="float32", device="cpu", seq_len=seq_len)
    ds_longseq.enable(model, {"streambp": {"enabled": True, "chunk_size": chunk},
                              "lm_head": {"enabled": True, "chunk_size": HEAD_CHUNK}})
    ids = random_tokens(LLAMA_SMALL, seq_len)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    harness.reset_peak_rss()
    base = harness.rss_mib()
    step()
    return {"chunk": chunk, "peak_mib": harness.maxrss_mib() - base}


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--out", default=None, help="write <out>.md and <out>.jsonl")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        return harness.child_main(measure, args._child)
    from benchmarks.recipes import LLAMA_SMALL
    from ds_longseq.ops.chunk_sizes import choose_chunk_size

    t = args.seq_len
    chunks = [c for c in (256, 512, 1024, 2048, 4096, 8192) if c < t] + [t]
    env = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
    rows = []
    for c in chunks:
        (rec,) = harness.spawn("benchmarks.auto_chunk", {"method": f"streambp_c{c}", "seq_len": t, "chunk": c},
                               timeout_s=1800, env=env)
        if rec.get("status") != "ok":
            raise RuntimeError(f"chunk {c}: {rec}")
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    work = _work_per_token(t)
    intercept, slope = _fit([(r["chunk"], r["peak_mib"] * MIB) for r in rows])
    lines = [f"# The chunk-work model of streambp.chunk_size 'auto' against measured peaks: {LLAMA_SMALL.describe()}, "
             f"fp32, T={t}, CPU", "",
             f"Analytic work per chunk token: {work / 1024:.1f} KiB; measured (least-squares slope of the step's peak "
             f"over the chunk size): {slope / 1024:.1f} KiB; analytic / measured = {work / slope:.2f} "
             f"(> 1: the model over-counts, a budget it keeps is kept). Intercept (what does not grow with the chunk): "
             f"{intercept / MIB:.0f} MiB.", "",
             "| chunk | step peak MiB | line MiB | analytic chunk work MiB |", "|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['chunk']} | {r['peak_mib']:.0f} | {(intercept + slope * r['chunk']) / MIB:.0f} | "
                     f"{work * r['chunk'] / MIB:.0f} |")
    lines += ["", "What \"auto\" picks for a work budget, and the work the measured slope gives that chunk:", "",
              "| auto_budget_gib | chunk picked | measured work MiB | within the budget |", "|---:|---:|---:|---|"]
    for budget_mib in (64, 128, 256, 512, 1024):
        c = choose_chunk_size(t, 1, work, budget_mib * MIB)
        measured = slope * c / MIB
        lines.append(f"| {budget_mib / 1024:g} | {c} | {measured:.0f} | {'yes' if measured <= budget_mib else 'NO'} |")
    lines += ["", *harness.environment([f"python -m benchmarks.auto_chunk --seq-len {t}"]), ""]
    harness.write_report(args.out, "\n".join(lines), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
