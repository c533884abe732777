"""GRPO on precomputed rollouts for a Hugging Face causal LM on long sequences with ds_longseq + DeepSpeed.

The code of ``ds-longseq grpo`` and of ``examples/grpo.py`` (a thin copy of this module's entry point). Launch it the
DeepSpeed way, or let the command start the launcher:

    ds-longseq grpo                       # no launcher: DeepSpeed's over the local GPUs (2 CPU ranks without)
    ds-longseq grpo --num_gpus 1          # one process
    deepspeed --num_gpus 2 examples/grpo.py --ds_config zero2_streambp
    deepspeed --num_gpus 2 examples/grpo.py --ds_config ds_configs/zero3_streambp.json \
        --model /path/to/model --data rollouts.jsonl --num-iterations 2 --beta 0.04

--data is JSONL, one prompt per line with its G sampled completions and their rewards:
{"prompt": ..., "completions": [G strings], "rewards": [G numbers]}, the same G on every line.
Generation is not part of this script: it trains on rollouts sampled elsewhere (e.g. by vLLM).

Every step takes ``train_micro_batch_size_per_gpu x gradient_accumulation_steps`` groups per
data-parallel replica, computes the old policy's per-token log-probs on them under no_grad (the
current policy, before this step's updates), then makes ``--num-iterations`` optimizer updates on
the same groups (TRL's num_iterations, mu): from the second update on, the ratio policy / old
policy differs from 1 and the clipping (``--epsilon``, ``--epsilon-high``) acts. Advantages are
the rewards normalised within each group (``--scale-rewards``). With ``--beta`` > 0 a k3 KL to
the reference (the frozen initial policy; with --lora-rank the policy with adapters disabled) is added.
``--loss-type`` is TRL's normalisation; "dapo" divides by the completion tokens of the whole
step, over all micro-batches and replicas.

With no --model / --data it trains the embedded default: sft's tiny Llama-shaped model (from
scratch) on built-in rollouts. Each prompt is random tokens; its G completions (of different
lengths) follow the rule "next token = previous token + 1" with a different fraction of tokens
replaced by random ones, and the reward is the fraction that follows the rule. The mean
advantage-weighted log-prob, sum_i A_i mean_t log p(completion_i,t), rises as the policy learns to
favour high-reward completions.

Outputs under --save-dir: ``metrics.jsonl`` (per step: loss, the loss of each update, clip_ratio,
kl, reward mean and std, adv_logp, tokens/s), ``grpo.png``, the final checkpoint and the HF export.

Holds:
    build_parser / parse_args: the command's flags (the shared ones, ``toolkit.args.script_parser``, and its own).
    check_args: every flag checked before anything starts.
    main: one rank's (or the one process') GRPO training; returns the exit status.
"""

from __future__ import annotations

import argparse

import torch

from ds_longseq.logging import get_logger, log_rank0
from ds_longseq.ops import GRPO_LOSS_TYPES, group_advantages, grpo_loss
from ds_longseq.toolkit import (
    DEFAULT_GROUP_SIZE,
    MetricsLog,
    Reference,
    RolloutData,
    completion_tokens,
    finish,
    load_tokenizer,
    mean_over_ranks,
    micro_batch_indices,
    rollout_micro_batch,
    setup_run,
    synthetic_group,
    token_logprobs,
)
from ds_longseq.toolkit import check_args as check_common_args
from ds_longseq.toolkit.args import script_parser

__all__ = ["DEFAULT_LR", "build_parser", "parse_args", "check_args", "main"]

logger = get_logger(__name__)
DEFAULT_LR = 5e-4  # the embedded tiny model starts from scratch; ds_configs/ hold fine-tuning rates


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``ds-longseq grpo`` / ``examples/grpo.py`` (``prog``: the name ``--help`` shows)."""
    p = script_parser(__doc__.split("\n\n")[0], prog=prog, save_dir="outputs/grpo", max_steps=40, seq_len=1024,
                      lr=DEFAULT_LR, data_help="JSONL with 'prompt', 'completions' (G strings) and 'rewards' (G "
                      "numbers) per line; needs --model")
    p.add_argument("--num-iterations", type=int, default=1,
                   help="optimizer updates per batch of rollouts (TRL's num_iterations, mu)")
    p.add_argument("--beta", type=float, default=0.0, help="weight of the k3 KL to the reference (0: no reference)")
    p.add_argument("--epsilon", type=float, default=0.2, help="clip the ratio below at 1 - epsilon")
    p.add_argument("--epsilon-high", type=float, default=None,
                   help="clip the ratio above at 1 + epsilon-high (DAPO's clip-higher); default: --epsilon")
    p.add_argument("--loss-type", choices=GRPO_LOSS_TYPES, default="dapo", help="TRL's loss normalisation")
    p.add_argument("--scale-rewards", choices=["group", "batch", "none"], default="group",
                   help="divide advantages by the group's reward std, the batch's, or nothing")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad command-line values before anything starts, naming the flag to change."""
    check_common_args(args)
    if args.num_iterations < 1:
        raise SystemExit(f"--num-iterations must be >= 1, got {args.num_iterations}")
    if args.beta < 0:
        raise SystemExit(f"--beta must be >= 0, got {args.beta}")
    if not 0 < args.epsilon < 1:
        raise SystemExit(f"--epsilon must be in (0, 1), got {args.epsilon}")
    if args.epsilon_high is not None and not args.epsilon_high > 0:
        raise SystemExit(f"--epsilon-high must be > 0, got {args.epsilon_high}")


def main(argv: list[str] | None = None) -> int:
    """Train (one rank of the launched world, or the one process); returns the exit status (0)."""
    args = parse_args(argv)
    check_args(args)
    import deepspeed.comm as dist

    state = {}

    def load_data():  # after the config checks, before the model is built
        if args.data:
            data = RolloutData(args.data, load_tokenizer(args.model), args.seq_len, args.scale_rewards)
            state.update(source=data.__getitem__, pad_id=data.pad_id, group_size=data.group_size)
        else:
            synthetic_group(0, args.seq_len, args.seed)  # fail early if --seq-len is too short
            state.update(source=lambda i: synthetic_group(i, args.seq_len, args.seed), pad_id=0,
                         group_size=DEFAULT_GROUP_SIZE)

    run = setup_run(args, before_model=load_data)
    engine, source, pad_id, G = run.engine, state["source"], state["pad_id"], state["group_size"]
    reference = Reference(run) if args.beta > 0 else None
    log_rank0(logger, f"{G} completions per prompt, {run.micro_bs} prompt(s) per micro-batch, "
                      f"{args.num_iterations} update(s) per batch of rollouts")
    log = MetricsLog(run, "grpo", ("loss", "clip_ratio", "adv_logp"))
    for step in range(log.start_step, args.max_steps):
        # The step's micro-batches, each prepared once: old-policy and reference log-probs, advantages.
        micro = []
        for m in range(run.gas):
            indices = micro_batch_indices(step, m, run.gas, run.replica, run.num_replicas, run.micro_bs)
            batch, rewards = rollout_micro_batch(source, indices)
            log.tokens += int(batch["attention_mask"].sum()) * run.num_replicas * args.num_iterations
            tokens = completion_tokens(batch)
            batch = run.prepare(batch, pad_id)
            advantages = group_advantages(rewards, G, args.scale_rewards).to(engine.device)
            with torch.no_grad():
                old = token_logprobs(engine, batch)
                ref = reference(batch).logprobs if reference is not None else None
            micro.append((batch, advantages, old.logprobs, ref, tokens, rewards, old))
        # "dapo": one divisor for the whole step. DeepSpeed averages gradients over replicas and
        # accumulation steps, so each micro-batch's sum is divided by total / (replicas x gas).
        total = torch.tensor(float(sum(m[4] for m in micro)))
        dist.all_reduce(total)
        total = total.item() / run.sp_size  # the ranks of a sequence-parallel group count the same rows
        num_items = total / (run.num_replicas * run.gas)

        # Before any update: mean over rows of A_i x (mean log-prob of completion i), rising as the
        # policy learns to favour high-advantage completions.
        sums = {"adv_logp": 0.0, "reward_mean": 0.0, "reward_std": 0.0}
        for _, advantages, _, _, _, rewards, old in micro:
            per_token = old.sequence_logprobs() / old.count()
            sums["adv_logp"] += (advantages * per_token).mean().item() / run.gas
            sums["reward_mean"] += rewards.mean().item() / run.gas
            sums["reward_std"] += rewards.view(-1, G).std(-1).mean().item() / run.gas if G > 1 else 0.0
        losses, clip, kl = [], 0.0, 0.0
        for _ in range(args.num_iterations):
            loss_sum = 0.0
            for batch, advantages, old_lp, ref_lp, _, _, _ in micro:
                loss, metrics = grpo_loss(
                    token_logprobs(engine, batch), advantages, old_logprobs=old_lp, ref_logprobs=ref_lp,
                    beta=args.beta, epsilon=args.epsilon, epsilon_high=args.epsilon_high, loss_type=args.loss_type,
                    max_completion_length=args.seq_len, num_items=num_items,
                )
                engine.backward(loss)
                engine.step()
                loss_sum += loss.item() / run.gas
                clip += metrics["clip_ratio"].item() / (run.gas * args.num_iterations)
                if "kl" in metrics:
                    kl += metrics["kl"].item() / (run.gas * args.num_iterations)
            losses.append(loss_sum)
        values = {**sums, "clip_ratio": clip, **{f"loss/update{i + 1}": v for i, v in enumerate(losses)}}
        if reference is not None:
            values["kl"] = kl
        values = mean_over_ranks(values, run.world)
        row = {"step": step + 1, "loss": sum(values[f"loss/update{i + 1}"] for i in range(len(losses))) / len(losses)}
        log.log({**row, **values})
        run.save_if_due(step + 1)
    log.close()

    exported = finish(run)
    if run.rank == 0:
        panels = [("loss", "GRPO loss (mean over updates)"), ("adv_logp", "mean advantage-weighted log-prob"),
                  ("clip_ratio", "clip ratio")]
        if reference is not None:
            panels.append(("kl", "KL to reference (k3)"))
        plot = log.plot(panels, "ds-longseq grpo", "grpo.png")
        first, last = log.rows[0], log.rows[-1]
        print(
            f"\nsummary: {args.max_steps - log.start_step} steps x {args.num_iterations} update(s) on "
            f"{run.world} rank(s)"
            + (f" (sequence parallel {run.sp_size} x data parallel {run.num_replicas})" if run.sp_size > 1 else "")
            + f", seq_len {args.seq_len}, G {G}, loss_type {args.loss_type}: adv_logp {first['adv_logp']:.4f} -> "
            f"{last['adv_logp']:.4f}, loss {first['loss']:.4f} -> {last['loss']:.4f}, clip_ratio "
            f"{last['clip_ratio']:.4f}, mean reward {last['reward_mean']:.3f}, {last['tokens/s']:.0f} tokens/s\n"
            f"outputs: {args.save_dir}/ (latest checkpoint, metrics.jsonl, {plot.rsplit('/', 1)[-1]}, {exported})",
            flush=True,
        )
    dist.barrier()
    return 0
