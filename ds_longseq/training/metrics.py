"""Run metrics: metrics.jsonl, the rank-0 progress bar, peak memory, and the end-of-run plots.

Holds:
    peak_memory_gib: this process's peak memory (CUDA allocator peak, else the CPU high-water mark).
    plot_losses: loss against step, with an optional chance line, as a png.
    plot_panels: one panel per metric against step, as a png.
    MetricsLog: metrics.jsonl (kept up to the checkpoint with --resume), the tqdm bar, tokens/s, the plot.
"""

from __future__ import annotations

import json
import os
import resource
import time
from typing import TYPE_CHECKING

import torch

from ds_longseq.training.checkpoint import start_or_resume

if TYPE_CHECKING:
    from ds_longseq.training.run import Run

__all__ = ["peak_memory_gib", "plot_losses", "plot_panels", "MetricsLog"]


def peak_memory_gib() -> float:
    """Peak memory of this process in GiB: CUDA's allocator peak on GPU, the resident high-water mark on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    return plt


def plot_losses(
    metrics: list[dict], path: str, chance: float | None, title: str = "examples/sft.py",
    chance_label: str = "chance",
) -> None:
    """``metrics`` rows' ``loss`` against ``step`` as a png at ``path``; a dashed line at ``chance`` if given."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="training loss")
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle="--", label=chance_label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_panels(rows: list[dict], panels: list[tuple[str, str]], title: str, path: str) -> None:
    """One panel per (metric key, y label) of ``rows`` against their ``step``, as a png at ``path``.

    A row without the key plots as a gap (NaN), so metrics logged only on some steps still line up.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    steps = [m["step"] for m in rows]
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        ax.plot(steps, [m.get(key, float("nan")) for m in rows])
        ax.set_xlabel("step")
        ax.set_ylabel(label)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class MetricsLog:
    """metrics.jsonl (rank 0 writes), the rank-0 tqdm bar, tokens/s, and the plot at the end.

    With ``--resume`` it first loads the checkpoint ``latest`` points at into the engine
    (:func:`~ds_longseq.training.checkpoint.start_or_resume`): ``start_step`` is the first step to
    train, ``rows`` the metrics before it. The loop adds its tokens to ``tokens`` and calls
    :meth:`log` once per step.
    """

    def __init__(self, run: Run, name: str, bar_keys: tuple[str, ...]):
        """
        Args:
            run: the started run (its args name save_dir, resume and max_steps).
            name: the bar's label.
            bar_keys: the metrics shown on the bar (by their last ``/`` component).
        """
        from tqdm import tqdm

        self.run, self.bar_keys = run, bar_keys
        args = run.args
        os.makedirs(args.save_dir, exist_ok=True)
        self.path = os.path.join(args.save_dir, "metrics.jsonl")
        self.start_step, self.rows = start_or_resume(run.engine, args.save_dir, self.path, resume_run=args.resume,
                                                     max_steps=args.max_steps, rank=run.rank,
                                                     frozen_excluded=run.checkpoint_options["exclude_frozen"])
        self.tokens = 0
        self.bar = tqdm(total=args.max_steps, initial=self.start_step, disable=run.rank != 0,
                        dynamic_ncols=True, desc=name)
        self.t_start = time.perf_counter()

    def log(self, row: dict) -> None:
        """Add ``row`` (with its ``step``) and the tokens/s so far; rank 0 appends it to metrics.jsonl."""
        row["tokens/s"] = self.tokens / (time.perf_counter() - self.t_start)
        self.rows.append(row)
        post = {k.split("/")[-1]: f"{row[k]:.4f}" for k in self.bar_keys if k in row}
        self.bar.set_postfix(**post, tok_s=f"{row['tokens/s']:.0f}", peak_gib=f"{peak_memory_gib():.2f}")
        self.bar.update(1)
        if self.run.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def plot(self, panels: list[tuple[str, str]], title: str, filename: str) -> str:
        """One panel per (metric key, y label), against the step, in ``save_dir/filename``; returns its path."""
        path = os.path.join(self.run.args.save_dir, filename)
        plot_panels(self.rows, panels, title, path)
        return path
