"""PEFT LoRA with ds_longseq, in either order (wrap then enable, enable then wrap), against PEFT's
own model: float64 to 1e-10 on the loss and every LoRA gradient (the base is frozen)."""

import copy

import pytest
import torch

import ds_longseq
from tests.helpers import compare, loss_and_grads, make_batch, make_model

peft = pytest.importorskip("peft")

STREAMBP = {
    "streambp": {"enabled": True, "chunk_size": 5}, "attention": {"kv_block_size": 4},
    "mini_seq": {"enabled": False},
    "lm_head": {"enabled": True, "chunk_size": 7},
}
MST = {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 6}}


ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora(model, targets=ALL_LINEAR):
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,  # random A and B: nonzero gradients
        target_modules=list(targets),
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("config", [STREAMBP, MST], ids=["streambp", "mini_seq"])
@pytest.mark.parametrize("order", ["wrap_then_enable", "enable_then_wrap"])
def test_lora_matches_peft_float64(order, config):
    base = make_model("qwen3", torch.float64)
    base.enable_input_require_grads()  # the frozen embedding's output gets a gradient to compare
    reference_model = lora(copy.deepcopy(base))
    batch = make_batch()
    ref = loss_and_grads(reference_model, batch, use_reference=True, ref_dtype=torch.float64)
    if order == "wrap_then_enable":
        ours = ds_longseq.enable(lora(copy.deepcopy(base)), config)
    else:
        ours = lora(ds_longseq.enable(copy.deepcopy(base), config))
    assert ds_longseq.is_enabled(ours)
    result = loss_and_grads(ours, batch)
    assert set(result[1]) == set(ref[1]) and all("lora_" in n for n in ref[1])
    errs = compare(result, ref)
    assert max(errs.values()) < 1e-10, errs


def test_disable_under_peft_restores_the_stock_forward():
    base = make_model("llama", torch.float64)
    base.enable_input_require_grads()
    model = ds_longseq.enable(lora(base), STREAMBP)
    batch = make_batch()
    assert model(**batch).logits is None  # the chunked head: no logits with labels
    ds_longseq.disable(model)
    assert not ds_longseq.is_enabled(model)
    assert model(**batch).logits.shape == (2, 37, 101)


STREAMBP_2R = {"streambp": {"enabled": True, "chunk_size": 3}, "lm_head": {"enabled": True, "chunk_size": 7}}
# LoRA on the MLPs only: under ZeRO-3 the MLPs are leaf modules whose input (the frozen first layer's
# attention output) needs no gradient; DeepSpeed's leaf gradient hook then fires before their backward.
MST_2R = {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 7}}
MLP_ONLY = ("gate_proj", "up_proj", "down_proj")


def zero_lora_worker(rank: int, stage: int, gas: int, long_seq: dict, targets: tuple):
    import ds_longseq.engine
    from tests.test_engine_dist import _gathered_state, ds_config, rank_batches

    model = lora(make_model("llama", torch.float32), targets)  # wrap, then engine.initialize enables the inner model
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = ds_longseq.engine.initialize(model=model, optimizer=optimizer, config=ds_config(stage, gas, long_seq))
    for batch in rank_batches(rank, 3 * gas):
        engine.backward(engine(**batch).loss)
        engine.step()
    return {n: p for n, p in _gathered_state(engine).items() if "lora_" in n}


@pytest.mark.parametrize(
    "stage,gas,long_seq,targets",
    [(2, 2, STREAMBP_2R, ALL_LINEAR), (3, 1, STREAMBP_2R, ALL_LINEAR), (3, 1, MST_2R, MLP_ONLY)],
    ids=["zero2-gas2-streambp", "zero3-streambp", "zero3-mini_seq-mlp_lora"],
)
def test_zero_lora_on_two_ranks_matches_single_process(stage, gas, long_seq, targets):
    """ZeRO-2/3 + LoRA on 2 CPU ranks with different data per rank: after 3 optimizer steps the LoRA
    weights equal a single-process PEFT run averaging the ranks' losses (fp32). Under ZeRO-3 the
    first decoder layer (MLP) is a leaf module whose input needs no gradient (the base is frozen)."""
    from tests.dist_utils import run_distributed
    from tests.test_engine_dist import rank_batches

    results = run_distributed(zero_lora_worker, 2, (stage, gas, long_seq, targets))
    model = lora(make_model("llama", torch.float32), targets)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    per_rank = [rank_batches(r, 3 * gas) for r in range(2)]
    for step in range(3):
        optimizer.zero_grad()
        total = sum(model(**per_rank[r][step * gas + m]).loss for r in range(2) for m in range(gas))
        (total / (2 * gas)).backward()
        optimizer.step()
    reference = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    for result in results:
        assert set(result) == set(reference)
        for name, ref in reference.items():
            err = ((result[name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (name, err)


@pytest.mark.parametrize("config", [STREAMBP, MST], ids=["streambp", "mini_seq"])
def test_lora_dropout_after_enable_exact_by_mask_replay(config):
    """LoRA dropout wrapped around an enabled model (enable, then get_peft_model): each chunk's recompute draws what
    its forward drew (tests/test_dropout.py runs the other order in every mode), against PEFT's own model run whole
    with those masks (tests/mask_replay.py), float64, 1e-10; eval forwards run without dropout."""
    from tests.helpers import full_precision_norms
    from tests.mask_replay import against_mask_replay

    def with_dropout(model):
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                          init_lora_weights=False, target_modules=list(ALL_LINEAR)))

    base = full_precision_norms(make_model("llama", torch.float64))
    base.enable_input_require_grads()
    stock = with_dropout(copy.deepcopy(base))
    model = with_dropout(ds_longseq.enable(copy.deepcopy(base), config)).train()
    batch = make_batch()
    model(**batch).loss.backward()  # the first training forward's one-time checks
    errs, recorder = against_mask_replay(model, stock, batch)
    assert recorder.calls > 0 and max(errs.values()) < 1e-10, errs
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)
