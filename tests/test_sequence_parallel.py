"""Ulysses sequence parallelism on CPU ranks (gloo) against the stock model on the whole sequence.

Every rank holds 1/P of each sequence (``shard_batch``). The loss must equal the stock loss of the
global batch on every rank, and the ranks' parameter gradients summed over the group (what
DeepSpeed's reduction does) must equal the stock gradients; float64 to 1e-10. The batches have
left and right padding and a masked prompt, so the ranks hold different numbers of valid tokens,
and one case gives a rank no valid token at all. The RMSNorms run in float64 here
(``full_precision_norms``: stock ones compute in float32 even in float64 models); the float32
tests against the unmodified stock model are in ``test_sequence_parallel_engine.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers import VOCAB, full_precision_norms, loss_and_grads, make_model, rel_err

# name -> long_seq config (the sequence_parallel section is added by the worker)
SP_CASES = {
    # chunk 3 and 7 do not divide the local shard of 20 tokens
    "streambp": {"streambp": {"enabled": True, "chunk_size": 3, "kv_block_size": 4}, "lm_head": {"enabled": True, "chunk_size": 7}},
    "streambp_stock_head": {"streambp": {"enabled": True, "chunk_size": 7, "kv_block_size": 8}},
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 5}},
    "ulysses_only": {},
}
SEQ = 40


def global_batch(seed: int = 3, batch: int = 2, seq_len: int = SEQ, no_labels_after: int | None = None):
    """Left padding (row 0), right padding and a masked prompt (row 1): uneven valid tokens per shard."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[0, :6] = 0
    mask[-1, seq_len - 9 :] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[-1, :13] = -100
    if no_labels_after is not None:  # every label of the later shards ignored
        labels[:, no_labels_after:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def exactness_worker(rank: int, world: int, arch: str, overrides: dict, cases: list[str], no_labels_after):
    import torch.distributed as dist

    import ds_longseq
    from ds_longseq.engine import shard_batch

    batch = global_batch(no_labels_after=no_labels_after)
    local = shard_batch(batch, rank, world)
    out = {}
    for name in cases:
        cfg = {**SP_CASES[name], "sequence_parallel": {"size": world}}
        model = full_precision_norms(make_model(arch, torch.float64, **overrides))
        ds_longseq.enable(model, cfg, sp_group=dist.group.WORLD)
        loss, grads, embed_grad = loss_and_grads(model, local)
        for g in grads.values():
            dist.all_reduce(g)
        out[name] = {"loss": loss, "grads": grads, "embed_grad": embed_grad}
    return out


def _reference(arch, overrides, no_labels_after=None):
    model = full_precision_norms(make_model(arch, torch.float64, **overrides))
    return loss_and_grads(model, global_batch(no_labels_after=no_labels_after), use_reference=True, ref_dtype=torch.float64)


def _check(results, reference, world, cases, tol=1e-10):
    ref_loss, ref_grads, ref_embed = reference
    local = SEQ // world
    for rank, per_rank in enumerate(results):
        for name in cases:
            r = per_rank[name]
            errs = {"loss": rel_err(r["loss"], ref_loss)}
            errs["embed_grad"] = rel_err(r["embed_grad"], ref_embed[:, rank * local : (rank + 1) * local])
            assert set(r["grads"]) == set(ref_grads)
            errs.update({f"grad:{n}": rel_err(g, ref_grads[n]) for n, g in r["grads"].items()})
            worst = max(errs, key=errs.get)
            assert errs[worst] < tol, (name, rank, worst, errs[worst])


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),  # 4 query heads on 2 kv heads: 2 heads / 1 kv head per rank
        ("qwen3", {"num_key_value_heads": 1}),  # GQA with fewer kv heads than ranks: kv replicated
    ],
)
def test_sp2_matches_stock_float64(arch, overrides):
    cases = list(SP_CASES)
    results = run_distributed(exactness_worker, world_size=2, args=(2, arch, overrides, cases, None))
    _check(results, _reference(arch, overrides), 2, cases)


def test_sp2_rank_without_valid_tokens():
    """Rank 1 holds no label at all: the loss is still the group's mean and its backward still runs."""
    cases = ["streambp", "mini_seq"]
    results = run_distributed(exactness_worker, world_size=2, args=(2, "llama", {}, cases, SEQ // 2 - 1))
    _check(results, _reference("llama", {}, SEQ // 2 - 1), 2, cases)


def test_sp4_matches_stock_float64():
    """4 ranks on one sequence (10 tokens each), 4 heads on 2 kv heads (kv replicated 2x)."""
    cases = ["streambp", "mini_seq"]
    results = run_distributed(exactness_worker, world_size=4, args=(4, "llama", {}, cases, None))
    _check(results, _reference("llama", {}), 4, cases)
