"""Training data: JSONL records, rows padded to a fixed length, and the deterministic micro-batch order.

Shapes: T the row length (``seq_len``), B the rows of a micro-batch.

Holds:
    read_jsonl: (line number, record) of every non-blank line of a JSONL file; errors name path:line.
    require_keys: refuse a record without the keys every line needs, naming path:line and the keys.
    pad_id_of: the token id a tokenizer pads with (its pad token, else its EOS, else 0).
    pad_row: one row of exactly T tokens (input_ids, attention_mask, labels), padded on the right.
    JsonlData: 'text' or 'prompt'/'completion' records tokenised and padded/truncated to T; prompts untrained.
    micro_batch_indices: the data indices of a (step, micro-step, data-parallel rank) micro-batch.
    micro_batch: that micro-batch stacked, each key (B, T): resuming replays the same data.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

import torch

__all__ = ["read_jsonl", "require_keys", "pad_id_of", "pad_row", "JsonlData", "micro_batch_indices", "micro_batch"]


def require_keys(record: dict, keys: tuple[str, ...], where: str, needs: str) -> None:
    """Raise ValueError at ``where`` (``path:line``) naming the ``keys`` missing from a JSONL ``record``;
    ``needs`` says what every line must hold."""
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(repr(k) for k in missing)}: each line needs {needs}")


def read_jsonl(path: str, flag: str = "--data") -> Iterator[tuple[int, dict]]:
    """(line number, record) for every non-blank line of ``path``; errors name ``path:line``.

    Args:
        path: the JSONL file, one JSON object per line.
        flag: the command-line flag that named it, for the "does not exist" error.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not valid JSON or not an object (naming ``path:line``).
    """
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


def pad_id_of(tokenizer) -> int:
    """The id to pad rows with: the tokenizer's pad token, else its EOS (many causal LMs have no pad), else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def pad_row(ids: list[int], labels: list[int], seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row of exactly ``seq_len`` tokens: ``ids`` (already at most seq_len) then padding.

    Returns:
        ``input_ids``, ``attention_mask`` (1 on ``ids``, 0 on the padding) and ``labels`` (-100 on
        the padding), each (T,).
    """
    pad = seq_len - len(ids)
    return {
        "input_ids": torch.tensor(ids + [pad_id] * pad),
        "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
        "labels": torch.tensor(labels + [-100] * pad),
    }


class JsonlData:
    """Tokenised JSONL records padded/truncated to ``seq_len``; prompt tokens are not trained on.

    Each line holds ``{"text": ...}`` (every token trained on) or ``{"prompt": ..., "completion": ...}``
    (labels -100 on the prompt's tokens). ``self[i]`` is record ``i % len(self)`` (epochs repeat).
    """

    def __init__(self, path: str, tokenizer, seq_len: int):
        """
        Args:
            path: the JSONL file.
            tokenizer: a Hugging Face tokenizer (called as ``tokenizer(text, add_special_tokens=...)``).
            seq_len: T, the row length.
        """
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
        self.pad_id = pad_id_of(tokenizer)

    def __len__(self) -> int:
        return len(self.records)

    def tokenize(self, index: int) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of record ``index``, not truncated; labels are -100 on prompt tokens."""
        prompt, completion = self.records[index % len(self.records)]
        p_ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        # Special tokens (BOS) once per record: on the prompt when there is one, else on the text.
        c_ids = self.tokenizer(completion, add_special_tokens=not prompt)["input_ids"]
        return p_ids + c_ids, [-100] * len(p_ids) + c_ids

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Record ``index % len(self)``: ``input_ids``, ``attention_mask``, ``labels``, each (T,)."""
        ids, labels = self.tokenize(index)
        return pad_row(ids[: self.seq_len], labels[: self.seq_len], self.seq_len, self.pad_id)


def micro_batch_indices(step: int, micro: int, gas: int, rank: int, world: int, micro_bs: int) -> range:
    """Indices into the data of the micro-batch of (step, micro-step, data-parallel rank).

    Args:
        step: the 0-based optimizer step.
        micro: the micro-step within it, in [0, gas).
        gas: gradient accumulation steps.
        rank: the data-parallel replica (ranks of a sequence-parallel group share one).
        world: the number of data-parallel replicas.
        micro_bs: items per micro-batch.

    A pure function of its arguments, so a resumed run sees exactly the data the interrupted one would have.
    """
    base = ((step * gas + micro) * world + rank) * micro_bs
    return range(base, base + micro_bs)


def micro_batch(
    source: Callable[[int], dict[str, torch.Tensor]], step: int, micro: int, gas: int, rank: int, world: int,
    micro_bs: int,
) -> dict[str, torch.Tensor]:
    """The deterministic micro-batch of (step, micro-step, rank): resuming replays the same data.

    Args:
        source: item ``i`` -> a dict of (T,) tensors (e.g. ``JsonlData.__getitem__``).
        step, micro, gas, rank, world, micro_bs: as for :func:`micro_batch_indices`.

    Returns:
        Every key the source returns stacked to (B, T), B = ``micro_bs``: ``position_ids`` of packed rows too.
    """
    items = [source(i) for i in micro_batch_indices(step, micro, gas, rank, world, micro_bs)]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}
