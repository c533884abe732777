"""Peak CPU memory of one forward + backward step versus sequence length.

For each method and sequence length, a fresh child process (``benchmarks.harness.spawn``) builds
the small Llama-shaped model (``benchmarks.recipes.LLAMA_SMALL``: random weights, float32,
batch 1; ``--shape`` picks gpt-oss's, DeepSeek-V3's or Qwen3.5's hybrid layout at the same size instead), records
the process's peak resident set size (``ru_maxrss``) as the baseline, runs
exactly one forward + backward step (no optimizer step) and reports the peak RSS minus that
baseline, in MiB. Fresh processes matter: ``ru_maxrss`` is a high-water mark and the allocator
keeps freed pages, so points must not share a process.

The number therefore counts everything a step allocates on top of the built model: activations,
logits, autograd buffers and the parameter gradients (about 173 MiB here, identical for every
method, so differences between methods are differences in activation memory).

Holds: ``measure`` (the child), ``report_markdown`` and the CLI (``main``). Methods are the recipes
of ``benchmarks.recipes`` (stock, hf_gc, alst, mst, streambp); the harness does the rest.

Example:
    python -m benchmarks.memory --seq-lens 2048 4096 --repeats 3 \
        --out benchmarks/results/memory_cpu
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.recipes import (
    LLAMA_SMALL,
    LOSS_TOKENS_PER_CHUNK,
    SHAPES,
    build_model,
    compute_loss,
    get_recipe,
    long_seq_config,
    prepare,
    random_tokens,
    step_context,
)

MODULE = "benchmarks.memory"
METHODS = ("stock", "hf_gc", "alst", "mst", "streambp")
SPARSE_METHODS = ("streambp_keep2", "streambp_keep4")  # long_seq.offload.keep_every, by name only
DEFAULT_SEQ_LENS = (2048, 4096, 8192, 16384)
CHUNK_SIZE = 1024  # StreamBP chunk and key-block tokens


def measure(spec: dict) -> dict:
    """One fwd + bwd step of ``spec['method']`` at ``spec['seq_len']`` in this fresh process."""
    import torch

    import ds_longseq

    torch.set_num_threads(2)
    recipe, seq_len = get_recipe(spec["method"]), spec["seq_len"]
    shape = SHAPES[spec.get("shape", LLAMA_SMALL.name)]
    model = build_model(shape, dtype="float32", device="cpu", seq_len=seq_len)
    prepare(model, recipe)
    long_seq = long_seq_config(recipe, shape, seq_len, chunk_size=CHUNK_SIZE,
                               loss_chunk_size=LOSS_TOKENS_PER_CHUNK)
    if long_seq:
        ds_longseq.enable(model, long_seq)
    ids = random_tokens(shape, seq_len)
    baseline = harness.maxrss_mib()
    if spec.get("budget_mib"):
        harness.set_address_space_budget(spec["budget_mib"])
    start = time.perf_counter()
    with step_context(recipe, pin_memory=False):
        loss = compute_loss(recipe, model, ids)
        loss.backward()
    step_s = time.perf_counter() - start
    return {"baseline_mib": baseline, "peak_mib": harness.maxrss_mib() - baseline, "step_s": step_s,
            "loss": float(loss.detach()), "device": "cpu"}


def report_markdown(rows, methods, seq_lens, repeats_note, shape=LLAMA_SMALL) -> str:
    """Peak MiB table, step-time table, notes, command and environment."""
    out = [f"# Peak memory of one training step ({shape.describe()}, fp32, batch 1)", "",
           "Peak RSS minus the post-build baseline, median over repeats, MiB "
           "(includes the ~173 MiB of parameter gradients every method allocates).", ""]
    out += harness.grid_table(rows, methods, seq_lens, "peak_mib", lambda x: f"{x:.0f}")
    out += ["", "Step wall time (s, median; noisy: shared 2-core machine):", ""]
    out += harness.grid_table(rows, methods, seq_lens, "step_s", lambda x: f"{x:.1f}")
    out += ["", repeats_note + " The CSV has min/max and the successful repeat count per point.",
            "", "Caveat: RSS also counts pages glibc keeps after frees, so a point can sit a few "
            "hundred MiB above the live-tensor peak and curves need not be monotonic "
            "(`--mmap-threshold 1048576` reduces this). Children use torch.set_num_threads(2).", ""]
    out += harness.environment([r["command"] for r in rows], device="cpu") + [""]
    return "\n".join(out)


def _parse_overrides(items):
    """Parses ``SEQ:REPEATS`` pairs, e.g. ``16384:1``."""
    return {int(s): int(n) for s, n in (item.split(":") for item in items)}


def main(argv=None, spawn=harness.spawn):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS))
    p.add_argument("--methods", nargs="+", choices=METHODS + SPARSE_METHODS, default=list(METHODS))
    p.add_argument("--shape", choices=sorted(SHAPES), default=LLAMA_SMALL.name,
                   help="model layout (same width, depth and vocabulary): Llama, gpt-oss or DeepSeek-V3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--repeats-at", nargs="+", default=[], metavar="SEQ:N",
                   help="per-length repeat overrides, e.g. 16384:1 to save time")
    p.add_argument("--out", default="benchmarks/results/memory_cpu",
                   help="output prefix; writes <out>.csv, <out>.png, <out>.md")
    p.add_argument("--quick", action="store_true", help="smoke test: seq lens 512 1024, 1 repeat")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="cap each child's address-space growth after the baseline (RLIMIT_AS)")
    p.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="set MALLOC_MMAP_THRESHOLD_ in children (less allocator retention in RSS)")
    p.add_argument("--child-timeout", type=float, default=3600.0, help="seconds per child")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="start no child after this many minutes; the rest are recorded as not run")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        return harness.child_main(measure, args._child)

    from tqdm import tqdm

    if args.quick:
        args.seq_lens, args.repeats = [512, 1024], 1
    overrides = _parse_overrides(args.repeats_at)
    command = "python -m benchmarks.memory " + " ".join(argv)
    note = f"Repeats per point: {args.repeats}" + "".join(
        f"; {n} at seq_len {s} (to bound run time)" for s, n in sorted(overrides.items())) + "."
    # A fixed threshold stops glibc from raising it (up to 32 MiB) after frees, which otherwise
    # serves mid-sized tensors from the heap where freed pages stay in RSS.
    env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    budget = harness.TimeBudget(args.time_budget_min)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    bar = tqdm([(s, m) for s in args.seq_lens for m in args.methods], desc="points", unit="pt")
    tqdm.write(f"{'method':>9} {'seq_len':>7} {'peak MiB (med/min/max)':>24} {'step s':>8}  error")
    for seq_len, method in bar:
        bar.set_postfix_str(f"{method}@{seq_len}")
        spec = {"method": method, "seq_len": seq_len, "budget_mib": args.budget_mib, "shape": args.shape}
        records = []
        for _ in range(overrides.get(seq_len, args.repeats)):
            if budget.spent():
                break
            records += spawn(MODULE, spec, timeout_s=budget.timeout(args.child_timeout), env=env)
        fields = harness.summarize_repeats(records) if records else {"status": "not_run",
                                                                      "error": harness.NOT_RUN_BUDGET}
        row = harness.new_row(suite="memory", kind="step", method=method, seq_len=seq_len,
                              budget_mib=args.budget_mib, device="cpu", command=command, **fields)
        rows.append(row)
        peaks = f"{row['peak_mib']}/{row['peak_mib_min']}/{row['peak_mib_max']}" if row["repeats"] else "-"
        tqdm.write(f"{method:>9} {seq_len:>7} {peaks:>24} {str(row['step_s']):>8}  {row['error']}")
        harness.write_outputs(  # after each point, so a partial run survives
            rows, args.out, report_markdown(rows, args.methods, args.seq_lens, note, SHAPES[args.shape]),
            lambda path: harness.plot(rows, path, f"{SHAPES[args.shape].describe()}, fp32, one fwd+bwd step",
                                      peak_label="peak RSS above post-build"),
        )
    print(f"wrote {args.out}.csv, {args.out}.png, {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
