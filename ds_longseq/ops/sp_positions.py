"""Which tokens each sequence-parallel rank holds, in the u x r layout ``ops/sp_layout.py`` chooses.

Holds:
    sp_positions: (P, T / P) global positions of every rank's tokens in the u x r layout.
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
from ds_longseq.ops.sp_layout import length_unit

__all__ = ["sp_positions", "position_runs"]


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


def position_runs(positions: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(first index, end index, first position)] of the runs of consecutive values in the 1-D CPU ``positions``."""
    breaks = (torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1).tolist()
    edges = [0, *breaks, len(positions)]
    return [(lo, hi, int(positions[lo])) for lo, hi in itertools.pairwise(edges)]
