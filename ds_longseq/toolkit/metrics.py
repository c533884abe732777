"""Run metrics: metrics.jsonl, DeepSpeed's monitor, the rank-0 progress bar, peak memory, and the end-of-run plots.

Holds:
    peak_memory_gib: this process's peak memory (CUDA allocator peak, else the CPU high-water mark).
    host_memory_gib: this process's resident memory now and its high-water mark.
    training_flops_per_token: the model FLOPs of one trained token (the MFU numerator's formula).
    device_peak_flops: the accelerator's peak FLOP/s for the run's dtype, when known (the MFU denominator).
    BackwardProgress: rank 0's sign of life inside a long step: which decoder layer the backward has reached.
    LogLines: the progress bar in a non-interactive log (a file, a job's output): one line at most every N seconds.
    plot_losses: loss against step, with an optional chance line, as a png.
    plot_panels: one panel per metric against step, as a png.
    MetricsLog: per optimizer step the loss, learning rate, gradient norm, tokens/s, MFU and peak memory into
        metrics.jsonl (kept up to the checkpoint with --resume) and DeepSpeed's monitor; the tqdm bar; the plot.

MFU (model FLOPs utilisation) = the step's model FLOPs / (step time x ranks x one device's peak FLOP/s). Model FLOPs
of a trained token (:func:`training_flops_per_token`): 2 per weight in the forward, 2 per weight for the input
gradient, 2 per trainable weight for its own gradient (so 6 N for full training, 4 N + 2 N_trainable with LoRA),
over every weight that multiplies (the input embedding is a lookup: left out; a tied LM head counted), plus causal
attention's 6 x layers x (heads x head_dim) x seq_len (QK^T and AV, forward and backward, at the average causal
length seq_len / 2). Recomputation (StreamBP's replay, checkpointing) is not model FLOPs: it lowers MFU, as it
should. Counted as if every layer were full attention and every MoE expert ran: an upper bound on sliding-window,
linear-attention and MoE layers (MFU overstated there). The peak: ``DS_LONGSEQ_PEAK_TFLOPS`` when set, else the dense
bf16 tensor-core peak of a known GPU (H100 / H200: 989 TFLOP/s; A100: 312); None otherwise (CPU, other dtypes):
then MFU is null.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import TYPE_CHECKING

import torch

from ds_longseq.compat import full_numel
from ds_longseq.logging import get_logger
from ds_longseq.toolkit.checkpoint import start_or_resume

if TYPE_CHECKING:
    from ds_longseq.toolkit.run import Run

logger = get_logger(__name__)

__all__ = ["peak_memory_gib", "host_memory_gib", "training_flops_per_token", "device_peak_flops", "BackwardProgress",
           "LogLines", "LOG_LINE_EVERY_S", "plot_losses", "plot_panels", "MetricsLog", "MONITOR_PREFIX",
           "WANDB_STEP"]

PEAK_FLOPS_ENV = "DS_LONGSEQ_PEAK_TFLOPS"
"""Environment variable: one device's peak TFLOP/s for MFU (overrides the table below; the only source on CPU)."""

# Dense bf16 tensor-core peaks (the vendors' datasheets, without sparsity), by a substring of the device name
_PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.1}

MONITOR_PREFIX = "Train/ds_longseq/"
"""What :class:`MetricsLog` puts before each metric's key in DeepSpeed's monitor."""
WANDB_STEP = MONITOR_PREFIX + "step"
"""The optimizer step in a W&B run: the x axis of the run's metrics there (W&B's own step counts DeepSpeed's
samples)."""


def peak_memory_gib() -> float:
    """Peak memory of this process in GiB: CUDA's allocator peak on GPU (since its peak statistics were last reset:
    :class:`MetricsLog` resets them every step and keeps the run's peak itself, ``MetricsLog.peak_gib``), the
    resident high-water mark on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return host_memory_gib()[1]


def host_memory_gib() -> tuple[float, float]:
    """(resident memory now, its high-water mark) of this process in GiB: Linux's VmRSS and VmHWM; elsewhere the
    high-water mark (``ru_maxrss``) twice."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "VmHWM:")))
        return int(fields["VmRSS"].split()[0]) / 2**20, int(fields["VmHWM"].split()[0]) / 2**20  # KiB -> GiB
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return peak, peak


def training_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Model FLOPs of one trained token in rows of ``seq_len`` tokens, forward and backward (the module docstring
    gives the formula). ``model``: the causal LM, or a PEFT model around one; ZeRO-3 partitioned parameters count
    whole."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = trainable = 0
    for p in model.parameters():
        if p is embedding:
            continue
        total += full_numel(p)
        trainable += full_numel(p) if p.requires_grad else 0
    if head is not None and head.weight is embedding:  # tied: the head's matmul still runs
        total += full_numel(embedding)
        trainable += full_numel(embedding) if embedding.requires_grad else 0
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    attention = 6 * text.num_hidden_layers * heads * head_dim * seq_len
    return 4.0 * total + 2.0 * trainable + attention


def device_peak_flops(dtype: torch.dtype) -> float | None:
    """One device's peak FLOP/s for MFU: ``DS_LONGSEQ_PEAK_TFLOPS``, else a known GPU's dense bf16 peak (bf16 runs
    only), else None."""
    override = os.environ.get(PEAK_FLOPS_ENV)
    if override:
        try:
            return float(override) * 1e12
        except ValueError:
            raise SystemExit(f"{PEAK_FLOPS_ENV}={override!r}: give one device's peak in TFLOP/s, e.g. 989") from None
    if not torch.cuda.is_available() or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name()
    return next((tflops * 1e12 for key, tflops in _PEAK_BF16_TFLOPS.items() if key in name), None)


LOG_LINE_EVERY_S = 30.0
"""How often the progress bar prints a line when its output is not a terminal."""


class LogLines:
    """What tqdm writes to, in place of stderr when that is not a terminal: each refresh of the bar (its carriage
    returns dropped) kept, and printed as one line at most every ``every_s`` seconds, the last one when the bar
    closes (:meth:`finish`). On a terminal the bar redraws in place; in a job's log file those redraws would pile up
    on one ever-growing line."""

    def __init__(self, stream, every_s: float = LOG_LINE_EVERY_S):
        self.stream, self.every_s = stream, every_s
        self._pending: str | None = None
        self._last = float("-inf")

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self._pending = line
            now = time.monotonic()
            if now - self._last >= self.every_s:
                self._last = now
                self._emit()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def finish(self) -> None:
        """Print the last state not printed yet."""
        self._emit()

    def _emit(self) -> None:
        if self._pending is not None:
            self.stream.write(self._pending + "\n")
            self.stream.flush()
            self._pending = None


class BackwardProgress:
    """A sign of life inside a long step, on rank 0: the decoder layer the backward has reached.

    A forward hook on every decoder layer puts a gradient hook on its output, which fires when the backward reaches
    that layer. Rate-limited: the bar's postfix at most every ``bar_every_s`` seconds, a log line at most every
    ``log_every_s`` seconds (a step of minutes shows where it is; a fast step shows nothing extra). Undo with
    :meth:`remove`.
    """

    def __init__(self, model: torch.nn.Module, bar, bar_every_s: float = 2.0, log_every_s: float = 60.0):
        from ds_longseq.patch import decoder_layers

        self.bar, self.bar_every_s, self.log_every_s = bar, bar_every_s, log_every_s
        self.layers = decoder_layers(model)
        self.step = 0
        self._step_start = self._last_bar = self._last_log = time.perf_counter()
        self._handles = [layer.register_forward_hook(self._on_forward(i)) for i, layer in enumerate(self.layers)]

    def start_step(self, step: int) -> None:
        self.step, self._step_start = step, time.perf_counter()

    def _on_forward(self, index: int):
        def hook(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self._reached(index))
        return hook

    def _reached(self, index: int) -> None:
        now = time.perf_counter()
        where = f"layer {index + 1}/{len(self.layers)}"
        if now - self._last_bar >= self.bar_every_s:
            self._last_bar = now
            self.bar.set_description_str(f"{self.bar.desc.split(' [')[0]} [step {self.step + 1} backward {where}]")
        if now - self._last_log >= self.log_every_s and now - self._step_start >= self.log_every_s:
            self._last_log = now
            logger.info("step %d: backward at decoder %s, %.0f s into the step", self.step + 1, where,
                        now - self._step_start)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


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
    """metrics.jsonl (rank 0 writes), DeepSpeed's monitor, the rank-0 tqdm bar, and the plot at the end.

    With ``--resume`` it first loads the checkpoint ``latest`` points at into the engine
    (:func:`~ds_longseq.toolkit.checkpoint.start_or_resume`): ``start_step`` is the first step to
    train, ``rows`` the metrics before it. The loop adds the step's real tokens (every replica's, padding left out)
    to ``tokens`` and calls :meth:`log` once per optimizer step, which adds to the row:

    - ``lr``: the learning rate the step used; ``grad_norm``: DeepSpeed's global gradient norm (before clipping;
      null where DeepSpeed did not compute one);
    - ``step_s``, ``tokens/s`` (this step's real tokens over its wall time), ``mfu`` (null without a known peak:
      see the module docstring);
    - ``gpu_peak_gib`` (the allocator's peak during the step; null on CPU), ``host_rss_gib``, ``host_peak_gib``.

    When the DeepSpeed config enables a monitor (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``; ``--report-to``
    turns them on: :mod:`~ds_longseq.toolkit.report_to`), every numeric value goes there too, as
    ``Train/ds_longseq/<key>`` at the step; in W&B against :data:`WANDB_STEP`, and the W&B run is finished by
    :meth:`close`.
    """

    def __init__(self, run: Run, name: str, bar_keys: tuple[str, ...]):
        """
        Args:
            run: the started run (its args name save_dir, resume, max_steps and seq_len).
            name: the bar's label.
            bar_keys: the metrics shown on the bar (by their last ``/`` component).
        """
        from tqdm import tqdm

        self.run, self.bar_keys = run, bar_keys
        args = run.args
        os.makedirs(args.save_dir, exist_ok=True)
        self.path = os.path.join(args.save_dir, "metrics.jsonl")
        self.start_step, self.rows = start_or_resume(run.engine, args.save_dir, self.path, resume_run=args.resume,
                                                     claim=run.claim,
                                                     max_steps=args.max_steps, rank=run.rank,
                                                     frozen_excluded=run.checkpoint_options["exclude_frozen"])
        self.tokens = 0
        self.lines = None if sys.stderr.isatty() else LogLines(sys.stderr)
        self.bar = tqdm(total=args.max_steps, initial=self.start_step, disable=run.rank != 0,
                        dynamic_ncols=self.lines is None, desc=name, file=self.lines or sys.stderr)
        self.flops_per_token = training_flops_per_token(run.model, args.seq_len)
        self.peak_flops = device_peak_flops(run.dtype)
        self.progress = BackwardProgress(run.model, self.bar) if run.rank == 0 else None
        self._wandb = _wandb_of(run.engine)
        self.t_start = self._t_step = time.perf_counter()
        self._tokens_before = 0
        self.peak_gib = 0.0
        """The run's peak memory per rank so far, GiB: the device's (the steps' allocator peaks) on GPU, the host's
        on CPU."""
        self._begin_step(self.start_step)

    def _begin_step(self, step: int) -> None:
        self._lr = float(self.run.engine.get_lr()[0])  # the rate this step trains with (the scheduler moves after it)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if self.progress is not None:
            self.progress.start_step(step)

    def log(self, row: dict) -> None:
        """Add ``row`` (with its ``step``) and the step's training metrics; rank 0 appends it to metrics.jsonl and
        writes it to DeepSpeed's monitor."""
        now = time.perf_counter()
        engine, step_s = self.run.engine, now - self._t_step
        step_tokens = self.tokens - self._tokens_before
        grad_norm = engine.get_global_grad_norm()
        rss, host_peak = host_memory_gib()
        row.update({
            "lr": self._lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "step_s": step_s,
            "tokens/s": step_tokens / step_s,
            "mfu": (None if self.peak_flops is None
                    else step_tokens * self.flops_per_token / (step_s * self.run.world * self.peak_flops)),
            "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "host_rss_gib": rss,
            "host_peak_gib": host_peak,
        })
        self.peak_gib = max(self.peak_gib, host_peak if row["gpu_peak_gib"] is None else row["gpu_peak_gib"])
        self.rows.append(row)
        post = {k.split("/")[-1]: f"{row[k]:.4f}" for k in self.bar_keys if k in row}
        self.bar.set_postfix(**post, tok_s=f"{row['tokens/s']:.0f}", peak_gib=f"{self.peak_gib:.2f}")
        self.bar.update(1)
        if self.run.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        monitor = getattr(engine, "monitor", None)
        if monitor is not None and monitor.enabled:  # DeepSpeed's MonitorMaster writes on rank 0 only
            events = [(MONITOR_PREFIX + key, value, row["step"]) for key, value in row.items()
                      if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]
            if self._wandb is None:
                monitor.write_events(events)
            else:
                # W&B keeps one step counter per run, which DeepSpeed's own events (Train/Samples/lr) move in samples:
                # written at the optimizer step, as DeepSpeed's monitor would, every row after the first would be
                # behind it and dropped. Logged without a step, against WANDB_STEP (_wandb_of's define_metric).
                self._wandb.log({**{name: value for name, value, _ in events}, WANDB_STEP: row["step"]})
                for other in (monitor.tb_monitor, monitor.csv_monitor, monitor.comet_monitor):
                    if other is not None:
                        other.write_events(events)
        self._t_step, self._tokens_before = time.perf_counter(), self.tokens
        self._begin_step(row["step"])

    @property
    def mean_tokens_per_s(self) -> float:
        """Real tokens per second over the run so far (start-up after the model was built included)."""
        return self.tokens / (time.perf_counter() - self.t_start)

    def close(self) -> None:
        """The bar closed and the progress hooks removed (the model is as it was)."""
        self.bar.close()
        if self.lines is not None:
            self.lines.finish()
        if self.progress is not None:
            self.progress.remove()
        if self._wandb is not None:  # written out now, not left to interpreter exit (which a killed rank never sees)
            self._wandb.finish()
            self._wandb = None

    def plot(self, panels: list[tuple[str, str]], title: str, filename: str) -> str:
        """One panel per (metric key, y label), against the step, in ``save_dir/filename``; returns its path."""
        path = os.path.join(self.run.args.save_dir, filename)
        plot_panels(self.rows, panels, title, path)
        return path


def _wandb_of(engine):
    """The ``wandb`` module when the engine's DeepSpeed monitor writes to a W&B run (rank 0 with a wandb section on),
    with the run's metrics set to plot against :data:`WANDB_STEP`; else None."""
    if getattr(getattr(engine, "monitor", None), "wandb_monitor", None) is None:
        return None
    import wandb

    wandb.define_metric(WANDB_STEP)
    wandb.define_metric(MONITOR_PREFIX + "*", step_metric=WANDB_STEP)
    return wandb
