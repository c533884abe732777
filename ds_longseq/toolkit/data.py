"""Training data: JSONL records, rows padded to a fixed length, and the deterministic micro-batch order.

Shapes: T the row length (``seq_len``), B the rows of a micro-batch.

Holds:
    read_jsonl: (line number, record) of every non-blank line of a JSONL file; errors name path:line.
    require_keys: refuse a record without the keys every line needs, naming path:line and the keys.
    pad_id_of: the token id a tokenizer pads with (its pad token, else its EOS, else 0).
    pad_row: one row of exactly T tokens (input_ids, attention_mask, labels), padded on the right.
    chat_tokens: a chat's tokens through the tokenizer's chat template, labels on the assistant turns only.
    JsonlData: 'text', 'prompt'/'completion' or chat 'messages' records tokenised and padded/truncated to T;
        prompts and non-assistant turns untrained.
    micro_batch_indices: the data indices of a (step, micro-step, data-parallel rank) micro-batch.
    micro_batch: that micro-batch stacked, each key (B, T): resuming replays the same data.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Callable, Iterator

import torch

from ds_longseq.logging import get_logger, log_rank0

__all__ = [
    "read_jsonl", "require_keys", "pad_id_of", "pad_row", "chat_tokens", "JsonlData", "micro_batch_indices",
    "micro_batch",
]

logger = get_logger(__name__)


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


def _chat_ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    out = out["input_ids"] if isinstance(out, Mapping) else out
    return list(out[0] if out and isinstance(out[0], list) else out)


def chat_tokens(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a chat rendered by the tokenizer's chat template, labels on the assistant turns.

    Each turn's tokens are what rendering the conversation up to it adds to the rendering up to the turn before;
    an assistant turn's start (the template's assistant header, what ``add_generation_prompt`` adds) is not
    trained, its content and end-of-turn tokens are. A template that renders earlier turns differently once
    later ones follow (one that drops earlier reasoning, or ends only the last turn) is refused, naming ``where``
    (``path:line``): the assistant tokens could not be told apart.
    """
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        full = _chat_ids(tokenizer, messages[: i + 1], False)
        trained = message["role"] == "assistant"
        # where the turn's own tokens start: after the assistant header for an assistant turn
        header = _chat_ids(tokenizer, messages[:i], True) if trained and i > 0 else ids
        start = len(header)
        if full[: len(ids)] != ids or header[: len(ids)] != ids or full[:start] != header:
            raise ValueError(
                f"{where}: the tokenizer's chat template renders the turns before turn {i} ({message['role']}) "
                "differently once that turn follows (e.g. it drops earlier reasoning or ends only the last turn), so "
                "the assistant turns' tokens cannot be told apart: use 'prompt'/'completion' records instead"
            )
        labels += [-100] * (start - len(ids)) + (full[start:] if trained else [-100] * (len(full) - start))
        ids = full
    return ids, labels


class JsonlData:
    """Tokenised JSONL records padded/truncated to ``seq_len``; prompt tokens are not trained on.

    Each line holds ``{"text": ...}`` (every token trained on), ``{"prompt": ..., "completion": ...}``
    (labels -100 on the prompt's tokens) or ``{"messages": [{"role": ..., "content": ...}, ...]}`` (a chat,
    rendered by the tokenizer's chat template, trained on its assistant turns only: :func:`chat_tokens`; a
    chat without an assistant turn is skipped and counted in the log, :attr:`skipped`). ``self[i]`` is record
    ``i % len(self)`` (epochs repeat).
    """

    def __init__(self, path: str, tokenizer, seq_len: int):
        """
        Args:
            path: the JSONL file.
            tokenizer: a Hugging Face tokenizer (called as ``tokenizer(text, add_special_tokens=...)``).
            seq_len: T, the row length.
        """
        self.path = path
        self.records = []
        self.skipped: list[int] = []  # line numbers of chats without an assistant turn
        for lineno, rec in read_jsonl(path):
            if "messages" in rec:
                messages = _checked_messages(rec["messages"], f"{path}:{lineno}")
                if not any(m["role"] == "assistant" for m in messages):
                    self.skipped.append(lineno)
                    continue
                self.records.append((lineno, messages))
            elif "text" in rec:
                self.records.append(("", rec["text"]))
            elif "prompt" in rec and "completion" in rec:
                self.records.append((rec["prompt"], rec["completion"]))
            else:
                raise ValueError(
                    f"{path}:{lineno}: each line needs 'text', 'prompt' and 'completion', or 'messages' (a chat)"
                )
        if self.skipped:
            log_rank0(logger, f"--data {path}: skipped {len(self.skipped)} chat record(s) without an assistant turn "
                      f"(nothing to train on), lines {self.skipped[:10]}{' ...' if len(self.skipped) > 10 else ''}",
                      logging.WARNING)
        if not self.records:
            raise ValueError(f"--data {path} holds no records" + (
                f" with an assistant turn ({len(self.skipped)} chat records without one)" if self.skipped else ""))
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.pad_id = pad_id_of(tokenizer)
        chats = [i for i, (first, _) in enumerate(self.records) if isinstance(first, int)]
        if chats:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    f"--data {path} holds chat 'messages' records, but the tokenizer has no chat template to render "
                    "them with: use a model whose tokenizer has one (tokenizer_config.json's chat_template), set "
                    "tokenizer.chat_template, or write 'prompt'/'completion' records"
                )
            self.tokenize(chats[0])  # a template that cannot be split into turns fails here, before any step

    def __len__(self) -> int:
        return len(self.records)

    def tokenize(self, index: int) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of record ``index``, not truncated; labels are -100 on prompt tokens."""
        prompt, completion = self.records[index % len(self.records)]
        if isinstance(prompt, int):  # a chat: (line number, messages)
            return chat_tokens(self.tokenizer, completion, f"{self.path}:{prompt}")
        p_ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
        # Special tokens (BOS) once per record: on the prompt when there is one, else on the text.
        c_ids = self.tokenizer(completion, add_special_tokens=not prompt)["input_ids"]
        return p_ids + c_ids, [-100] * len(p_ids) + c_ids

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Record ``index % len(self)``: ``input_ids``, ``attention_mask``, ``labels``, each (T,)."""
        ids, labels = self.tokenize(index)
        return pad_row(ids[: self.seq_len], labels[: self.seq_len], self.seq_len, self.pad_id)


def _checked_messages(messages, where: str) -> list[dict]:
    """A chat record's ``messages``: a non-empty list of {"role": str, "content": str} objects."""
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}} "
                         "objects with string values")
    return messages


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
