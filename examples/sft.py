"""Supervised fine-tuning of a Hugging Face causal LM on long sequences with ds_longseq + DeepSpeed.

Launch it the DeepSpeed way (CPU ranks use gloo, GPUs nccl):

    deepspeed --num_gpus 2 examples/sft.py --ds_config ds_configs/zero2_streambp.json
    deepspeed --num_gpus 2 examples/sft.py --ds_config ds_configs/zero3_ulysses_streambp.json  # SP 2
    deepspeed --hostfile launch/hostfile examples/sft.py --ds_config ds_configs/zero3_streambp.json
    mpirun -np 2 python examples/sft.py --ds_config ds_configs/zero2_streambp.json

With no --model / --data it trains the embedded default: a tiny Llama-shaped model built from a
config, from scratch, on built-in data in which the loss can only fall if attention reaches far
back: each sequence is a random document followed by the same document again, and only the copy
is trained on. No token of the copy can be guessed better than chance (ln 224) without looking
(T-1)/2 tokens back; once the model forms an induction head the loss drops well below chance.

``--pack`` (with ``--data``) puts several documents in each row of exactly --seq-len tokens, in
the padding-free form of transformers' ``DataCollatorWithFlattening``: position_ids restart at
every document, no attention_mask (see :class:`PackedData`).

``--lora-rank N`` (needs peft) freezes the model and trains a LoRA adapter of rank N on every
linear projection of the decoder layers (or on ``--lora-targets``), scaled by ``--lora-alpha / N``.

Outputs under --save-dir: DeepSpeed checkpoints (``step<N>/`` plus an atomically written
``latest``), ``metrics.jsonl`` (one line per step), ``loss.png`` and an HF-format export in
``hf_model/``; with ``--lora-rank``, the adapter in PEFT's format in ``hf_adapter/`` instead (for
``PeftModel.from_pretrained(base, path)``), and with ``--merge-lora`` also the base with the adapter
merged in as ``hf_model/``. ``--resume`` continues from ``latest`` with the same data order and losses.

With ``long_seq.sequence_parallel.size = P`` (or DeepSpeed's ``sequence_parallel_size``) every P
consecutive ranks share each sequence: they build the same batch and ``shard_batch`` gives each
its 1/P (labels shifted first); the world / P groups are data-parallel replicas.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import resource
import signal
import sys
import time
from typing import Iterator, Sequence

import torch

import ds_longseq.engine
from ds_longseq.engine import check_sequence_length, sequence_parallel_rank_and_size, shard_batch, split_config
from ds_longseq.logging import get_logger, log_rank0

logger = get_logger("ds_longseq.examples.sft")

# Built-in copy task: 0 pad, 1 BOS, document tokens drawn uniformly from DOC_TOKENS.
BOS = 1
DOC_TOKENS = range(32, 256)
VOCAB = 256
DEFAULT_LR = 3e-3  # the embedded tiny model trains from scratch; ds_configs/ hold fine-tuning rates

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--ds_config", "--ds-config", dest="ds_config", default="ds_configs/zero2_streambp.json",
                   help="DeepSpeed JSON config with an optional long_seq section")
    p.add_argument(
        "--model", default=None, help="local HF causal-LM path (from_pretrained); default: tiny built-in Llama"
    )
    p.add_argument("--data", default=None, help="JSONL with 'text' or 'prompt'/'completion' per line (needs --model)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--pack", action="store_true",
                   help="pack several --data documents into each row of --seq-len tokens (position_ids restart "
                        "per document, no attention_mask); default: one document per row, padded")
    p.add_argument("--max-steps", type=int, default=400, help="optimizer steps")
    p.add_argument("--save-dir", default="outputs/sft", help="checkpoints, metrics, plot and HF export")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: the config's; {DEFAULT_LR} for the built-in model)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: bf16 on GPU, fp32 on CPU (overrides the config's bf16 section)")
    p.add_argument("--pad-for-sp", action="store_true",
                   help="pad sequences on the right to a multiple of the sequence_parallel size (else: an error)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="freeze the model and train a LoRA adapter of this rank (needs peft); 0: train every weight")
    p.add_argument("--lora-alpha", type=float, default=None,
                   help="LoRA scale numerator: the update is (alpha / rank) B A; default: 2 x --lora-rank")
    p.add_argument("--lora-targets", default=None,
                   help="comma-separated names of the modules LoRA adapts, e.g. q_proj,v_proj; default: every "
                        "linear projection of the decoder layers")
    p.add_argument("--merge-lora", action="store_true",
                   help="with --lora-rank: also write the base model with the adapter merged in to hf_model/")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    # Fault injection for the crash-safety test: exit abruptly in the middle of saving this step.
    p.add_argument("--_crash-during-save-at-step", dest="crash_step", type=int, default=0, help=argparse.SUPPRESS)
    # Fault injection for the fault tests: "RANK:STEP:WHERE" acts on global rank RANK in step STEP. WHERE =
    # "backward": SIGKILL before its backward (the others wait in a collective); "save": SIGKILL at its first
    # file of the step-STEP checkpoint (the others may have written theirs); "stop": SIGSTOP before its
    # backward (a hung rank); "sleep": sleep an hour before its backward (for a kill from outside).
    p.add_argument("--_sigkill-at", dest="sigkill_at", type=sigkill_spec, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def sigkill_spec(text: str) -> tuple[int, int, str]:
    """``--_sigkill-at RANK:STEP:WHERE`` as (rank, step, where), checked when the arguments are parsed."""
    target, step, where = text.split(":")
    if where not in ("backward", "save", "stop", "sleep"):
        raise argparse.ArgumentTypeError(f"WHERE must be backward, save, stop or sleep, got {where!r}")
    return int(target), int(step), where


def sigkill_point(args: argparse.Namespace, rank: int) -> tuple[int, str] | None:
    """(step, where) at which this rank SIGKILLs itself (``--_sigkill-at``), or None."""
    if args.sigkill_at is None or args.sigkill_at[0] != rank:
        return None
    return args.sigkill_at[1:]


def arm_sigkill_on_save(engine) -> None:
    """SIGKILL this process at the next file DeepSpeed's checkpoint engine writes (before writing it)."""
    def save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    engine.checkpoint_engine.save = save


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad command-line values before anything starts, naming the flag to change.

    Run before the config is read, so that an error here is never blamed on the config.
    """
    if args.seq_len <= 0:
        raise SystemExit(f"--seq-len must be positive, got {args.seq_len}: pass the tokens per sequence, e.g. 2048")
    if args.max_steps <= 0:
        raise SystemExit(f"--max-steps must be positive, got {args.max_steps}")
    if args.save_every < 0:
        raise SystemExit(f"--save-every must be >= 0 (0: a checkpoint only at the end), got {args.save_every}")
    if args.data and not args.model:
        raise SystemExit("--data needs --model: its tokenizer turns the text into tokens")
    if args.pack and not args.data:
        raise SystemExit(
            "--pack packs the documents of --data: add --data FILE.jsonl --model PATH, or drop --pack "
            "(the built-in copy task has one sequence per row)"
        )
    if args.lora_rank < 0:
        raise SystemExit(f"--lora-rank must be >= 0 (0: no LoRA), got {args.lora_rank}: pass e.g. --lora-rank 16")
    if args.lora_rank == 0:
        given = {"--lora-alpha": args.lora_alpha is not None, "--lora-targets": args.lora_targets is not None,
                 "--merge-lora": args.merge_lora}
        unused = [flag for flag, is_given in given.items() if is_given]
        if unused:
            flags = ", ".join(unused)
            raise SystemExit(
                f"{flags} given without --lora-rank (no LoRA): add --lora-rank N (N > 0), or leave out {flags}"
            )
        return
    if args.lora_alpha is not None and not args.lora_alpha > 0:
        raise SystemExit(f"--lora-alpha must be positive, got {args.lora_alpha}")
    if args.lora_targets is not None and not all(lora_targets(args)):
        raise SystemExit(f"--lora-targets {args.lora_targets!r} has an empty name: pass e.g. q_proj,v_proj")
    import_peft()  # a missing peft fails here, before DeepSpeed starts


def check_parallel_args(args: argparse.Namespace, sp: int, world: int) -> None:
    """Refuse arguments that do not fit ``sp`` (the sequence_parallel size) and ``world`` ranks."""
    if world % sp:
        raise SystemExit(
            f"sequence_parallel size {sp} does not divide the {world} launched ranks: launch a multiple of {sp}"
        )
    up = args.seq_len + sp - args.seq_len % sp
    if args.seq_len % sp and not args.pad_for_sp:
        raise SystemExit(
            f"--seq-len {args.seq_len} is not divisible by sequence_parallel size {sp}: use --seq-len {up}, "
            "or pass --pad-for-sp"
        )


# ---------------------------------------------------------------------------------------------
# Data


def copy_example(index: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """[BOS] doc doc (pad): a random document and its copy; only the copy carries labels.

    The copy's first token is not labelled (nothing says where the copy starts); every other copy
    token is determined by the token (T-1)/2 positions back and by nothing else.
    """
    half = (seq_len - 1) // 2
    if half < 2:
        raise ValueError(f"--seq-len {seq_len} is too short for the built-in copy task: use at least 5")
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    doc = torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop, (half,), generator=g)
    tail = seq_len - 1 - 2 * half
    ids = torch.cat([torch.tensor([BOS]), doc, doc, torch.zeros(tail, dtype=torch.long)])
    labels = torch.full_like(ids, -100)
    labels[half + 2 : 2 * half + 1] = ids[half + 2 : 2 * half + 1]
    mask = torch.ones_like(ids)
    mask[2 * half + 1 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def read_jsonl(path: str, flag: str = "--data") -> Iterator[tuple[int, dict]]:
    """(line number, record) for every non-blank line of ``path``; errors name ``path:line``."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{flag} {path} does not exist")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                # err's own "line 1 column N" counts within this one line: name the file's line instead.
                raise ValueError(
                    f"{path}:{lineno}: not valid JSON: {err.msg} (column {err.colno}); "
                    "each line must be one JSON object"
                ) from err
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            yield lineno, rec


class JsonlData:
    """Tokenised JSONL records padded/truncated to ``seq_len``; prompt tokens are not trained on."""

    def __init__(self, path: str, tokenizer, seq_len: int):
        self.records = []
        for lineno, rec in read_jsonl(path):
            if "text" in rec:
                prompt, completion = "", rec["text"]
            elif "prompt" in rec and "completion" in rec:
                prompt, completion = rec["prompt"], rec["completion"]
            else:
                raise ValueError(f"{path}:{lineno}: each line needs 'text' or 'prompt' and 'completion'")
            self.records.append((prompt, completion))
        if not self.records:
            raise ValueError(f"--data {path} holds no records")
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def __len__(self) -> int:
        return len(self.records)

    def tokenize(self, index: int) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of record ``index``, not truncated; labels are -100 on prompt tokens."""
        prompt, completion = self.records[index % len(self.records)]
        p_ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        c_ids = self.tokenizer(completion, add_special_tokens=not prompt)["input_ids"]
        return p_ids + c_ids, [-100] * len(p_ids) + c_ids

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.tokenize(index)
        ids, labels = ids[: self.seq_len], labels[: self.seq_len]
        pad = self.seq_len - len(ids)
        return {
            "input_ids": torch.tensor(ids + [self.pad_id] * pad),
            "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
            "labels": torch.tensor(labels + [-100] * pad),
        }


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy bin packing: the indices of ``lengths`` grouped into bins of at most ``capacity``.

    First-fit decreasing: items are taken longest first (ties in input order) and each goes into
    the first bin with room, a new bin when none has. Deterministic; it never uses more than
    11/9 OPT + 6/9 bins. Each bin lists its items in the order they were placed (longest first).
    A max-tree over the bins' free space finds the first fitting bin in O(log n) rather than
    scanning every open bin (O(n^2) for a large data set).

    Args:
        lengths: item sizes, each in [1, capacity].
        capacity: bin size.

    Returns:
        One list of item indices per bin, bins in the order they were opened.
    """
    for i, n in enumerate(lengths):
        if not 1 <= n <= capacity:
            raise ValueError(f"item {i} has length {n}: lengths must be in [1, {capacity}]")
    num_leaves = 1 << max(0, (len(lengths) - 1).bit_length())  # at most one bin per item
    # free[num_leaves + b] is bin b's free space; an inner node holds the max of its two children.
    # Bins not yet opened are full-capacity leaves to the right of every open one (an open bin
    # holds at least one item), so "first leaf with room" opens a new bin exactly when no open one fits.
    free = [capacity] * (2 * num_leaves)
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        node = 1
        while node < num_leaves:
            node = 2 * node if free[2 * node] >= lengths[i] else 2 * node + 1
        b = node - num_leaves
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        free[node] -= lengths[i]
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return bins


@dataclasses.dataclass(frozen=True)
class PackStats:
    """What packing did, for the start-of-run report."""

    num_documents: int
    """Documents packed (empty ones are dropped and counted in ``num_empty``)."""
    num_rows: int
    """Rows of ``seq_len`` tokens they fill."""
    seq_len: int
    """Tokens per row (``--seq-len``)."""
    num_real_tokens: int
    """Document tokens in all rows (after truncation); the rest is the pad tails."""
    num_truncated: int
    """Documents longer than ``seq_len``, cut to their first ``seq_len`` tokens."""
    num_empty: int
    """Documents with no token at all, skipped."""

    @property
    def efficiency(self) -> float:
        """Real tokens / (rows x seq_len): the fraction of computed positions that are not padding."""
        return self.num_real_tokens / (self.num_rows * self.seq_len)


class PackedData:
    """Documents packed several to a row of exactly ``seq_len`` tokens, the padding-free form.

    The form of transformers' ``DataCollatorWithFlattening`` (TRL's ``padding_free``), with fixed
    row length. A row of seq_len 8 holding document a (3 tokens, the first two its prompt),
    document b (2 tokens) and a pad tail of 3::

        input_ids     a0   a1   a2   b0   b1   pad  pad  pad
        position_ids  0    1    2    0    1    0    1    2
        labels        -100 -100 a2   -100 b1   -100 -100 -100

    - ``position_ids`` restart at 0 at every document's first token: that is how the model (or
      transformers' mask builder, given no ``attention_mask``) knows the documents apart and keeps
      attention inside each one. There is no ``attention_mask`` key.
    - ``labels`` are -100 at every document's first token (the collator's convention): after the
      causal shift, the last token of a document is never trained to predict the next document's
      first token. Prompt tokens are -100 as in :class:`JsonlData`.
    - The tail no document fills is one more "document" of pad tokens, all labels -100, whose
      positions restart at 0, so it attends only to itself and nothing real attends to it.

    Rows come from :func:`first_fit_decreasing` over the token counts, then are put in a random
    order drawn from ``seed`` (first-fit decreasing opens rows longest documents first, and
    training should not see the data sorted by length). Packing is deterministic, so every rank
    builds the same rows. ``self[i]`` is row ``i % num_rows`` (epochs repeat).
    """

    def __init__(
        self, documents: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, pad_id: int, seed: int = 0
    ):
        """
        Args:
            documents: (input_ids, labels) per document, labels -100 where not trained on; a
                document longer than ``seq_len`` is cut to its first ``seq_len`` tokens.
            seq_len: tokens per row.
            pad_id: token id of the pad tail.
            seed: seed of the row order.
        """
        self.seq_len, self.pad_id = seq_len, pad_id
        docs = [(list(ids[:seq_len]), list(labels[:seq_len])) for ids, labels in documents if len(ids)]
        if not docs:
            raise ValueError("no document holds any token: nothing to pack")
        self.docs = [(torch.tensor(ids), torch.tensor(labels)) for ids, labels in docs]
        rows = first_fit_decreasing([len(ids) for ids, _ in docs], seq_len)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
        self.rows = [rows[r] for r in order]
        self.stats = PackStats(
            num_documents=len(docs),
            num_rows=len(self.rows),
            seq_len=seq_len,
            num_real_tokens=sum(len(ids) for ids, _ in docs),
            num_truncated=sum(len(ids) > seq_len for ids, _ in documents),
            num_empty=len(documents) - len(docs),
        )

    def __len__(self) -> int:
        return len(self.rows)

    def num_real_tokens(self, index: int) -> int:
        """Document tokens (not the pad tail) in row ``index % num_rows``."""
        return sum(len(self.docs[d][0]) for d in self.rows[index % len(self.rows)])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Row ``index % num_rows``: ``input_ids``, ``position_ids``, ``labels``, each (seq_len,)."""
        ids, pos, labels = [], [], []
        for d in self.rows[index % len(self.rows)]:
            doc_ids, doc_labels = self.docs[d]
            ids.append(doc_ids)
            pos.append(torch.arange(len(doc_ids)))
            labels.append(torch.cat([torch.tensor([-100]), doc_labels[1:]]))
        tail = self.seq_len - sum(len(t) for t in ids)
        if tail:
            ids.append(torch.full((tail,), self.pad_id))
            pos.append(torch.arange(tail))
            labels.append(torch.full((tail,), -100))
        return {"input_ids": torch.cat(ids), "position_ids": torch.cat(pos), "labels": torch.cat(labels)}


def pack_jsonl(data: JsonlData, seed: int = 0) -> PackedData:
    """Tokenise every record of ``data`` and pack them into rows of ``data.seq_len`` tokens."""
    return PackedData([data.tokenize(i) for i in range(len(data))], data.seq_len, data.pad_id, seed)


def micro_batch_indices(step: int, micro: int, gas: int, rank: int, world: int, micro_bs: int) -> range:
    """Indices into the data of the micro-batch of (step, micro-step, data-parallel rank)."""
    base = ((step * gas + micro) * world + rank) * micro_bs
    return range(base, base + micro_bs)


def micro_batch(
    source, step: int, micro: int, gas: int, rank: int, world: int, micro_bs: int
) -> dict[str, torch.Tensor]:
    """The deterministic micro-batch of (step, micro-step, rank): resuming replays the same data.

    Stacks every key the source returns, each (micro_bs, T): ``position_ids`` of packed rows too.
    """
    items = [source(i) for i in micro_batch_indices(step, micro, gas, rank, world, micro_bs)]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


# ---------------------------------------------------------------------------------------------
# Model, checkpoints, reporting


def build_model(args, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=max(args.seq_len, 2048), rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).to(dtype)


def import_peft():
    """peft, which only LoRA runs need (it is not an install requirement of ds_longseq)."""
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            "--lora-rank needs peft, which is not installed: pip install 'peft>=0.21' (or pip install -e '.[lora]')"
        ) from err
    return peft


def lora_targets(args) -> list[str]:
    """The names given with --lora-targets (empty names kept, for check_args to refuse)."""
    return [name.strip() for name in args.lora_targets.split(",")]


def decoder_linear_names(model: torch.nn.Module) -> list[str]:
    """Names (last component, first-seen order) of the linear modules inside ``model.model.layers``.

    PEFT's "all-linear" would pick the same modules in our families, but it writes every module's full
    path into adapter_config.json; short names keep the config readable and apply to every layer.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.Module):
        raise SystemExit(
            f"--lora-rank: {type(model).__name__} has no decoder layers at model.layers to find the projections "
            "in: name the modules to adapt with --lora-targets"
        )
    return list(dict.fromkeys(
        name.rsplit(".", 1)[-1] for name, module in layers.named_modules() if isinstance(module, torch.nn.Linear)
    ))


def add_lora(model: torch.nn.Module, args) -> torch.nn.Module:
    """Freeze ``model`` and wrap it in a PEFT LoRA model per --lora-rank / --lora-alpha / --lora-targets.

    lora_dropout is 0 and not an option: StreamBP re-forwards chunks in backward and cannot replay
    dropout masks. ``lora_A`` is initialised from --seed (``lora_B`` starts at zero), so a run and
    its resume, and every rank, start from the same adapter.
    """
    peft = import_peft()
    names = {name for name, _ in model.named_modules()}
    head = next((name for name, module in model.named_modules() if module is model.get_output_embeddings()), None)
    if args.lora_targets is None:
        targets = decoder_linear_names(model)
    else:
        targets = lora_targets(args)
        # PEFT's rule: a target names a module whose path is that name or ends with "." + name.
        matches = {t: [n for n in names if n == t or n.endswith("." + t)] for t in targets}
        missing = [t for t, found in matches.items() if not found]
        if missing:
            raise SystemExit(
                f"--lora-targets: {', '.join(missing)} matches no module of {type(model).__name__}; "
                f"its decoder layers' linear projections are {','.join(decoder_linear_names(model))}"
            )
        if head is not None and any(head in found for found in matches.values()):
            raise SystemExit(
                f"--lora-targets must not adapt the LM head ({head}): ds_longseq's chunked loss reads "
                f"{head}.weight directly and needs it to stay a torch.nn.Linear; adapt the decoder layers only"
            )
    alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_rank
    config = peft.LoraConfig(r=args.lora_rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets)
    torch.manual_seed(args.seed)
    model = peft.get_peft_model(model, config)
    trainable, total = model.get_nb_trainable_parameters()
    log_rank0(
        logger,
        f"LoRA rank {args.lora_rank}, alpha {alpha:g} on {','.join(targets)}: training {trainable:,} of "
        f"{total:,} parameters ({trainable / total:.2%}); the rest are frozen",
    )
    return model


def configure_logging(rank: int) -> None:
    """Show ds_longseq's log records (INFO and up) on stderr, tagged with the rank.

    The package configures no handler (no import-time side effects); an entry point does.
    """
    package_logger = logging.getLogger("ds_longseq")
    if not package_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(name)s: %(message)s"))
        package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)


def log_packing(stats: PackStats) -> None:
    """The start-of-run packing report, once (rank 0)."""
    log_rank0(
        logger,
        f"--pack: {stats.num_documents} documents in {stats.num_rows} rows of {stats.seq_len} tokens "
        f"(first-fit decreasing): packing efficiency {stats.efficiency:.1%} (real tokens / (rows x seq_len))",
    )
    if stats.num_truncated:
        log_rank0(
            logger,
            f"--pack: {stats.num_truncated} of {stats.num_documents} documents were longer than --seq-len "
            f"{stats.seq_len} and were truncated to their first {stats.seq_len} tokens: raise --seq-len to train "
            "on all of them",
            logging.WARNING,
        )
    if stats.num_empty:
        log_rank0(logger, f"--pack: {stats.num_empty} documents with no tokens were skipped", logging.WARNING)


def peak_memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``latest`` at a COMPLETE checkpoint: written to a temp file, then renamed (atomic)."""
    tmp = os.path.join(save_dir, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, "latest"))


def resume(engine, save_dir: str, metrics_path: str) -> tuple[int, list[dict], str]:
    """Load the checkpoint ``latest`` points at; return (its step, the metrics up to it, its tag)."""
    latest = os.path.join(save_dir, "latest")
    if not os.path.exists(latest):
        raise SystemExit(f"--resume: no checkpoint in {save_dir} (no 'latest' file)")
    with open(latest) as f:
        tag = f.read().strip()
    _, client_state = engine.load_checkpoint(save_dir, tag=tag)
    start_step, metrics = client_state["step"], []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            metrics = [m for m in map(json.loads, f) if m["step"] <= start_step]
    return start_step, metrics, tag


def start_or_resume(engine, args, rank: int, metrics_path: str) -> tuple[int, list[dict]]:
    """(first step to train, metrics rows of the steps before it).

    ``--resume``: load the checkpoint ``latest`` points at and keep the metrics up to it; the rows
    of later steps (the interrupted run's, trained again now) are dropped from ``metrics_path``.
    Otherwise: step 0 and a fresh ``metrics_path``.
    """
    import deepspeed.comm as dist

    if not args.resume:
        if rank == 0 and os.path.exists(metrics_path):
            os.remove(metrics_path)
        return 0, []
    start_step, metrics, tag = resume(engine, args.save_dir, metrics_path)
    if start_step >= args.max_steps:
        raise SystemExit(f"--resume: {args.save_dir}/{tag} is at step {start_step}, and --max-steps is "
                         f"{args.max_steps}: nothing left to train; raise --max-steps")
    dist.barrier()  # every rank has read the metrics before rank 0 truncates them
    if rank == 0:
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in metrics)
        logger.warning("resumed from %s/%s at step %d", args.save_dir, tag, start_step)
    return start_step, metrics


def save_if_due(engine, args, step: int, rank: int) -> None:
    """After step ``step`` (1-based): a checkpoint every ``--save-every`` steps, the last one included."""
    if (args.save_every and step % args.save_every == 0) or step == args.max_steps:
        save_checkpoint(engine, args, step, rank)


def save_checkpoint(engine, args, step: int, rank: int) -> None:
    import deepspeed.comm as dist

    tag = f"step{step}"
    if sigkill_point(args, rank) == (step, "save"):
        arm_sigkill_on_save(engine)
    # save_latest=False: DeepSpeed would rewrite ``latest`` in place; ours flips it only after
    # every rank has finished writing, so a crash mid-save leaves the previous one in charge.
    engine.save_checkpoint(args.save_dir, tag=tag, client_state={"step": step}, save_latest=False)
    if args.crash_step == step:
        os._exit(17)  # fault injection: die after writing, before ``latest`` moves
    dist.barrier()
    if rank == 0:
        write_latest(args.save_dir, tag)
    dist.barrier()


def gathered_state_dict(model: torch.nn.Module, rank: int, trainable_only: bool = False) -> dict | None:
    """``model.state_dict()`` (or only its trainable parameters) as CPU copies on rank 0; None elsewhere.

    Under ZeRO-3 every rank holds 1/world of each parameter: all ranks must call this, which
    gathers the selected parameters for the copy (and only those: a LoRA export gathers no base weight).
    """
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    is_zero3 = hasattr(params[0], "ds_id")
    with deepspeed.zero.GatheredParameters(params, enabled=is_zero3):
        if rank != 0:
            return None
        if trainable_only:
            return {k: v.detach().cpu().clone() for k, v in model.named_parameters() if v.requires_grad}
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def merge_lora(args, dtype: torch.dtype, adapter_dir: str, out_dir: str) -> None:
    """Write the base model with the adapter in ``adapter_dir`` merged in, as a plain HF model.

    The base is built again as for training (--model, or the seeded built-in model): LoRA never
    changes it, so this is exactly what a user does with the adapter later.
    """
    from peft import PeftModel

    merged = PeftModel.from_pretrained(build_model(args, dtype), adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)


def export_hf(model, args, rank: int, dtype: torch.dtype) -> None:
    """The end-of-run export: ``hf_model/``, or with LoRA ``hf_adapter/`` (and, with --merge-lora, ``hf_model/``)."""
    if not args.lora_rank:
        state = gathered_state_dict(model, rank)
        if rank == 0:
            model.save_pretrained(os.path.join(args.save_dir, "hf_model"), state_dict=state)
        return
    state = gathered_state_dict(model, rank, trainable_only=True)
    if rank == 0:
        adapter_dir = os.path.join(args.save_dir, "hf_adapter")
        # PeftModel.save_pretrained keeps only the adapter's entries of state_dict and writes
        # adapter_config.json + adapter_model.safetensors, PEFT's own format.
        model.save_pretrained(adapter_dir, state_dict=state)
        if args.merge_lora:
            merge_lora(args, dtype, adapter_dir, os.path.join(args.save_dir, "hf_model"))


def plot_losses(metrics: list[dict], path: str, chance: float | None, title: str = "examples/sft.py") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], label="training loss")
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle="--", label=f"chance without looking back (ln {len(DOC_TOKENS)})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def start_distributed(args: argparse.Namespace):
    """Start DeepSpeed's process group and check the config against the arguments before any
    training starts (shared by sft.py, dpo.py and grpo.py).

    Returns:
        (rank, world, ds_config with its bf16 and long_seq sections set, LongSeqConfig, use_bf16).
    """
    import deepspeed
    import deepspeed.comm as dist

    # Under mpirun, DeepSpeed's MPI discovery sets MASTER_PORT to distributed_port: honour the caller's.
    deepspeed.init_distributed(
        dist_backend="nccl" if torch.cuda.is_available() else "gloo",
        auto_mpi_discovery=True,
        distributed_port=int(os.environ.get("MASTER_PORT", 29500)),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    configure_logging(rank)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))

    ds_config, long_seq = split_config(args.ds_config)
    check_sequence_length(long_seq, args.seq_len)
    check_parallel_args(args, long_seq.sequence_parallel.size, world)
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and torch.cuda.is_available())
    ds_config["bf16"] = {"enabled": use_bf16}
    ds_config.pop("fp16", None)
    if not torch.cuda.is_available():
        for key in ("offload_optimizer", "offload_param"):  # nothing to pin without a GPU
            if key in ds_config.get("zero_optimization", {}):
                ds_config["zero_optimization"][key]["pin_memory"] = False
    ds_config["long_seq"] = long_seq.to_dict()
    return rank, world, ds_config, long_seq, use_bf16


def set_learning_rate(ds_config: dict, lr: float | None) -> None:
    """Put ``lr`` (None: keep the config's) into the optimizer and a WarmupLR scheduler's peak."""
    if lr is not None:
        ds_config.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"]["lr"] = lr
        if ds_config.get("scheduler", {}).get("type") == "WarmupLR":
            ds_config["scheduler"]["params"]["warmup_max_lr"] = lr


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    import deepspeed.comm as dist
    from tqdm import tqdm

    rank, world, ds_config, long_seq, use_bf16 = start_distributed(args)
    micro_bs = ds_config.get("train_micro_batch_size_per_gpu", 1)
    gas = ds_config.get("gradient_accumulation_steps", 1)

    packed: PackedData | None = None
    if args.data:
        from transformers import AutoTokenizer

        data = JsonlData(args.data, AutoTokenizer.from_pretrained(args.model), args.seq_len)
        source, chance, pad_id = data.__getitem__, None, data.pad_id
        if args.pack:
            packed = pack_jsonl(data, args.seed)
            log_packing(packed.stats)
            source = packed.__getitem__
    else:
        copy_example(0, args.seq_len, args.seed)  # fail early if --seq-len is too short
        source, chance, pad_id = (lambda i: copy_example(i, args.seq_len, args.seed)), math.log(len(DOC_TOKENS)), 0
    set_learning_rate(ds_config, args.lr if args.lr is not None else (None if args.model else DEFAULT_LR))

    dtype = torch.bfloat16 if use_bf16 else torch.float32
    model = build_model(args, dtype)
    if args.lora_rank:
        model = add_lora(model, args)
    # Frozen weights (the base under LoRA) get no optimizer state.
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = ds_longseq.engine.initialize(model=model, model_parameters=trainable, config=ds_config)
    device = engine.device
    # Ranks of one sequence-parallel group build the same batch and keep their shard of it.
    sp_rank, sp_size = sequence_parallel_rank_and_size()
    replica, num_replicas = rank // sp_size, world // sp_size

    os.makedirs(args.save_dir, exist_ok=True)
    metrics_path = os.path.join(args.save_dir, "metrics.jsonl")
    start_step, metrics = start_or_resume(engine, args, rank, metrics_path)

    bar = tqdm(total=args.max_steps, initial=start_step, disable=rank != 0, dynamic_ncols=True, desc="sft")
    t_start, tokens = time.perf_counter(), 0
    for step in range(start_step, args.max_steps):
        step_loss = torch.zeros((), device=device)
        for micro in range(gas):
            batch = micro_batch(source, step, micro, gas, replica, num_replicas, micro_bs)
            # Text tokens of this replica's whole micro-batch (before sharding), times the replicas;
            # padding is not counted. Packed rows have no mask: their data knows each row's pad tail.
            if packed is None:
                tokens += int(batch["attention_mask"].sum()) * num_replicas
            else:
                indices = micro_batch_indices(step, micro, gas, replica, num_replicas, micro_bs)
                tokens += sum(packed.num_real_tokens(i) for i in indices) * num_replicas
            if sp_size > 1:
                batch = shard_batch(batch, sp_rank, sp_size, pad=args.pad_for_sp, pad_token_id=pad_id)
            batch = {k: v.to(device) for k, v in batch.items()}
            # No KV cache in training. It also matters for packed rows: transformers reads restarting
            # position_ids as separate documents only when no cache is passed, and with the config's
            # default use_cache=True the stock model would build one and attend across documents.
            loss = engine(**batch, use_cache=False).loss
            point = sigkill_point(args, rank) if micro == 0 else None
            if point is not None and point[0] == step + 1 and point[1] != "save":
                if point[1] == "sleep":
                    time.sleep(3600)
                os.kill(os.getpid(), signal.SIGSTOP if point[1] == "stop" else signal.SIGKILL)
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float() / gas
        dist.all_reduce(step_loss)  # ranks of a sequence-parallel group report the same value
        step_loss = step_loss.item() / world
        metrics.append({"step": step + 1, "loss": step_loss})
        elapsed = time.perf_counter() - t_start
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tokens / elapsed:.0f}", peak_gib=f"{peak_memory_gib():.2f}")
        bar.update(1)
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(metrics[-1]) + "\n")
        save_if_due(engine, args, step + 1, rank)
    bar.close()

    export_hf(model, args, rank, dtype)
    if rank == 0:
        exported = "hf_model/" if not args.lora_rank else "hf_adapter/" + (", hf_model/" if args.merge_lora else "")
        plot_losses(metrics, os.path.join(args.save_dir, "loss.png"), chance)
        elapsed = time.perf_counter() - t_start
        first, last = metrics[0]["loss"], metrics[-1]["loss"]
        print(
            f"\nsummary: {args.max_steps - start_step} steps on {world} rank(s)"
            + (f" (sequence parallel {sp_size} x data parallel {num_replicas})" if sp_size > 1 else "")
            + f", seq_len {args.seq_len}, "
            f"loss {first:.4f} -> {last:.4f}"
            + (f" (chance without looking back {chance:.4f})" if chance is not None else "")
            + f", {tokens / elapsed:.0f} tokens/s, peak memory {peak_memory_gib():.2f} GiB/rank\n"
            f"outputs: {args.save_dir}/ (latest checkpoint, metrics.jsonl, loss.png, {exported})",
            flush=True,
        )
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
