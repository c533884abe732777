"""Which tokens each sequence-parallel rank holds, and how an SP size splits into Ulysses x ring degrees.

Holds:
    sp_degrees: (u, r) for an SP size and a model's query and key/value heads: Ulysses over the largest degree the
        heads allow (:func:`ulysses_fits`), ring attention over the rest.
    sp_positions: (P, T / P) global positions of every rank's tokens in the u x r layout.
    length_unit: what a sequence length must be a multiple of for that layout.
    position_runs: the runs of consecutive positions in one rank's tokens (two zigzag parts under a ring).

Shape legend: P = u r sequence-parallel ranks, T tokens, T_l = T / P per rank.

Layout: rank p = j u + i is Ulysses rank i of Ulysses group j and ring rank j of ring group i: the u ranks of a
Ulysses group are consecutive (its all-to-all, the heavier exchange, stays on one node when u divides the GPUs per
node), a ring group takes every u-th rank. The sequence is cut into the ring's zigzag shards (2 r blocks, ring rank j
holding blocks j and 2 r - 1 - j: ops/ring.py), and each shard into u contiguous parts, part i on Ulysses rank i. So
the Ulysses all-to-all of a group gathers exactly its ring shard, in the zigzag order ring attention takes. With
r = 1 this is Ulysses' own contiguous layout (rank p holds tokens [p T_l, (p + 1) T_l)).
"""

from __future__ import annotations

import itertools

import torch

from ds_longseq.ops.ring import zigzag_blocks

__all__ = ["ulysses_fits", "sp_degrees", "sp_positions", "length_unit", "position_runs"]


def ulysses_fits(ulysses: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether Ulysses can shard ``num_heads`` query / ``num_kv_heads`` key-value heads over ``ulysses`` ranks: whole
    query heads per rank, and whole key/value heads per rank (u divides them) or each rank one replica of the
    key/value head its query heads share (u a multiple of them: DeepSpeed-Ulysses' ``kv_replication_factor``)."""
    return num_heads % ulysses == 0 and (num_kv_heads % ulysses == 0 or ulysses % num_kv_heads == 0)


def sp_degrees(size: int, num_heads: int, ring: int | None = None, num_kv_heads: int | None = None
               ) -> tuple[int, int]:
    """(u, r) with u r = ``size``: u the largest divisor of ``size`` Ulysses can shard the heads over
    (:func:`ulysses_fits`: it divides the query heads, and divides or is a multiple of the key/value heads), r the
    rest (ring attention, which any degree takes); ``ring`` forces r. ``num_kv_heads``: None for as many as the
    query heads.

    Raises:
        ValueError: a forced ``ring`` that does not divide ``size``, or leaves a Ulysses degree the heads do not
            fit, naming both head counts and the ring degrees that work.
    """
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if size < 1 or num_heads < 1 or kv < 1:
        raise ValueError(f"sequence-parallel size {size}, {num_heads} query heads and {kv} key/value heads must be "
                         "positive")
    if ring is not None:
        if ring < 1 or size % ring:
            raise ValueError(f"sequence_parallel.ring={ring} does not divide sequence_parallel.size={size}: choose a "
                             f"divisor of {size}")
        ulysses = size // ring
        if not ulysses_fits(ulysses, num_heads, kv):
            working = [r for r in range(1, size + 1) if size % r == 0 and ulysses_fits(size // r, num_heads, kv)]
            chosen = size // sp_degrees(size, num_heads, None, kv)[0]
            raise ValueError(
                f"sequence_parallel.ring={ring} with sequence_parallel.size={size} leaves a Ulysses degree of "
                f"{ulysses}, which cannot shard the model's {num_heads} query and {kv} key/value heads (it must divide "
                f"the query heads, and divide or be a multiple of the key/value heads): set ring to one of "
                f"{working}, or leave it unset (chosen from the heads: {chosen})"
            )
        return ulysses, ring
    ulysses = max(d for d in range(1, size + 1) if size % d == 0 and ulysses_fits(d, num_heads, kv))
    return ulysses, size // ulysses


def sp_positions(seq_len: int, ulysses: int, ring: int) -> torch.Tensor:
    """(u r, T / (u r)) int64: row p the global positions of rank p's tokens, in the order it holds them.

    Raises:
        ValueError: ``seq_len`` not a multiple of u (r = 1) or of 2 u r (the zigzag blocks, each cut u ways).
    """
    size = ulysses * ring
    unit = length_unit(size, ring)
    if seq_len % unit:
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of {unit} (sequence parallelism {ulysses} x {ring}"
            + ("" if ring == 1 else f": 2 x {ring} zigzag blocks, each cut {ulysses} ways") + f"): pad to "
            f"{seq_len + unit - seq_len % unit} tokens"
        )
    positions = torch.arange(seq_len, dtype=torch.int64)
    if ring > 1:
        blocks = positions.chunk(2 * ring)
        positions = torch.cat([torch.cat([blocks[b] for b in zigzag_blocks(j, ring)]) for j in range(ring)])
    # positions now lists ring shard 0, then 1, ...; each shard's u contiguous parts are ranks j u .. j u + u - 1
    return positions.view(size, seq_len // size)


def length_unit(size: int, ring: int) -> int:
    """What a sequence length must be a multiple of to be cut over ``size`` ranks with ring degree ``ring``: P, or
    2 P under a ring (2 r zigzag blocks, each cut u ways)."""
    return size if ring == 1 else 2 * size


def position_runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(first index, end index, first position)] of the runs of consecutive values in the 1-D CPU ``positions``."""
    breaks = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    edges = [0, *breaks, len(positions)]
    return [(lo, hi, int(positions[lo])) for lo, hi in itertools.pairwise(edges)]
