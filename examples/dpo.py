"""Direct Preference Optimization of a Hugging Face causal LM on long sequences with ds_longseq + DeepSpeed.

    deepspeed --num_gpus 2 examples/dpo.py --ds_config ds_configs/zero2_streambp.json
    deepspeed --num_gpus 2 examples/dpo.py --ds_config ds_configs/zero3_streambp.json \
        --model /path/to/model --data pairs.jsonl --beta 0.1

--data is JSONL, one preference pair per line: {"prompt": ..., "chosen": ..., "rejected": ...},
optionally with precomputed reference log-probs of the two completions, "ref_chosen_logp" and
"ref_rejected_logp" (then no reference model is run). Without them the reference is the initial
policy, frozen: a second copy run through the same chunked path under no_grad, or with
``--lora-rank`` the policy itself with its adapters disabled.

With no --model / --data it trains the embedded default: sft.py's tiny Llama-shaped model (from
scratch) on built-in pairs. Each prompt is random tokens; the chosen completion continues it by
the rule "next token = previous token + 1" (wrapping inside the document tokens), the rejected one
is the same completion with half its tokens replaced by random ones. The DPO loss starts at ln 2
(policy = reference) and falls as the policy learns to prefer the rule.

Each micro-batch holds ``train_micro_batch_size_per_gpu`` pairs: their chosen rows, then their
rejected rows, one forward. Labels cover the completion tokens only. Outputs under --save-dir:
``metrics.jsonl`` (loss, rewards/accuracies, rewards/margins, rewards/chosen, rewards/rejected,
tokens/s per step), ``dpo.png``, the final DeepSpeed checkpoint and the HF export (as sft.py).
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
from ds_longseq.ops import dpo_loss

logger = get_logger("ds_longseq.examples.dpo")
DEFAULT_LR = 5e-4  # the embedded tiny model starts from scratch; ds_configs/ hold fine-tuning rates


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_common_args(p, save_dir="outputs/dpo", max_steps=20, seq_len=1024, lr=DEFAULT_LR)
    p.add_argument("--data", default=None,
                   help="JSONL with 'prompt', 'chosen', 'rejected' (and optionally 'ref_chosen_logp', "
                        "'ref_rejected_logp') per line; needs --model")
    p.add_argument("--beta", type=float, default=0.1,
                   help="DPO temperature: reward = beta x log-ratio to the reference")
    p.add_argument("--label-smoothing", type=float, default=0.0,
                   help="conservative DPO: the probability in [0, 0.5) that a preference label is flipped")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    check_common_args(args)
    if not args.beta > 0:
        raise SystemExit(f"--beta must be > 0, got {args.beta}: pass e.g. --beta 0.1")
    if not 0.0 <= args.label_smoothing < 0.5:
        raise SystemExit(f"--label-smoothing must be in [0, 0.5), got {args.label_smoothing}")


# ---------------------------------------------------------------------------------------------
# Data: every item is one pair, (chosen row, rejected row[, ref_chosen_logp, ref_rejected_logp]).


def rule_continuation(start: int, length: int) -> torch.Tensor:
    """``length`` tokens counting up by one from ``start`` + 1, wrapping inside DOC_TOKENS."""
    lo, n = DOC_TOKENS.start, len(DOC_TOKENS)
    return lo + (start - lo + 1 + torch.arange(length)) % n


def synthetic_pair(index: int, seq_len: int, seed: int) -> dict:
    """[BOS] prompt | completion: chosen follows the +1 rule, rejected has half its tokens randomised."""
    prompt_len = seq_len // 2
    completion_len = seq_len - prompt_len
    if prompt_len < 2 or completion_len < 2:
        raise SystemExit(f"--seq-len {seq_len} is too short for the built-in pairs: use at least 4")
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    body = torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop, (prompt_len - 1,), generator=g)
    prompt = torch.cat([torch.tensor([BOS]), body])
    chosen = rule_continuation(int(prompt[-1]), completion_len)
    rejected = chosen.clone()
    corrupt = torch.randperm(completion_len, generator=g)[: completion_len // 2]
    noise = torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop - 1, (len(corrupt),), generator=g)
    rejected[corrupt] = noise + (noise >= chosen[corrupt]).long()  # never the rule's own token
    p = prompt.tolist()
    rows = [pad_row(p + c.tolist(), [-100] * len(p) + c.tolist(), seq_len, 0) for c in (chosen, rejected)]
    return {"chosen": rows[0], "rejected": rows[1]}


class PreferenceData:
    """Pairs from --data, tokenised with --model's tokenizer, each side padded to --seq-len.

    Every problem is found here, before training, and named by path:line.
    """

    def __init__(self, path: str, tokenizer, seq_len: int):
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.items = []
        with_ref = None
        for lineno, rec in read_jsonl(path):
            where = f"{path}:{lineno}"
            missing = [k for k in ("prompt", "chosen", "rejected") if k not in rec]
            if missing:
                raise ValueError(
                    f"{where}: missing {', '.join(repr(k) for k in missing)}: each line needs 'prompt', 'chosen' and "
                    "'rejected' (strings)"
                )
            for key in ("prompt", "chosen", "rejected"):
                if not isinstance(rec[key], str):
                    raise ValueError(f"{where}: '{key}' must be a string, got {type(rec[key]).__name__}")
            has_ref = [k in rec for k in ("ref_chosen_logp", "ref_rejected_logp")]
            if any(has_ref) and not all(has_ref):
                raise ValueError(f"{where}: give both 'ref_chosen_logp' and 'ref_rejected_logp', or neither")
            if with_ref is None:
                with_ref = all(has_ref)
            elif with_ref != all(has_ref):
                raise ValueError(
                    f"{where}: precomputed reference log-probs on some lines and not others: give "
                    "'ref_chosen_logp'/'ref_rejected_logp' on every line, or on none (then the reference model runs)"
                )
            p_ids = tokenizer(rec["prompt"], add_special_tokens=True)["input_ids"] if rec["prompt"] else []
            item = {}
            for key in ("chosen", "rejected"):
                c_ids = tokenizer(rec[key], add_special_tokens=not p_ids)["input_ids"]
                if not c_ids:
                    raise ValueError(
                        f"{where}: '{key}' is empty (no tokens): every pair needs two non-empty completions"
                    )
                ids, labels = (p_ids + c_ids)[:seq_len], ([-100] * len(p_ids) + c_ids)[:seq_len]
                # A label at position 0 predicts nothing (log-probs are of labels[t + 1]).
                if all(x == -100 for x in labels[1:]):
                    raise ValueError(
                        f"{where}: the prompt fills --seq-len {seq_len}, leaving no '{key}' token to score: "
                        "raise --seq-len or shorten the prompt"
                    )
                item[key] = pad_row(ids, labels, seq_len, self.pad_id)
            if with_ref:
                for key in ("ref_chosen_logp", "ref_rejected_logp"):
                    value = rec[key]
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                        raise ValueError(
                            f"{where}: '{key}' must be a finite number (a sequence log-prob), got {value!r}"
                        )
                item["ref"] = (float(rec["ref_chosen_logp"]), float(rec["ref_rejected_logp"]))
            self.items.append(item)
        if not self.items:
            raise ValueError(f"--data {path} holds no records")
        self.precomputed_ref = bool(with_ref)

    def __getitem__(self, index: int) -> dict:
        return self.items[index % len(self.items)]


def micro_batch(source, indices) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Chosen rows of the pairs, then their rejected rows; and their precomputed reference log-probs."""
    items = [source(i) for i in indices]
    rows = [it["chosen"] for it in items] + [it["rejected"] for it in items]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    ref = None
    if "ref" in items[0]:
        ref = torch.tensor([it["ref"][0] for it in items] + [it["ref"][1] for it in items], dtype=torch.float32)
    return batch, ref


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    import deepspeed.comm as dist

    state = {}

    def load_data():  # after the config checks, before the model is built
        if args.data:
            from transformers import AutoTokenizer

            data = PreferenceData(args.data, AutoTokenizer.from_pretrained(args.model), args.seq_len)
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
            batch, ref_seq = micro_batch(source, indices)
            log.tokens += int(batch["attention_mask"].sum()) * run.num_replicas
            batch = prepare(run, batch, pad_id)
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
        step_done(run, step + 1)
    log.bar.close()

    exported = finish(run)
    if run.rank == 0:
        plot = log.plot([("loss", "DPO loss"), ("rewards/accuracies", "reward accuracy"),
                         ("rewards/margins", "reward margin")], "examples/dpo.py", "dpo.png")
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


if __name__ == "__main__":
    sys.exit(main())
