"""How an SP size splits into Ulysses x ring degrees, and what a sequence length must be a multiple of. Pure
arithmetic, no torch: the planner (``ds_longseq.plan``) imports it without loading torch. Which tokens each rank
then holds: ``ops/sp_positions.py``.

Holds:
    sp_degrees: (u, r) for an SP size and a model's query and key/value heads: Ulysses over the largest degree the
        heads allow (:func:`ulysses_fits`), ring attention over the rest.
    length_unit: what a sequence length must be a multiple of for the u x r layout, and the start rule that
        refuses a length that is not (``sequence_parallel.length_unit``, run by ``ds_longseq.resolver``).

P = u r sequence-parallel ranks.

The layout itself (which rank holds which tokens): ``ops/sp_positions.py``.
"""

from __future__ import annotations

from ds_longseq.rules import Start, start_rule

__all__ = ["ulysses_fits", "sp_degrees", "length_unit"]


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


def length_unit(size: int, ring: int) -> int:
    """What a sequence length must be a multiple of to be cut over ``size`` ranks with ring degree ``ring``: P, or
    2 P under a ring (2 r zigzag blocks, each cut u ways)."""
    return size if ring == 1 else 2 * size


@start_rule("sequence_parallel.length_unit", needs=("seq_len",))
def _length_fits_the_layout(start: Start) -> list[str]:
    """A sequence length the ranks can cut (:func:`length_unit`), unless the sequences are padded to one. The ring
    degree is the run's once chosen from the model (``RunShape.ring``), else the config's, else 1."""
    size = start.long_seq.sequence_parallel.size
    ring = start.run.ring or start.long_seq.sequence_parallel.ring or 1
    seq_len, unit = start.run.seq_len, length_unit(size, ring)
    if size == 1 or start.run.pad_for_sp or seq_len <= 0 or seq_len % unit == 0:
        return []
    what = f"sequence_parallel size {size}" if ring == 1 else (
        f"2 x sequence_parallel size {size} (a ring of {ring}: its zigzag blocks)")
    return [f"sequence length {seq_len} is not divisible by {what}: use --seq-len {seq_len + unit - seq_len % unit}, "
            "or pad the sequences (--pad-for-sp; shard_batch(pad=True))"]
