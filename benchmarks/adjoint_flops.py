"""FLOPs of one SSM training step: our adjoint sharding vs autograd vs paper 002's un-collapsed VJPs.

Everything here is a COUNT derived from the code (and, for the paper's algorithm, from its Secs.
4.2-4.3 applied to our layer), not a measurement. Parts of it are checked against the code at tiny
sizes by ``tests/test_benchmark_adjoint.py``: the VJP counts against a brute-force enumeration of
the (t, i) pairs, the scan counts against the elementwise ops ``linear_scan`` / ``truncated_adjoint``
actually dispatch, and the matmul FLOPs of a whole step against torch's own FLOP formulas
(``torch.utils.flop_counter``) over the dispatched ops.

Holds:
    Scan counts per state element (one of B x D x N): ``scan_flops`` (our Hillis-Steele
        ``linear_scan``, also the exact adjoint scan), ``sequential_scan_flops`` (a token loop),
        ``truncated_flops`` (``truncated_adjoint``).
    VJP counts per layer: ``our_vjps`` (T, exact or truncated), ``paper_vjps`` (T(T+1)/2 for A and
        for B, T for C; truncated: T*T-bar - T-bar(T-bar-1)/2 for A and for B).
    ``matmul_flops_per_token``: the layer's and head's matmul FLOPs per token.
    ``step_flops``: one forward + backward of a ``benchmarks.recipes.SSMShape`` model, by component.
    ``validation_rows``: the count's ratios and slopes against measured step times (a results CSV of
        ``benchmarks.adjoint_memory``).
    ``time_scans``: the one measurement here (``--time-scans``): wall time of ``linear_scan`` vs T and of
        ``truncated_adjoint`` vs T-bar in this process (best of a few repeats after a warm-up), next to
        their counts: constant time per counted FLOP means the count has the scaling right.
    CLI: writes ``<out>.md`` and ``<out>.png``.

Shape legend: T sequence, T-bar truncation, P hidden, D inner channels, N state size, V vocab, K layers.

What the step costs, per layer and token (F_pre = matmuls of the per-token maps before the scan:
in_proj, dt_proj, bc_proj = 4PD + 4PN; F_out = out_proj = 2DP; a backward costs 2x its forward):
    autograd:   forward + backward of pre and post (3 F), the forward scan, the adjoint scan.
    adjoint:    exact, streamed over chunks: forward without graph (1 F), a boundary sweep of pre
                (F_pre), per chunk pre + post with a graph (1 F), the input gradient of post for c
                (F_out), the VJPs (2 F): 5 F_pre + 5 F_out; scans, each chunk by chunk with carries
                (``chunked_scan_flops``, ``chunked_adjoint_flops``): forward, sweep, chunk, adjoint.
                Truncated (whole-sequence a, h, mu): forward (1 F), a recompute of pre (F_pre), the VJP
                of post for c (2 F_out), the chunked VJPs (3 F): 5 F_pre + 6 F_out; scans: forward (by
                chunks), recompute (whole sequence), and ``truncated_flops`` for the adjoint.
    paper:      the forward once (1 F), then per pair (t, i <= t) the VJPs of A_i and B_i with vectors
                lambda^{t,i} (x) h_{i-1} and lambda^{t,i} (2 F_pre: a backward of pre at token i), T VJPs
                of C (2 F_out), and the adjoint states lambda^{t,i} = lambda^{t,i+1} * a_{i+1}, one
                multiply per pair with i < t. Activations of pre at each token are assumed computed once
                and reused by all of its VJPs (the cheapest reading of the paper).
Elementwise work on the (D, N) state outside the scans is approximated: the forward's a (multiply,
exp), b (outer product), h * C and its sum over N: 5 DN per token; a backward: 2x. Copies (torch.cat,
flip) move memory but are not FLOPs and are not counted, though on a CPU they cost time.

    python -m benchmarks.adjoint_flops --measured benchmarks/results/adjoint_memory_cpu_timing.csv \
        --out benchmarks/results/adjoint_flops
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.recipes import SSM_SHAPES, SSMShape, ssm_truncation

METHODS = ("autograd", "adjoint", "adjoint_t64", "paper", "paper_t64")
DEFAULT_SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 65536, 262144)
STATE_FWD_PER_TOKEN = 5  # x DN: a = exp(delta (x) -exp(A_log)) (2), b = (delta u) (x) B (1), h * C and sum (2)
STATE_PRE_PER_TOKEN = 3  # the part of it in pre (a and b)


# ---- scans, per state element --------------------------------------------------------------------


def scan_flops(num_tokens: int) -> int:
    """FLOPs of ``linear_scan`` (and of ``adjoint_scan``) per state element: Hillis-Steele doubling.

    Step ``offset`` = 1, 2, 4, ... < T: an addcmul on T - offset elements (2 FLOPs each) and, while
    2 * offset < T, the decay product on T - offset elements (1 FLOP). About 3 T log2 T: O(T log T)
    work, against 2 (T - 1) for a token loop.
    """
    total, offset = 0, 1
    while offset < num_tokens:
        total += 2 * (num_tokens - offset)
        if 2 * offset < num_tokens:
            total += num_tokens - offset
        offset *= 2
    return total


def chunked_scan_flops(num_tokens: int, chunk_size: int) -> int:
    """``linear_scan`` chunk by chunk with the state carried (the streamed forward, boundary sweep and
    chunk recompute): each chunk's scan, plus folding the carry into a later chunk's first input (an
    addcmul on one token: 2 FLOPs)."""
    lens = [min(chunk_size, num_tokens - s) for s in range(0, num_tokens, chunk_size)]
    return sum(scan_flops(n) for n in lens) + 2 * (len(lens) - 1)


def chunked_adjoint_flops(num_tokens: int, chunk_size: int) -> int:
    """``adjoint_scan`` chunk by chunk, last chunk first (the streamed exact backward): each chunk's scan,
    adding the carry from the chunk after it to its last direct gradient (1 FLOP; not for the last
    chunk), and the carry it passes on, a_s * mu_s (1 FLOP)."""
    lens = [min(chunk_size, num_tokens - s) for s in range(0, num_tokens, chunk_size)]
    return sum(scan_flops(n) + 1 for n in lens) + (len(lens) - 1)


def sequential_scan_flops(num_tokens: int) -> int:
    """A token loop h_t = a_t h_{t-1} + b_t: one multiply-add per step after the first."""
    return 2 * max(num_tokens - 1, 0)


def truncated_flops(num_tokens: int, window: int) -> int:
    """FLOPs of ``truncated_adjoint(a, c, window)`` per state element.

    Offsets d = 1 .. min(window, T) - 1: an addcmul on T - d elements (2 FLOPs each) and, from d = 2
    on, the running decay product on T - d elements (1 FLOP). About 3 T T-bar: it overtakes the exact
    adjoint scan's 3 T log2 T once T-bar > log2 T.
    """
    total = 0
    for d in range(1, min(window, num_tokens)):
        total += 2 * (num_tokens - d) + (num_tokens - d if d >= 2 else 0)
    return total


# ---- VJP counts, per layer ---------------------------------------------------------------------


def pairs(num_tokens: int, window: int | None = None) -> int:
    """Adjoint states lambda^{t,i} with i <= t (and t - i < T-bar when truncated): T(T+1)/2, or
    T T-bar - T-bar (T-bar - 1) / 2 for T-bar <= T."""
    if window is None or window >= num_tokens:
        return num_tokens * (num_tokens + 1) // 2
    return num_tokens * window - window * (window - 1) // 2


def paper_vjps(num_tokens: int, window: int | None = None) -> dict:
    """VJPs per layer of paper 002's algorithm: one per pair for A and for B, one per token for C."""
    n = pairs(num_tokens, window)
    return {"A": n, "B": n, "C": num_tokens, "total": 2 * n + num_tokens}


def our_vjps(num_tokens: int, window: int | None = None) -> dict:
    """VJPs per layer here: one per token (batched C tokens at a time) for A, B and C together, exact or
    truncated (truncation changes the adjoint state mu, not the number of VJPs)."""
    return {"total": num_tokens}


# ---- FLOPs of a step ---------------------------------------------------------------------------


def matmul_flops_per_token(shape: SSMShape) -> dict:
    """Forward matmul FLOPs per token: ``pre`` (in_proj, dt_proj, bc_proj), ``out`` (out_proj), ``head``."""
    p, d, n, v = shape.hidden_size, shape.inner_size, shape.state_size, shape.vocab_size
    return {"pre": 2 * p * d + 2 * p * d + 2 * p * 2 * n, "out": 2 * d * p, "head": 2 * p * v}


def _method(method: str) -> tuple[str, int | None]:
    if method.startswith("paper"):
        rest = method[len("paper"):]
        if rest == "":
            return "paper", None
        if rest.startswith("_t") and rest[2:].isdigit():
            return "paper", int(rest[2:])
        raise ValueError(f"unknown method {method!r}: paper or paper_t<T-bar>")
    return ("autograd" if method == "autograd" else "adjoint"), ssm_truncation(method)


def step_flops(shape: SSMShape, num_tokens: int, method: str, batch: int = 1, chunk_size: int = 1024) -> dict:
    """FLOPs of one forward + backward, by component (a count; see the module docstring).

    Returns {"matmul": exact count of matmul FLOPs, "state": elementwise FLOPs on the (D, N) state
    (scans exact, the rest approximate), "total"}; methods: autograd, adjoint, adjoint_t<T-bar>,
    paper, paper_t<T-bar>. ``chunk_size``: the adjoint plan's (its forward and exact backward scan chunk
    by chunk; it does not change the matmul count).
    """
    kind, window = _method(method)
    mm = matmul_flops_per_token(shape)
    t, k, dn = num_tokens, shape.num_layers, shape.inner_size * shape.state_size
    f_layer = mm["pre"] + mm["out"]
    s_fwd, s_pre = STATE_FWD_PER_TOKEN * dn, STATE_PRE_PER_TOKEN * dn
    s_post = s_fwd - s_pre
    if kind == "autograd":
        matmul = k * t * 3 * f_layer + t * 3 * mm["head"]
        state = k * (t * 3 * s_fwd + dn * (2 * scan_flops(t) + t))  # + mu * h_prev
    elif kind == "adjoint" and (window is None or window >= t):
        # streamed exact backward: forward (1 F), boundary sweep (F_pre), per chunk pre + post with a
        # graph (1 F), the c-VJP (input gradient of post: F_out), the VJPs (2 F): 5 F_pre + 5 F_out;
        # scans: forward, sweep, chunk recompute, adjoint. The chunked head: logits, and in its forward the input
        # and weight gradients (2x), over the t - 1 valid targets.
        matmul = k * t * (5 * mm["pre"] + 5 * mm["out"]) + (t - 1) * 3 * mm["head"]
        per_token = s_fwd + s_pre + s_fwd + (s_post + dn) + 2 * s_fwd  # fwd, sweep, chunk, c-VJP, VJPs
        scans = 3 * chunked_scan_flops(t, chunk_size) + chunked_adjoint_flops(t, chunk_size)
        state = k * (t * per_token + dn * (scans + t))
    elif kind == "adjoint":
        # truncated: whole-sequence a, h, mu: forward (1 F), a recompute of pre (F_pre), the VJP of
        # post for c (2 F_out: forward + input gradient), the chunked VJPs (3 F): 5 F_pre + 6 F_out
        matmul = k * t * (5 * mm["pre"] + 6 * mm["out"]) + (t - 1) * 3 * mm["head"]
        per_token = s_fwd + s_pre + (s_post + dn) + 3 * s_fwd  # fwd, recompute, c-VJP, chunk VJPs
        scans = chunked_scan_flops(t, chunk_size) + scan_flops(t) + truncated_flops(t, window)  # fwd streamed
        state = k * (t * per_token + dn * (scans + t))
    else:
        n = pairs(t, window)
        matmul = k * (t * f_layer + n * 2 * mm["pre"] + t * 2 * mm["out"]) + t * 3 * mm["head"]
        # forward (token loop), C-VJPs, per pair: the VJP vectors lambda (x) h and the pre backward,
        # and one multiply per lambda^{t,i} with i < t
        state = k * (t * s_fwd + dn * sequential_scan_flops(t) + t * 2 * s_post + n * (dn + 2 * s_pre)
                     + dn * (n - t))
    return {"matmul": batch * matmul, "state": batch * state, "total": batch * (matmul + state)}


# ---- validation against measured step times ---------------------------------------------------


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log y on log x."""
    if len(points) < 2:
        return None
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else None


def validation_rows(rows: list[dict]) -> list[dict]:
    """Per (size, method) of a ``benchmarks.adjoint_memory`` CSV: the log-log slope of measured step time
    vs T and of the counted FLOPs, and the mean ratio of step time to autograd's against the count's."""
    ok = [r for r in rows if r["kind"] == "step" and r["status"] == "ok" and harness.num(r["step_s"])]
    by = {(r["method"], int(r["seq_len"])): float(r["step_s"]) for r in ok}
    out = []
    for name in dict.fromkeys(r["method"] for r in ok):
        size, method = name.split(":", 1)
        if size not in SSM_SHAPES:
            continue
        shape = SSM_SHAPES[size]
        lens = sorted(t for (n, t) in by if n == name)
        measured = [(t, by[(name, t)]) for t in lens]
        counted = [(t, step_flops(shape, t, method)["total"]) for t in lens]
        ratios = [(by[(name, t)] / by[(f"{size}:autograd", t)],
                   step_flops(shape, t, method)["total"] / step_flops(shape, t, "autograd")["total"])
                  for t in lens if (f"{size}:autograd", t) in by]
        out.append({
            "size": size, "method": method, "seq_lens": lens, "time_slope": _slope(measured),
            "count_slope": _slope(counted),
            "time_ratio": sum(r for r, _ in ratios) / len(ratios) if ratios else None,
            "count_ratio": sum(c for _, c in ratios) / len(ratios) if ratios else None,
        })
    return out


def time_scans(seq_lens, windows, window_len: int, state=(64, 16), repeats: int = 3, threads: int = 1) -> dict:
    """Best-of-``repeats`` seconds of ``linear_scan`` per T and of ``truncated_adjoint`` per T-bar (at
    ``window_len`` tokens), batch 1, a (D, N) = ``state`` float32 state; a measurement, in this process."""
    import time

    import torch

    from ds_longseq.ops.linear_scan import linear_scan, truncated_adjoint

    torch.set_num_threads(threads)

    def best(fn):
        fn()  # warm-up: first-touch of the allocator's pages, thread pool
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    g = torch.Generator().manual_seed(0)
    out = {"scan": [], "truncated": [], "state": list(state), "threads": threads}
    for t in seq_lens:
        a, b = torch.rand(1, t, *state, generator=g), torch.rand(1, t, *state, generator=g)
        out["scan"].append((t, best(lambda a=a, b=b: linear_scan(a, b)), scan_flops(t)))
    a, c = torch.rand(1, window_len, *state, generator=g), torch.rand(1, window_len, *state, generator=g)
    for w in windows:
        out["truncated"].append((w, best(lambda w=w: truncated_adjoint(a, c, w)), truncated_flops(window_len, w)))
    return out


def _scan_timing_lines(timing: dict, window_len: int) -> list[str]:
    d, n = timing["state"]
    out = [f"**Scan timings against their counts** (measured: best of 3 after a warm-up, this process, "
           f"{timing['threads']} threads, batch 1, (D, N) = ({d}, {n}) float32; ns per counted FLOP = time / (count x "
           f"D x N); a constant column means the count scales as the time does):", "",
           "| `linear_scan`, T | ms | count per state element | ns per counted FLOP |", "|---:|---:|---:|---:|"]
    for t, sec, count in timing["scan"]:
        out.append(f"| {t} | {1e3 * sec:.1f} | {count:,} | {1e9 * sec / (count * d * n):.2f} |")
    out += ["", f"| `truncated_adjoint`, T = {window_len}, T-bar | ms | count per state element | "
            "ns per counted FLOP |", "|---:|---:|---:|---:|"]
    for w, sec, count in timing["truncated"]:
        per = f"{1e9 * sec / (count * d * n):.2f}" if count else ""
        out.append(f"| {w} | {1e3 * sec:.1f} | {count:,} | {per} |")
    return out + [""]


# ---- report ------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def report_markdown(sizes, seq_lens, window: int, measured_paths, command: str, timing: dict | None = None,
                    window_len: int = 0, chunk_size: int = 1024) -> str:
    out = [
        "# FLOPs of one SSM training step: a count, not a measurement (`benchmarks.adjoint_flops`)",
        "",
        "Counted from the code (ours) and from paper 002 Secs. 4.2-4.3 applied to our layer (paper); batch 1. "
        "Matmul FLOPs are exact counts (checked against torch's FLOP formulas at tiny sizes); elementwise FLOPs "
        "on the (D, N) state are exact for the scans (checked against the dispatched ops) and approximate for "
        "the rest (5 DN per token forward, 2x that backward). Copies are not counted.",
        "",
        f"**VJPs per layer** (ours: one per token for A, B and C together, batched; paper: A and B once per "
        f"pair (t, i <= t), C once per token; `_t{window}`: truncated to T-bar = {window}):",
        "",
        f"| T | ours (exact or truncated) | paper | paper_t{window} | paper_t{window} / paper |",
        "|---:|---:|---:|---:|---:|",
    ]
    for t in seq_lens:
        full, trunc = paper_vjps(t)["total"], paper_vjps(t, window)["total"]
        out.append(f"| {t} | {our_vjps(t)['total']:,} | {full:,} | {trunc:,} | {trunc / full:.3f} |")
    t10k = paper_vjps(10_000)["total"] - 10_000
    t10k_2000 = paper_vjps(10_000, 2000)["total"] - 10_000
    out += [
        "",
        f"The paper's own example (Sec. 4.3): at T = 10K, T-bar = 2000 removes {100 * (1 - t10k_2000 / t10k):.0f}% "
        "of the A/B VJPs (the paper says 64%); its count is T T-bar - T-bar (T-bar - 1) / 2 per network.",
        "",
        "**Adjoint-state work per state element** (FLOPs on one of the D x N channels, per layer): ours exact = "
        f"the Hillis-Steele adjoint scan, chunk by chunk (C = {chunk_size}) with carries (~3 T log2 C; on the "
        "whole sequence at once it would be ~3 T log2 T, a token loop 2 (T - 1)); ours truncated = "
        "`truncated_adjoint` on the whole sequence (~3 T T-bar); paper = one multiply per lambda^{t,i} with "
        "i < t plus one per VJP vector lambda (x) h.",
        "",
        f"| T | ours exact (C = {chunk_size}) | whole-sequence scan | token loop | ours t{window} | paper | "
        f"paper_t{window} |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in seq_lens:
        p_full, p_tr = 2 * pairs(t) - t, 2 * pairs(t, window) - t
        out.append(f"| {t} | {chunked_adjoint_flops(t, chunk_size):,} | {scan_flops(t):,} | "
                   f"{sequential_scan_flops(t):,} | {truncated_flops(t, window):,} | {p_full:,} | {p_tr:,} |")
    big = 1 << 20
    crossover = next(w for w in range(1, big) if truncated_flops(big, w) > chunked_adjoint_flops(big, chunk_size))
    out += ["", f"Truncation is cheaper than our exact adjoint scan only for tiny T-bar: at T = 2^20 the "
            f"truncated adjoint costs more from T-bar = {crossover} on (~3 T T-bar against ~3 T log2 C).", ""]
    methods = ["autograd", "adjoint", f"adjoint_t{window}", "paper", f"paper_t{window}"]
    for s in sizes:
        shape = SSM_SHAPES[s]
        out += [f"**Step FLOPs, {shape.describe()}** (GFLOP, forward + backward; in brackets: / autograd):", "",
                "| T | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
        for t in seq_lens:
            ref = step_flops(shape, t, "autograd")["total"]
            cells = []
            for m in methods:
                total = step_flops(shape, t, m, chunk_size=chunk_size)["total"]
                cells.append(f"{total / 1e9:.3g}" + ("" if m == "autograd" else f" ({total / ref:.3g}x)"))
            out.append(f"| {t} | " + " | ".join(cells) + " |")
        out.append("")
    for measured_path in [p for p in measured_paths or () if Path(p).exists()]:
        val = validation_rows(harness.read_csv(measured_path))
        out += [f"**The count against measured step times** (`{measured_path}`; CPU, shared machine, noisy): "
                "log-log slope of step time vs T next to the count's, and step time / autograd's (mean over "
                "lengths) next to the count's ratio:", "",
                "| size | method | lengths | time slope | count slope | time / autograd | count / autograd |",
                "|---|---|---|---:|---:|---:|---:|"]
        for v in val:
            cells = [v["size"], v["method"], ", ".join(str(t) for t in v["seq_lens"])]
            cells += [_fmt(v[k]) if v[k] is not None else "" for k in ("time_slope", "count_slope", "time_ratio",
                                                                        "count_ratio")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if timing:
        out += _scan_timing_lines(timing, window_len)
    out += ["Command:", f"`{command}`", ""]
    if timing:
        out += harness.environment([], device="cpu")[2:] + [""]
    return "\n".join(out)


def plot(path: str, sizes, seq_lens, window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted(set(seq_lens) | {2**k for k in range(7, 21)})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    ax.plot(lens, [our_vjps(t)["total"] for t in lens], marker=".", label="ours (exact or truncated)")
    ax.plot(lens, [paper_vjps(t)["total"] for t in lens], marker=".", label="paper 002")
    ax.plot(lens, [paper_vjps(t, window)["total"] for t in lens], marker=".", label=f"paper 002, T-bar={window}")
    ax.set_ylabel("VJPs per layer (count)")
    ax = axes[1]
    shape = SSM_SHAPES[sizes[0]]
    for m in ("autograd", "adjoint", f"adjoint_t{window}", "paper", f"paper_t{window}"):
        ax.plot(lens, [step_flops(shape, t, m)["total"] for t in lens], marker=".", label=m)
    ax.set_ylabel(f"FLOPs of one fwd+bwd step (count), {shape.name}")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Counted, not measured: adjoint sharding's VJPs and step FLOPs vs T", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", choices=sorted(SSM_SHAPES), default=["h32-L4", "h64-L4", "h32-L16"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS))
    p.add_argument("--truncation", type=int, default=64, help="T-bar of the truncated columns")
    p.add_argument("--chunk-size", type=int, default=1024,
                   help="the adjoint plan's chunk size (benchmarks.adjoint_memory's)")
    p.add_argument("--measured", nargs="+", default=[],
                   help="benchmarks.adjoint_memory CSVs to validate the count against (one table each)")
    p.add_argument("--time-scans", action="store_true",
                   help="also time linear_scan vs T and truncated_adjoint vs T-bar against their counts")
    p.add_argument("--scan-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--scan-windows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--window-len", type=int, default=4096, help="T of the truncated_adjoint timings")
    p.add_argument("--scan-threads", type=int, default=1,
                   help="torch threads for the scan timings (1: on a busy machine, 2 threads wait on each other)")
    p.add_argument("--out", default="benchmarks/results/adjoint_flops", help="writes <out>.md and <out>.png")
    args = p.parse_args(argv)
    command = "python -m benchmarks.adjoint_flops " + " ".join(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    timing = (time_scans(args.scan_lens, args.scan_windows, args.window_len, threads=args.scan_threads)
              if args.time_scans else None)
    text = report_markdown(args.sizes, args.seq_lens, args.truncation, args.measured, command, timing,
                           args.window_len, args.chunk_size)
    Path(args.out + ".md").write_text(text)
    plot(args.out + ".png", args.sizes, args.seq_lens, args.truncation)
    print(f"wrote {args.out}.md, {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
