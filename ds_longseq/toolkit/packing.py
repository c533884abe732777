"""Packing several documents into each row of exactly ``seq_len`` tokens, the padding-free form.

Shapes: T the row length (``seq_len``).

Holds:
    first_fit_decreasing: greedy bin packing of document lengths into rows (O(n log n), deterministic).
    PackStats: what packing did (documents, rows, real tokens, truncated, empty), for the start-of-run report.
    PackedData: the packed rows, in the form of transformers' ``DataCollatorWithFlattening``.
    pack_jsonl: every record of a :class:`~ds_longseq.toolkit.data.JsonlData` packed.
    log_packing: the rank-0 packing report (efficiency, truncated and empty documents).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import torch

from ds_longseq.logging import get_logger, log_rank0
from ds_longseq.toolkit.data import JsonlData

__all__ = ["first_fit_decreasing", "PackStats", "PackedData", "pack_jsonl", "log_packing"]

logger = get_logger(__name__)


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
