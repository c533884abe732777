"""Dropout and router noise under the chunked modes, exact by the mask-replay reference (tests/mask_replay.py).

Every random draw inside a region that is run again in backward (a StreamBP chunk: its forward, its K/V
capture, its re-forward; a mini_seq MLP chunk; a checkpointed layer) draws the same numbers each time it runs
(``ds_longseq.ops.draws``). The reference runs the stock model whole with the masks ds_longseq's forward drew
and must give its loss, input gradient and every parameter gradient to 1e-10 in float64. The masks are also
fresh (each chunk, layer and step its own, at the rate p), and three mutations of the replay fail.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ds_longseq
from ds_longseq.ops import draws as draws_module
from tests.helpers import compare, full_precision_norms, lora_with_dropout, make_batch, make_model
from tests.mask_replay import MaskRecorder, against_mask_replay

DT = torch.float64
TOL = 1e-10  # float64 against the whole stock model with the same masks (no float32 rounding left: full-precision
# norms, the loss from float64 logits), as the suite's other float64 exactness tests
LM_HEAD = {"lm_head": {"enabled": True, "chunk_size": 16}}
MODES = {
    "streambp": {"streambp": {"enabled": True, "chunk_size": 10}},
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}},
    "streambp_offload": {"streambp": {"enabled": True, "chunk_size": 10}, "offload": {"layer_inputs": "cpu"}},
    "mini_seq_offload": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "offload": {"layer_inputs": "cpu"}},
    "streambp_keep_every": {"streambp": {"enabled": True, "chunk_size": 10}, "offload": {"keep_every": 2}},
}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(dropout: float = 0.1, num_layers: int = 2):
    """Llama (float64, full-precision norms) with LoRA on every linear of its layers, ``lora_dropout`` on each,
    and nonzero ``lora_B`` (so every adapter's gradient reaches its input)."""
    pytest.importorskip("peft")
    model = lora_with_dropout(full_precision_norms(make_model("llama", DT, num_layers=num_layers)), dropout,
                              PROJECTIONS)
    model.enable_input_require_grads()  # the input gradient is compared too
    return model


def enabled(model, mode: str):
    ours = copy.deepcopy(model)
    inner = ours.base_model.model if hasattr(ours, "base_model") else ours
    ds_longseq.enable(inner, {**MODES[mode], **LM_HEAD})
    return ours


@pytest.mark.parametrize("mode", list(MODES))
def test_lora_dropout_exact_by_mask_replay(mode):
    """lora_dropout=0.1 on every linear of every layer, each mode against the stock model with the same masks."""
    model, batch = lora_model(), make_batch(seq_len=37)
    ours = enabled(model, mode)
    ours(**batch).loss.backward()  # the first training forward runs the layers' one-time probes
    errs, recorder = against_mask_replay(ours, model, batch)
    assert max(errs.values()) < TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    chunked = 4 if mode.startswith("streambp") else 3  # 37 tokens: 4 StreamBP chunks of 10, or 3 MLP chunks
    sites = {site: len(masks) for site, masks in recorder.masks.items()}
    assert len(sites) == 2 * len(PROJECTIONS)
    # the chunked path ran: every site of a StreamBP layer drew once per chunk, a mini_seq MLP's per MLP chunk
    for (module, _), n in sites.items():
        mlp = ".mlp." in module
        assert n == (chunked if mode.startswith("streambp") or mlp else 1), (module, n)


def test_masks_are_fresh_and_follow_the_global_generator():
    """The fraction dropped is p within a binomial bound; two chunks, two layers and two steps draw different
    masks; re-seeding before a forward draws the same ones; a forward advances the global generator."""
    model, batch = lora_model(dropout=0.3), make_batch(seq_len=37)
    ours = enabled(model, "streambp")
    ours(**batch).loss.backward()

    def masks(seed):
        torch.manual_seed(seed)
        recorder = MaskRecorder(ours)
        with recorder:
            loss = ours(**batch).loss
        after = torch.get_rng_state()
        loss.backward()
        return recorder.masks, after

    first, after = masks(1)
    again, _ = masks(1)
    second, _ = masks(2)
    assert first.keys() == again.keys() == second.keys()
    assert all(torch.equal(a, b) for site in first for a, b in zip(first[site], again[site], strict=True))
    torch.manual_seed(1)
    assert not torch.equal(after, torch.get_rng_state())
    every = torch.cat([m.flatten() for chunks in first.values() for m in chunks])
    dropped = 1 - every.double().mean().item()
    n = every.numel()
    assert abs(dropped - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n), (dropped, n)
    q0 = first[next(s for s in first if "layers.0.self_attn.q_proj" in s[0])]
    q1 = first[next(s for s in first if "layers.1.self_attn.q_proj" in s[0])]
    assert not torch.equal(q0[0], q0[1][:, : q0[0].shape[1]])  # two chunks
    assert not torch.equal(q0[0], q1[0])  # two layers
    assert not any(torch.equal(a, b) for site in first for a, b in zip(first[site], second[site], strict=True))


def test_a_backward_drawing_fresh_masks_fails_the_reference(monkeypatch):
    """The mutation: no replayed regions (every pass draws from the global generator where it stands), so the
    backward's re-forward draws other masks than the forward's; the reference sees the difference."""
    monkeypatch.setattr("ds_longseq.forwards.streambp_layer.replay_draws", lambda *a, **k: None)
    _assert_streambp_fails_the_reference()


def _assert_streambp_fails_the_reference() -> None:
    """StreamBP with LoRA dropout, under a mutation the caller installed, is off the mask-replay reference."""
    model, batch = lora_model(), make_batch(seq_len=37)
    ours = enabled(model, "streambp")
    ours(**batch).loss.backward()
    errs, _ = against_mask_replay(ours, model, batch)
    assert max(errs.values()) > 1e-3


def test_a_capture_pass_consuming_other_draws_fails_the_reference(monkeypatch):
    """The mutation: the K/V capture pass starts its draws from another state than its chunk's forward (here: the
    next chunk's region), so the keys its dropout masks give differ from those the forward attended."""
    from ds_longseq.ops.kv_stream import KVStream

    region, begin_chunk = draws_module.Draws.region, KVStream.begin_chunk
    capturing = {"on": False}

    def begin(self):  # the chunk about to run: in a capture pass or not
        capturing["on"] = self.mode == "capture"
        return begin_chunk(self)

    monkeypatch.setattr(KVStream, "begin_chunk", begin)
    monkeypatch.setattr(draws_module.Draws, "region",
                        lambda self, *key: region(self, *((k + 1 for k in key) if capturing["on"] else key)))
    _assert_streambp_fails_the_reference()


def test_one_mask_for_every_chunk_fails_freshness(monkeypatch):
    """The mutation: regions that ignore where they are (every chunk starts from the same state) still replay
    exactly, but every chunk draws the same mask: what the freshness check above refuses."""
    region = draws_module.Draws.region
    monkeypatch.setattr(draws_module.Draws, "region", lambda self, *key: region(self))
    model, batch = lora_model(dropout=0.3), make_batch(seq_len=40)
    ours = enabled(model, "streambp")
    ours(**batch).loss.backward()
    recorder = MaskRecorder(ours)
    with recorder:
        ours(**batch)
    q0 = recorder.masks[next(s for s in recorder.masks if "layers.0.self_attn.q_proj" in s[0])]
    assert torch.equal(q0[0], q0[1])  # 40 tokens: 4 chunks of 10, each the same mask


SP_MODES = {
    "streambp": MODES["streambp"],
    "mini_seq": MODES["mini_seq"],
    "ulysses_only": {},
}


def sp_dropout_worker(rank: int, world: int, modes: list[str]) -> dict:
    """Each mode on this rank's shard of the SP test batch (uneven valid tokens per rank): the loss, the parameter
    gradients summed over the group, the input gradient of the shard and the masks this rank's forward drew."""
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from tests.helpers import grads_of
    from tests.test_sequence_parallel import global_batch

    local = shard_batch(global_batch(), rank, world)
    out = {}
    for mode in modes:
        ours = copy.deepcopy(lora_model())
        cfg = {**SP_MODES[mode], **LM_HEAD, "sequence_parallel": {"size": world}}
        ds_longseq.enable(ours.base_model.model, cfg, sp_group=dist.group.WORLD)
        ours(**local).loss.backward()  # the first training forward's one-time checks
        torch.manual_seed(5)  # the same global generator state on every rank
        recorder = MaskRecorder(ours)

        def forward(recorder=recorder, ours=ours):
            with recorder:
                return ours(**local).loss

        loss, grads, embed_grad = grads_of(ours, forward)
        for g in grads.values():
            dist.all_reduce(g)
        out[mode] = {"loss": loss, "grads": grads, "embed_grad": embed_grad, "masks": recorder.masks}
    return out


def test_sequence_parallel_dropout_exact_by_mask_replay():
    """SP 2 on 2 gloo ranks, lora_dropout=0.1 on every linear, under StreamBP, mini_seq and Ulysses alone: each rank
    draws its own shard's masks (from the same global generator state, unlike each other), and the group's loss,
    input gradient and summed parameter gradients equal the stock model run whole with the masks of both ranks
    joined in sequence order, float64, 1e-10."""
    from tests.dist_utils import run_distributed
    from tests.mask_replay import joined
    from tests.test_sequence_parallel import global_batch

    modes = list(SP_MODES)
    results = run_distributed(sp_dropout_worker, world_size=2, args=(2, modes))
    batch = global_batch()
    for mode in modes:
        per_rank = [r[mode] for r in results]
        local = [joined(r["masks"], 2) for r in per_rank]
        assert local[0].keys() == local[1].keys() and len(local[0]) == 2 * len(PROJECTIONS)
        assert not any(torch.equal(local[0][site], local[1][site]) for site in local[0])  # each rank its own
        whole = {site: torch.cat([m[site] for m in local], dim=1) for site in local[0]}
        half = batch["input_ids"].shape[1] // 2
        _check_ranks_against_replay(per_rank, lora_model(), whole, batch,
                                    [slice(rank * half, (rank + 1) * half) for rank in range(2)], mode)


def _check_ranks_against_replay(per_rank: list[dict], stock, whole: dict, batch: dict, tokens: list, case: str) -> None:
    """Each rank's loss, input gradient (its ``tokens`` of the sequence) and summed parameter gradients against
    ``stock`` run whole on ``batch`` with the masks ``whole`` in place of its draws, float64, 1e-10."""
    from tests.helpers import grads_of, reference_loss, rel_err
    from tests.mask_replay import MaskReplayer

    replayer = MaskReplayer(stock, whole)

    def reference():
        with replayer:
            return reference_loss(stock, batch, DT)

    ref_loss, ref_grads, ref_embed = grads_of(stock, reference)
    assert replayer.used == set(whole)
    for rank, (r, where) in enumerate(zip(per_rank, tokens, strict=True)):
        errs = {"loss": rel_err(r["loss"], ref_loss), "embed_grad": rel_err(r["embed_grad"], ref_embed[:, where])}
        errs.update({name: rel_err(g, ref_grads[name]) for name, g in r["grads"].items()})
        assert set(r["grads"]) == set(ref_grads)
        assert max(errs.values()) < TOL, (case, rank, max(errs, key=errs.get), max(errs.values()))


SP_ATTENTION = {  # SP 2 with 4 query / 2 key-value heads: Ulysses (2 heads a rank), or a ring of 2 (all heads)
    "ulysses_only": {"sequence_parallel": {"size": 2}},
    "streambp": {**MODES["streambp"], "sequence_parallel": {"size": 2}},
    "ring": {"sequence_parallel": {"size": 2, "ring": 2}},
    "streambp_ring": {**MODES["streambp"], "sequence_parallel": {"size": 2, "ring": 2}},
}


def attention_dropout_model():
    from tests.helpers import float64_eager_attention

    return float64_eager_attention(full_precision_norms(make_model("llama", DT, attention_dropout=0.1)))


def sp_attention_dropout_worker(rank: int, world: int, cases: list[str]) -> dict:
    """Each case on this rank's shard (no left padding: the eager reference and ds_longseq differ on a query that
    sees no key): loss, summed parameter gradients, the shard's input gradient and positions, and the attention
    dropout masks this rank's tiles drew, placed at their global heads and positions."""
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from tests.helpers import grads_of
    from tests.mask_replay import AttentionDropoutTap
    from tests.test_sequence_parallel import global_batch

    out = {}
    for case in cases:
        ours = attention_dropout_model()
        ds_longseq.enable(ours, {**SP_ATTENTION[case], **LM_HEAD}, sp_group=dist.group.WORLD)
        local = shard_batch(global_batch(left_pad=False), rank, world, layout=ours)  # a ring's cases: its zigzag
        ours(**local).loss.backward()  # the first training forward's one-time checks
        c = ours.config
        ulysses = 1 if SP_ATTENTION[case]["sequence_parallel"].get("ring") else world
        heads = torch.arange(c.num_attention_heads).chunk(ulysses)[rank % ulysses]
        tap = AttentionDropoutTap(ours, 2, c.num_attention_heads, global_batch()["input_ids"].shape[1], heads)
        torch.manual_seed(5)  # the same global generator state on every rank

        def forward(tap=tap, ours=ours, local=local):
            with tap:
                return ours(**local).loss

        loss, grads, embed_grad = grads_of(ours, forward)
        for g in grads.values():
            dist.all_reduce(g)
        out[case] = {"loss": loss, "grads": grads, "embed_grad": embed_grad, "masks": tap.masks,
                     "positions": local["position_ids"][0], "heads": heads, "tiles": tap.tiles}
        ds_longseq.disable(ours)
    return out


def test_sequence_parallel_attention_dropout_exact_by_mask_replay():
    """Attention-probability dropout (attention_dropout 0.1, GQA 4 / 2 heads) under SP 2 on 2 gloo ranks: Ulysses
    alone (whole-shard attention, 2 heads a rank), StreamBP's chunk attention against the exchanged keys, ring
    attention (a ring of 2, zigzag shards, each query's tiles on its own rank) and StreamBP under the ring. Each rank
    draws its own call seed in its own region (``ops.draws``), each tile its mask from that seed and its global
    positions. The tiles' masks of both ranks, placed at their global heads and positions, replayed in the stock
    model run whole (float64 eager attention): loss, each rank's input gradient and the summed parameter gradients
    equal it to 1e-10; the ranks' masks differ; about p of the positions drawn are dropped."""
    from tests.dist_utils import run_distributed
    from tests.test_sequence_parallel import global_batch

    cases = list(SP_ATTENTION)
    results = run_distributed(sp_attention_dropout_worker, world_size=2, args=(2, cases))
    batch = global_batch(left_pad=False)
    for case in cases:
        per_rank = [r[case] for r in results]
        sites = [site for site in per_rank[0]["masks"] if site[0] != "seen"]
        assert len(sites) == 2 and all(r["tiles"] > 0 for r in per_rank), (case, sites)  # 2 layers' attention
        whole, drawn = {}, []
        for site in sites:
            seen = [r["masks"][("seen", site[0])] for r in per_rank]
            assert not (seen[0] & seen[1]).any()  # each position drawn by one rank
            whole[site] = sum(r["masks"][site] & s for r, s in zip(per_rank, seen, strict=True)).bool()
            drawn += [r["masks"][site][s] for r, s in zip(per_rank, seen, strict=True)]
            if case in ("ulysses_only", "streambp"):  # the same positions of heads 0 (rank 0) and 2 (rank 1)
                both = seen[0][:, 0] & seen[1][:, 2]
                assert both.any() and not torch.equal(whole[site][:, 0][both], whole[site][:, 2][both]), case
        kept = torch.cat(drawn).double()
        assert abs((1 - kept.mean().item()) - 0.1) < 5 * (0.09 / kept.numel()) ** 0.5, (case, kept.mean())
        _check_ranks_against_replay(per_rank, attention_dropout_model(), whole, batch,
                                    [r["positions"] for r in per_rank], case)


def test_a_region_replays_its_draws_and_leaves_the_global_generator_alone():
    """ops.draws.Draws: take() reads its seed without drawing; a region's draws depend on its key only; the global
    generator is as the region found it; advance() moves it by one draw once, and only if a region drew."""
    torch.manual_seed(0)
    start = torch.get_rng_state()
    quiet, draws = draws_module.Draws.take(), draws_module.Draws.take()
    assert torch.equal(torch.get_rng_state(), start) and quiet.seed == draws.seed
    with quiet.region(0):
        torch.zeros(3).add_(1)  # nothing random
    quiet.advance()
    assert not quiet.drew and torch.equal(torch.get_rng_state(), start)
    with draws.region(7):
        first = torch.rand(4)
    with draws.region(8):
        other = torch.rand(4)
    with draws.region(7):
        again = torch.rand(4)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.get_rng_state(), start) and draws.drew
    draws.advance()
    advanced = torch.get_rng_state()
    draws.advance()
    assert not torch.equal(advanced, start) and torch.equal(torch.get_rng_state(), advanced)
    assert draws_module.Draws(draws.seed, rank=1).seed == draws.seed
    with draws_module.Draws(draws.seed, rank=1).region(7):
        assert not torch.equal(torch.rand(4), first)  # another rank, another mask


@pytest.mark.parametrize("mode", ["streambp", "streambp_offload"])
def test_saved_bytes_are_those_of_the_run_without_dropout(mode):
    """No mask is stored: what a StreamBP step saves for backward (every tensor autograd keeps, counted by a
    saved-tensors hook) is the same with lora_dropout 0.1 as with no dropout, and the chunked path ran."""

    def saved_bytes(dropout: float) -> int:
        ours = enabled(lora_model(dropout=dropout), mode)
        batch = make_batch(seq_len=37)
        ours(**batch).loss.backward()  # the one-time probes
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = ours(**batch).loss
        loss.backward()
        return total

    assert saved_bytes(0.1) == saved_bytes(0.0) > 0



def _attention_backward_drawing_other_masks(monkeypatch):
    """Mutation: the tiles' backward draws from another seed than their forward."""
    from ds_longseq.ops import chunk_attention as attention

    backward = attention._attention_backward

    def other(*args):
        *rest, dropout = args
        return backward(*rest, None if dropout is None else (dropout[0], dropout[1] + 1))

    monkeypatch.setattr(attention, "_attention_backward", other)


@pytest.mark.parametrize("arch,kv_block_size,mutation", [
    ("llama", 4, None), ("llama", None, None), ("gemma2", 4, None), ("llama", 4, "backward_other_masks"),
])
def test_attention_dropout_under_streambp_exact_by_mask_replay(arch, kv_block_size, mutation, monkeypatch):
    """Attention-probability dropout (attention_dropout 0.1, GQA 4 / 2 heads) in StreamBP's chunk attention: each
    tile draws its keep mask from its own generator (the call's seed drawn in the chunk's region, and where the tile
    lies), the same in the forward, the backward's re-forward and the tile's own backward. Against the stock model
    (float64 eager attention) run whole with the tiles' masks put in place (tests/mask_replay.py), 1e-10; with
    key tiles of 4 (prefix tiles merged by log-sum-exp) and whole prefixes; Gemma 2 with its sliding window of 6
    and its softcaps. The mutation (the tiles' backward on other masks) fails."""
    from tests.helpers import float64_eager_attention, grads_of, reference_loss
    from tests.mask_replay import AttentionDropoutTap, MaskReplayer
    from tests.test_families import right_padded_batch

    if mutation:
        _attention_backward_drawing_other_masks(monkeypatch)
    model = float64_eager_attention(full_precision_norms(make_model(arch, DT, attention_dropout=0.1)))
    ours = copy.deepcopy(model)
    cfg = {**MODES["streambp"], **LM_HEAD, "attention": {"kv_block_size": kv_block_size}}
    ds_longseq.enable(ours, cfg)
    batch = right_padded_batch()
    ours(**batch).loss.backward()  # the first training forward's one-time checks
    torch.manual_seed(5)
    c = model.config
    tap = AttentionDropoutTap(ours, 2, c.num_attention_heads, batch["input_ids"].shape[1])

    def forward():
        with tap:
            return ours(**batch).loss

    result = grads_of(ours, forward)
    replayer = MaskReplayer(model, tap.whole())

    def reference():
        with replayer:
            return reference_loss(model, batch, DT)

    errs = compare(result, grads_of(model, reference))
    if mutation:
        assert max(errs.values()) > 1e-3
        return
    assert replayer.used == {(site, None) for site, _ in tap.whole()} and len(replayer.used) == 2
    assert tap.tiles > 0 and max(errs.values()) < TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]
    drawn = torch.cat([tap.masks[(module, None)][tap.masks[("seen", module)]] for module, _ in tap.whole()])
    dropped = 1 - drawn.double().mean().item()
    assert abs(dropped - 0.1) < 5 * (0.09 / drawn.numel()) ** 0.5, (dropped, drawn.numel())


def test_chunk_attention_dropout_against_dense():
    """ops.chunk_attention.chunk_causal_attention with dropout: GQA (4 / 2 heads), a prefix of 9 keys in tiles of 4, a
    chunk of 7: output and the q / k / v gradients equal dense attention with the tiles' masks put in place
    (float64, 1e-12); a tile's backward draws the mask its forward drew; about p of the positions are dropped.
    (tests/gpu/test_dropout_gpu.py runs it on a CUDA device.)"""
    check_chunk_attention_dropout(torch.device("cpu"))


def check_chunk_attention_dropout(device: torch.device) -> None:
    from ds_longseq.ops.chunk_attention import chunk_causal_attention
    from ds_longseq.ops.tile_kernels import dropout_masks_tapped

    torch.manual_seed(0)
    B, H, Hkv, C, S, D, p = 2, 4, 2, 7, 9, 5, 0.3
    opts = {"dtype": DT, "device": device}
    q = torch.randn(B, H, C, D, **opts, requires_grad=True)
    k, v = (torch.randn(B, Hkv, C, D, **opts, requires_grad=True) for _ in range(2))
    kp, vp = torch.randn(B, Hkv, S, D, **opts), torch.randn(B, Hkv, S, D, **opts)
    sink = (torch.zeros(B, Hkv, S, D, **opts), torch.zeros(B, Hkv, S, D, **opts))
    whole, drawn = torch.zeros(B, H, C, S + C, dtype=torch.bool, device=device), {}

    def tap(keep, mask):
        key0, query0, stacked = mask.dropout_where
        if stacked:
            keep = keep.reshape(B, Hkv, H // Hkv, -1, keep.shape[-1]).reshape(B, H, -1, keep.shape[-1])
        place = (key0, query0, keep.shape[2], keep.shape[3])
        assert place not in drawn or torch.equal(drawn[place], keep)  # the backward's mask is the forward's
        drawn[place] = keep
        whole[:, :, query0 - S:query0 - S + keep.shape[2], key0:key0 + keep.shape[3]] = keep

    g = torch.randn(B, H, C, D, **opts)
    with dropout_masks_tapped(tap):
        out = chunk_causal_attention(q, k, v, scale=D ** -0.5, k_prefix=kp, v_prefix=vp, kv_block_size=4,
                                     prefix_grad_sink=sink, dropout=p, dropout_seed=123)
        grads = torch.autograd.grad(out, (q, k, v), g)
    kk, vv = (torch.cat(t, 2).repeat_interleave(H // Hkv, 1) for t in ((kp, k), (vp, v)))
    causal = torch.ones(C, S + C, dtype=torch.bool, device=device).tril(S)
    probs = ((q * D ** -0.5) @ kk.transpose(-1, -2)).masked_fill(~causal, float("-inf")).softmax(-1)
    ref = (probs * whole / (1 - p)) @ vv
    for a, b in zip((out, *grads), (ref, *torch.autograd.grad(ref, (q, k, v), g)), strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-12
    kept = whole[:, :, causal]
    assert len(drawn) == 4 and abs((1 - kept.double().mean().item()) - p) < 5 * (p * (1 - p) / kept.numel()) ** 0.5


def zero3_dropout_worker(rank: int) -> dict:
    """One ZeRO-3 step (engine.initialize, StreamBP, SGD on the LoRA weights, float32) of lora_model() with this
    rank's batch: the masks its forward drew and the LoRA weights after the step, gathered."""
    import ds_longseq.engine
    from ds_longseq.compat import gathered_parameters  # DeepSpeed 0.18's gather on gloo: see its docstring
    from tests.test_engine_dist import LR, ds_config, rank_batches

    model = lora_model().float()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine, *_ = ds_longseq.engine.initialize(model=model, optimizer=optimizer,
                                              config=ds_config(3, 1, {**MODES["streambp"], **LM_HEAD}))
    batch = rank_batches(rank, 1)[0]
    engine(**batch)  # the first training forward runs the layers' one-time probes (its graph is dropped)
    torch.manual_seed(5)
    recorder = MaskRecorder(engine.module)
    with recorder:
        loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()
    params = [p for p in engine.module.parameters() if p.requires_grad]
    with gathered_parameters(params):
        lora = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    return {"masks": recorder.masks, "lora": lora}


def test_zero3_dropout_step_exact_by_mask_replay():
    """ZeRO-3 + StreamBP on 2 ranks with lora_dropout 0.1 (each rank its own data, its own masks): the LoRA weights
    after one SGD step equal one process stepping on the mean of the two ranks' stock losses, each run whole with
    that rank's masks (float32: 1e-5 relative, the engine tests' tolerance)."""
    from tests.dist_utils import run_distributed
    from tests.helpers import reference_loss
    from tests.mask_replay import MaskReplayer, joined
    from tests.test_engine_dist import LR, rank_batches

    results = run_distributed(zero3_dropout_worker, 2, ())
    stock = lora_model().float()
    params = [p for p in stock.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    total = 0.0
    for rank, result in enumerate(results):
        with MaskReplayer(stock, joined(result["masks"], 2)):
            total = total + reference_loss(stock, rank_batches(rank, 1)[0], torch.float32)
    (total / 2).backward()
    optimizer.step()
    assert not any(torch.equal(results[0]["masks"][s][0], results[1]["masks"][s][0]) for s in results[0]["masks"])
    for name, p in stock.named_parameters():
        if p.requires_grad:
            for result in results:
                assert ((result["lora"][name] - p.detach()).norm() / p.norm()).item() < 1e-5, name
