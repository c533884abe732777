"""What examples/dpo.py and examples/grpo.py share, on top of examples/sft.py's helpers.

Holds:
    add_common_args: the flags every example takes (config, model, data, lengths, steps, LoRA, ...).
    Run / setup_run: DeepSpeed start-up (process group, logging, config checked against the arguments,
        dtype, learning rate) and the ds_longseq engine around the policy.
    Reference: a frozen copy of the initial policy run through the same chunked path under no_grad
        (with LoRA: the policy itself with its adapters disabled).
    token_logprobs: one micro-batch's per-token log-probs (sharded under sequence parallelism).
    read_jsonl: (re-exported from sft.py) records of a JSONL file, with errors that name path:line.
    MetricsLog: metrics.jsonl (kept up to the checkpoint with --resume), the rank-0 progress bar,
        the end-of-run plot, and the step to start from.
    step_done: the checkpoint every --save-every steps and at the last one.

sft.py stays the owner of the start-up, model builder, LoRA, JSONL reader, checkpoint and export
code; this module imports them from there (the launched script's directory, examples/, is on
sys.path).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from sft import (
    DEFAULT_LR,
    add_lora,
    build_model,
    check_args,
    export_hf,
    peak_memory_gib,
    read_jsonl,
    save_if_due,
    set_learning_rate,
    start_distributed,
    start_or_resume,
)

import ds_longseq
import ds_longseq.engine
from ds_longseq.engine import sequence_parallel_rank_and_size, shard_batch
from ds_longseq.ops import TokenLogprobs

__all__ = ["add_common_args", "check_common_args", "Run", "setup_run", "Reference", "token_logprobs",
           "read_jsonl", "MetricsLog", "step_done", "DEFAULT_LR"]


def add_common_args(p: argparse.ArgumentParser, *, save_dir: str, max_steps: int, seq_len: int, lr: float) -> None:
    """The flags dpo.py and grpo.py share with sft.py (same names, same meaning)."""
    p.add_argument("--ds_config", "--ds-config", dest="ds_config", default="ds_configs/zero2_streambp.json",
                   help="DeepSpeed JSON config with an optional long_seq section")
    p.add_argument("--model", default=None,
                   help="local HF causal-LM path (from_pretrained); default: tiny built-in Llama")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per row (prompt + completion), padded")
    p.add_argument("--max-steps", type=int, default=max_steps, help="training steps")
    p.add_argument("--save-dir", default=save_dir, help="checkpoints, metrics, plot and HF export")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --save-dir (same data, same losses)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: the config's; {lr} for the built-in model)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 on GPU, fp32 on CPU (overrides the config's bf16 section)")
    p.add_argument("--pad-for-sp", action="store_true",
                   help="pad rows on the right to a multiple of the sequence_parallel size (else: an error)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train a LoRA adapter of this rank (needs peft); the reference is then the policy with its "
                        "adapters disabled; 0: train every weight")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator; default: 2 x --lora-rank")
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated module names LoRA adapts; default: every linear projection of the decoder")
    p.add_argument("--merge-lora", action="store_true",
                   help="with --lora-rank: also write the base model with the adapter merged in to hf_model/")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    # sft.check_args / sft.save_checkpoint read these sft-only attributes.
    p.set_defaults(pack=False, crash_step=0, sigkill_at=None, default_lr=lr)


def check_common_args(args: argparse.Namespace) -> None:
    """sft.py's checks of the shared flags (lengths, steps, --data needs --model, LoRA flags)."""
    check_args(args)


@dataclasses.dataclass
class Run:
    """A started run: the engine around the policy and where this rank stands."""

    args: argparse.Namespace
    engine: object
    model: torch.nn.Module
    long_seq: object
    dtype: torch.dtype
    rank: int
    world: int
    sp_rank: int
    sp_size: int
    micro_bs: int
    gas: int

    @property
    def replica(self) -> int:
        """This rank's data-parallel replica (the ranks of a sequence-parallel group share one)."""
        return self.rank // self.sp_size

    @property
    def num_replicas(self) -> int:
        return self.world // self.sp_size


def setup_run(args: argparse.Namespace, before_model=None) -> Run:
    """Start DeepSpeed, check the config against the arguments, build the policy and its engine.

    ``before_model()`` runs after the config checks and before the model is built: the place to
    read and validate data, so that bad input fails before any weight is allocated.
    """
    rank, world, ds_config, long_seq, use_bf16 = start_distributed(args)
    set_learning_rate(ds_config, args.lr if args.lr is not None else (None if args.model else args.default_lr))
    if before_model is not None:
        before_model()

    dtype = torch.bfloat16 if use_bf16 else torch.float32
    model = build_model(args, dtype)
    if args.lora_rank:
        model = add_lora(model, args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = ds_longseq.engine.initialize(model=model, model_parameters=trainable, config=ds_config)
    sp_rank, sp_size = sequence_parallel_rank_and_size()
    return Run(args, engine, model, long_seq, dtype, rank, world, sp_rank, sp_size,
               ds_config.get("train_micro_batch_size_per_gpu", 1), ds_config.get("gradient_accumulation_steps", 1))


class Reference:
    """The frozen initial policy, for reference log-probs under no_grad.

    Without LoRA: a second copy of the model built as the policy was (same --model or the same
    seeded built-in weights), enabled with the same long_seq settings (chunked head, StreamBP,
    sequence parallelism), so its log-probs come through the same chunked path. With LoRA: no
    second model; the policy with its adapters disabled is the base it started from.
    """

    def __init__(self, run: Run):
        self.run = run
        self.model = None
        if not run.args.lora_rank:
            model = build_model(run.args, run.dtype)
            # Default sp_group: DeepSpeed's sequence-parallel group, which engine.initialize set up.
            self.model = ds_longseq.enable(model, run.long_seq).to(run.engine.device).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> TokenLogprobs:
        if self.model is not None:
            return self.model(**batch, use_cache=False, return_token_logprobs=True)
        with self.run.engine.module.disable_adapter():
            return self.run.engine(**batch, use_cache=False, return_token_logprobs=True)


def token_logprobs(model, batch: dict[str, torch.Tensor]) -> TokenLogprobs:
    """Per-token log-probs of ``batch['labels']`` (or its ``shift_labels`` shard) under ``model``."""
    return model(**batch, use_cache=False, return_token_logprobs=True)


def prepare(run: Run, batch: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """This rank's shard of ``batch`` (whole rows without sequence parallelism), on its device."""
    if run.sp_size > 1:
        batch = shard_batch(batch, run.sp_rank, run.sp_size, pad=run.args.pad_for_sp, pad_token_id=pad_id)
    return {k: v.to(run.engine.device) for k, v in batch.items()}


def pad_row(ids: list[int], labels: list[int], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row of exactly ``seq_len`` tokens: ``ids`` (already at most seq_len) then padding."""
    pad = seq_len - len(ids)
    return {
        "input_ids": torch.tensor(ids + [pad_id] * pad),
        "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
        "labels": torch.tensor(labels + [-100] * pad),
    }


class MetricsLog:
    """metrics.jsonl (rank 0 writes), the rank-0 tqdm bar, tokens/s, and the plot at the end.

    With ``--resume`` it first loads the checkpoint ``latest`` points at into the engine
    (:func:`sft.start_or_resume`): ``start_step`` is the first step to train, ``rows`` the metrics
    before it.
    """

    def __init__(self, run: Run, name: str, bar_keys: tuple[str, ...]):
        from tqdm import tqdm

        self.run, self.bar_keys = run, bar_keys
        os.makedirs(run.args.save_dir, exist_ok=True)
        self.path = os.path.join(run.args.save_dir, "metrics.jsonl")
        self.start_step, self.rows = start_or_resume(run.engine, run.args, run.rank, self.path)
        self.tokens = 0
        self.bar = tqdm(total=run.args.max_steps, initial=self.start_step, disable=run.rank != 0,
                        dynamic_ncols=True, desc=name)
        self.t_start = time.perf_counter()

    def log(self, row: dict) -> None:
        row["tokens/s"] = self.tokens / (time.perf_counter() - self.t_start)
        self.rows.append(row)
        post = {k.split("/")[-1]: f"{row[k]:.4f}" for k in self.bar_keys if k in row}
        self.bar.set_postfix(**post, tok_s=f"{row['tokens/s']:.0f}", peak_gib=f"{peak_memory_gib():.2f}")
        self.bar.update(1)
        if self.run.rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def plot(self, panels: list[tuple[str, str]], title: str, filename: str) -> str:
        """One panel per (metric key, y label), against the step; returns the png's path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
        steps = [m["step"] for m in self.rows]
        for ax, (key, label) in zip(axes[0], panels, strict=True):
            ax.plot(steps, [m.get(key, float("nan")) for m in self.rows])
            ax.set_xlabel("step")
            ax.set_ylabel(label)
        fig.suptitle(title)
        fig.tight_layout()
        path = os.path.join(self.run.args.save_dir, filename)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def mean_over_ranks(values: dict[str, float], world: int) -> dict[str, float]:
    """Every value averaged over all ranks (ranks of a sequence-parallel group hold the same one)."""
    import deepspeed.comm as dist

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: v / world for k, v in zip(keys, t.tolist(), strict=True)}


def step_done(run: Run, step: int) -> None:
    """After step ``step`` (1-based): the checkpoint every ``--save-every`` steps and at the last."""
    save_if_due(run.engine, run.args, step, run.rank)


def finish(run: Run) -> str:
    """The HF export (the final checkpoint was written by :func:`step_done`); returns what was exported."""
    import deepspeed.comm as dist

    export_hf(run.model, run.args, run.rank, run.dtype)
    dist.barrier()
    if not run.args.lora_rank:
        return "hf_model/"
    return "hf_adapter/" + (", hf_model/" if run.args.merge_lora else "")
