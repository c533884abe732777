"""Peak CPU memory and time of one SSM training step vs sequence length: autograd vs adjoint sharding.

Paper 002's figure 1 on our code: for each model size (``benchmarks.recipes.SSM_SHAPES``), method and
length, a fresh child process (``benchmarks.harness.spawn``) builds the residual selective SSM LM
(float32, batch 1, random weights and tokens, the same for every method), resets its peak RSS after
the build, runs exactly one forward + backward (no optimizer step) and reports the peak RSS above
the post-build RSS in MiB, the step time and tokens/s.

Methods (``benchmarks.recipes.SSM_METHODS``):
    autograd:          plain autograd; the scan's autograd Function saves a and h (B, T, D, N) per
                       layer, as a fused selective-scan kernel would.
    adjoint:           exact adjoint sharding (``long_seq.adjoint``): keeps each layer's input (B, T, P)
                       and recomputes one layer at a time in the backward.
    adjoint_t<T-bar>:  truncated adjoint sharding: an APPROXIMATE gradient (see
                       ``benchmarks.adjoint_truncation`` for how approximate).

Checks, so that a broken configuration cannot draw a nice curve: every adjoint child also runs the
plain forward (no graph, after the measurement) and fails the point if its loss differs from the
adjoint training forward's by more than 1e-5 relative; the parent compares each exact adjoint point's
gradient norm with autograd's at the same point (same weights and tokens) and fails it beyond 1e-4.
For truncated points the gradient-norm ratio to autograd is reported, not checked.

Holds: ``measure`` (the child), ``saved_bytes_estimate``, ``report_markdown`` and the CLI (``main``).

Example (the committed run):
    python -m benchmarks.adjoint_memory --out benchmarks/results/adjoint_memory_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.recipes import SSM_SHAPES, build_ssm, enable_ssm_method, ssm_truncation

MODULE = "benchmarks.adjoint_memory"
SUITE = "adjoint_memory"
DEFAULT_SIZES = ("h32-L4", "h64-L4", "h32-L16")
DEFAULT_METHODS = ("autograd", "adjoint", "adjoint_t64")
DEFAULT_SEQ_LENS = (1024, 2048, 4096, 8192)
CHUNK_SIZE = 1024  # tokens per batched VJP and per LM-head chunk on the adjoint path
LOSS_RTOL = 1e-5  # float32: chunked vs full-logits cross entropy differ in summation order only (~1e-7)
GRAD_NORM_RTOL = 1e-4  # float32: scan re-association and chunked sums move the norm by ~1e-6


def point_name(size: str, method: str) -> str:
    """The CSV ``method`` cell of a point: ``<size>:<method>`` (one plotted line each)."""
    return f"{size}:{method}"


def split_name(name: str) -> tuple[str, str]:
    size, method = name.split(":", 1)
    return size, method


def measure(spec: dict) -> dict:
    """One forward + backward of ``spec['method']`` (``size:method``) at ``spec['seq_len']``, in this fresh child."""
    import torch
    import torch.fx.experimental.symbolic_shapes  # noqa: F401  (import cost before the baseline, see below)

    # torch.autograd.grad with grad_outputs imports sympy on first use (~34 MiB of module code): the
    # adjoint backward calls it, autograd's backward does not; imported here it is not counted as the step's.
    torch.set_num_threads(spec.get("threads", 2))
    size, method = split_name(spec["method"])
    shape, seq_len = SSM_SHAPES[size], spec["seq_len"]
    model = build_ssm(shape)
    enable_ssm_method(model, method, spec.get("chunk_size", CHUNK_SIZE))
    ids = torch.randint(0, shape.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    harness.reset_peak_rss()
    baseline = harness.maxrss_mib()
    if spec.get("budget_mib"):
        harness.set_address_space_budget(spec["budget_mib"])
    start = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    step_s = time.perf_counter() - start
    peak = harness.maxrss_mib() - baseline
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    extra = {"size": size, "truncation": ssm_truncation(method)}
    if method != "autograd":
        with torch.no_grad():  # the plain forward: the adjoint plan only acts with gradients enabled
            plain = model(ids, labels=ids).loss.item()
        extra["plain_loss"] = plain
        if abs(loss.item() - plain) > LOSS_RTOL * abs(plain):
            raise RuntimeError(f"loss check failed: {method} loss {loss.item():.8f} != plain forward {plain:.8f}")
    return {"baseline_mib": baseline, "peak_mib": peak, "step_s": step_s, "tokens_per_s": seq_len / step_s,
            "loss": loss.item(), "grad_norm": grad_norm, "device": "cpu", "extra": extra}


def saved_bytes_estimate(shape, method: str, seq_len: int) -> int:
    """Bytes kept from forward to backward, a COUNT from the code, not a measurement (float32, batch 1).

    autograd: per layer the scan's a and h (T, D, N) plus the per-token maps' saved inputs (about
    6 (T, D) and 3 (T, P) tensors: norm, projections, softplus, u, delta); adjoint: each layer's input
    (T, P). The backward's working set (one layer's a, h, c, mu and the scans' temporaries, several
    (T, D, N) tensors) comes on top for both.
    """
    d, n, p, k = shape.inner_size, shape.state_size, shape.hidden_size, shape.num_layers
    if method == "autograd":
        return 4 * seq_len * k * (2 * d * n + 6 * d + 3 * p)
    return 4 * seq_len * k * p


def _check_grad_norms(rows: list[dict]) -> None:
    """Fail exact-adjoint rows whose gradient norm differs from autograd's at the same point."""
    ref = {(split_name(r["method"])[0], int(r["seq_len"])): harness.num(r["grad_norm"])
           for r in rows if r["status"] == "ok" and split_name(r["method"])[1] == "autograd"}
    for r in rows:
        size, method = split_name(r["method"])
        want = ref.get((size, int(r["seq_len"])))
        if method != "adjoint" or r["status"] != "ok" or want is None:
            continue
        got = harness.num(r["grad_norm"])
        if abs(got - want) > GRAD_NORM_RTOL * want:
            r["status"], r["error"] = "crash", f"gradient check failed: norm {got:.6g} vs autograd {want:.6g}"


def _ratio_table(rows, sizes, methods, seq_lens) -> list[str]:
    """| seq_len | per size: autograd / each adjoint method's peak |."""
    by = {(r["method"], int(r["seq_len"])): r for r in rows if r["kind"] == "step" and r["status"] == "ok"}
    others = [m for m in methods if m != "autograd"]
    cols = [(s, m) for s in sizes for m in others]
    lines = ["| seq_len | " + " | ".join(f"{s} {m}" for s, m in cols) + " |", "|---:|" + "---:|" * len(cols)]
    for t in seq_lens:
        cells = []
        for s, m in cols:
            a, b = by.get((point_name(s, "autograd"), t)), by.get((point_name(s, m), t))
            ok = a and b and float(b["peak_mib"]) > 0  # a tiny point can peak at 0 MiB above the baseline
            cells.append(f"{float(a['peak_mib']) / float(b['peak_mib']):.2f}x" if ok else "")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def _check_table(rows, sizes, methods, seq_lens) -> list[str]:
    """Loss and gradient-norm agreement per point (what the checks compared)."""
    by = {(r["method"], int(r["seq_len"])): r for r in rows if r["kind"] == "step" and r["status"] == "ok"}
    lines = ["| size | seq_len | method | loss | plain-forward loss | grad norm | / autograd's |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for s in sizes:
        for t in seq_lens:
            ref = by.get((point_name(s, "autograd"), t))
            for m in methods:
                r = by.get((point_name(s, m), t))
                if r is None:
                    continue
                extra = json.loads(r["extra"]) if r["extra"] else {}
                ratio = (f"{float(r['grad_norm']) / float(ref['grad_norm']):.6f}" if ref and m != "autograd" else "")
                plain = f"{extra['plain_loss']:.6f}" if "plain_loss" in extra else ""
                lines.append(f"| {s} | {t} | {m} | {float(r['loss']):.6f} | {plain} | {float(r['grad_norm']):.5g} | "
                             f"{ratio} |")
    return lines


def report_markdown(rows, sizes, methods, seq_lens) -> str:
    names = [point_name(s, m) for s in sizes for m in methods]
    shapes = "; ".join(SSM_SHAPES[s].describe() for s in sizes)
    out = [
        "# Adjoint sharding vs autograd: peak memory of one SSM training step (`benchmarks.adjoint_memory`)",
        "",
        f"Residual selective diagonal SSM LM, float32, batch 1, one forward + backward (no optimizer step), "
        f"adjoint chunk {CHUNK_SIZE} tokens. Sizes: {shapes}. Peak RSS of a fresh process above its post-build "
        "RSS (peak reset after the build), MiB; it includes the parameter gradients (< 1 MiB here).",
        "",
    ]
    for s in sizes:
        sub = [point_name(s, m) for m in methods]
        out += [f"**{SSM_SHAPES[s].describe()}**: peak MiB", ""]
        out += harness.grid_table(rows, sub, seq_lens, "peak_mib", lambda x: f"{x:.0f}")
        out += [""]
    out += ["Memory ratio autograd / adjoint method (> 1: adjoint sharding uses less):", ""]
    out += _ratio_table(rows, sizes, methods, seq_lens)
    out += ["", "Bytes kept from forward to backward, a count from the code (not measured), MiB; the backward's "
            "one-layer working set comes on top (`saved_bytes_estimate`):", ""]
    est_cols = [(s, m) for s in sizes for m in ("autograd", "adjoint")]
    out += ["| seq_len | " + " | ".join(f"{s} {m}" for s, m in est_cols) + " |", "|---:|" + "---:|" * len(est_cols)]
    for t in seq_lens:
        out.append(f"| {t} | " + " | ".join(f"{saved_bytes_estimate(SSM_SHAPES[s], m, t) / 2**20:.1f}"
                                            for s, m in est_cols) + " |")
    out += ["", "Step time, s (secondary: a shared 2-core VM, another job often running; `load1` per point in "
            "the CSV). One step in a fresh process, no warm-up. With MALLOC_MMAP_THRESHOLD_ set (the default here, "
            "for clean memory readings) every tensor above 1 MiB is a fresh mmap whose pages the kernel zeroes, which "
            "made steps 3-10x slower in our runs: compare times from a `--mmap-threshold 0` run (and `--threads 1` on "
            "a busy machine, where two threads stall on each other):", ""]
    out += harness.grid_table(rows, names, seq_lens, "step_s", lambda x: f"{x:.1f}")
    out += ["", "Tokens per second:", ""]
    out += harness.grid_table(rows, names, seq_lens, "tokens_per_s", lambda x: f"{x:.0f}")
    out += ["", f"Checks: each adjoint child's loss against the plain forward's (rtol {LOSS_RTOL:g}, else the point "
            f"fails); exact adjoint gradient norm against autograd's (rtol {GRAD_NORM_RTOL:g}, else the point fails); "
            "truncated methods' norm ratio reported only:", ""]
    out += _check_table(rows, sizes, methods, seq_lens)
    out += ["", "Caveat: RSS counts pages the allocator keeps after frees (children run with "
            "MALLOC_MMAP_THRESHOLD_=1048576 unless `--mmap-threshold 0`); small points (tens of MiB) carry a few "
            "MiB of noise. Children use torch.set_num_threads(`--threads`, default 2: see the command).", ""]
    out += harness.environment([r["command"] for r in rows], device="cpu") + [""]
    return "\n".join(out)


def main(argv=None, spawn=harness.spawn):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(SSM_SHAPES), default=list(DEFAULT_SIZES))
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help="autograd, adjoint, adjoint_t<T-bar> (e.g. adjoint_t64)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS))
    p.add_argument("--max-len", nargs="+", default=[], metavar="SIZE:T",
                   help="longest length per size, e.g. h32-L16:4096 (the others run every --seq-lens)")
    p.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
    p.add_argument("--threads", type=int, default=2, help="torch threads per child")
    p.add_argument("--out", default="benchmarks/results/adjoint_memory_cpu",
                   help="output prefix; writes <out>.csv, <out>.png, <out>.md")
    p.add_argument("--append", action="store_true", help="keep the points of an existing <out>.csv not re-run")
    p.add_argument("--mmap-threshold", type=int, default=1048576, metavar="BYTES",
                   help="MALLOC_MMAP_THRESHOLD_ in children (less allocator retention in RSS); 0: leave unset")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="cap each child's address-space growth after the baseline (RLIMIT_AS)")
    p.add_argument("--child-timeout", type=float, default=900.0, help="seconds per child")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="start no child after this many minutes; the rest are recorded as not run")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        return harness.child_main(measure, args._child)
    for m in args.methods:
        ssm_truncation(m)  # unknown names fail here, not in every child

    from tqdm import tqdm

    max_len = {k: int(v) for k, v in (item.split(":") for item in args.max_len)}
    command = "python -m benchmarks.adjoint_memory " + " ".join(argv)
    env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    budget = harness.TimeBudget(args.time_budget_min)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    points = [(t, s, m) for t in sorted(args.seq_lens) for s in args.sizes for m in args.methods
              if t <= max_len.get(s, t)]
    planned = {(point_name(s, m), t) for t, s, m in points}
    rows = harness.keep_rows(harness.read_csv(args.out + ".csv") if args.append else [],
                             lambda r: (r["method"], int(r["seq_len"])) in planned)
    sizes = list(dict.fromkeys([split_name(r["method"])[0] for r in rows] + args.sizes))
    methods = list(dict.fromkeys(args.methods + [split_name(r["method"])[1] for r in rows]))
    seq_lens = sorted({int(r["seq_len"]) for r in rows} | set(args.seq_lens))
    bar = tqdm(points, desc="points", unit="pt")
    for seq_len, size, method in bar:
        name = point_name(size, method)
        bar.set_postfix_str(f"{name}@{seq_len}")
        spec = {"method": name, "seq_len": seq_len, "chunk_size": args.chunk_size, "budget_mib": args.budget_mib,
                "threads": args.threads}
        if budget.spent():
            records = []
        else:
            records = spawn(MODULE, spec, timeout_s=budget.timeout(args.child_timeout), env=env)
        fields = harness.summarize_repeats(records) if records else {"status": "not_run",
                                                                      "error": harness.NOT_RUN_BUDGET}
        ok = [r for r in records if r.get("status") == "ok"]
        if ok:
            fields.update(grad_norm=f"{ok[0]['grad_norm']:.8g}", loss=round(ok[0]["loss"], 7),
                          extra=json.dumps(ok[0]["extra"]))
        row = harness.new_row(suite=SUITE, kind="step", method=name, seq_len=seq_len, budget_mib=args.budget_mib,
                              load1=round(os.getloadavg()[0], 2), device="cpu", command=command, **fields)
        rows.append(row)
        _check_grad_norms(rows)
        tqdm.write(f"{name:>22} {seq_len:>6} {row['status']:>7} peak {row['peak_mib']!s:>8} MiB  "
                   f"step {row['step_s']!s:>8} s  loss {row['loss']}  {row['error']}")
        harness.write_outputs(  # after each point, so a partial run survives
            rows, args.out, report_markdown(rows, sizes, methods, seq_lens),
            lambda path: harness.plot(rows, path, "Residual SSM LM, fp32, batch 1, one fwd+bwd step: autograd vs "
                                      "adjoint sharding", peak_label="peak RSS above post-build"),
        )
    print(f"wrote {args.out}.csv, {args.out}.png, {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
