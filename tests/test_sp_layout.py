"""The Ulysses x ring degrees and token layout of sequence parallelism (ops/sp_layout.py)."""

from __future__ import annotations

import pytest
import torch

from ds_longseq.ops.ring import zigzag_shard
from ds_longseq.ops.sp_layout import SPLayout, sp_degrees
from ds_longseq.ops.sp_positions import sp_positions


@pytest.mark.parametrize("size, heads, want", [
    (8, 32, (8, 1)),   # Llama-3-8B on a node: Ulysses alone, as today
    (8, 28, (4, 2)),   # Qwen2.5-7B: 28 heads, SP 8
    (8, 14, (2, 4)),   # Qwen2.5-0.5B
    (2, 9, (1, 2)),    # SmolLM2-135M: 9 heads, SP 2 and 4: ring alone
    (4, 9, (1, 4)),
    (64, 32, (32, 2)),  # beyond the head count: ring over the rest
    (4, 2, (2, 2)),
    (1, 7, (1, 1)),
])
def test_degrees_take_the_largest_ulysses_the_heads_allow(size, heads, want):
    assert sp_degrees(size, heads) == want


@pytest.mark.parametrize("size, heads, kv, want", [
    (3, 12, 2, (1, 3)),   # Qwen2.5-1.5B at SP 3: 3 divides the query heads but neither divides nor is a multiple of 2
    (5, 40, 8, (1, 5)),   # Qwen2.5-14B at SP 5 and 10
    (10, 40, 8, (2, 5)),
    (7, 14, 2, (1, 7)),   # Qwen2.5-0.5B at SP 7
    (2, 9, 3, (1, 2)),    # SmolLM2-135M at SP 2, 3, 4, 6
    (3, 9, 3, (3, 1)),
    (4, 9, 3, (1, 4)),
    (6, 9, 3, (3, 2)),
    (8, 28, 4, (4, 2)),   # Qwen2.5-7B at SP 8
    (4, 6, 3, (1, 4)),    # 6 query / 3 key-value heads at SP 4 (the query heads alone would give 2 x 2)
    (8, 32, 2, (8, 1)),   # a multiple of the key/value heads: each rank one replica
    (4, 8, 8, (4, 1)),
])
def test_degrees_fit_the_key_value_heads_too(size, heads, kv, want):
    assert sp_degrees(size, heads, num_kv_heads=kv) == want


def test_a_forced_ring_degree_is_checked():
    assert sp_degrees(8, 32, ring=2) == (4, 2)
    with pytest.raises(ValueError, match="ring=3 does not divide sequence_parallel.size=8"):
        sp_degrees(8, 32, ring=3)
    with pytest.raises(ValueError, match=r"sequence_parallel.ring=2 with sequence_parallel.size=8 leaves a Ulysses "
                                         r"degree of 4, which cannot shard the model's 14 query and 14 key/value "
                                         r"heads .* set ring to one of \[4, 8\], or leave it unset \(chosen from the "
                                         r"heads: 4\)"):
        sp_degrees(8, 14, ring=2)
    with pytest.raises(ValueError, match=r"6 query and 3 key/value heads .* set ring to one of \[4\]"):
        sp_degrees(4, 6, ring=2, num_kv_heads=3)


@pytest.mark.parametrize("ulysses, ring", [(1, 1), (4, 1), (1, 4), (2, 2), (3, 2), (2, 3)])
# bitwise by construction: integer positions
def test_every_token_is_on_one_rank_and_a_ulysses_group_holds_its_ring_shard(ulysses, ring):
    T = 2 * ulysses * ring * 5
    pos = sp_positions(T, ulysses, ring)
    assert pos.shape == (ulysses * ring, T // (ulysses * ring))
    assert torch.equal(pos.flatten().sort().values, torch.arange(T))  # a permutation
    whole = torch.arange(T).view(1, T)
    for j in range(ring):  # Ulysses group j (ranks j u .. j u + u - 1) gathers ring shard j in zigzag order
        gathered = pos[j * ulysses:(j + 1) * ulysses].flatten()
        assert torch.equal(gathered, zigzag_shard(whole, j, ring)[0] if ring > 1 else whole[0, j * T // ring:])
    if ring == 1:  # Ulysses' own contiguous layout
        assert torch.equal(pos, torch.arange(T).view(ulysses, -1))


def test_a_length_the_layout_cannot_cut_names_the_padding():
    with pytest.raises(ValueError, match=r"sequence length 30 is not a multiple of 8 \(sequence parallelism 2 x 2: "
                                         r"2 x 2 zigzag blocks, each cut 2 ways\): pad to 32 tokens"):
        sp_positions(30, 2, 2)


def test_the_support_table_lists_the_families_sequence_parallelism_is_verified_on():
    """docs/SUPPORT.md's "Sequence parallelism by family" table names exactly the families enable lets run it."""
    import pathlib
    import re

    from ds_longseq.families import FAMILIES
    from ds_longseq.families.discovery import OVERRIDES

    text = (pathlib.Path(__file__).parents[1] / "docs" / "SUPPORT.md").read_text()
    section = text.split("## Sequence parallelism by family", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    verified = {k for k, v in FAMILIES.items() if v.sequence_parallel_verified}
    verified |= {k for k, v in OVERRIDES.items() if v.get("sequence_parallel_verified")}
    assert listed == verified, (sorted(listed - verified), sorted(verified - listed))


def test_a_layout_value_without_groups():
    """SPLayout as a value: u from P and r, the length unit (P, or 2 P under a ring); a ring that does not divide P is
    refused, and a layout without groups has no rank to give (the groups: SPLayout.build, tests/test_ring_attention.py
    on 4 ranks)."""
    layout = SPLayout(8, ring=2)
    assert (layout.ulysses, layout.degrees, layout.length_unit) == (4, (4, 2), 16)
    assert SPLayout(4).degrees == (4, 1) and SPLayout(4).length_unit == 4
    with pytest.raises(ValueError, match="ring degree 3 does not divide sequence_parallel size 8"):
        SPLayout(8, ring=3)
    with pytest.raises(ValueError, match="has no process group, so no rank"):
        _ = layout.rank
