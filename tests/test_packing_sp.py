"""Packed rows under Ulysses sequence parallelism (CPU gloo ranks), against every document run alone
through the stock model: float64 to 1e-10 on the loss, each rank's input gradient and every
parameter gradient summed over the group. Documents span shard boundaries; the ranks hold different
numbers of trained tokens. Batches come from ``engine.shard_batch`` (both packed forms) and from
DeepSpeed's own ``UlyssesSPDataLoaderAdapter``."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers import full_precision_norms, loss_and_grads, make_model, rel_err
from tests.test_packing import documents_alone, packed_batch

SEQ = 40
# Row 0: a 1-token document, then documents crossing the shard boundaries at 10, 20 and 30.
SP_DOCS = [[1, 12, 15, 12], [22, 1, 17]]
SP_CONFIGS = {
    "streambp": {
        "streambp": {"enabled": True, "chunk_size": 3}, "attention": {"kv_block_size": 4},
        "lm_head": {"enabled": True, "chunk_size": 7},
    },
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 5}},
    "ulysses_only": {"lm_head": {"enabled": True, "chunk_size": 6}},
}


def _batch(collator_labels: bool):
    batch, documents = packed_batch(SP_DOCS, "position_ids", collator_labels)
    batch["labels"][1, :5] = -100  # a masked prompt: the ranks train on different numbers of tokens
    return batch, documents


def sp_worker(rank: int, world: int, cases: list[str], source: str, collator_labels: bool, heads: int = 4):
    """heads=3: a ring of ``world`` (Ulysses x ring 1 x world), the batch cut by its zigzag layout."""
    import torch.distributed as dist

    import ds_longseq
    from ds_longseq.engine import shard_batch

    batch, _ = _batch(collator_labels)
    ring = 1 if heads % world == 0 else world
    if source == "shard_batch":
        local = shard_batch(batch, rank, world, ring=ring)
    elif source == "shard_batch_varlen":
        varlen, _ = packed_batch(SP_DOCS, "cu_seq_lens", collator_labels)
        varlen["labels"] = batch["labels"]
        local = shard_batch(varlen, rank, world)
    else:  # DeepSpeed's adapter: every rank's loader yields the same batch; keep the first micro-batch
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        loader = [{k: v.clone() for k, v in batch.items()}]
        adapter = UlyssesSPDataLoaderAdapter(loader, rank, dist.group.WORLD, world, torch.device("cpu"))
        local = next(iter(adapter))
        assert set(local) == {"input_ids", "position_ids", "shift_labels"}, sorted(local)
    out = {}
    for name in cases:
        model = full_precision_norms(make_model("llama", torch.float64, **_heads(heads)))
        ds_longseq.enable(model, {**SP_CONFIGS[name], "sequence_parallel": {"size": world}}, sp_group=dist.group.WORLD)
        loss, grads, embed_grad = loss_and_grads(model, local)
        for g in grads.values():
            dist.all_reduce(g)
        out[name] = (loss, grads, embed_grad)
    return out


def _heads(heads: int) -> dict:
    return {} if heads == 4 else {"hidden_size": 16 * heads, "num_attention_heads": heads, "num_key_value_heads": 1}


def _check(results, world, cases, heads: int = 4):
    from ds_longseq.ops.sp_positions import sp_positions

    batch, documents = _batch(collator_labels=True)
    flat = batch["labels"].flatten()
    bounds = torch.tensor([0] + [len(d) for d in documents]).cumsum(0).tolist()
    labels = [flat[a:b] for a, b in itertools.pairwise(bounds)]
    model = full_precision_norms(make_model("llama", torch.float64, **_heads(heads)))
    ref_loss, ref_grads, ref_embed = documents_alone(model, documents, labels)
    ref_embed = ref_embed.reshape(batch["input_ids"].shape[0], SEQ, -1)
    positions = sp_positions(SEQ, 1, world) if heads % world else torch.arange(SEQ).view(world, -1)
    for rank, per_rank in enumerate(results):
        for name in cases:
            loss, grads, embed_grad = per_rank[name]
            errs = {"loss": rel_err(loss, ref_loss), "embed_grad": rel_err(embed_grad, ref_embed[:, positions[rank]])}
            assert set(grads) == set(ref_grads)
            errs.update({n: rel_err(g, ref_grads[n]) for n, g in grads.items()})
            worst = max(errs, key=errs.get)
            assert errs[worst] < 1e-10, (name, rank, worst, errs[worst])


@pytest.mark.parametrize("source, cases", [("shard_batch", list(SP_CONFIGS)), ("shard_batch_varlen", ["streambp"])])
def test_packed_sp2_matches_documents_alone_float64(source, cases):
    _check(run_distributed(sp_worker, 2, (2, cases, source, True)), 2, cases)


def test_packed_rows_under_a_ring_match_documents_alone_float64():
    """3 heads at SP 2 run a ring of 2: each rank holds zigzag blocks [0, 10) + [30, 40), [10, 30), so documents
    cross both the blocks' and the ranks' boundaries; a ring tile wholly before a query's document is skipped.
    Whole shards and StreamBP (chunks of 3, the documents found on the global positions), exact at 1e-10."""
    cases = ["streambp", "ulysses_only"]
    _check(run_distributed(sp_worker, 2, (2, cases, "shard_batch", True, 3)), 2, cases, heads=3)


def test_packed_sp4_deepspeed_adapter_labels_without_boundary_masks():
    """DeepSpeed's adapter shifts labels without knowing the documents; the model masks the targets
    that would cross a boundary (here the labels carry no -100 at document starts)."""
    cases = ["streambp"]
    _check(run_distributed(sp_worker, 4, (4, cases, "adapter", False)), 4, cases)


def test_shard_batch_pads_a_packed_row_as_one_more_document():
    from ds_longseq.engine import shard_batch

    batch, _ = packed_batch([[3, 4]], "position_ids", collator_labels=False)
    shards = [shard_batch(batch, r, 3, pad=True) for r in range(3)]
    pos = torch.cat([s["position_ids"] for s in shards], 1)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]  # 7 tokens + a 2-token padding document
    assert all("attention_mask" not in s for s in shards)  # a mask would hide the documents
    labels = torch.cat([s["shift_labels"] for s in shards], 1)[0].tolist()
    ids = batch["input_ids"][0].tolist()
    # the last token of document 0 (index 2) does not predict document 1's first token
    assert labels == [ids[1], ids[2], -100, ids[4], ids[5], ids[6], -100, -100, -100]
