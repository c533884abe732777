"""GRPO on precomputed rollouts for a Hugging Face causal LM on long sequences with ds_longseq + DeepSpeed.

    deepspeed --num_gpus 2 examples/grpo.py --ds_config ds_configs/zero2_streambp.json
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

With no --model / --data it trains the embedded default: sft.py's tiny Llama-shaped model (from
scratch) on built-in rollouts. Each prompt is random tokens; its G completions (of different
lengths) follow the rule "next token = previous token + 1" with a different fraction of tokens
replaced by random ones, and the reward is the fraction that follows the rule. The mean
advantage-weighted log-prob, sum_i A_i mean_t log p(completion_i,t), rises as the policy learns to
favour high-reward completions.

Outputs under --save-dir: ``metrics.jsonl`` (per step: loss, the loss of each update, clip_ratio,
kl, reward mean and std, adv_logp, tokens/s), ``grpo.png``, the final checkpoint and the HF export.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from _common import (
    MetricsLog,
    Reference,
    add_common_args,
    check_common_args,
    finish,
    mean_over_ranks,
    pad_row,
    prepare,
    read_jsonl,
    setup_run,
    step_done,
    token_logprobs,
)
from sft import BOS, DOC_TOKENS, micro_batch_indices

from ds_longseq.logging import get_logger, log_rank0
from ds_longseq.ops import GRPO_LOSS_TYPES, group_advantages, grpo_loss

logger = get_logger("ds_longseq.examples.grpo")
DEFAULT_LR = 5e-4  # the embedded tiny model starts from scratch; ds_configs/ hold fine-tuning rates
DEFAULT_GROUP_SIZE = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_common_args(p, save_dir="outputs/grpo", max_steps=40, seq_len=1024, lr=DEFAULT_LR)
    p.add_argument("--data", default=None,
                   help="JSONL with 'prompt', 'completions' (G strings) and 'rewards' (G numbers) per line; "
                        "needs --model")
    p.add_argument("--num-iterations", type=int, default=1,
                   help="optimizer updates per batch of rollouts (TRL's num_iterations, mu)")
    p.add_argument("--beta", type=float, default=0.0, help="weight of the k3 KL to the reference (0: no reference)")
    p.add_argument("--epsilon", type=float, default=0.2, help="clip the ratio below at 1 - epsilon")
    p.add_argument("--epsilon-high", type=float, default=None,
                   help="clip the ratio above at 1 + epsilon-high (DAPO's clip-higher); default: --epsilon")
    p.add_argument("--loss-type", choices=GRPO_LOSS_TYPES, default="dapo", help="TRL's loss normalisation")
    p.add_argument("--scale-rewards", choices=["group", "batch", "none"], default="group",
                   help="divide advantages by the group's reward std, the batch's, or nothing")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    check_common_args(args)
    if args.num_iterations < 1:
        raise SystemExit(f"--num-iterations must be >= 1, got {args.num_iterations}")
    if args.beta < 0:
        raise SystemExit(f"--beta must be >= 0, got {args.beta}")
    if not 0 < args.epsilon < 1:
        raise SystemExit(f"--epsilon must be in (0, 1), got {args.epsilon}")
    if args.epsilon_high is not None and not args.epsilon_high > 0:
        raise SystemExit(f"--epsilon-high must be > 0, got {args.epsilon_high}")


def check_group_size(group_size: int, scale: str, where: str) -> None:
    if group_size == 1 and scale == "group":
        raise ValueError(
            f"{where}: groups of 1 completion with --scale-rewards group: a group of size 1 has no reward standard "
            "deviation (every advantage would be 0): sample >= 2 completions per prompt, or pass --scale-rewards "
            "batch (or none)"
        )


# ---------------------------------------------------------------------------------------------
# Data: every item is one group, G rows (prompt + completion i) and G rewards.


def synthetic_group(index: int, seq_len: int, seed: int, group_size: int = DEFAULT_GROUP_SIZE) -> dict:
    """[BOS] prompt | completion i, i < G: the +1 rule with fraction i / (G - 1) of tokens randomised
    (completion lengths between half and all of the room left); reward = fraction following the rule."""
    prompt_len = seq_len // 2
    room = seq_len - prompt_len
    if prompt_len < 2 or room < 2:
        raise SystemExit(f"--seq-len {seq_len} is too short for the built-in rollouts: use at least 4")
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    prompt = [BOS] + torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop, (prompt_len - 1,), generator=g).tolist()
    lo, n = DOC_TOKENS.start, len(DOC_TOKENS)
    rows, rewards = [], []
    for i in range(group_size):
        length = int(torch.randint(max(1, room // 2), room + 1, (1,), generator=g))
        rule = lo + (prompt[-1] - lo + 1 + torch.arange(length)) % n
        completion = rule.clone()
        corrupt = torch.randperm(length, generator=g)[: round(length * i / max(1, group_size - 1))]
        noise = torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop - 1, (len(corrupt),), generator=g)
        completion[corrupt] = noise + (noise >= rule[corrupt]).long()  # never the rule's own token
        rows.append(pad_row(prompt + completion.tolist(), [-100] * len(prompt) + completion.tolist(), seq_len, 0))
        rewards.append(float((completion == rule).float().mean()))
    return {"rows": rows, "rewards": rewards}


class RolloutData:
    """Groups from --data, tokenised with --model's tokenizer, each row padded to --seq-len.

    Every problem is found here, before training, and named by path:line.
    """

    def __init__(self, path: str, tokenizer, seq_len: int, scale_rewards: str):
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.items, self.group_size = [], None
        for lineno, rec in read_jsonl(path):
            where = f"{path}:{lineno}"
            missing = [k for k in ("prompt", "completions", "rewards") if k not in rec]
            if missing:
                raise ValueError(
                    f"{where}: missing {', '.join(repr(k) for k in missing)}: each line needs 'prompt' (a string), "
                    "'completions' (G strings) and 'rewards' (G numbers)"
                )
            prompt, completions, rewards = rec["prompt"], rec["completions"], rec["rewards"]
            if not isinstance(prompt, str):
                raise ValueError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
            if not isinstance(completions, list) or not all(isinstance(c, str) for c in completions):
                raise ValueError(f"{where}: 'completions' must be a list of strings")
            if not completions:
                raise ValueError(f"{where}: 'completions' is empty: give the G completions sampled for the prompt")
            if not isinstance(rewards, list) or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in rewards
            ):
                raise ValueError(f"{where}: 'rewards' must be a list of finite numbers")
            if len(rewards) != len(completions):
                raise ValueError(
                    f"{where}: {len(completions)} completions but {len(rewards)} rewards: "
                    "give one reward per completion"
                )
            if self.group_size is None:
                self.group_size = len(completions)
                check_group_size(self.group_size, scale_rewards, where)
            elif len(completions) != self.group_size:
                raise ValueError(
                    f"{where}: {len(completions)} completions, but the first line has {self.group_size}: every prompt "
                    "needs the same number G of completions"
                )
            p_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
            rows = []
            for i, completion in enumerate(completions):
                c_ids = tokenizer(completion, add_special_tokens=not p_ids)["input_ids"]
                if not c_ids:
                    raise ValueError(
                        f"{where}: completion {i} is empty (no tokens): drop it from the group (with its reward) "
                        "or drop the line"
                    )
                ids, labels = (p_ids + c_ids)[:seq_len], ([-100] * len(p_ids) + c_ids)[:seq_len]
                if all(x == -100 for x in labels[1:]):  # a label at position 0 predicts nothing
                    raise ValueError(
                        f"{where}: the prompt fills --seq-len {seq_len}, leaving no token of completion {i} to train "
                        "on: raise --seq-len or shorten the prompt"
                    )
                rows.append(pad_row(ids, labels, seq_len, self.pad_id))
            self.items.append({"rows": rows, "rewards": [float(r) for r in rewards]})
        if not self.items:
            raise ValueError(f"--data {path} holds no records")

    def __getitem__(self, index: int) -> dict:
        return self.items[index % len(self.items)]


def micro_batch(source, indices) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The groups' rows, group after group (G consecutive rows each), and their (B,) rewards."""
    items = [source(i) for i in indices]
    rows = [r for it in items for r in it["rows"]]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    return batch, torch.tensor([x for it in items for x in it["rewards"]], dtype=torch.float32)


def completion_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Scored completion tokens of a whole (unsharded) batch: log-probs are of labels[:, 1:]."""
    return int((batch["labels"][:, 1:] != -100).sum())


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    import deepspeed.comm as dist

    state = {}

    def load_data():  # after the config checks, before the model is built
        if args.data:
            from transformers import AutoTokenizer

            data = RolloutData(args.data, AutoTokenizer.from_pretrained(args.model), args.seq_len, args.scale_rewards)
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
            batch, rewards = micro_batch(source, indices)
            log.tokens += int(batch["attention_mask"].sum()) * run.num_replicas * args.num_iterations
            tokens = completion_tokens(batch)
            batch = prepare(run, batch, pad_id)
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
        step_done(run, step + 1)
    log.bar.close()

    exported = finish(run)
    if run.rank == 0:
        panels = [("loss", "GRPO loss (mean over updates)"), ("adv_logp", "mean advantage-weighted log-prob"),
                  ("clip_ratio", "clip ratio")]
        if reference is not None:
            panels.append(("kl", "KL to reference (k3)"))
        plot = log.plot(panels, "examples/grpo.py", "grpo.png")
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


if __name__ == "__main__":
    sys.exit(main())
