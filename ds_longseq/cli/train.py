"""Supervised fine-tuning of a Hugging Face causal LM on long sequences with ds_longseq + DeepSpeed.

The code of ``ds-longseq train`` and of ``examples/sft.py`` (a thin copy of this module's entry point). Launch it
the DeepSpeed way (CPU ranks use gloo, GPUs nccl), or let the command start the launcher:

    ds-longseq train                      # no launcher: DeepSpeed's over the local GPUs (2 CPU ranks without)
    ds-longseq train --num_gpus 1         # one process
    deepspeed --num_gpus 2 examples/sft.py --ds_config zero2_streambp
    deepspeed --num_gpus 2 examples/sft.py --ds_config zero3_ulysses_streambp  # SP 2
    deepspeed --hostfile launch/hostfile examples/sft.py --ds_config ds_configs/zero3_streambp.json
    mpirun -np 2 python examples/sft.py --ds_config zero2_streambp

``--ds_config`` takes a path or a shipped config's name (``ds-longseq configs`` lists them).

With no --model / --data it trains the embedded default: a tiny Llama-shaped model built from a
config, from scratch, on built-in data in which the loss can only fall if attention reaches far
back: each sequence is a random document followed by the same document again, and only the copy
is trained on. No token of the copy can be guessed better than chance (ln 224) without looking
(T-1)/2 tokens back; once the model forms an induction head the loss drops well below chance.

``--pack`` (with ``--data``) puts several documents in each row of exactly --seq-len tokens, in
the padding-free form of transformers' ``DataCollatorWithFlattening``: position_ids restart at
every document, no attention_mask (see :class:`ds_longseq.toolkit.PackedData`).

``--lora-rank N`` (needs peft) freezes the model and trains a LoRA adapter of rank N on every
linear projection of the decoder layers (or on ``--lora-targets``), scaled by ``--lora-alpha / N``;
``--load-in-4bit [nf4|fp4]`` with it (needs bitsandbytes) trains the adapter on a 4-bit base (QLoRA;
docs/TRAINING_SCRIPTS.md), and ``--merge-lora`` then merges into the base dequantized to the run's dtype.

Outputs under --save-dir: DeepSpeed checkpoints (``step<N>/`` plus an atomically written
``latest``), ``metrics.jsonl`` (one line per step), ``loss.png`` and an HF-format export in
``hf_model/``; with ``--lora-rank``, the adapter in PEFT's format in ``hf_adapter/`` instead (for
``PeftModel.from_pretrained(base, path)``), and with ``--merge-lora`` also the base with the adapter
merged in as ``hf_model/``. ``--resume`` continues from ``latest`` with the same data order and losses.

With ``long_seq.sequence_parallel.size = P`` (or DeepSpeed's ``sequence_parallel_size``) every P
consecutive ranks share each sequence: they build the same batch and ``shard_batch`` gives each
its 1/P (labels shifted first); the world / P groups are data-parallel replicas.

Holds:
    build_parser / parse_args: the command's flags (the shared ones, ``toolkit.args.script_parser``, and its own).
    check_args: every flag checked before anything starts.
    main: one rank's (or the one process') SFT training; returns the exit status.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from ds_longseq.toolkit import (
    DOC_TOKENS,
    JsonlData,
    MetricsLog,
    check_lora_args,
    check_run_args,
    copy_example,
    finish,
    load_tokenizer,
    log_packing,
    micro_batch,
    micro_batch_indices,
    pack_jsonl,
    plot_losses,
    setup_run,
)
from ds_longseq.toolkit.args import script_parser
from ds_longseq.toolkit.faults import before_backward

__all__ = ["build_parser", "parse_args", "check_args", "main"]

DEFAULT_LR = 3e-3  # the embedded tiny model trains from scratch; ds_configs/ hold fine-tuning rates


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The flags of ``ds-longseq train`` / ``examples/sft.py`` (``prog``: the name ``--help`` shows)."""
    # the flags dpo and grpo share (what toolkit.setup_run reads: --lr's default for the built-in model too)
    p = script_parser(__doc__.split("\n\n")[0], prog=prog, save_dir="outputs/sft", max_steps=400, seq_len=2048,
                      lr=DEFAULT_LR, data_help="JSONL with 'text', 'prompt'/'completion' or chat 'messages' (trained "
                      "on the assistant turns) per line (needs --model)")
    p.add_argument("--pack", action="store_true",
                   help="pack several --data documents into each row of --seq-len tokens (position_ids restart "
                        "per document, no attention_mask); default: one document per row, padded")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad command-line values before anything starts, naming the flag to change.

    Run before the config is read, so that an error here is never blamed on the config.
    """
    check_run_args(args)
    if args.pack and not args.data:
        raise SystemExit(
            "--pack packs the documents of --data: add --data FILE.jsonl --model PATH, or drop --pack "
            "(the built-in copy task has one sequence per row)"
        )
    check_lora_args(args)


def main(argv: list[str] | None = None) -> int:
    """Train (one rank of the launched world, or the one process); returns the exit status (0)."""
    args = parse_args(argv)
    check_args(args)
    import deepspeed.comm as dist

    data = {}  # what load_data reads: the rows' source, the loss at chance (or None), the pad id, the packing

    def load_data():  # after the config checks, before any weight is allocated: bad data fails first
        if args.data:
            rows = JsonlData(args.data, load_tokenizer(args.model), args.seq_len)
            packed = pack_jsonl(rows, args.seed) if args.pack else None
            if packed is not None:
                log_packing(packed.stats)
            source = rows.__getitem__ if packed is None else packed.__getitem__
            data.update(source=source, chance=None, pad_id=rows.pad_id, packed=packed)
        else:
            copy_example(0, args.seq_len, args.seed)  # fail early if --seq-len is too short
            data.update(source=lambda i: copy_example(i, args.seq_len, args.seed),
                        chance=math.log(len(DOC_TOKENS)), pad_id=0, packed=None)

    run = setup_run(args, before_model=load_data)
    source, chance, pad_id, packed = data["source"], data["chance"], data["pad_id"], data["packed"]
    engine, rank, world, device = run.engine, run.rank, run.world, run.engine.device
    # Ranks of one sequence-parallel group build the same batch and keep their shard of it.
    gas, replica, num_replicas = run.gas, run.replica, run.num_replicas

    log = MetricsLog(run, "sft", ("loss",))
    for step in range(log.start_step, args.max_steps):
        step_loss = torch.zeros((), device=device)
        for micro in range(gas):
            batch = micro_batch(source, step, micro, gas, replica, num_replicas, run.micro_bs)
            # Text tokens of this replica's whole micro-batch (before sharding), times the replicas;
            # padding is not counted. Packed rows have no mask: their data knows each row's pad tail.
            if packed is None:
                log.tokens += int(batch["attention_mask"].sum()) * num_replicas
            else:
                indices = micro_batch_indices(step, micro, gas, replica, num_replicas, run.micro_bs)
                log.tokens += sum(packed.num_real_tokens(i) for i in indices) * num_replicas
            batch = run.prepare(batch, pad_id)
            # No KV cache in training. It also matters for packed rows: transformers reads restarting
            # position_ids as separate documents only when no cache is passed, and with the config's
            # default use_cache=True the stock model would build one and attend across documents.
            loss = engine(**batch, use_cache=False).loss
            if micro == 0:
                before_backward(rank, step + 1)  # test-only fault injection (DS_LONGSEQ_FAULT_INJECT); unset: nothing
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / gas
        dist.all_reduce(step_loss)  # ranks of a sequence-parallel group report the same value
        log.log({"step": step + 1, "loss": step_loss.item() / world})
        run.save_if_due(step + 1)
    log.close()
    metrics, start_step = log.rows, log.start_step

    exported = finish(run)
    if rank == 0:
        plot_losses(metrics, os.path.join(args.save_dir, "loss.png"), chance,
                    chance_label=f"chance without looking back (ln {len(DOC_TOKENS)})")
        first, last = metrics[0]["loss"], metrics[-1]["loss"]
        print(
            f"\nsummary: {args.max_steps - start_step} steps on {world} rank(s)"
            + (f" (sequence parallel {run.sp_size} x data parallel {num_replicas}"
               + (f", Ulysses {run.sp_size // run.ring} x ring {run.ring})" if run.ring > 1 else ")")
               if run.sp_size > 1 else "")
            + f", seq_len {args.seq_len}, "
            f"loss {first:.4f} -> {last:.4f}"
            + (f" (chance without looking back {chance:.4f})" if chance is not None else "")
            + f", {log.mean_tokens_per_s:.0f} tokens/s, peak memory {log.peak_gib:.2f} GiB/rank\n"
            f"outputs: {args.save_dir}/ (latest checkpoint, metrics.jsonl, loss.png, {exported})",
            flush=True,
        )
    dist.barrier()
    return 0
