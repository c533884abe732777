"""Mixture-of-experts families (Qwen3-MoE, Mixtral) beyond the family exactness test in
test_families.py: router logits and the load-balancing loss equal to stock, routing ties broken
the same way, the loss without router logits, and clear refusals.

The float64 references use float64 routers and load-balancing loss (test_families.py explains why);
the float32 test runs the stock model with its default grouped_mm experts."""

import pytest
import torch

import ds_longseq
from tests.helpers import clone, compare, loss_and_grads, make_model
from tests.test_families import CONFIGS, exact, float64_load_balancing, right_padded_batch  # noqa: F401

MOE = ["qwen3_moe", "mixtral"]


@pytest.mark.parametrize("arch", MOE)
@pytest.mark.parametrize("config", ["streambp", "mini_seq"])
def test_router_logits_and_aux_loss_equal_stock(arch, config):
    """The recorded router logits: one (B*T, E) tensor per sparse layer, stock's to 1e-12, in
    training and in a no_grad forward (where the chunked layers take their no-grad path)."""
    model = exact(make_model(arch, torch.float64))
    ours = ds_longseq.enable(clone(model), CONFIGS[config])
    batch = right_padded_batch()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            ref, out = model(**batch), ours(**batch)
        sparse = 1 if arch == "qwen3_moe" else 2  # Qwen3-MoE's layer 1 is dense (mlp_only_layers)
        assert len(out.router_logits) == len(ref.router_logits) == sparse
        for a, b in zip(out.router_logits, ref.router_logits, strict=True):
            assert a.shape == b.shape == (2 * 37, model.num_experts)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=1e-12, atol=0)
        assert out.aux_loss.requires_grad == grad


@pytest.mark.parametrize("arch", MOE)
def test_routing_ties_are_broken_the_same_way(arch):
    """Two experts with identical router rows tie at every token: top-k picks the same one as stock
    (and the gradient, which differs per expert, matches)."""
    model = make_model(arch, torch.float64)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight[1] = gate.weight[0]
    model = exact(model)
    batch = right_padded_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    errs = compare(loss_and_grads(ds_longseq.enable(clone(model), CONFIGS["streambp"]), batch), ref)
    assert max(errs.values()) < 1e-10, errs


def test_without_router_logits_only_the_lm_loss():
    """output_router_logits=False: no aux loss, the LM loss alone, exact; with it the loss differs
    (the load-balancing term is not vacuous in these tests)."""
    model = exact(make_model("mixtral", torch.float64))
    batch = right_padded_batch()
    ref = loss_and_grads(model, {**batch, "output_router_logits": False}, use_reference=True,
                         ref_dtype=torch.float64)
    ours = ds_longseq.enable(clone(model), CONFIGS["streambp"])
    out = ours(**batch, output_router_logits=False)
    assert getattr(out, "aux_loss", None) is None
    errs = compare(loss_and_grads(ours, {**batch, "output_router_logits": False}), ref)
    assert max(errs.values()) < 1e-10, errs
    assert abs(ours(**batch).loss.item() - out.loss.item()) > 1e-3


@pytest.mark.parametrize("arch", MOE)
def test_moe_float32_with_stock_grouped_mm_experts(arch):
    model = make_model(arch, torch.float32, experts_implementation="grouped_mm")
    batch = right_padded_batch()
    ref = loss_and_grads(model, batch)
    errs = compare(loss_and_grads(ds_longseq.enable(clone(model), CONFIGS["streambp"]), batch), ref)
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("config", ["streambp", "mini_seq"])
def test_router_jitter_exact_by_noise_replay(config):
    """Mixtral's router jitter (its MoE input scaled by uniform noise in training) is drawn again, the same, in each
    chunk's recompute: against the stock model run whole with the noise ds_longseq's forward drew
    (tests/mask_replay.py), float64, 1e-10; each chunk drew its own noise."""
    from tests.mask_replay import against_mask_replay

    model = exact(make_model("mixtral", torch.float64, router_jitter_noise=0.1))
    ours = ds_longseq.enable(clone(model), CONFIGS[config])
    batch = right_padded_batch()
    ours(**batch).loss.backward()  # the first training forward's one-time checks
    errs, recorder = against_mask_replay(ours, model, batch)
    assert max(errs.values()) < 1e-10, errs
    noise = [chunks for (module, _), chunks in recorder.masks.items() if module.endswith("mlp")]
    chunks = 8 if config == "streambp" else 3  # 37 tokens in chunks of 5, or 3 MLP chunks
    assert len(noise) == 2 and all(len(n) == chunks for n in noise)
    assert not torch.equal(noise[0][0], noise[0][1][:, : noise[0][0].shape[1]])


def test_router_logits_with_mini_seq_offload_are_refused():
    """The layer checkpoint of mini_seq + offload would record router logits without gradient."""
    model = make_model("qwen3_moe", torch.float32)
    ours = ds_longseq.enable(model, {**CONFIGS["mini_seq"], "offload": {"layer_inputs": "cpu"}})
    with pytest.raises(NotImplementedError, match=r"output_router_logits.*offload.layer_inputs"):
        ours(**right_padded_batch())
    ours(**right_padded_batch(), output_router_logits=False).loss.backward()  # the LM loss alone runs


def zero3_moe_worker(rank: int, long_seq: dict):
    import ds_longseq.engine
    from tests.test_engine_dist import _gathered_state, ds_config, rank_batches

    model = make_model("qwen3_moe", torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = ds_longseq.engine.initialize(model=model, optimizer=optimizer, config=ds_config(3, 1, long_seq))
    for batch in rank_batches(rank, 2):
        engine.backward(engine(**batch).loss)
        engine.step()
    return _gathered_state(engine)


def test_zero3_moe_with_load_balancing_on_two_ranks_matches_single_process():
    """Qwen3-MoE under ZeRO-3 with StreamBP and the chunked head on 2 CPU ranks, different data per
    rank, LM + load-balancing loss: after 2 SGD steps every weight (experts and routers included)
    equals a single process averaging the ranks' losses (fp32)."""
    from tests.dist_utils import run_distributed
    from tests.test_engine_dist import rank_batches

    config = {"streambp": {"enabled": True, "chunk_size": 3}, "lm_head": {"enabled": True, "chunk_size": 7}}
    results = run_distributed(zero3_moe_worker, 2, (config,))
    model = make_model("qwen3_moe", torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    per_rank = [rank_batches(r, 2) for r in range(2)]
    for step in range(2):
        optimizer.zero_grad()
        (sum(model(**per_rank[r][step]).loss for r in range(2)) / 2).backward()
        optimizer.step()
    for result in results:
        for name, p in model.named_parameters():
            err = ((result[name] - p.detach()).norm() / p.detach().norm()).item()
            assert err < 1e-5, (name, err)
