"""Convergence with and without Approx-BP: loss curves of ``examples/sft.py`` runs, a plot and a table.

Reads the ``metrics.jsonl`` of several runs of ``examples/sft.py`` (one ``{"step", "loss"}`` line per
step) that differ only in their ``long_seq.approx_bp`` section (same seed, steps, data, model), and
writes ``<out>.png`` (loss vs step, one line per run; below, each run's difference to its exact
baseline, both smoothed over ``--window`` steps) and ``<out>.md`` with, per run:
    final loss:      mean of the last ``--window`` steps;
    - exact:         that minus the baseline's final loss;
    max |diff|:      the largest |smoothed run - smoothed baseline| over the run;
    below level:     the first step at which the run's smoothed loss is below the baseline's level,
                     halfway between the baseline's first loss and its final loss (the step where
                     the baseline's curve is half way down).
Smoothing is a trailing mean (the first steps average what there is), so a step's value uses no later
loss. The baseline of a run is the first ``--run`` unless ``--baseline RUN BASE`` says otherwise (one
baseline per seed when several seeds are compared).

Example (the commands that produced the runs go to the top of the markdown with ``--command``):
    python -m benchmarks.approx_convergence \\
        --run exact /tmp/conv/exact/metrics.jsonl --run approx /tmp/conv/approx/metrics.jsonl \\
        --command "deepspeed --num_gpus 2 examples/sft.py ..." --out benchmarks/results/approx_convergence
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WINDOW = 20


def read_losses(path) -> list[float]:
    """The per-step losses of one ``metrics.jsonl``, in step order (steps must be 1..N without gaps)."""
    with open(path) as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    metrics.sort(key=lambda m: m["step"])
    steps = [m["step"] for m in metrics]
    if steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"{path}: steps are not 1..{len(steps)} (a resumed or truncated run?)")
    return [float(m["loss"]) for m in metrics]


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _final(values: list[float], window: int) -> float:
    tail = values[-window:]
    return sum(tail) / len(tail)


def level_of(baseline: list[float], window: int = WINDOW) -> float:
    """Half way between the baseline's first loss and its final loss (mean of the last ``window``)."""
    return (baseline[0] + _final(baseline, window)) / 2


def _first_below(values: list[float], level: float) -> int | None:
    """The 1-based step of the first value below ``level``, or None."""
    return next((i + 1 for i, v in enumerate(values) if v < level), None)


def summarise(losses: dict[str, list[float]], window: int = WINDOW, baselines: dict[str, str] | None = None):
    """Per-run rows (dicts: run, baseline, final, final_diff, max_diff, level, below_step) and the level
    of the first run's baseline (the first run itself unless ``baselines`` names another).

    ``baselines``: run -> the run it is compared with; default: the first run in ``losses``.
    """
    names = list(losses)
    baselines = dict(baselines or {})
    first = names[0]
    rows = []
    for name in names:
        base = baselines.get(name, first if name not in baselines.values() else name)
        ref = losses[base]
        smooth, smooth_ref = _smooth(losses[name], window), _smooth(ref, window)
        n = min(len(smooth), len(smooth_ref))
        level = level_of(ref, window)
        final = _final(losses[name], window)
        rows.append(
            dict(
                run=name,
                baseline=base,
                steps=len(losses[name]),
                final=final,
                final_diff=final - _final(ref, window),
                max_diff=max(abs(smooth[i] - smooth_ref[i]) for i in range(n)),
                level=level,
                below_step=_first_below(smooth, level),
            )
        )
    return rows, rows[0]["level"]


def report_markdown(rows: list[dict], window: int, commands: list[str], sources: dict[str, str],
                    notes: list[str] = ()) -> str:
    out = ["# Convergence with and without Approx-BP (`examples/sft.py`, embedded copy task)", ""]
    if commands:
        out += ["Commands that produced the runs:", "", "```"] + list(commands) + ["```", ""]
    out += [
        f"Smoothing: trailing mean over {window} steps. *final*: mean loss of the last {window} steps. "
        "*max |diff|*: largest |smoothed run - smoothed baseline| over the run. *below level*: first step at "
        "which the smoothed loss is below the level half way between the baseline's first and final loss.",
        "",
        "| run | baseline | steps | final loss | final - baseline | max abs smoothed diff | level "
        "| below level at step |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        below = "never" if r["below_step"] is None else str(r["below_step"])
        out.append(
            f"| {r['run']} | {r['baseline']} | {r['steps']} | {r['final']:.4f} | {r['final_diff']:+.4f} | "
            f"{r['max_diff']:.4f} | {r['level']:.3f} | {below} |"
        )
    out += ["", "Metrics read from:", ""] + [f"- {name}: `{path}`" for name, path in sources.items()]
    if notes:
        out += [""] + list(notes)
    return "\n".join(out) + "\n"


def plot(losses: dict[str, list[float]], rows: list[dict], window: int, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colors = {}
    for name, values in losses.items():
        steps = range(1, len(values) + 1)
        (line,) = top.plot(steps, values, lw=0.6, alpha=0.35)
        colors[name] = line.get_color()
        top.plot(steps, _smooth(values, window), lw=1.6, color=colors[name], label=name)
    level = rows[0]["level"]
    top.axhline(level, color="grey", ls=":", lw=1, label=f"level {level:.2f} (half way, {rows[0]['baseline']})")
    top.set_ylabel(f"training loss (thin: per step; thick: {window}-step mean)")
    top.set_title(title)
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    for r in rows:
        if r["run"] == r["baseline"]:
            continue
        a, b = _smooth(losses[r["run"]], window), _smooth(losses[r["baseline"]], window)
        n = min(len(a), len(b))
        bottom.plot(range(1, n + 1), [a[i] - b[i] for i in range(n)], color=colors[r["run"]],
                    label=f"{r['run']} - {r['baseline']}")
    bottom.axhline(0.0, color="black", lw=0.8)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"loss difference ({window}-step mean)")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", nargs=2, action="append", required=True, metavar=("NAME", "METRICS_JSONL"),
                   help="one run (repeat); the first is the default baseline")
    p.add_argument("--baseline", nargs=2, action="append", default=[], metavar=("RUN", "BASE"),
                   help="compare RUN with BASE instead of the first run (repeat)")
    p.add_argument("--window", type=int, default=WINDOW, help="smoothing window and final-loss window, in steps")
    p.add_argument("--command", action="append", default=[], help="a command that produced the runs (repeat)")
    p.add_argument("--note", action="append", default=[], help="a paragraph appended to the markdown (repeat)")
    p.add_argument("--title", default="examples/sft.py embedded task: exact BP vs Approx-BP")
    p.add_argument("--out", default="benchmarks/results/approx_convergence", help="output prefix for .md/.png")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sources = {name: path for name, path in args.run}
    losses = {name: read_losses(path) for name, path in args.run}
    baselines = {run: base for run, base in args.baseline}
    for run, base in baselines.items():
        if run not in losses or base not in losses:
            raise SystemExit(f"--baseline {run} {base}: both must be names given with --run")
    rows, _ = summarise(losses, args.window, baselines)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".md").write_text(report_markdown(rows, args.window, args.command, sources, args.note))
    plot(losses, rows, args.window, args.out + ".png", args.title)
    for r in rows:
        print(f"{r['run']:>16}: final {r['final']:.4f} ({r['final_diff']:+.4f} vs {r['baseline']}), "
              f"max |diff| {r['max_diff']:.4f}, below {r['level']:.3f} at step {r['below_step']}")
    print(f"wrote {args.out}.md, {args.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
