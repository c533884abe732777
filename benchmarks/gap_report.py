"""The speed-gap script's combined table (issue 61): every measured row, its MFU, and the ratios against the targets.

    python -m benchmarks.gap_report OUT_DIR [MORE_DIRS...] [--short-len 32768 --long-len 131072]

Reads, from each folder, ``gap_ab.csv`` (benchmarks.run's rows of stages (a) and (b) of
``benchmarks/gpu_gap.sh``) and ``phase_*.json`` (benchmarks.phase_profile's record of stage (c)), and prints
one markdown table: method, length, steps (warm-up + timed: every row must be steady state, and says so),
tokens/s, peak allocated and reserved memory (above the post-build model, as benchmarks.run measures them),
MFU (``benchmarks/mfu.py``, against the device's dense bf16 peak, named under the table); then the ratios
against issue 61's targets (TARGETS). Writes ``<out>.md`` and ``<out>.csv`` (default ``OUT_DIR/gap_report``).
Several folders: the two device commands each bring back their own, and the table wants both.

Holds: Target and TARGETS, rows (the table's rows from the folders), ratio_lines, report_markdown, main.
Imports no torch: it runs where the files land, in a second.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shlex
import sys
from dataclasses import dataclass

from benchmarks import harness
from benchmarks.mfu import mfu, peak_tflops

__all__ = ["Target", "TARGETS", "rows", "ratio_lines", "report_markdown", "main"]

AB_CSV = "gap_ab.csv"
COLUMNS = ("method", "seq_len", "source", "warmup", "steps", "status", "tokens_per_s", "peak_alloc_gib",
           "peak_reserved_gib", "mfu", "peak_tflops", "device", "error")


@dataclass(frozen=True)
class Target:
    """One of issue 61's targets: the fastest of ``candidates`` against ``baseline`` at one length."""

    length: str  # "short" (32K on the GPU) or "long" (128K): the lengths come from the command line
    baseline: str
    candidates: tuple[str, ...]
    min_speedup: float  # candidate tokens/s over the baseline's
    max_memory: float | None = None  # candidate peak allocated over the baseline's (None: no memory target)


TARGETS = (
    Target("short", "hf_gc", ("streambp_auto", "streambp_auto_offload"), 1.05, 0.25),
    Target("long", "alst_offload", ("streambp_auto_offload",), 1.15),
)


def _steps_of(row: dict) -> tuple[int, int]:
    """(warm-up, timed) steps of a benchmarks.run row, read from its own command (else the suite's defaults)."""
    from benchmarks.run import SUITES, parse_args

    argv = shlex.split(row["command"])
    argv = argv[argv.index("benchmarks.run") + 1:] if "benchmarks.run" in argv else []
    args = parse_args(argv)
    suite = SUITES[row["suite"]]
    return (suite.warmup if args.warmup is None else args.warmup, suite.steps if args.steps is None else args.steps)


def _gib(mib) -> float | None:
    value = harness.num(mib)
    return None if value is None else value / 1024


def _mfu(suite: str, seq_len: int, tokens_per_s: float | None, device: str) -> tuple[float | None, float | None]:
    from benchmarks.run import SUITES

    peak = peak_tflops(device or "")
    if peak is None or not tokens_per_s:
        return None, None
    return mfu(tokens_per_s, SUITES[suite].shape, seq_len, peak[0]), peak[0]


def rows(folders: list[str]) -> tuple[list[dict], list[dict]]:
    """(the table's rows, the phase-profile records) from the folders' files; later folders' rows of the same
    method, length and source replace earlier ones."""
    table: dict[tuple, dict] = {}
    phases = []
    for folder in folders:
        for r in harness.read_csv(os.path.join(folder, AB_CSV)):
            if r["kind"] != "step":
                continue
            warmup, steps = _steps_of(r)
            tps = harness.num(r["tokens_per_s"]) if r["status"] == "ok" else None
            value, peak = _mfu(r["suite"], int(r["seq_len"]), tps, r["device"])
            table[(r["method"], int(r["seq_len"]), "a/b")] = dict(
                method=r["method"], seq_len=int(r["seq_len"]), source="benchmarks.run", warmup=warmup, steps=steps,
                status=r["status"], tokens_per_s=tps, peak_alloc_gib=_gib(r["peak_mib"]),
                peak_reserved_gib=_gib(r["reserved_mib"]), mfu=value, peak_tflops=peak, device=r["device"],
                error=r["error"])
        for path in sorted(glob.glob(os.path.join(folder, "phase_*.json"))):
            with open(path) as f:
                p = json.load(f)
            phases.append(p)
            value, peak = _mfu(p["suite"], p["seq_len"], p["tokens_per_s"], p["device"])
            table[(p["method"], p["seq_len"], "c")] = dict(
                method=p["method"], seq_len=p["seq_len"], source="phase_profile (phase-timed step)",
                warmup=p["warmup"], steps=p["steps"], status="ok", tokens_per_s=p["tokens_per_s"],
                peak_alloc_gib=_gib(p["peak_mib"]), peak_reserved_gib=_gib(p.get("reserved_mib")), mfu=value,
                peak_tflops=peak, device=p["device"], error="")
    ordered = sorted(table.values(), key=lambda r: (r["seq_len"], r["source"] != "benchmarks.run", r["method"]))
    return ordered, phases


def _by(table: list[dict], method: str, seq_len: int) -> dict | None:
    return next((r for r in table if r["method"] == method and r["seq_len"] == seq_len
                 and r["source"] == "benchmarks.run" and r["status"] == "ok" and r["tokens_per_s"]), None)


def _missing(table, method, seq_len) -> str:
    r = next((r for r in table if r["method"] == method and r["seq_len"] == seq_len), None)
    return f"{method} has no row" if r is None else f"{method}: {r['status']} {r['error']}".rstrip()


def ratio_lines(table: list[dict], lengths: dict[str, int]) -> list[str]:
    """One line per target: the ratios, the target, met or not (or what is missing)."""
    out = []
    for t in TARGETS:
        seq_len = lengths[t.length]
        base = _by(table, t.baseline, seq_len)
        found = [r for r in (_by(table, c, seq_len) for c in t.candidates) if r is not None]
        goal = f">= {t.min_speedup:.2f}x {t.baseline}'s tokens/s" + (
            f" at <= {t.max_memory:.2f}x its peak allocated memory" if t.max_memory is not None else "")
        if base is None or not found:
            why = "; ".join(_missing(table, m, seq_len) for m in (t.baseline, *t.candidates)
                            if _by(table, m, seq_len) is None)
            out.append(f"- {seq_len} tokens: not measured ({why}). Target {goal}.")
            continue
        best = max(found, key=lambda r: r["tokens_per_s"])
        speed = best["tokens_per_s"] / base["tokens_per_s"]
        which = f" (the faster of {', '.join(t.candidates)})" if len(t.candidates) > 1 else ""
        text = f"- {seq_len} tokens: {best['method']}{which} {speed:.2f}x {t.baseline}'s tokens/s"
        met = speed >= t.min_speedup
        if t.max_memory is not None:
            if best["peak_alloc_gib"] is None or not base["peak_alloc_gib"]:
                text += ", peak memory not measured"
                met = False
            else:
                memory = best["peak_alloc_gib"] / base["peak_alloc_gib"]
                text += f" at {memory:.2f}x its peak allocated memory"
                met = met and memory <= t.max_memory
        out.append(f"{text}. Target {goal}: {'met' if met else 'NOT met'}.")
    return out


def _fmt(x, spec: str) -> str:
    return "" if x is None or x == "" else format(x, spec)


def _gib_text(x) -> str:
    return "" if x is None else (f"{x:.2f}" if x >= 1 else f"{x:.4f}")


def _phase_lines(phases: list[dict]) -> list[str]:
    lines = []
    for p in phases:
        cuda = p["cuda"]
        key = "device_ms" if cuda else "host_ms"
        ours = sorted(((n, v) for n, v in p["phases"].items() if not n.startswith("step.")), key=lambda kv: -kv[1][key])
        step_ms = p["step_device_ms"] if cuda else 1e3 * p["step_s"]
        top = ", ".join(f"{n} {v[key] / step_ms:.0%}" for n, v in ours[:4])
        line = f"- Phase profile, {p['method']} at {p['seq_len']} tokens ({p['timing']}; phases nest): {top}."
        mix = p.get("kernel_mix")
        if mix:
            classes = ", ".join(f"{c} {v['share']:.0%}" for c, v in mix["classes"].items() if v["ms"] > 0)
            idle = "GPU idle" if cuda else "host time outside operators"
            line += f" Kernel mix ({mix['source']}): {classes}; {idle} {mix['idle_share']:.0%}."
        else:
            line += " Kernel mix: not measured."
        lines.append(line)
    return lines


def report_markdown(table: list[dict], phases: list[dict], lengths: dict[str, int]) -> str:
    peaks = sorted({(r["device"].split(" (")[0], r["peak_tflops"]) for r in table if r["peak_tflops"]})
    devices = sorted({r["device"].split(" (")[0] for r in table if r["device"]})
    mfu_note = ("MFU: model FLOPs per step (benchmarks/mfu.py: frozen base, so input gradients only; causal "
                "attention; LoRA's own ~1% left out) over the dense bf16 peak of "
                + "; ".join(f"{d}, {p:.0f} TFLOP/s" for d, p in peaks) + "."
                if peaks else f"MFU: none (no dense bf16 peak known for {', '.join(devices) or 'the device'}).")
    lines = ["# Speed gap (issue 61): combined table", ""]
    lines += _phase_lines(phases)
    lines += ["", f"Peak memory: above the post-build model (benchmarks.run's baseline; GPU: max_memory_allocated / "
              f"max_memory_reserved; CPU: RSS growth, no reserved). Steps: warm-up + timed (the timed steps' median "
              f"gives tokens/s). {mfu_note}", "",
              "| method | tokens | steps (warm-up + timed) | tokens/s | peak allocated GiB | peak reserved GiB | MFU "
              "| source |", "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in table:
        steady = f"{r['warmup']} + {r['steps']}" + ("" if r["warmup"] >= 1 else " (NOT steady state)")
        speed = _fmt(r["tokens_per_s"], ".0f") if r["status"] == "ok" else f"{r['status']}: {r['error']}"
        lines.append(f"| {r['method']} | {r['seq_len']} | {steady} | {speed} | {_gib_text(r['peak_alloc_gib'])} | "
                     f"{_gib_text(r['peak_reserved_gib'])} | {_fmt(r['mfu'], '.1%')} | {r['source']} |")
    lines += ["", "Ratios against issue 61's targets (benchmarks.run rows at the same length):"]
    lines += ratio_lines(table, lengths)
    return "\n".join(lines) + "\n"


def write_csv(table: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in table:
            writer.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="folders holding gap_ab.csv and / or phase_*.json")
    p.add_argument("--short-len", type=int, default=32768, help="the length of the checkpointing target")
    p.add_argument("--long-len", type=int, default=131072, help="the length of the ALST target")
    p.add_argument("--out", default=None, help="output prefix (.md, .csv); default FIRST_FOLDER/gap_report")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    table, phases = rows(args.folders)
    text = report_markdown(table, phases, {"short": args.short_len, "long": args.long_len})
    out = args.out or os.path.join(args.folders[0], "gap_report")
    with open(out + ".md", "w") as f:
        f.write(text)
    write_csv(table, out + ".csv")
    print(f"wrote {out}.md, {out}.csv\n")
    print(text, end="")  # last: the device call's reply carries the end of the output
    return 0


if __name__ == "__main__":
    sys.exit(main())
