"""Chunk-size arithmetic shared by StreamBP's automatic chunk size (``forwards/auto_chunk.py``) and the planner
(``ds_longseq.plan``). Pure arithmetic, no torch: the planner imports it without loading torch.

Holds:
    MIN_CHUNK: the smallest chunk ``"auto"`` chooses.
    choose_chunk_size: the largest chunk whose work fits a budget.
    largest_fitting: the largest n that fits, by doubling then bisection (the micro-batch ``AutoChunkSize`` reports,
        the planner's micro-batch and longest length).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["MIN_CHUNK", "choose_chunk_size", "largest_fitting"]

MIN_CHUNK = 128
"""The smallest chunk ``"auto"`` picks: below it the per-chunk overhead (one kernel launch per op and chunk, the
prefix keys read again) outweighs the memory it saves."""


def choose_chunk_size(seq_len: int, batch_size: int, work_per_token: float, budget_bytes: float,
                      max_chunk: int | None = None) -> int:
    """The largest chunk of a ``seq_len``-token sequence whose work (``batch_size`` x chunk x ``work_per_token``
    bytes) fits ``budget_bytes``: ``seq_len`` itself (one chunk), else the largest power of two below it that fits,
    never below ``MIN_CHUNK`` (or ``seq_len`` when shorter). ``max_chunk``: never above it either (a speed cap:
    the largest power of two up to it when the sequence is longer)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if batch_size * seq_len * work_per_token <= budget_bytes and (max_chunk is None or seq_len <= max_chunk):
        return seq_len
    floor = min(MIN_CHUNK, seq_len)
    chunk = 1 << (seq_len - 1).bit_length() - 1  # the largest power of two below seq_len
    if max_chunk is not None:
        chunk = min(chunk, 1 << max_chunk.bit_length() - 1)
    while chunk > floor and batch_size * chunk * work_per_token > budget_bytes:
        chunk //= 2
    return max(chunk, floor)


def largest_fitting(fits: Callable[[int], bool], limit: int = 1024) -> int:
    """The largest n <= ``limit`` for which ``fits(n)`` (false from some n on: a micro-batch, a length in units),
    by doubling then bisection; 0 if not even 1 fits."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
