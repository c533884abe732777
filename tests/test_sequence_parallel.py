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

import contextlib

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.helpers import VOCAB, float64_eager_attention, full_precision_norms, loss_and_grads, make_model, rel_err

# name -> long_seq config (the sequence_parallel section is added by the worker)
SP_CASES = {
    # chunk 3 and 7 do not divide the local shard of 20 tokens
    "streambp": {
        "streambp": {"enabled": True, "chunk_size": 3}, "attention": {"kv_block_size": 4},
        "lm_head": {"enabled": True, "chunk_size": 7},
    },
    "streambp_stock_head": {"streambp": {"enabled": True, "chunk_size": 7}, "attention": {"kv_block_size": 8}},
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 5}},
    "ulysses_only": {},
}
SEQ = 40


def global_batch(
    seed: int = 3, batch: int = 2, seq_len: int = SEQ, no_labels_after: int | None = None, left_pad: bool = True
):
    """Left padding (row 0), right padding and a masked prompt (row 1): uneven valid tokens per shard.

    With left padding the last padding token is trained to predict the first real one, so the loss
    depends on what attention gives a query that sees no key (0 here and in stock SDPA; the float64
    eager reference of tests/helpers.py differs): ``left_pad=False`` for models checked against it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    if left_pad:
        mask[0, :6] = 0
    mask[-1, seq_len - 9 :] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[-1, :13] = -100
    if no_labels_after is not None:  # every label of the later shards ignored
        labels[:, no_labels_after:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def exactness_worker(
    rank: int, world: int, arch: str, overrides: dict, cases: list[str], no_labels_after, dtype=torch.float64,
    left_pad: bool = True,
):
    import torch.distributed as dist

    import ds_longseq
    from ds_longseq.engine import shard_batch

    batch = global_batch(no_labels_after=no_labels_after, left_pad=left_pad)
    local = shard_batch(batch, rank, world)
    out = {}
    for name in cases:
        cfg = {**SP_CASES[name], "sequence_parallel": {"size": world}}
        model = make_model(arch, torch.float64, **overrides)
        model = full_precision_norms(model) if dtype == torch.float64 else model.to(dtype)
        ds_longseq.enable(model, cfg, sp_group=dist.group.WORLD)
        loss, grads, embed_grad = loss_and_grads(model, local)
        grads = {n: g.double() for n, g in grads.items()}  # summed over ranks without extra rounding
        for g in grads.values():
            dist.all_reduce(g)
        out[name] = {"loss": loss, "grads": grads, "embed_grad": embed_grad}
    return out


def _reference(arch, overrides, no_labels_after=None):
    model = full_precision_norms(make_model(arch, torch.float64, **overrides))
    return loss_and_grads(
        model, global_batch(no_labels_after=no_labels_after), use_reference=True, ref_dtype=torch.float64
    )


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


def test_sp2_gemma2_stock_head_float64():
    """Gemma 2 with the stock LM head: the final-logit softcap that CausalLMForward applies after the
    head itself (the chunked head is off), the attention-logit softcap and a sliding window (6) shorter
    than a shard (20), against the stock model in float64 (its eager attention in float64, see
    tests/test_families.py; no left padding, see global_batch)."""
    cases = ["streambp_stock_head", "ulysses_only"]
    results = run_distributed(
        exactness_worker, world_size=2, args=(2, "gemma2", {}, cases, None, torch.float64, False)
    )
    model = float64_eager_attention(full_precision_norms(make_model("gemma2", torch.float64)))
    batch = global_batch(left_pad=False)
    _check(results, loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64), 2, cases)


def test_sp2_bf16_no_worse_than_stock_bf16():
    """StreamBP paper App. B.1 protocol: error against float64, relative to stock bf16's own error."""
    from tests.helpers import compare

    exact = loss_and_grads(
        make_model("llama", torch.float64), global_batch(), use_reference=True, ref_dtype=torch.float64
    )
    stock = compare(loss_and_grads(make_model("llama", torch.float64).to(torch.bfloat16), global_batch()), exact)
    results = run_distributed(exactness_worker, 2, (2, "llama", {}, ["streambp", "mini_seq"], None, torch.bfloat16))
    for rank, per_rank in enumerate(results):
        for name, r in per_rank.items():
            ours = {
                "loss": rel_err(r["loss"], exact[0]),
                "input_grad": rel_err(r["embed_grad"], exact[2][:, rank * 20 : (rank + 1) * 20]),
            }
            ours.update({f"grad:{n}": rel_err(g, exact[1][n]) for n, g in r["grads"].items()})
            assert max(ours.values()) <= 1.5 * max(stock.values()), (name, max(ours.values()), max(stock.values()))
            assert sum(ours.values()) / len(ours) <= 1.5 * sum(stock.values()) / len(stock), name


def test_sp2_rank_without_valid_tokens():
    """Rank 1 holds no label at all: the loss is still the group's mean and its backward still runs."""
    cases = ["streambp", "mini_seq"]
    results = run_distributed(exactness_worker, world_size=2, args=(2, "llama", {}, cases, SEQ // 2 - 1))
    _check(results, _reference("llama", {}, SEQ // 2 - 1), 2, cases)


@pytest.mark.slow  # heavy: SP 4 runs by default as the 2 x 2 ring and test_packing_sp's SP 4
def test_sp4_matches_stock_float64():
    """4 ranks on one sequence (10 tokens each), 4 heads on 2 kv heads (kv replicated 2x)."""
    cases = ["streambp", "mini_seq"]
    results = run_distributed(exactness_worker, world_size=4, args=(4, "llama", {}, cases, None))
    _check(results, _reference("llama", {}), 4, cases)


def layout_worker(rank: int, num_kv_heads: int):
    """Our exchanges against DeepSpeed's UlyssesSPAttentionHF on the same tensors."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from ds_longseq.ops.ulysses import UlyssesExchange

    B, H, C, D, P = 2, 4, 5, 3, 2
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, H, C, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, num_kv_heads, C, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, num_kv_heads, C, D, generator=g, dtype=torch.float64)
    seen = {}

    def core_attn(module, query, key, value, mask, *args, **kwargs):
        seen.update(q=query, k=key, v=value)
        return query.transpose(1, 2), None  # context = the queries, in [bs, sl, hc_l, hs]

    ds = UlyssesSPAttentionHF(
        core_attn, B, H, D, num_kv_heads, 1, dist.group.WORLD, local_seq_length=C, global_seq_length=P * C
    )
    module = torch.nn.Module()
    ds_out, _ = ds(module, q, k, v, None, position_ids=torch.arange(rank * C, (rank + 1) * C).unsqueeze(0))
    ours = UlyssesExchange(dist.group.WORLD, P, H, num_kv_heads)
    qh, kh, vh = ours.query_to_heads(q), ours.kv_to_heads(k), ours.kv_to_heads(v)
    back = ours.output_to_tokens(qh).transpose(1, 2).reshape(B, C, H * D)
    # bitwise by construction: all-to-alls and reshapes only move values; the kv gradient sums kv_repeat (at most 2
    # here) equal copies, and x + x == 2 * x exactly
    return {
        "q": torch.equal(qh, seen["q"]),
        "k": torch.equal(kh, seen["k"]),
        "v": torch.equal(vh, seen["v"]),
        "out": torch.equal(back, ds_out),
        "roundtrip": torch.equal(ours.output_to_tokens(qh), q),
        "kv_grad": torch.equal(ours.kv_grad_to_tokens(kh), k * ours.kv_repeat),
    }


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_exchange_layouts_equal_deepspeed_ulysses(num_kv_heads):
    """Same heads-sharded q/k/v (kv replicated when fewer kv heads than ranks) and the same output."""
    for result in run_distributed(layout_worker, 2, (num_kv_heads,)):
        assert all(result.values()), result


def misuse_worker(rank: int):
    import torch.distributed as dist

    import ds_longseq
    from ds_longseq.engine import shard_batch

    errors = {}
    model = make_model("llama", torch.float32)
    ds_longseq.enable(
        model,
        {"streambp": {"enabled": True, "chunk_size": 4}, "sequence_parallel": {"size": 2}},
        sp_group=dist.group.WORLD,
    )
    batch = shard_batch(global_batch(), rank, 2)
    for name, call in {
        "labels_not_shifted": lambda: model(input_ids=batch["input_ids"], labels=batch["shift_labels"]),
        "generation": lambda: model.generate(batch["input_ids"], max_new_tokens=1),
        "uneven_shards": lambda: model(
            input_ids=batch["input_ids"][:, : 20 - rank], shift_labels=batch["shift_labels"][:, : 20 - rank]
        ),
        "mask_shape": lambda: model(
            input_ids=batch["input_ids"],
            attention_mask=torch.ones(2, 40, dtype=torch.long),
            shift_labels=batch["shift_labels"],
        ),
    }.items():
        try:
            call()
            errors[name] = None
        except Exception as err:  # noqa: BLE001 - the message is what is tested
            errors[name] = f"{type(err).__name__}: {err}"
    # the model still trains after the refused calls, and disable() restores the stock forward
    loss = model(**batch).loss
    ds_longseq.disable(model)
    errors["after"] = model(input_ids=batch["input_ids"]).logits.shape
    errors["loss"] = float(loss)
    return errors


def test_misuse_gets_clear_errors_and_loses_nothing():
    results = run_distributed(misuse_worker, 2)
    for errors in results:
        assert "pass shift_labels=" in errors["labels_not_shifted"]
        assert "NotImplementedError" in errors["generation"] and "KV cache" in errors["generation"]
        assert "different (batch, local length) shards" in errors["uneven_shards"]
        assert "slice of the 2D padding mask" in errors["mask_shape"]
        assert errors["after"] == (2, 20, VOCAB) and errors["loss"] == errors["loss"]
    # by construction: the loss is the group's mean, the one all-reduced value on every rank
    assert results[0]["loss"] == results[1]["loss"]


def test_enable_without_a_group_says_how():
    import ds_longseq

    with pytest.raises(RuntimeError, match="engine.initialize"):
        ds_longseq.enable(make_model(), {"sequence_parallel": {"size": 2}})


def ring_worker(rank: int, world: int, arch: str, overrides: dict, ring: int | None, cases: list[str],
                left_pad: bool = True, seq_len: int = SEQ):
    """exactness_worker under Ulysses x ring: the batch cut by shard_batch(..., ring=r) (each rank's tokens from
    ops.sp_layout), the config's ring degree given or chosen from the heads."""
    import torch.distributed as dist

    import ds_longseq
    from ds_longseq.ops.sp_layout import sp_degrees
    from tests.sp_harness import rank_step

    heads = overrides.get("num_attention_heads", 4)
    u, r = sp_degrees(world, heads, ring, overrides.get("num_key_value_heads", 2))
    batch = global_batch(left_pad=left_pad, seq_len=seq_len)
    out = {"degrees": (u, r)}
    for name in cases:
        section = {"size": world} if ring is None else {"size": world, "ring": ring}
        model = full_precision_norms(make_model(arch, torch.float64, **overrides))
        technique, _, mutation = name.partition(":")
        ds_longseq.enable(model, {**SP_CASES[technique], "sequence_parallel": section}, sp_group=dist.group.WORLD)
        with RING_MUTATIONS[mutation]() if mutation else contextlib.nullcontext():
            loss, grads, embed_grad, out["positions"] = rank_step(model, batch, rank, world, r, loss_and_grads)
        out[name] = {"loss": loss, "grads": grads, "embed_grad": embed_grad}
    return out


@pytest.mark.parametrize("world, overrides, ring, degrees", [
    (2, {"hidden_size": 144, "num_attention_heads": 9, "num_key_value_heads": 3}, None, (1, 2)),  # 9 heads (SmolLM2's)
    pytest.param(4, {"hidden_size": 144, "num_attention_heads": 9, "num_key_value_heads": 3}, None, (1, 4),
                 marks=pytest.mark.slow),  # at SP 2 and 4 (heavy: a ring of 4 runs in test_hybrids' SP 4 rings)
    (4, {"num_attention_heads": 2, "num_key_value_heads": 1, "hidden_size": 32}, None, (2, 2)),  # SP 4 > 2 heads
    pytest.param(4, {}, 2, (2, 2), marks=pytest.mark.slow),  # 4 heads as 2 x 2 (ring forced; 2 x 2 runs above)
])
def test_ulysses_x_ring_matches_stock_float64(world, overrides, ring, degrees):
    """Any SP size on any head count: the loss on every rank and the parameter gradients summed over the group equal
    the stock model on the whole batch (left and right padding, a masked prompt: uneven valid tokens per rank).
    Whole shards (ring attention), mini_seq, and StreamBP (chunks of 3, some spanning a rank's two zigzag blocks,
    against the whole sequence's K/V gathered over the ring: ops.ulysses.UlyssesRingExchange)."""
    cases = ["ulysses_only", "mini_seq", "streambp"]
    mutations = [f"streambp:{m}" for m in RING_MUTATIONS] if world == 2 else []  # one launch carries the controls
    results = run_distributed(ring_worker, world_size=world, args=(world, "llama", overrides, ring, cases + mutations))
    _check_ring(results, _reference("llama", overrides), cases, degrees)
    for name in mutations:  # each mutation of StreamBP's ring exchange must fail the same check
        assert _check_ring(results, _reference("llama", overrides), [name], degrees, tol=float("inf")) > 1e-3, name


@contextlib.contextmanager
def _kv_left_rank_major():
    """Mutation: the ring-gathered K/V left in rank-major order instead of put in global order."""
    from ds_longseq.ops.ulysses import UlyssesRingExchange

    original = UlyssesRingExchange._order
    UlyssesRingExchange._order = lambda self, seq_len, device: torch.arange(seq_len, device=device)
    try:
        yield
    finally:
        UlyssesRingExchange._order = original


@contextlib.contextmanager
def _dkv_kept_where_computed():
    """Mutation: dK/dV not sent home over the ring (each rank keeps its own block of what it computed)."""
    import torch.distributed as dist

    original = dist.reduce_scatter_single

    def own_block(output, blocks, group=None, **kwargs):
        output.copy_(blocks.view(-1, *output.shape)[dist.get_rank(group)])

    dist.reduce_scatter_single = own_block
    try:
        yield
    finally:
        dist.reduce_scatter_single = original


RING_MUTATIONS = {"kv_order": _kv_left_rank_major, "dkv_not_returned": _dkv_kept_where_computed}


def test_ring_gemma2_window_and_softcaps_float64():
    """Gemma 2 (3 heads at SP 2: a ring of 2) with its sliding window (6, shorter than a zigzag block of 10) and
    attention / final-logit softcaps, whole shards and StreamBP, against the stock model in float64 (its eager
    attention in float64 as in test_sp2_gemma2_stock_head_float64; no left padding, see global_batch). The window
    skips every ring tile it cannot reach."""
    overrides = {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
    cases = ["streambp_stock_head", "ulysses_only"]
    results = run_distributed(ring_worker, world_size=2, args=(2, "gemma2", overrides, None, cases, False))
    model = float64_eager_attention(full_precision_norms(make_model("gemma2", torch.float64, **overrides)))
    reference = loss_and_grads(model, global_batch(left_pad=False), use_reference=True, ref_dtype=torch.float64)
    _check_ring(results, reference, cases, (1, 2))


def _check_ring(results, reference, cases, degrees, tol: float = 1e-10) -> float:
    """The worst relative error over ranks, cases, the loss, the input and every parameter gradient (< ``tol``)."""
    ref_loss, ref_grads, ref_embed = reference
    worst_error = 0.0
    for per_rank in results:
        assert per_rank["degrees"] == degrees
        for name in cases:
            r = per_rank[name]
            errs = {"loss": rel_err(r["loss"], ref_loss),
                    "embed_grad": rel_err(r["embed_grad"], ref_embed[:, per_rank["positions"]])}
            errs.update({f"grad:{n}": rel_err(g, ref_grads[n]) for n, g in r["grads"].items()})
            worst = max(errs, key=errs.get)
            assert errs[worst] < tol, (name, worst, errs[worst])
            worst_error = max(worst_error, errs[worst])
    return worst_error


def contiguous_under_ring_worker(rank: int):
    import torch.distributed as dist

    import ds_longseq
    from ds_longseq.engine import shard_batch
    from ds_longseq.engine.sp_groups import shard_sequence

    model = make_model("llama", torch.float64, hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    ds_longseq.enable(model, {"sequence_parallel": {"size": 2}}, sp_group=dist.group.WORLD)
    default = shard_batch(global_batch(), layout=model)  # the model's layout (a ring of 2); rank and size from it
    assert torch.equal(default["input_ids"], shard_batch(global_batch(), rank, 2, ring=2)["input_ids"])  # the alias
    assert torch.equal(shard_sequence(global_batch()["labels"], rank, 2, ring=2), default["input_ids"] * 0
                       + global_batch()["labels"][:, default["position_ids"][0]])
    model(**default)
    messages = []
    try:
        model(**shard_batch(global_batch(), rank, 2))  # no layout: contiguous shards (Ulysses alone)
    except ValueError as err:
        messages.append(str(err))
    ds_longseq.disable(model)
    try:
        shard_batch(global_batch(), layout=model)  # the layout left with the model
    except ValueError as err:
        messages.append(str(err))
    return messages, whole_sequence_calls_under_ring(rank)


def test_a_batch_cut_for_ulysses_alone_is_refused_under_a_ring():
    """3 heads at SP 2 run a ring: shard_batch(layout=model) cuts by the model's layout; a batch cut into contiguous
    shards anyway (no layout given) would train on a shuffled sequence, so the forward stops before any compute,
    naming the call that cuts it right; a disabled model has no layout left to cut by. Whole-sequence calls (TRL's
    DPO / GRPO) under the ring: see whole_sequence_calls_under_ring."""
    for messages, whole in run_distributed(contiguous_under_ring_worker, world_size=2, args=()):
        assert len(messages) == 2, messages
        assert "shard_batch(batch, layout=<the model or its engine>)" in messages[0]
        assert "the model is not enabled with sequence parallelism" in messages[1]
        check_whole_sequence_calls(whole)


TWO_LAYOUTS = {  # two models at SP 2 whose heads give them different layouts
    "ring": {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1},  # 3 heads: a ring of 2
    "ulysses": {},  # 4 heads on 2 key/value heads: Ulysses 2
}


def two_layouts_worker(rank: int) -> dict:
    """Two models with different layouts enabled at once in one process, steps interleaved, each batch cut by its
    own model's layout; a third handed the first one's layout (``enable(sp_layout=)``: the same groups); a layout
    handed to a section it does not fit refused."""
    import torch.distributed as dist

    import ds_longseq
    from ds_longseq.engine import sp_layout_of
    from ds_longseq.techniques import sequence_parallel_layout
    from tests.sp_harness import rank_step

    config = {**SP_CASES["streambp"], "sequence_parallel": {"size": 2}}
    models = {name: full_precision_norms(make_model("llama", torch.float64, **overrides))
              for name, overrides in TWO_LAYOUTS.items()}
    ring_layout = sequence_parallel_layout(models["ring"], config, dist.group.WORLD)
    ds_longseq.enable(models["ring"], config, sp_layout=ring_layout)
    ds_longseq.enable(models["ulysses"], config, sp_group=dist.group.WORLD)
    models["shared"] = full_precision_norms(make_model("llama", torch.float64, **TWO_LAYOUTS["ring"]))
    ds_longseq.enable(models["shared"], config, sp_layout=ring_layout)
    out = {"shared_is_handed": sp_layout_of(models["shared"]) is ring_layout}
    for name, model in models.items():  # ring, Ulysses, ring again: both layouts alive throughout
        layout = sp_layout_of(model)
        loss, grads, embed_grad, positions = rank_step(model, global_batch(), rank, 2, layout.ring, loss_and_grads)
        out[name] = {"degrees": layout.degrees, "positions": positions,
                     name: {"loss": loss, "grads": grads, "embed_grad": embed_grad}}
    try:
        ds_longseq.enable(make_model(), {"sequence_parallel": {"size": 2, "ring": 1}}, sp_layout=ring_layout)
    except ds_longseq.UnsupportedModelError as err:
        out["refused"] = str(err)
    for model in models.values():
        ds_longseq.disable(model)
    return out


def test_two_models_with_different_layouts_in_one_process():
    """At SP 2 on 2 ranks, a 3-head model (Ulysses x ring 1 x 2) and a 4-head one (Ulysses 2 x 1) enabled side by
    side, no layout kept by the process: each trains equal to its stock model on the whole batch (float64, loss, input
    and every parameter gradient to 1e-10), batches cut by shard_batch(layout=model); a third model on the first
    one's layout (enable(sp_layout=)) too."""
    results = run_distributed(two_layouts_worker, world_size=2, args=())
    degrees = {"ring": (1, 2), "ulysses": (2, 1), "shared": (1, 2)}
    for name, want in degrees.items():
        overrides = TWO_LAYOUTS["ulysses" if name == "ulysses" else "ring"]
        _check_ring([r[name] for r in results], _reference("llama", overrides), [name], want)
    for r in results:
        assert r["shared_is_handed"]
        assert "enable(sp_layout=) runs 1 x 2 (Ulysses x ring) on 2 ranks" in r["refused"], r["refused"]


def whole_sequence_calls_under_ring(rank: int) -> dict:
    """engine.WholeSequenceCalls (TRL's DPO / GRPO model calls) under a ring: 3 heads at SP 2, whole (B, 37) rows
    on both ranks (padded to 40 = 2 x 2 x 10 for the zigzag blocks), a fused-LM-head call cut by the layout and its
    per-token outputs gathered back in the sequence's order; then the same call with the gather NOT put back in
    order (sequence_from_shards replaced by the identity), which the test must see fail."""
    import torch.distributed as dist

    import ds_longseq
    import ds_longseq.engine.sp_groups as engine_sp
    from ds_longseq.engine import WholeSequenceCalls

    batch = global_batch(seq_len=37, left_pad=False)
    model = full_precision_norms(make_model("llama", torch.float64, hidden_size=48, num_attention_heads=3,
                                            num_key_value_heads=1))
    config = {"lm_head": {"enabled": True, "chunk_size": 7}, "sequence_parallel": {"size": 2}}
    ds_longseq.enable(model, config, sp_group=dist.group.WORLD)
    weights = torch.randn(2, 36, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = {}
    with WholeSequenceCalls([model], rank, 2, dist.group.WORLD) as calls:
        assert calls.ring == 2
        fused = model(**batch, fused_lm_head=True)
        objective = (fused.log_probs * weights).sum() + (fused.entropy * weights.flip(0)).sum()
        objective.backward()  # a whole-sequence function on every rank: each rank's gradient is its tokens' share
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g)
        out.update(log_probs=fused.log_probs.detach(), entropy=fused.entropy.detach(), mask=fused.label_mask,
                   objective=objective.detach(), grads=grads)
        identity, engine_sp.sequence_from_shards = engine_sp.sequence_from_shards, lambda whole, size, ring: whole
        try:
            with torch.no_grad():
                out["unordered"] = model(**batch, fused_lm_head=True).log_probs
        finally:
            engine_sp.sequence_from_shards = identity
    try:  # calls cut for Ulysses alone would be attended as the ring's layout
        WholeSequenceCalls([model], rank, 2, dist.group.WORLD, ring=1)
    except ValueError as err:
        out["wrong_ring"] = str(err)
    # TRL 1.9's calls without labels (whole_logits): the logits gathered whole, then the last logits_to_keep of them
    model.zero_grad(set_to_none=True)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with WholeSequenceCalls([model], rank, 2, dist.group.WORLD, whole_logits=True):
        logits = model(**inputs, logits_to_keep=5).logits
        (logits * _logit_weights(logits.shape)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g)
    out.update(logits=logits.detach(), logit_grads=grads)
    try:  # without whole_logits (TRL 1.16's trainers make fused calls only) a call without labels is refused
        with WholeSequenceCalls([model], rank, 2, dist.group.WORLD):
            model(**inputs)
    except ValueError as err:
        out["logits_refused"] = str(err)
    ds_longseq.disable(model)
    return out


def _logit_weights(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)


def check_whole_sequence_calls(whole: dict) -> None:
    """whole_sequence_calls_under_ring's outputs against the stock model on the whole batch, float64: per-token
    values to 1e-10 absolute (log-probs of ~-5 over 101 tokens: rounding ~1e-14), the objective's parameter
    gradients summed over the ranks to 1e-10 relative; and the unordered gather visibly wrong."""
    batch = global_batch(seq_len=37, left_pad=False)
    model = full_precision_norms(make_model("llama", torch.float64, hidden_size=48, num_attention_heads=3,
                                            num_key_value_heads=1))
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].double()
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    log_p = torch.log_softmax(logits, dim=-1)
    log_probs = log_p.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(log_p.exp() * log_p).sum(-1) * mask
    weights = torch.randn(2, 36, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ((log_probs * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
    assert torch.equal(whole["mask"], mask)
    torch.testing.assert_close(whole["log_probs"], log_probs.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(whole["entropy"], entropy.detach(), rtol=0, atol=1e-10)
    errs = {n: rel_err(g, p.grad) for n, p in model.named_parameters() for g in [whole["grads"][n]]}
    worst = max(errs, key=errs.get)
    assert errs[worst] < 1e-10, (worst, errs[worst])
    # mutation control: the rank-after-rank gather, not put back by the layout, scores other tokens
    assert (whole["unordered"] - log_probs.detach()).abs().max() > 1e-2
    assert "but the modules run ring degree 2: pass modules of one layout" in whole["wrong_ring"]
    # the logits of a call without labels, made whole: the stock's last 5 positions (float64 rounding: 1e-10), and the
    # gradient of a function of them summed over the ranks the stock's
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -5:]
    torch.testing.assert_close(whole["logits"], logits.detach(), rtol=0, atol=1e-10)
    (logits * _logit_weights(logits.shape)).sum().backward()
    errs = {n: rel_err(whole["logit_grads"][n], p.grad) for n, p in model.named_parameters()}
    worst = max(errs, key=errs.get)
    assert errs[worst] < 1e-10, (worst, errs[worst])
    assert "not as a fused-LM-head call" in whole["logits_refused"]
