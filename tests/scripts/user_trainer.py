"""A user's Trainer / TRL script written the ALST way, which tests/test_launchers.py launches unmodified.

It starts no process group of its own: whatever launcher runs it (deepspeed, torchrun, accelerate launch,
launch/mpirun.sh) or none (``--stock``: the plain Hugging Face / TRL trainer in one process, the reference), the
Trainer's accelerator and ds_longseq must set everything up. With ds_longseq the script differs from a stock ALST
script in its two documented places only: the DeepSpeed config carries a ``long_seq`` section and the Trainer class
is ``LongSeqTrainer`` / ``with_long_seq(...)``.

    deepspeed --num_gpus 2 tests/scripts/user_trainer.py --deepspeed ds.json --trainer sft --model M --data F --out O
    python tests/scripts/user_trainer.py --stock --trainer sft --model M --data F --out O

Writes ``log.json`` (the Trainer's logged losses, rank 0) and ``hf_model/`` (the trained model, HF format).
"""

from __future__ import annotations

import argparse
import json
import os

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments


def collate(features):
    """Right padding to the longest row (pad id 0, mask 0, label -100)."""
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), length, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], mask[i, :n], labels[i, :n] = torch.tensor(f["input_ids"]), 1, torch.tensor(f["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=["trainer", "sft", "dpo"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSON list of samples")
    p.add_argument("--out", required=True)
    p.add_argument("--deepspeed", default=None, help="DeepSpeed JSON (with a long_seq section)")
    p.add_argument("--sp", type=int, default=2, help="parallelism_config's sp_size (1: no parallelism_config)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--stock", action="store_true", help="the plain trainer, no DeepSpeed, no parallelism_config")
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    cli = p.parse_args()

    from accelerate.parallelism_config import ParallelismConfig

    common = dict(
        output_dir=os.path.join(cli.out, "out"), per_device_train_batch_size=2, max_steps=cli.steps,
        learning_rate=cli.lr, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, optim="sgd",
        report_to=[], logging_steps=1, use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=7,
        save_strategy="no", bf16=False, remove_unused_columns=False,
    )
    if not cli.stock:
        if cli.deepspeed:  # under accelerate launch, its config file names the DeepSpeed JSON instead
            common["deepspeed"] = cli.deepspeed
        if cli.sp > 1:  # else: sequence parallelism, if any, from the DeepSpeed JSON's long_seq section
            common["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=cli.sp)
    with open(cli.data) as f:
        data = datasets.Dataset.from_list(json.load(f))
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    model = AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.float32, attn_implementation="sdpa")

    if cli.trainer == "trainer":
        cls, args = Trainer, TrainingArguments(**common)
        kwargs = dict(data_collator=collate)
    elif cli.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        cls, args = SFTTrainer, SFTConfig(**common, max_length=64)
        kwargs = dict(processing_class=tokenizer)
    else:
        from trl import DPOConfig, DPOTrainer

        cls, args = DPOTrainer, DPOConfig(**common, beta=0.5)
        kwargs = dict(processing_class=tokenizer)
    if not cli.stock:
        from ds_longseq.trainer import with_long_seq

        cls = with_long_seq(cls)
    trainer = cls(model=model, args=args, train_dataset=data, **kwargs)
    trainer.train()
    trainer.save_model(os.path.join(cli.out, "hf_model"))
    if trainer.is_world_process_zero():
        with open(os.path.join(cli.out, "log.json"), "w") as f:
            json.dump([h for h in trainer.state.log_history if "loss" in h], f)


if __name__ == "__main__":
    main()
