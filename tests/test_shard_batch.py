"""shard_batch (labels shifted once, then cut; padding on request) and the SP config checks."""

import logging

import pytest
import torch

from ds_longseq import LongSeqConfig, LongSeqConfigError
from ds_longseq.engine import check_sequence_length, shard_batch, shard_sequence, split_config


def _batch(T=10):
    ids = torch.arange(100, 100 + 2 * T).view(2, T)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :2] = 0
    labels = ids.clone()
    labels[0, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# bitwise by construction: integer ids and labels
def test_labels_are_shifted_over_the_whole_sequence_before_cutting():
    batch = _batch()
    shards = [shard_batch(batch, r, 2) for r in range(2)]
    assert set(shards[0]) == {"input_ids", "attention_mask", "position_ids", "shift_labels"}
    # rank 0's last target is rank 1's first token: nothing is lost at the boundary
    assert shards[0]["shift_labels"][1, -1] == batch["input_ids"][1, 5]
    assert shards[1]["shift_labels"][:, -1].tolist() == [-100, -100]
    glued = {k: torch.cat([s[k] for s in shards], dim=1) for k in shards[0]}
    assert torch.equal(glued["input_ids"], batch["input_ids"])
    assert torch.equal(glued["shift_labels"][:, :-1], batch["labels"][:, 1:])
    assert glued["position_ids"].tolist() == [list(range(10))]


def test_indivisible_length_is_an_error_unless_padding_is_asked_for():
    batch = _batch(T=10)
    with pytest.raises(ValueError, match="sequence length 10 is not divisible by sequence_parallel size 4: pad to 12"):
        shard_batch(batch, 0, 4)
    shards = [shard_batch(batch, r, 4, pad=True, pad_token_id=7) for r in range(4)]
    glued = {k: torch.cat([s[k] for s in shards], dim=1) for k in shards[0]}
    assert glued["input_ids"].shape == (2, 12) and glued["input_ids"][:, 10:].eq(7).all()
    assert glued["attention_mask"][:, 10:].eq(0).all() and glued["shift_labels"][:, 9:].eq(-100).all()
    assert glued["position_ids"].tolist() == [list(range(12))]


# bitwise by construction: integers
def test_shard_sequence_cuts_like_shard_batch():
    """Per-position metadata (e.g. evaluation buckets) cut with shard_sequence lines up with shard_batch's shards:
    the same padding to a multiple of P, the same contiguous 1/P."""
    ids = torch.arange(14).reshape(2, 7)
    meta = torch.arange(100, 114).reshape(2, 7)
    for rank in range(3):
        shard = shard_batch({"input_ids": ids}, rank, 3, pad=True, pad_token_id=-5)["input_ids"]
        cut = shard_sequence(meta, rank, 3, fill=-1)
        assert cut.shape == shard.shape == (2, 3)
        real = shard != -5
        assert torch.equal(cut[real] - 100, shard[real]) and (cut[~real] == -1).all()
    assert torch.equal(torch.cat([shard_sequence(meta, r, 3, fill=-1) for r in range(3)], 1)[:, :7], meta)


@pytest.mark.parametrize("ulysses, ring", [(2, 2), (1, 4), (3, 2)])
# bitwise by construction: integer ids, labels and positions
def test_a_ring_layout_gives_each_rank_its_sp_positions(ulysses, ring):
    """With a ring degree each rank's shard is the tokens ops.sp_layout gives it (part of its ring rank's zigzag
    shard): glued back by those positions the shards are the whole (padded) batch, labels shifted over the whole
    sequence before cutting, position ids the tokens' global positions."""
    from ds_longseq.ops.sp_positions import sp_positions

    size = ulysses * ring
    batch = _batch(T=2 * size * 3 - 1)  # one short of a multiple of 2 P: padded by one
    T = batch["input_ids"].shape[1] + 1
    with pytest.raises(ValueError, match=rf"not divisible by 2 x sequence_parallel size {size} \(ring\): pad to {T}"):
        shard_batch(batch, 0, size, ring=ring)
    whole = shard_batch(batch, 0, 1, pad=True, pad_token_id=7)  # the reference cut: one rank, no padding needed
    shards = [shard_batch(batch, r, size, pad=True, pad_token_id=7, ring=ring) for r in range(size)]
    positions = sp_positions(T, ulysses, ring)
    for key in shards[0]:
        glued = torch.zeros((2, T), dtype=shards[0][key].dtype)
        for r in range(size):
            glued[:, positions[r]] = shards[r][key].expand(2, -1)
        if key == "input_ids":
            assert torch.equal(glued[:, :-1], whole["input_ids"]) and glued[:, -1].eq(7).all()
        elif key == "shift_labels":
            assert torch.equal(glued[:, :-1], whole["shift_labels"]) and glued[:, -1].eq(-100).all()
        elif key == "position_ids":
            assert torch.equal(glued, torch.arange(T).expand(2, T))
    assert torch.equal(shards[1]["position_ids"][0], positions[1])
    meta = torch.arange(T - 1).view(1, -1)
    assert torch.equal(shard_sequence(meta, 1, size, fill=-1, ring=ring)[0],
                       torch.where(positions[1] < T - 1, positions[1], torch.tensor(-1)))


# bitwise by construction: integers
def test_a_layout_value_cuts_as_the_ring_alias():
    """layout=SPLayout(P, ring=r) (a layout without groups: the rank and size given) cuts as the ring= alias kept for
    a release; arguments that contradict the layout, a model not enabled with sequence parallelism and a ring that
    does not divide P are refused."""
    from ds_longseq.engine import SPLayout

    batch = _batch(T=16)
    for rank in range(4):
        by_layout = shard_batch(batch, rank, 4, layout=SPLayout(4, ring=2))
        by_alias = shard_batch(batch, rank, 4, ring=2)
        assert by_layout.keys() == by_alias.keys() and all(torch.equal(by_layout[k], by_alias[k]) for k in by_alias)
    with pytest.raises(ValueError, match="leave sp_size and ring out"):
        shard_batch(batch, 0, 2, layout=SPLayout(4, ring=2))
    with pytest.raises(ValueError, match="leave sp_size and ring out"):
        shard_batch(batch, 0, 4, layout=SPLayout(4, ring=2), ring=1)
    with pytest.raises(ValueError, match="the model is not enabled with sequence parallelism"):
        shard_batch(batch, 0, 2, layout=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="ring degree 3 does not divide sequence_parallel size 4"):
        shard_batch(batch, 0, 4, ring=3)


def test_bad_batches_are_refused():
    batch = _batch()
    with pytest.raises(ValueError, match="not know how to cut"):
        shard_batch({**batch, "pixel_values": torch.zeros(1)}, 0, 2)
    with pytest.raises(ValueError, match="labels or shift_labels, not both"):
        shard_batch({**batch, "shift_labels": batch["labels"]}, 0, 2)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        shard_batch({**batch, "attention_mask": batch["attention_mask"][:, :5]}, 0, 2)


def test_sequence_parallel_config_and_deepspeed_key_agree():
    assert LongSeqConfig.from_dict({"sequence_parallel": {"size": 4}}).any_enabled
    with pytest.raises(LongSeqConfigError, match="sequence_parallel.size must be a positive integer, got 0"):
        LongSeqConfig.from_dict({"sequence_parallel": {"size": 0}})
    ds, ls = split_config({"sequence_parallel_size": 2, "long_seq": {"streambp": {"enabled": True}}})
    assert ls.sequence_parallel.size == 2 and ds["sequence_parallel_size"] == 2
    ds, ls = split_config({"long_seq": {"sequence_parallel": {"size": 2}}})
    assert ds["sequence_parallel_size"] == 2  # DeepSpeed's batch-size arithmetic then counts replicas
    with pytest.raises(LongSeqConfigError, match="sequence_parallel_size=4 but long_seq.sequence_parallel.size=2"):
        split_config({"sequence_parallel_size": 4, "long_seq": {"sequence_parallel": {"size": 2}}})
    with pytest.raises(LongSeqConfigError, match="remove data_parallel_size"):
        split_config({"data_parallel_size": 2, "long_seq": {"sequence_parallel": {"size": 2}}})


def test_chunk_sizes_are_checked_against_the_local_shard(caplog):
    _, ls = split_config(
        {"long_seq": {"streambp": {"enabled": True, "chunk_size": 1024}, "sequence_parallel": {"size": 4}}}
    )
    caplog.set_level(logging.WARNING, logger="ds_longseq")
    check_sequence_length(ls, 4096)
    assert not caplog.records
    # 2048 / 4 = 512 local tokens: one chunk per shard, a warning rather than an error.
    check_sequence_length(ls, 2048)
    assert "exceeds the local shard 512 (sequence length 2048" in caplog.records[-1].getMessage()
