"""PEFT LoRA with ds_longseq, in either order (wrap then enable, enable then wrap), against PEFT's
own model: float64 to 1e-10 on the loss and every LoRA gradient (the base is frozen)."""

import copy

import pytest
import torch

import ds_longseq
from tests.helpers import compare, loss_and_grads, make_batch, make_model

peft = pytest.importorskip("peft")

STREAMBP = {
    "streambp": {"enabled": True, "chunk_size": 5, "kv_block_size": 4},
    "mini_seq": {"enabled": False},
    "lm_head": {"enabled": True, "chunk_size": 7},
}
MST = {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 6}}


def lora(model):
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,  # random A and B: nonzero gradients
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
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
