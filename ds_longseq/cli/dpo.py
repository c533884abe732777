"""Direct Preference Optimization of a Hugging Face causal LM on long sequences with ds_longseq + DeepSpeed.

The code of ``ds-longseq dpo`` and of ``examples/dpo.py`` (a thin copy of this module's entry point). Launch it the
DeepSpeed way, or let the command start the launcher:

    ds-longseq dpo                        # no launcher: DeepSpeed's over the local GPUs (2 CPU ranks without)
    ds-longseq dpo --num_gpus 1           # one process
    deepspeed --num_gpus 2 examples/dpo.py --ds_config zero2_streambp
    deepspeed --num_gpus 2 examples/dpo.py --ds_config ds_configs/zero3_streambp.json \
        --model /path/to/model --data pairs.jsonl --beta 0.1

--data is JSONL, one preference pair per line: {"prompt": ..., "chosen": ..., "rejected": ...},
optionally with precomputed reference log-probs of the two completions, "ref_chosen_logp" and
"ref_rejected_logp" (then no reference model is run). Without them the reference is the initial
policy, frozen: a second copy run through the same chunked path under no_grad, or with
``--lora-rank`` the policy itself with its adapters disabled.

With no --model / --data it trains the embedded default: sft's tiny Llama-shaped model (from
scratch) on built-in pairs. Each prompt is random tokens; the chosen completion continues it by
the rule "next token = previous token + 1" (wrapping inside the document tokens), the rejected one
is the same completion with half its tokens replaced by random ones. The DPO loss starts at ln 2
(policy = reference) and falls as the policy learns to prefer the rule.

Each micro-batch holds ``train_micro_batch_size_per_gpu`` pairs: their chosen rows, then their
rejected rows, one forward. Labels cover the completion tokens only. Outputs under --save-dir:
``metrics.jsonl`` (loss, rewards/accuracies, rewards/margins, rewards/chosen, rewards/rejected,
tokens/s per step), ``dpo.png``, the final DeepSpeed checkpoint and the HF export (as sft).

Holds:
    build_parser / parse_args: the command's flags (the shared ones, ``toolkit.args.script_parser``, and its own).
    check_args: every flag checked before anything starts.
    main: one rank's (or the one process') DPO training; returns the exit status.
"""

from __future__ import annotations

import argparse
import math

from ds_longseq.logging import get_logger, log_rank0
from ds_longseq.ops import dpo_loss
from ds_longseq.toolkit import (
    MetricsLog,
    PreferenceData,
    Reference,
    finish,
    load_tokenizer,
    mean_over_ranks,
    micro_batch_indices,
    preference_micro_batch,
    setup_run,
    synthetic_pair,
    token_logprobs,
)
from ds_longseq.toolkit import check_args as check_common_args
from ds_longseq.toolkit.args import script_parser

__all__ = ["DEFAULT_LR", "build_parser", "parse_args", "check_args", "main"]

logger = get_logger(__name__)
DEFAULT_LR = 5e-4  # the embedded tiny model starts from scratch; ds_configs/ hold fine-tuning rates


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``ds-longseq dpo`` / ``examples/dpo.py`` (``prog``: the name ``--help`` shows)."""
    p = script_parser(__doc__.split("\n\n")[0], prog=prog, save_dir="outputs/dpo", max_steps=20, seq_len=1024,
                      lr=DEFAULT_LR, data_help="JSONL with 'prompt', 'chosen', 'rejected' (and optionally "
                      "'ref_chosen_logp', 'ref_rejected_logp') per line; needs --model")
    p.add_argument("--beta", type=float, default=0.1,
                   help="DPO temperature: reward = beta x log-ratio to the reference")
    p.add_argument("--label-smoothing", type=float, default=0.0,
                   help="conservative DPO: the probability in [0, 0.5) that a preference label is flipped")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad command-line values before anything starts, naming the flag to change."""
    check_common_args(args)
    if not args.beta > 0:
        raise SystemExit(f"--beta must be > 0, got {args.beta}: pass e.g. --beta 0.1")
    if not 0.0 <= args.label_smoothing < 0.5:
        raise SystemExit(f"--label-smoothing must be in [0, 0.5), got {args.label_smoothing}")


def main(argv: list[str] | None = None) -> int:
    """Train (one rank of the launched world, or the one process); returns the exit status (0)."""
    args = parse_args(argv)
    check_args(args)
    import deepspeed.comm as dist

    state = {}

    def load_data():  # after the config checks, before the model is built
        if args.data:
            data = PreferenceData(args.data, load_tokenizer(args.model), args.seq_len)
            state.update(source=data.__getitem__, pad_id=data.pad_id, precomputed=data.precomputed_ref)
        else:
            synthetic_pair(0, args.seq_len, args.seed)  # fail early if --seq-len is too short
            state.update(source=lambda i: synthetic_pair(i, args.seq_len, args.seed), pad_id=0, precomputed=False)

    run = setup_run(args, before_model=load_data)
    engine, source, pad_id = run.engine, state["source"], state["pad_id"]
    reference = None if state["precomputed"] else Reference(run)
    log_rank0(
        logger,
        "reference: "
        + ("precomputed log-probs from --data" if state["precomputed"]
           else "the policy with its LoRA adapters disabled" if args.lora_rank
           else "a frozen copy of the initial policy"),
    )
    log = MetricsLog(run, "dpo", ("loss", "rewards/accuracies", "rewards/margins"))
    for step in range(log.start_step, args.max_steps):
        sums = {"loss": 0.0, "rewards/accuracies": 0.0, "rewards/margins": 0.0, "rewards/chosen": 0.0,
                "rewards/rejected": 0.0}
        for micro in range(run.gas):
            indices = micro_batch_indices(step, micro, run.gas, run.replica, run.num_replicas, run.micro_bs)
            batch, ref_seq = preference_micro_batch(source, indices)
            log.tokens += int(batch["attention_mask"].sum()) * run.num_replicas
            batch = run.prepare(batch, pad_id)
            n = len(indices)
            if reference is not None:
                ref_seq = reference(batch).sequence_logprobs()
            ref_seq = ref_seq.to(engine.device)
            seq = token_logprobs(engine, batch).sequence_logprobs()
            loss, metrics = dpo_loss(seq[:n], seq[n:], ref_seq[:n].to(seq.dtype), ref_seq[n:].to(seq.dtype),
                                     beta=args.beta, label_smoothing=args.label_smoothing)
            engine.backward(loss)
            engine.step()
            sums["loss"] += loss.item() / run.gas
            for key in ("rewards/accuracies", "rewards/margins"):
                sums[key] += metrics[key].item() / run.gas
            for key in ("rewards/chosen", "rewards/rejected"):
                sums[key] += metrics[key].float().mean().item() / run.gas
        log.log({"step": step + 1, **mean_over_ranks(sums, run.world)})
        run.save_if_due(step + 1)
    log.close()

    exported = finish(run)
    if run.rank == 0:
        plot = log.plot([("loss", "DPO loss"), ("rewards/accuracies", "reward accuracy"),
                         ("rewards/margins", "reward margin")], "ds-longseq dpo", "dpo.png")
        first, last = log.rows[0], log.rows[-1]
        print(
            f"\nsummary: {args.max_steps - log.start_step} steps on {run.world} rank(s)"
            + (f" (sequence parallel {run.sp_size} x data parallel {run.num_replicas})" if run.sp_size > 1 else "")
            + f", seq_len {args.seq_len}, beta {args.beta}: loss {first['loss']:.4f} -> {last['loss']:.4f} "
            f"(ln 2 = {math.log(2):.4f} at the reference), reward accuracy {first['rewards/accuracies']:.2f} -> "
            f"{last['rewards/accuracies']:.2f}, margin {first['rewards/margins']:.3f} -> "
            f"{last['rewards/margins']:.3f}, "
            f"{last['tokens/s']:.0f} tokens/s\n"
            f"outputs: {args.save_dir}/ (latest checkpoint, metrics.jsonl, {plot.rsplit('/', 1)[-1]}, {exported})",
            flush=True,
        )
    dist.barrier()
    return 0
