"""Loss curves of examples/sft.py runs with and without ``long_seq.approx_bp``: plot and table.

Reads each run's ``metrics.jsonl`` (one ``{"step", "loss"}`` line per optimizer step, written by
``examples/sft.py``), and writes ``<out>.png`` (loss against step per run; below it, each run's loss
minus the exact run's, both smoothed over ``--window`` steps) and ``<out>.md`` (final loss as the mean
of the last ``--window`` steps, the largest |smoothed difference| to the exact run, the first step at
which each smoothed curve falls below a level halfway between the exact run's first and final loss).

    python -m benchmarks.approx_convergence --runs exact=/tmp/conv/exact/metrics.jsonl \\
        approx=/tmp/conv/approx/metrics.jsonl --out benchmarks/results/approx_convergence \\
        --command "deepspeed --num_gpus 2 examples/sft.py --ds_config ... --seed 0 --max-steps 400"
"""

from __future__ import annotations

import argparse
import json


def _load(path: str) -> list[float]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]


def _smooth(xs: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (the first points average what there is)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= window:
            total -= xs[i - window]
        out.append(total / min(i + 1, window))
    return out


def summarise(runs: dict[str, list[float]], window: int, reference: str = "exact") -> tuple[list[dict], float]:
    """Per run: final loss, max |smoothed difference| to ``reference``, first step below the level."""
    ref = _smooth(runs[reference], window)
    level = (ref[0] + sum(runs[reference][-window:]) / window) / 2
    rows = []
    for name, losses in runs.items():
        sm = _smooth(losses, window)
        n = min(len(sm), len(ref))
        below = next((i + 1 for i, v in enumerate(sm) if v < level), None)
        rows.append({
            "run": name,
            "steps": len(losses),
            "final": sum(losses[-window:]) / window,
            "max_diff": max(abs(sm[i] - ref[i]) for i in range(n)),
            "below_step": below,
        })
    return rows, level


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", required=True, metavar="NAME=METRICS", help="the first run named 'exact'")
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--out", required=True, help="prefix for .png and .md")
    p.add_argument("--command", action="append", default=[], help="the command that produced the runs (repeatable)")
    args = p.parse_args(argv)
    runs = dict(item.split("=", 1) for item in args.runs)
    if "exact" not in runs:
        raise SystemExit("--runs needs a run named 'exact' (the reference)")
    losses = {name: _load(path) for name, path in runs.items()}
    rows, level = summarise(losses, args.window)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    ref = _smooth(losses["exact"], args.window)
    for name, ls in losses.items():
        top.plot(range(1, len(ls) + 1), ls, label=name, linewidth=0.8)
        sm = _smooth(ls, args.window)
        if name != "exact":
            n = min(len(sm), len(ref))
            bottom.plot(range(1, n + 1), [sm[i] - ref[i] for i in range(n)], label=name, linewidth=0.9)
    top.axhline(level, color="gray", linestyle=":", linewidth=0.8)
    top.set_ylabel("training loss")
    top.legend()
    top.set_title("examples/sft.py: exact backprop vs long_seq.approx_bp")
    bottom.axhline(0.0, color="black", linewidth=0.6)
    bottom.set_ylabel(f"loss - exact\n({args.window}-step mean)")
    bottom.set_xlabel("optimizer step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)

    lines = ["# Convergence with and without long_seq.approx_bp (examples/sft.py, embedded task)", ""]
    lines += ["Commands:", ""] + [f"    {c}" for c in args.command] + [""]
    lines += [
        f"Plot: `{args.out.split('/')[-1]}.png`. Final loss: mean of the last {args.window} steps. Max |diff|: "
        f"largest gap between a run's and the exact run's {args.window}-step trailing means. Level: "
        f"{level:.3f}, halfway between the exact run's first smoothed loss and its final loss.",
        "",
        "| run | steps | final loss | final - exact | max abs diff to exact | first step below level |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    exact_final = next(r["final"] for r in rows if r["run"] == "exact")
    for r in rows:
        lines.append(
            f"| {r['run']} | {r['steps']} | {r['final']:.4f} | {r['final'] - exact_final:+.4f} | "
            f"{r['max_diff']:.4f} | {r['below_step'] if r['below_step'] else 'never'} |"
        )
    text = "\n".join(lines) + "\n"
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
