"""examples/sft.py's job through the Hugging Face Trainer (or TRL's SFTTrainer) with ds_longseq.

Compared with a stock Trainer script, two things change: the DeepSpeed config carries a
``"long_seq"`` section, and the Trainer class is ``LongSeqTrainer`` (``with_long_seq(SFTTrainer)``
for TRL). Launch it the DeepSpeed way (CPU ranks use gloo, GPUs nccl), or with accelerate and a
DeepSpeed accelerate config (its ``deepspeed_config_file`` is then the default ``--ds_config``):

    deepspeed --num_gpus 2 examples/trainer_sft.py
    deepspeed --num_gpus 2 examples/trainer_sft.py --trl        # TRL's SFTTrainer (pip install 'trl>=1.9')
    accelerate launch --config_file launch/accelerate_deepspeed.yaml examples/trainer_sft.py

``--model PATH --data FILE.jsonl`` trains a local Hugging Face model on your data, as sft.py does: one JSON
object per line, ``{"text": ...}``, ``{"prompt": ..., "completion": ...}`` (the prompt untrained) or a chat
``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered by the tokenizer's chat template and trained on
its assistant turns only. With no arguments it trains sft.py's embedded default: the tiny Llama-shaped model
built from a config, from scratch, on the built-in copy task (a random document, then the same document again;
only the copy is trained on, so the loss can fall below chance, ln 224, only once attention reaches
back to the first copy), here at a shorter default length. Outputs under --output-dir: the model in
HF format (``hf_model/``, loadable by the stock ``AutoModelForCausalLM``), ``trainer_state.json``
(the Trainer's log history) and ``loss.png``.

The default config, ds_configs/trainer_zero2_streambp.json, leaves batch sizes, gradient clipping
and bf16 to the Trainer ("auto") and has no "optimizer" / "scheduler" section, so the Trainer's own
AdamW and schedule from TrainingArguments are used, as in any Trainer script. Any other config works
when the values the Trainer also sets are "auto" or equal to its own (the Trainer names each one
that is not: sft.py's ds_configs/zero*_streambp.json fix lr 2e-5 and a micro-batch of 1); an
"optimizer" section makes DeepSpeed build the optimizer. Under ZeRO-3 set
``stage3_gather_16bit_weights_on_model_save`` for the HF-format save; with
``long_seq.sequence_parallel.size = P`` the P ranks of a group train on the same rows, 1/P each.

``--lora-rank N`` trains a PEFT LoRA adapter of rank N on the frozen model (``hf_adapter/`` is then written in
PEFT's format instead of ``hf_model/``), and ``--load-in-4bit [nf4|fp4]`` with it loads the base quantised to 4
bits (QLoRA; bitsandbytes, ``pip install 'ds_longseq[qlora]'``), the flags sft.py takes (docs/TRAINING_SCRIPTS.md).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from transformers import TrainingArguments

from ds_longseq.toolkit import (
    DOC_TOKENS,
    VOCAB,
    DefaultsOnceFormatter,
    FourBit,
    JsonlData,
    add_lora,
    build_model,
    check_4bit_args,
    check_model_and_data,
    copy_example,
    load_tokenizer,
    plot_losses,
    start_distributed,
)
from ds_longseq.toolkit.args import exit_status
from ds_longseq.trainer import LongSeqTrainer, TrainerConfigError, with_long_seq

DEFAULT_DS_CONFIG = "trainer_zero2_streambp"  # a shipped config (ds_configs/); trainer_zero3_ulysses_streambp: SP 2
BATCH = 8  # rows per rank and step: 8 x 256 tokens, the 2048 tokens per rank of sft.py's default step
DEFAULT_LR = 3e-3  # sft.py's rate for the embedded tiny model, which trains from scratch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsOnceFormatter
    )
    p.add_argument("--ds_config", "--ds-config", dest="ds_config",
                   default=os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or DEFAULT_DS_CONFIG,
                   help="DeepSpeed JSON config with a long_seq section, a path or a shipped config's name (an existing "
                   "path wins); Trainer-set values 'auto' or equal to its own (under accelerate launch: the config "
                   "file its DeepSpeed config names)")
    p.add_argument("--trl", action="store_true", help="train with TRL's SFTTrainer instead of transformers' Trainer")
    p.add_argument("--model", default=None,
                   help="local HF causal-LM directory or .gguf file (from_pretrained); default: tiny built-in Llama")
    p.add_argument("--data", default=None, help="JSONL with 'text', 'prompt'/'completion' or chat 'messages' per line "
                   "(needs --model)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: {DEFAULT_LR} for the built-in model, 2e-5 with --model)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--max-steps", type=int, default=150, help="optimizer steps")
    p.add_argument("--output-dir", "--save-dir", dest="output_dir", default="outputs/trainer_sft",
                   help="HF-format model, trainer_state.json (the logged losses) and loss plot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-rank", type=int, default=0,
                   help="freeze the model and train a LoRA adapter of this rank (needs peft), exported to "
                        "hf_adapter/; 0: train every weight")
    p.add_argument("--load-in-4bit", nargs="?", const="nf4", default=None, choices=["nf4", "fp4"],
                   help="QLoRA: the base's decoder linears quantised to 4 bits (bitsandbytes; nf4 when given bare), "
                        "computing in the run's dtype; needs --lora-rank")
    p.add_argument("--no-double-quant", action="store_true",
                   help="with --load-in-4bit: do not quantise the per-block scales (on by default, as in QLoRA)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    return p.parse_args(argv)


def import_trl():
    """TRL's SFTConfig and SFTTrainer (TRL is not an install requirement of ds_longseq)."""
    try:
        from trl import SFTConfig, SFTTrainer
    except ImportError as err:
        raise SystemExit(
            "--trl needs TRL, which is not installed: pip install 'trl>=1.9' (or pip install -e '.[trl]')"
        ) from err
    return SFTConfig, SFTTrainer


def copy_task_tokenizer():
    """An offline tokenizer over the copy task's ids (token i is "t<i>", 0 the pad): TRL needs one."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", eos_token="t2")


def make_trainer(args, training: dict, model, rows: list, tokenizer, long_seq):
    """The Trainer (or TRL's SFTTrainer with --trl) over ``rows``: a stock script would say Trainer / SFTTrainer;
    the Trainer class is the only code change (and ``long_seq=``)."""
    if not args.trl:
        return LongSeqTrainer(model=model, args=TrainingArguments(**training), train_dataset=rows, long_seq=long_seq)
    import datasets

    SFTConfig, SFTTrainer = import_trl()
    # TRL pads each batch itself: the rows without their padding, as token lists
    data = datasets.Dataset.from_list([
        {"input_ids": r["input_ids"][r["attention_mask"] == 1].tolist(),
         "labels": r["labels"][r["attention_mask"] == 1].tolist()} for r in rows
    ])
    # StreamBP recomputes each layer itself: TRL's default checkpointing off (transformers 5.23 renamed the flag)
    flag = ("activation_checkpointing" if "activation_checkpointing" in SFTConfig.__dataclass_fields__
            else "gradient_checkpointing")
    config = SFTConfig(**training, max_length=args.seq_len, **{flag: False})
    return with_long_seq(SFTTrainer)(model=model, args=config, train_dataset=data,
                                     processing_class=tokenizer or copy_task_tokenizer(), long_seq=long_seq)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_model_and_data(args.model, args.data)  # the paths named before anything loads
    if args.lora_rank < 0:
        raise SystemExit(f"--lora-rank must be >= 0 (0: no LoRA), got {args.lora_rank}: pass e.g. --lora-rank 16")
    check_4bit_args(args)  # --load-in-4bit beside --lora-rank, not GGUF, bitsandbytes installed
    tokenizer = None
    if args.data:  # bad data fails here, before anything starts
        tokenizer = load_tokenizer(args.model)
        data = JsonlData(args.data, tokenizer, args.seq_len)
    else:
        copy_example(0, args.seq_len, args.seed)  # a too-short --seq-len fails here, before anything starts
    if args.trl:
        import_trl()  # a missing TRL fails here, before anything starts
    # gloo on CPU, nccl on GPU; checks the config's long_seq section against --seq-len and the world size
    _, world, ds_config, long_seq, use_bf16 = start_distributed(args.ds_config, seq_len=args.seq_len)
    # the section start_distributed parsed, handed to the Trainer as it is (not parsed again): a script of your own
    # can leave it in the DeepSpeed JSON instead, where the Trainer takes it out itself
    ds_config.pop("long_seq", None)

    model = build_model(args.model, torch.bfloat16 if use_bf16 else torch.float32, seq_len=args.seq_len,
                        seed=args.seed, four_bit=FourBit.from_args(args))
    if args.lora_rank:
        model = add_lora(model, args.lora_rank, seed=args.seed)
    count = args.max_steps * world * BATCH
    rows = [data[i] for i in range(count)] if args.data else [
        copy_example(i, args.seq_len, args.seed) for i in range(count)]
    lr = args.lr if args.lr is not None else (2e-5 if args.model else DEFAULT_LR)
    training = dict(
        output_dir=args.output_dir, deepspeed=ds_config, max_steps=args.max_steps, per_device_train_batch_size=BATCH,
        learning_rate=lr, adam_beta2=0.95, weight_decay=0.0, warmup_steps=10,
        lr_scheduler_type="constant_with_warmup", max_grad_norm=1.0, bf16=use_bf16,
        use_cpu=not torch.cuda.is_available(), logging_steps=0.02,  # 50 logs per run
        save_strategy="no", report_to="none", seed=args.seed,
    )

    try:
        trainer = make_trainer(args, training, model, rows, tokenizer, long_seq)
    except TrainerConfigError as err:  # the config against TrainingArguments: one line, exit status 2
        raise SystemExit(f"--ds_config {args.ds_config}: {err}") from None
    result = trainer.train()
    exported = "hf_adapter" if args.lora_rank else "hf_model"  # a PeftModel saves its adapter, PEFT's format
    trainer.save_model(os.path.join(args.output_dir, exported))  # every rank: ZeRO-3 gathers the weights
    trainer.save_state()  # trainer_state.json, with the log history

    if trainer.is_world_process_zero():
        losses = [h for h in trainer.state.log_history if "loss" in h]
        chance = None if args.data else math.log(len(DOC_TOKENS))
        plot_losses(losses, os.path.join(args.output_dir, "loss.png"), chance,
                    chance_label=f"chance without looking back (ln {len(DOC_TOKENS)})",
                    title="examples/trainer_sft.py" + (" --trl" if args.trl else ""))
        sp = trainer.long_seq_sp_size
        print(
            f"\nsummary: {type(trainer).__name__}, {args.max_steps} steps on {world} rank(s)"
            + (f" (sequence parallel {sp} x data parallel {world // sp})" if sp > 1 else "")
            + f", seq_len {args.seq_len}, "
            f"loss {losses[0]['loss']:.4f} (step {losses[0]['step']}) -> {losses[-1]['loss']:.4f} "
            f"(step {losses[-1]['step']}"
            + ("" if chance is None else f"; chance without looking back {chance:.4f}")
            + f"), {result.metrics['train_runtime']:.0f} s of training\n"
            f"outputs: {args.output_dir}/ ({exported}/, trainer_state.json, loss.png)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))  # 0 done, 1 does not fit (the preflight), 2 bad input (one line on stderr)
