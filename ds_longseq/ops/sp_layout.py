"""How an SP size splits into Ulysses x ring degrees, what a sequence length must be a multiple of, and the layout as
one value. Torch-free to import: the planner (``ds_longseq.plan``) imports it without loading torch (only
:meth:`SPLayout.build` imports ``torch.distributed``, when called). Which tokens each rank then holds:
``ops/sp_positions.py``.

Holds:
    sp_degrees: (u, r) for an SP size and a model's query and key/value heads: Ulysses over the largest degree the
        heads allow (:func:`ulysses_fits`), ring attention over the rest.
    length_unit: what a sequence length must be a multiple of for the u x r layout, and the start rule that
        refuses a length that is not (``sequence_parallel.length_unit``, run by ``ds_longseq.resolver``).
    SPLayout: one model's sequence parallelism as a value (P, u, r and the process groups), built once where its
        groups are made (:meth:`SPLayout.build`, called by the ``sequence_parallel`` technique at ``enable``) and
        handed down: to the model's ``forwards.sp_model.SequenceParallel`` and to ``engine.shard_batch``, which
        cuts a batch by the layout of the model (or engine) it is for. No module keeps a layout of its own: two
        models with different layouts live side by side in one process.

P = u r sequence-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds_longseq.rules import Start, start_rule

__all__ = ["ulysses_fits", "sp_degrees", "length_unit", "SPLayout"]


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


@dataclass(frozen=True)
class SPLayout:
    """Sequence parallelism over P = u r ranks as one value: Ulysses over u of them times a ring over r, and the
    process groups that run it. Group rank p = j u + i is Ulysses rank i of Ulysses group j (u consecutive ranks) and
    ring rank j of ring group i (every u-th rank); which tokens it holds: ``ops.sp_positions.sp_positions``.

    A layout without groups (``SPLayout(4, ring=2)``) only says how batches are cut (``engine.shard_batch(...,
    layout=)``); :meth:`build` makes one with its groups.
    """

    size: int
    """P, the ranks that share each sequence."""
    ring: int = 1
    """r, the ring degree (1: Ulysses alone over the P ranks)."""
    group: Any = None
    """The P ranks' process group (None: a layout to cut batches by, with no groups)."""
    ulysses_group: Any = None
    """This rank's Ulysses group (u consecutive ranks; the whole group without a ring)."""
    ring_group: Any = None
    """This rank's ring group (r ranks, every u-th; None without a ring)."""

    def __post_init__(self):
        if not (isinstance(self.size, int) and isinstance(self.ring, int)) or self.size < 1 or self.ring < 1 \
                or self.size % self.ring:
            raise ValueError(f"ring degree {self.ring} does not divide sequence_parallel size {self.size}: choose a "
                             f"divisor of {self.size}")

    @property
    def ulysses(self) -> int:
        """u, the Ulysses degree: P / r."""
        return self.size // self.ring

    @property
    def degrees(self) -> tuple[int, int]:
        """(u, r)."""
        return self.ulysses, self.ring

    @property
    def length_unit(self) -> int:
        """What a sequence length must be a multiple of to be cut by this layout (:func:`length_unit`)."""
        return length_unit(self.size, self.ring)

    @property
    def rank(self) -> int:
        """This process's rank in :attr:`group`.

        Raises:
            ValueError: a layout without groups.
        """
        if self.group is None:
            raise ValueError(f"this SPLayout ({self.ulysses} x {self.ring}) has no process group, so no rank: pass "
                             "the rank yourself (shard_batch(batch, rank, size, layout=...))")
        import torch.distributed as dist

        return dist.get_rank(self.group)

    @classmethod
    def build(cls, group, size: int, ring: int = 1) -> SPLayout:
        """The layout of ``group`` (the ``size`` ranks that share a sequence, this rank among them) run as Ulysses x
        ring with ring degree ``ring``, its Ulysses and ring groups made here. The one check of the ranks against
        the size where groups are made (the launch's: ``sequence_parallel.divides_world``, run by the resolver).

        Every rank of the world must call it in the same order with the same arguments under a ring
        (``torch.distributed.new_group`` is collective over the world): the sub-groups of every sequence-parallel
        group are made, each rank keeping its own.

        Raises:
            ValueError: the group does not have ``size`` ranks; under a ring, the groups are not DeepSpeed's (the
                world cut into runs of ``size`` consecutive ranks).
        """
        import torch.distributed as dist

        layout = cls(size, ring)  # the degrees checked
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) != size:
            raise ValueError(f"long_seq.sequence_parallel.size={size} but the sequence-parallel group has "
                             f"{len(ranks)} ranks: make them equal")
        if ring == 1:
            return cls(size, 1, group, group, None)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size or ranks[0] % size or ranks != list(range(ranks[0], ranks[0] + size)):
            raise ValueError(
                f"Ulysses x ring sequence parallelism needs DeepSpeed's sequence-parallel groups (the {world} ranks "
                f"cut into runs of {size} consecutive ranks), got ranks {ranks}: build the engine with "
                "ds_longseq.engine.initialize, or pass enable(..., sp_group=<a group of consecutive ranks>)"
            )
        ulysses, mine = layout.ulysses, [None, None]
        for first in range(0, world, size):  # each sequence-parallel group's sub-groups, made on every rank
            for j in range(ring):
                members = list(range(first + j * ulysses, first + (j + 1) * ulysses))
                made = dist.new_group(members)
                mine[0] = made if rank in members else mine[0]
            for i in range(ulysses):
                members = list(range(first + i, first + size, ulysses))
                made = dist.new_group(members)
                mine[1] = made if rank in members else mine[1]
        return cls(size, ring, group, *mine)
