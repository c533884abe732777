"""The command-line flags the example scripts share, and their checks.

Every check runs before DeepSpeed starts and names the flag to change (an error here is never
blamed on the config).

Holds:
    add_common_args: the flags examples/sft.py, dpo.py and grpo.py share (same names, same meaning).
    script_parser: a training script's parser: its description, the shared flags with its defaults, and --data.
    DefaultsOnceFormatter: ``--help`` saying each default once.
    check_run_args: lengths, steps, --save-every, --save-every-minutes, --save-total-limit, --data needs --model,
        the paths exist, the save directory can be created and written (check_save_dir), and an earlier run's
        checkpoints in it are resumed or started over, never trained beside (check_earlier_run).
    check_model_and_data: --data needs --model; the --model directory and the --data file exist.
    check_lora_args: --lora-rank / --lora-alpha / --lora-dropout / --lora-targets / --merge-lora, and peft
        installed; then check_4bit_args.
    check_4bit_args: --load-in-4bit / --no-double-quant: beside --lora-rank, a model directory (not GGUF), and
        bitsandbytes installed.
    check_args: both, in that order.
    EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT / DoesNotFit / exit_status: the exit statuses the scripts and the
        ``ds-longseq`` command keep (the planner's): 0 done, 1 the step does not fit (the memory preflight), 2 bad
        input, one line on stderr; a genuine error keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from ds_longseq.toolkit.lora import import_peft, parse_lora_targets
from ds_longseq.toolkit.pretrained import gguf_parts
from ds_longseq.toolkit.quantized import import_bitsandbytes
from ds_longseq.toolkit.report_to import REPORT_TO, check_report_to

__all__ = ["add_common_args", "DefaultsOnceFormatter", "check_run_args", "check_model_and_data", "check_save_dir",
           "check_earlier_run",
           "check_lora_args", "check_4bit_args", "check_args", "EXIT_OK", "EXIT_DOES_NOT_FIT", "EXIT_BAD_INPUT",
           "EXIT_STATUSES",
           "DoesNotFit", "exit_status", "script_parser"]

DEFAULT_SAVE_MINUTES = 30.0
"""--save-every-minutes' default: a run that crashes loses at most about this much work."""
DEFAULT_SAVE_LIMIT = 2
"""--save-total-limit's default: the newest checkpoint and the one before it (were the newest unreadable)."""

EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
"""The exit statuses of the training scripts, the ``ds-longseq`` command and the planner (``python -m
ds_longseq.plan``): done (or fits), the step does not fit, bad input."""

EXIT_STATUSES = ("exit status: 0 done; 1 the memory preflight says the step does not fit (its message says what "
                 "would); 2 bad input (a flag, the DeepSpeed config, the model or data path), one line on stderr; "
                 "another status is a genuine error, with its traceback")
"""The scripts' and the command's ``--help`` epilog."""


class DoesNotFit(SystemExit):
    """The memory preflight's refusal (``--seq-len`` cannot fit): exit status 1, as the planner's "does not fit",
    where every other one-line refusal of these scripts is bad input (2)."""


def exit_status(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a script's ``main(argv)`` and return its exit status: its own, 0 for None; a one-line refusal
    (``SystemExit`` with a message, how every check here refuses) printed on stderr and mapped to
    :data:`EXIT_DOES_NOT_FIT` (:class:`DoesNotFit`) or :data:`EXIT_BAD_INPUT`. Anything else, a genuine error,
    propagates with its traceback (nothing here catches ``Exception``)."""
    try:
        return main(argv) or EXIT_OK
    except SystemExit as err:
        if not isinstance(err.code, str):
            raise  # argparse's own exits (status 2 after its usage line; 0 after --help), sys.exit(N)
        print(err.code, file=sys.stderr, flush=True)
        return EXIT_DOES_NOT_FIT if isinstance(err, DoesNotFit) else EXIT_BAD_INPUT


def add_common_args(p: argparse.ArgumentParser, *, save_dir: str, max_steps: int, seq_len: int, lr: float) -> None:
    """Add the flags sft.py, dpo.py and grpo.py share (same names, same meaning) to ``p``.

    Args:
        p: the script's parser.
        save_dir, max_steps, seq_len: the script's defaults of --save-dir, --max-steps, --seq-len.
        lr: the peak learning rate for the built-in model (no --model); stored as ``args.default_lr``.
    """
    p.add_argument("--ds_config", "--ds-config", dest="ds_config", default="zero2_streambp",
                   help="DeepSpeed JSON config with an optional long_seq section: a path, or the name of a shipped "
                        "config (`ds-longseq configs` lists them; ds_configs/NAME.json also finds one from any "
                        "directory); an existing path wins over a shipped name (default: zero2_streambp)")
    p.add_argument("--model", default=None,
                   help="local HF causal-LM directory or .gguf file (from_pretrained); default: tiny built-in Llama")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per row (padded, or packed with sft.py --pack)")
    p.add_argument("--max-steps", type=int, default=max_steps,
                   help="optimizer steps (each of train_batch_size sequences: train_micro_batch_size_per_gpu x "
                        "gradient_accumulation_steps micro-batches per rank, as DeepSpeed reads the config's batch "
                        "keys), one metrics.jsonl line each")
    p.add_argument("--save-dir", default=save_dir, help="checkpoints, metrics, plot and HF export")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N optimizer steps (default 0: by time alone, --save-every-minutes); the "
                        "last step always saves")
    p.add_argument("--save-every-minutes", type=float, default=DEFAULT_SAVE_MINUTES,
                   help=f"checkpoint once this many minutes have passed since the last one (default "
                        f"{DEFAULT_SAVE_MINUTES:g}, so a crash loses at most about that much; 0: by steps alone)")
    p.add_argument("--save-total-limit", type=int, default=DEFAULT_SAVE_LIMIT,
                   help=f"keep only the newest N checkpoints, removing older ones once a new one is complete "
                        f"(default {DEFAULT_SAVE_LIMIT}, bounding the disk a long run takes; 0: keep all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --save-dir (same data, same losses)")
    p.add_argument("--start-over", action="store_true",
                   help="in a --save-dir holding an earlier run's checkpoints, remove them (its step<N>/, latest, "
                        "metrics.jsonl, loss.png, hf_model/, hf_adapter/, the monitors' tensorboard/, csv_monitor/, "
                        "wandb/) and train from step 0; without it, or "
                        "--resume, such a directory is refused")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: the config's; {lr} for the built-in model)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 on GPU, fp32 on CPU (overrides the config's bf16 section)")
    p.add_argument("--pad-for-sp", action="store_true",
                   help="pad rows on the right to a multiple of the sequence_parallel size (else: an error)")
    p.add_argument("--report-to", default=None, metavar="{" + ",".join(("none", *REPORT_TO)) + "}",
                   help="where each step's metrics also go, comma-separated: tensorboard (SAVE_DIR/tensorboard/), csv "
                        "(SAVE_DIR/csv_monitor/), wandb (a W&B run in SAVE_DIR/wandb/ unless WANDB_DIR is set; "
                        "WANDB_MODE=offline keeps it on disk); none: nowhere, even where the DeepSpeed config "
                        "enables a monitor. Not given: the config's monitor sections as they are")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="freeze the model and train a LoRA adapter of this rank (needs peft); dpo.py's and grpo.py's "
                        "reference is then the policy with its adapters disabled; 0: train every weight")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator; default: 2 x --lora-rank")
    p.add_argument("--lora-dropout", type=float, default=None,
                   help="dropout on each LoRA adapter's input (PEFT's lora_dropout; e.g. 0.05), replayed exactly in "
                        "the chunk re-forwards; default: 0")
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated module names LoRA adapts; default: every linear projection of the decoder")
    p.add_argument("--merge-lora", action="store_true",
                   help="with --lora-rank: also write the base model with the adapter merged in to hf_model/ (a "
                        "--load-in-4bit base dequantized to the run's dtype first: the adapter was trained on it)")
    p.add_argument("--load-in-4bit", nargs="?", const="nf4", default=None, choices=["nf4", "fp4"],
                   help="QLoRA: load the base with its decoder's linear layers quantised to 4 bits (bitsandbytes; "
                        "nf4 when given bare, or fp4), computing in the run's dtype; needs --lora-rank and a --model "
                        "directory or the built-in model (not GGUF)")
    p.add_argument("--no-double-quant", action="store_true",
                   help="with --load-in-4bit: do not quantise the per-block scales (double quantisation is on by "
                        "default, as in the QLoRA paper)")
    p.add_argument("--no-preflight", action="store_true",
                   help="run even when the memory planner says the step cannot fit (python -m ds_longseq.plan)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    p.set_defaults(default_lr=lr)


class DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default said once: argparse's "(default: X)" is added only where the flag's own
    help does not already say its default, and not for a switch (False) or an unset value (None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def check_run_args(args: argparse.Namespace) -> None:
    """Refuse bad --seq-len, --max-steps, --save-every, --save-total-limit, --data without --model, a --model
    directory or --data file that is not there, a bad --report-to, and a --save-dir that cannot be created or
    written."""
    if args.seq_len <= 0:
        raise SystemExit(f"--seq-len must be positive, got {args.seq_len}: pass the tokens per sequence, e.g. 2048")
    if args.max_steps <= 0:
        raise SystemExit(f"--max-steps must be positive, got {args.max_steps}")
    if args.save_every < 0:
        raise SystemExit(f"--save-every must be >= 0 (0: a checkpoint only at the end), got {args.save_every}")
    if getattr(args, "save_every_minutes", 0) < 0:
        raise SystemExit(f"--save-every-minutes must be >= 0 (0: by steps alone), got {args.save_every_minutes}")
    limit = getattr(args, "save_total_limit", 0)
    if limit < 0:
        raise SystemExit(f"--save-total-limit must be >= 0 (the newest checkpoints to keep), got {limit}: pass 0 to "
                         "keep every checkpoint")
    check_model_and_data(args.model, args.data)
    check_report_to(getattr(args, "report_to", None))
    if args.data and not args.model:
        raise SystemExit("--data needs --model: its tokenizer turns the text into tokens")
    if getattr(args, "save_dir", None):
        check_save_dir(args.save_dir)
        check_earlier_run(args)


def check_earlier_run(args: argparse.Namespace) -> None:
    """Decide, before anything starts, what to do with the checkpoints an earlier run left in --save-dir: --resume
    continues them, --start-over removes them (``setup_run``, before the model is built), and anything else is
    refused naming both (training beside them would mix two runs' checkpoints and fail at the last save)."""
    from ds_longseq.toolkit.save_dir import earlier_run

    resume, start_over = getattr(args, "resume", False), getattr(args, "start_over", False)
    if resume and start_over:
        raise SystemExit("--resume and --start-over both given: --resume continues the run in --save-dir, "
                         "--start-over removes it; pass one")
    found = earlier_run(args.save_dir)
    if resume or start_over or not found:
        return
    shown = ", ".join(found if len(found) <= 4 else [found[0], "...", *found[-3:]])
    raise SystemExit(f"--save-dir {args.save_dir} holds an earlier run's checkpoints ({shown}): pass --resume to "
                     "continue it, or --start-over to remove them and train from step 0, or choose another --save-dir")


def check_save_dir(save_dir: str) -> None:
    """Create ``save_dir`` (and its parents) if needed and check it can be written, before the model loads: an
    uncreatable or read-only one stops here naming it and why (a later save would fail after the setup)."""
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as err:
        raise SystemExit(f"--save-dir {save_dir}: cannot be created ({err.strerror}): pass a directory you can "
                         "write") from None
    if not os.access(save_dir, os.W_OK | os.X_OK):
        raise SystemExit(f"--save-dir {save_dir}: not writable: pass a directory you can write")


def check_model_and_data(model: str | None, data: str | None) -> None:
    """Refuse --data without --model, a --model that is neither a saved Hugging Face model directory nor a GGUF file
    (or a GGUF file without the gguf package), and a --data file that is not there or not readable, naming the path
    (before transformers' hub-id messages could)."""
    if data and not model:
        raise SystemExit("--data needs --model: its tokenizer turns the text into tokens")
    try:
        gguf = model is not None and gguf_parts(model) is not None  # its own messages: no such file, pip install gguf
    except (FileNotFoundError, ImportError) as err:
        raise SystemExit(str(err)) from None
    if model and not gguf and not os.path.isdir(model):
        raise SystemExit(
            f"--model {model}: no such directory. Pass a local Hugging Face model directory (with config.json and the "
            "weights, e.g. from `huggingface-cli download <repo> --local-dir DIR`) or a .gguf file"
        )
    if model and not gguf and not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(f"--model {model}: no config.json in it: pass the directory of a saved Hugging Face model")
    if data and not os.path.isfile(data):
        raise SystemExit(f"--data {data}: no such file (a JSONL file, one record per line)")
    if data and not os.access(data, os.R_OK):
        raise SystemExit(f"--data {data}: not readable (check its permissions)")


def check_lora_args(args: argparse.Namespace) -> None:
    """Refuse bad LoRA flags, and LoRA flags given without --lora-rank; import peft when LoRA is asked for.

    A missing peft fails here, before DeepSpeed starts.
    """
    if args.lora_rank < 0:
        raise SystemExit(f"--lora-rank must be >= 0 (0: no LoRA), got {args.lora_rank}: pass e.g. --lora-rank 16")
    if args.lora_rank == 0:
        given = {"--lora-alpha": args.lora_alpha is not None, "--lora-dropout": args.lora_dropout is not None,
                 "--lora-targets": args.lora_targets is not None, "--merge-lora": args.merge_lora}
        unused = [flag for flag, is_given in given.items() if is_given]
        if unused:
            flags = ", ".join(unused)
            raise SystemExit(
                f"{flags} given without --lora-rank (no LoRA): add --lora-rank N (N > 0), or leave out {flags}"
            )
        check_4bit_args(args)
        return
    if args.lora_alpha is not None and not args.lora_alpha > 0:
        raise SystemExit(f"--lora-alpha must be positive, got {args.lora_alpha}")
    if args.lora_dropout is not None and not 0 <= args.lora_dropout < 1:
        raise SystemExit(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}: pass e.g. --lora-dropout 0.05")
    if args.lora_targets is not None and not all(parse_lora_targets(args.lora_targets)):
        raise SystemExit(f"--lora-targets {args.lora_targets!r} has an empty name: pass e.g. q_proj,v_proj")
    import_peft()
    check_4bit_args(args)


def check_4bit_args(args: argparse.Namespace) -> None:
    """Refuse --load-in-4bit without --lora-rank (a 4-bit base cannot be trained, only adapted), with a GGUF --model
    (already quantised by llama.cpp, dequantized on load), --no-double-quant without --load-in-4bit, and a missing
    bitsandbytes, before DeepSpeed starts."""
    kind = getattr(args, "load_in_4bit", None)
    if kind is None:
        if getattr(args, "no_double_quant", False):
            raise SystemExit("--no-double-quant given without --load-in-4bit: add --load-in-4bit, or leave out "
                             "--no-double-quant")
        return
    if not args.lora_rank:
        raise SystemExit("--load-in-4bit needs --lora-rank: a 4-bit base is frozen and only a LoRA adapter trains "
                         "(QLoRA); add --lora-rank N (N > 0), or leave out --load-in-4bit")
    if args.model and gguf_parts(args.model) is not None:
        raise SystemExit(f"--load-in-4bit with a GGUF --model ({args.model}): transformers dequantizes GGUF on load "
                         "and takes no second quantisation; pass the model's Hugging Face directory, or leave out "
                         "--load-in-4bit to train on the dequantized GGUF weights")
    try:
        import_bitsandbytes()
    except ImportError as err:
        raise SystemExit(str(err)) from None


def check_args(args: argparse.Namespace) -> None:
    """:func:`check_run_args` then :func:`check_lora_args`: every shared flag, before anything starts."""
    check_run_args(args)
    check_lora_args(args)


def script_parser(description: str, *, prog: str | None, save_dir: str, max_steps: int, seq_len: int, lr: float,
                  data_help: str) -> argparse.ArgumentParser:
    """The parser of a training script (``ds-longseq train`` / ``dpo`` / ``grpo`` and the examples that copy them):
    ``description``, the exit statuses as the epilog, :func:`add_common_args` with the script's defaults, and its
    ``--data`` (``data_help``: the records it reads). ``prog``: the name ``--help`` shows (None: the script's).

    Abbreviations are off: ``ds-longseq`` parses these flags once before starting the ranks and each rank again, and
    an abbreviation of a launch-only flag (--num_gpu) would pass the first parse and fail the second.
    """
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=EXIT_STATUSES,
                                formatter_class=DefaultsOnceFormatter, allow_abbrev=False)
    add_common_args(p, save_dir=save_dir, max_steps=max_steps, seq_len=seq_len, lr=lr)
    p.add_argument("--data", default=None, help=data_help)
    return p
