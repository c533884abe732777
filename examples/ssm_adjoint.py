"""Train a residual state-space LM on long sequences with adjoint sharding, through DeepSpeed.

Launch it the DeepSpeed way (CPU ranks use gloo, GPUs nccl); every rank is one stage that owns a
slice of the layers (long_seq.adjoint.layer_split, default: even) and all ranks see the same batch:

    deepspeed --num_gpus 2 examples/ssm_adjoint.py --ds_config ds_configs/zero2_adjoint.json
    python examples/ssm_adjoint.py                      # one process, all layers
    mpirun -np 2 python examples/ssm_adjoint.py --ds_config ds_configs/zero2_adjoint.json

The embedded task (topic recall) needs memory across the whole sequence. Each row (``--seq-len``
tokens) opens with a briefing, then only filler and questions follow::

    position  0     1 .. C    C+1   ...   C+1+Q   C+2+Q  ...  C+1+2Q  ...
    input     BOS   c .. c    SEP   f ... QUERY   f      ...  QUERY   f ...
    trained                                 ->ANS                ->ANS

- the row's topic is one of ``--num-topics``, drawn uniformly; the briefing is ``--num-clues`` (C)
  clue tokens drawn from that topic's own set of 4 clue tokens;
- after ``SEP`` every position holds a random filler token (``--num-filler`` of them, the same
  distribution for every topic), except that every ``--query-every`` (Q) tokens a ``QUERY`` token
  asks for the topic's answer token (``labels[q + 1]``: position q is trained to predict it).
  Only the answers are trained (labels -100 elsewhere).

The answer tokens never appear in the input, and nothing after the briefing depends on the topic:
an answer can only come from the clues, carried by the recurrent state from the first C+1 tokens
to the QUERY, up to ``--seq-len`` - C - 3 tokens later (the last query of a row). A model without that
memory can do no better than a uniform guess among the topics' answers: **chance = ln(num_topics)**
(ln 4 = 1.386 by default; the loss starts higher, at about ln(vocab size), and first falls to
chance while the model learns which tokens are answers). Below chance, the state carries the topic.
At the end, rank 0 measures the recall accuracy on held-out rows (``eval.json``): over all
questions, and over the questions in the last quarter of the rows only (position >= 3/4 x
--seq-len: by default at least 768 - 65 = 703 tokens after the briefing's SEP); chance is
1/num_topics. The briefing says the topic C = 64 times (default) because a selective SSM trained
from scratch writes a single token into its state faintly at first (the write scales with its step
size delta, which starts small); the repeats make the memory learnable in ~100 steps on a CPU (the default runs 160).

Outputs under --save-dir: DeepSpeed checkpoints (``step<N>/`` plus an atomically written
``latest``; ``--resume`` continues from it with the same data and losses), ``metrics.jsonl`` (one
line per step), ``loss.png``, ``eval.json`` (the held-out recall accuracies above), and
``model.pt`` + ``ssm_config.json`` (the final weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

import ds_longseq.engine
from ds_longseq.adjoint import ResidualSSMForCausalLM, SSMConfig
from ds_longseq.batch_size import BatchSizeError, read_batch_size
from ds_longseq.toolkit import (
    TopicRecallTask,
    init_process_group,
    peak_memory_gib,
    read_ds_config,
    save_if_due,
    start_or_resume,
)
from ds_longseq.toolkit.args import exit_status

TASK_DEFAULTS = TopicRecallTask()  # the task's defaults are written once, in its dataclass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ds_config", default=os.path.join(os.path.dirname(__file__), "..", "ds_configs",
                                                       "zero2_adjoint.json"))
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--seq-len", type=int, default=TASK_DEFAULTS.seq_len)
    p.add_argument("--max-steps", type=int, default=160)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--state-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--conv-kernel", type=int, default=4)
    p.add_argument("--num-topics", type=int, default=TASK_DEFAULTS.num_topics)
    p.add_argument("--num-clues", type=int, default=TASK_DEFAULTS.num_clues)
    p.add_argument("--query-every", type=int, default=TASK_DEFAULTS.query_every)
    p.add_argument("--num-filler", type=int, default=TASK_DEFAULTS.num_filler)
    p.add_argument("--chunk-size", type=int, default=None, help="overrides long_seq.adjoint.chunk_size")
    p.add_argument("--truncation", type=int, default=None, help="T-bar; overrides long_seq.adjoint.truncation")
    p.add_argument("--dtype", choices=["float32", "bf16"], default="float32")
    p.add_argument("--save-dir", default="runs/ssm_adjoint")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from <save-dir>/latest")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    problems = []
    for name in ("seq_len", "max_steps", "hidden_size", "state_size", "num_layers", "conv_kernel", "num_topics",
                 "num_clues", "query_every", "num_filler"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.truncation is not None and args.truncation < 1:
        problems.append(f"--truncation (T-bar) must be >= 1, got {args.truncation}; leave it out for exact gradients")
    if args.save_every < 0:
        problems.append(f"--save-every must be >= 0 (0: a checkpoint only at the end), got {args.save_every}")
    if args.chunk_size is not None and args.chunk_size < 1:
        problems.append(f"--chunk-size must be a positive integer, got {args.chunk_size}")
    if args.query_every < 2:
        problems.append("--query-every must be at least 2 (a QUERY and its answer)")
    need = args.num_clues + 2 + 2 * args.query_every
    if args.seq_len < need:
        problems.append(f"--seq-len {args.seq_len} is too short for the task: it needs at least {need} tokens "
                        f"(BOS, {args.num_clues} clues, SEP and two query periods); raise --seq-len")
    if problems:
        raise SystemExit("examples/ssm_adjoint.py: " + "; ".join(problems))


def task(args) -> TopicRecallTask:
    """The topic-recall task the arguments describe."""
    return TopicRecallTask(seq_len=args.seq_len, num_topics=args.num_topics, num_clues=args.num_clues,
                           query_every=args.query_every, num_filler=args.num_filler, seed=args.seed)


def batch(step: int, micro: int, args, micro_bs: int, gas: int) -> dict[str, torch.Tensor]:
    first = (step * gas + micro) * micro_bs
    rows = [task(args).row(first + i) for i in range(micro_bs)]
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


EVAL_ROWS = 16
EVAL_OFFSET = 1 << 40  # held-out rows: indices the training data never reaches


@torch.no_grad()
def recall_accuracy(model: torch.nn.Module, args, device) -> dict[str, float]:
    """Answer accuracy of ``model`` (plain forward, argmax over the whole vocabulary) on EVAL_ROWS
    held-out rows: over all questions, and over those in the last quarter of the rows."""
    rows = [task(args).row(EVAL_OFFSET + i) for i in range(EVAL_ROWS)]
    ids = torch.stack([r["input_ids"] for r in rows]).to(device)
    targets = torch.stack([r["labels"] for r in rows])[:, 1:].to(device)  # position t answers labels[t + 1]
    was_training = model.training
    model.eval()
    hits = model(ids).logits[:, :-1].argmax(-1) == targets
    model.train(was_training)
    asked = targets != -100
    far = asked.clone()
    far[:, : (3 * args.seq_len) // 4] = False
    return {"accuracy": hits[asked].float().mean().item(), "far_accuracy": hits[far].float().mean().item(),
            "far_questions_per_row": int(far[0].sum()), "chance": 1 / args.num_topics, "rows": EVAL_ROWS}


def plot(metrics: list[dict], path: str, chance: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps, losses = [m["step"] for m in metrics], [m["loss"] for m in metrics]
    ax.plot(steps, losses, color="tab:blue", alpha=0.35, label="answer loss (training, per step)")
    smooth = [sum(losses[max(0, i - 9) : i + 1]) / len(losses[max(0, i - 9) : i + 1]) for i in range(len(losses))]
    ax.plot(steps, smooth, color="tab:blue", label="mean of the last 10 steps")
    ax.axhline(chance, color="gray", linestyle="--", label=f"chance without memory (ln {round(math.exp(chance))})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title("examples/ssm_adjoint.py: topic recall")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    from tqdm import tqdm

    ds_config, long_seq = read_ds_config(args.ds_config)
    if not long_seq.adjoint.enabled:
        raise SystemExit(f"{args.ds_config}: long_seq.adjoint.enabled must be true for this example")
    adjoint = long_seq.adjoint
    overrides = {"chunk_size": args.chunk_size, "truncation": args.truncation}
    # the parsed section travels on as one object (engine.initialize does not parse it again)
    ds_config["long_seq"] = dataclasses.replace(
        long_seq, adjoint=dataclasses.replace(adjoint, **{k: v for k, v in overrides.items() if v is not None})
    )
    ds_config["bf16"] = {"enabled": args.dtype == "bf16"}
    ds_config.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"]["lr"] = args.lr
    rank, world = init_process_group()
    try:  # as DeepSpeed reads the triple (any two of its three keys): the loop steps the optimizer by it
        batch_size = read_batch_size(ds_config, world)
    except BatchSizeError as err:
        raise SystemExit(f"--ds_config {args.ds_config}: {err}") from None
    micro_bs, gas = batch_size.micro_batch, batch_size.gradient_accumulation

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = SSMConfig(vocab_size=task(args).vocab_size, hidden_size=args.hidden_size, state_size=args.state_size,
                       num_layers=args.num_layers, conv_kernel=args.conv_kernel)
    model = ResidualSSMForCausalLM(config)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    engine, _, _, _ = ds_longseq.engine.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    device = engine.device

    os.makedirs(args.save_dir, exist_ok=True)
    metrics_path = os.path.join(args.save_dir, "metrics.jsonl")
    start_step, metrics = start_or_resume(engine, args.save_dir, metrics_path, resume_run=args.resume,
                                          max_steps=args.max_steps, rank=rank)
    chance = math.log(args.num_topics)
    bar = tqdm(range(start_step, args.max_steps), disable=rank != 0, initial=start_step, total=args.max_steps,
               desc="ssm_adjoint")
    for step in bar:
        started = time.perf_counter()
        losses = []
        for micro in range(gas):
            b = {k: v.to(device) for k, v in batch(step, micro, args, micro_bs, gas).items()}
            loss = engine(**b).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        seconds = time.perf_counter() - started
        row = {"step": step + 1, "loss": sum(losses) / len(losses), "seconds": seconds,
               "tokens_per_s": gas * micro_bs * args.seq_len / seconds, "peak_gib": peak_memory_gib()}
        metrics.append(row)
        bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                        peak_gib=f"{row['peak_gib']:.2f}")
        if rank == 0:
            with open(metrics_path, "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in metrics)
        # `latest` moves only after every rank wrote
        save_if_due(engine, args.save_dir, step + 1, save_every=args.save_every, max_steps=args.max_steps, rank=rank)
    if rank == 0:
        plot(metrics, os.path.join(args.save_dir, "loss.png"), chance)
        torch.save(engine.module.state_dict(), os.path.join(args.save_dir, "model.pt"))
        with open(os.path.join(args.save_dir, "ssm_config.json"), "w") as f:
            json.dump(config.to_dict(), f, indent=1)
        recall = recall_accuracy(engine.module, args, device)
        with open(os.path.join(args.save_dir, "eval.json"), "w") as f:
            json.dump(recall, f, indent=1)
        first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-10:]) / len(metrics[-10:])
        print(f"answer loss: first step {first:.3f}, mean of the last 10 steps {last:.3f} "
              f"(chance without memory {chance:.3f}); held-out recall accuracy {recall['accuracy']:.3f}, "
              f"in the last quarter of the rows {recall['far_accuracy']:.3f} (chance {recall['chance']:.3f}); "
              f"outputs in {args.save_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))  # 0 done, 1 does not fit (the preflight), 2 bad input (one line on stderr)
