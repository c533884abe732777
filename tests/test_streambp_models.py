"""StreamBP + chunked LM head on every supported family, against the stock Hugging Face model."""

import pytest
import torch

import ds_longseq
from tests.helpers import ARCHS, clone, compare, loss_and_grads, make_batch, make_model

STREAMBP = lambda chunk, lm_chunk=10, kv_block=6: {  # noqa: E731
    "streambp": {"enabled": True, "chunk_size": chunk}, "attention": {"kv_block_size": kv_block},
    "lm_head": {"enabled": True, "chunk_size": lm_chunk},
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("chunk", [1, 3, 8, 37, 64])
def test_float64_exact(arch, chunk):
    """T=37: chunks of 1 and 3 tokens, uneven chunks of 8, one exact chunk, one chunk longer than T."""
    model = make_model(arch, torch.float64)
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    # Key tiles of 6 (and of 1024 for one-token chunks, where tiny tiles would only be slow).
    config = STREAMBP(chunk, lm_chunk=7, kv_block=1024 if chunk == 1 else 6)
    ours = loss_and_grads(ds_longseq.enable(clone(model), config), batch)
    errs = compare(ours, ref)
    # float64 round-off over a 2-layer model is ~1e-15; 1e-10 leaves room only for summation order.
    assert max(errs.values()) < 1e-10, errs


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("tie", [False, True])
def test_float32_against_stock(arch, tie):
    model = make_model(arch, torch.float32, tie=tie)
    batch = make_batch()
    ref = loss_and_grads(model, batch)
    ours = loss_and_grads(ds_longseq.enable(clone(model), STREAMBP(5)), batch)
    errs = compare(ours, ref)
    # float32 epsilon is 1.2e-7; chunked sums reorder additions over 37 tokens and 2 layers.
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bf16_no_worse_than_stock(arch):
    """StreamBP paper App. B.1: bf16 error against the float64 model, relative to stock bf16's own."""
    model = make_model(arch, torch.float64)
    batch = make_batch()
    exact = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    stock_bf16 = compare(loss_and_grads(clone(model).to(torch.bfloat16), batch), exact)
    ours_bf16 = compare(loss_and_grads(ds_longseq.enable(clone(model).to(torch.bfloat16), STREAMBP(5)), batch), exact)
    worst_stock = max(stock_bf16.values())
    worst_ours = max(ours_bf16.values())
    assert worst_ours <= 1.5 * worst_stock, (worst_ours, worst_stock)
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    assert mean(ours_bf16) <= 1.5 * mean(stock_bf16), (mean(ours_bf16), mean(stock_bf16))


def test_no_padding_batch_of_one_and_explicit_position_ids():
    model = make_model("qwen3")
    batch = make_batch(batch=1, seq_len=29, pad=False)
    batch["position_ids"] = torch.arange(100, 129).unsqueeze(0)  # offset positions: RoPE must follow them
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    ours = loss_and_grads(ds_longseq.enable(clone(model), STREAMBP(4)), batch)
    assert max(compare(ours, ref).values()) < 1e-10


def test_streambp_without_lm_head_uses_stock_loss():
    model = make_model("llama", torch.float32)
    batch = make_batch()
    ref = loss_and_grads(model, batch)
    enabled = ds_longseq.enable(clone(model), {"streambp": {"enabled": True, "chunk_size": 6}})
    out = enabled(**batch)
    assert out.logits is not None and out.logits.shape == (2, 37, 101)
    assert max(compare(loss_and_grads(enabled, batch), ref).values()) < 1e-5


@pytest.mark.parametrize("train", [True, False])
def test_no_grad_forward_matches_stock(train):
    model = make_model("mistral")
    model.train(train)
    batch = make_batch()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        ref = model(**inputs)
        ours = ds_longseq.enable(clone(model).train(train), STREAMBP(6))(**inputs, output_hidden_states=True)
    valid = batch["attention_mask"].bool()
    # Padded positions carry no information; compare the real tokens.
    torch.testing.assert_close(ours.logits[valid], ref.logits[valid], rtol=1e-12, atol=1e-12)
    assert len(ours.hidden_states) == 3


@pytest.mark.kernel_paths
def test_loss_with_labels_returns_no_logits_and_honours_num_items_in_batch():
    model = make_model("llama", torch.float64)
    batch = make_batch()
    enabled = ds_longseq.enable(clone(model), STREAMBP(8))
    out = enabled(**batch)
    assert out.logits is None
    ref = model(**batch, num_items_in_batch=100).loss
    ours = enabled(**batch, num_items_in_batch=100).loss
    torch.testing.assert_close(ours, ref.double(), rtol=1e-6, atol=0)  # stock loss is float32
    as_tuple = enabled(**batch, return_dict=False)
    assert torch.equal(as_tuple[0], out.loss)  # the same forward run again, only returned as a tuple: bitwise
