"""enable()/disable(): per-instance patching, undo, no-grad and generation paths, clear errors."""

import inspect

import pytest
import torch
import transformers
from packaging.version import Version

import ds_longseq
from ds_longseq import LongSeqConfigError, UnsupportedModelError
from ds_longseq.compat import set_activation_checkpointing
from tests.helpers import clone, make_batch, make_model

STREAMBP = {"streambp": {"enabled": True, "chunk_size": 8}, "lm_head": {"enabled": True, "chunk_size": 16}}


def _param_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.kernel_paths
def test_two_models_in_one_process_do_not_interfere_and_disable_restores():
    plain = make_model("llama", torch.float32)
    patched = ds_longseq.enable(clone(plain), STREAMBP)
    batch = make_batch()
    assert plain.config._attn_implementation == "sdpa"
    assert patched.config._attn_implementation == "ds_longseq"
    assert "forward" not in plain.__dict__ and "forward" not in plain.model.layers[0].__dict__
    assert ds_longseq.is_enabled(patched) and not ds_longseq.is_enabled(plain)
    assert ds_longseq.get_config(patched).streambp.chunk_size == 8
    assert plain(**batch).logits is not None and patched(**batch).logits is None
    ref_loss, _ = _param_grads(plain, batch)
    ds_longseq.disable(patched)
    assert not ds_longseq.is_enabled(patched)
    assert patched.config._attn_implementation == "sdpa"
    for module in [patched, *patched.model.layers, *(layer.mlp for layer in patched.model.layers)]:
        assert "forward" not in module.__dict__
    loss, _ = _param_grads(patched, batch)
    assert torch.equal(loss, ref_loss)  # bitwise: the stock path again
    ds_longseq.enable(patched, STREAMBP)  # and it can be enabled again
    with pytest.raises(RuntimeError, match="already enabled"):
        ds_longseq.enable(patched, STREAMBP)


def test_state_dict_and_save_pretrained_are_untouched(tmp_path):
    model = make_model("qwen3", torch.float32)
    keys = list(model.state_dict())
    ds_longseq.enable(model, STREAMBP)
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation != "ds_longseq"
    batch = make_batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).loss, model(**batch).loss, rtol=1e-5, atol=1e-6)


def test_generate_matches_stock():
    """With a KV cache the stock layer runs and our attention handles q_len < kv_len (bottom-right)."""
    model = make_model("llama", torch.float64).eval()
    patched = ds_longseq.enable(clone(model), STREAMBP)
    batch = make_batch()
    prompt = {"input_ids": batch["input_ids"][:, :20], "attention_mask": batch["attention_mask"][:, :20]}
    prompt["attention_mask"][1] = 1  # only left padding makes sense for generation
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    # greedy token ids of two computations (our attention on the prompt, the stock SDPA): a token flips only where the
    # top two logits are within rounding (~1e-15); here they are >= 0.12 apart at every step
    assert torch.equal(patched.generate(**prompt, **kwargs), model.generate(**prompt, **kwargs))


def test_unsupported_model_class_is_rejected_at_enable():
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=50))
    # Bloom's attention does not go through transformers' interface (and from transformers 5.23 its forward is none
    # of the heads ds_longseq re-implements; 5.16's is Llama's): refused before anything changes, every reason listed
    with pytest.raises(UnsupportedModelError, match=r"cannot be enabled on BloomForCausalLM") as refused:
        ds_longseq.enable(bloom, STREAMBP)
    assert "(BloomAttention) does not compute through transformers' attention interface" in str(refused.value)
    if Version(transformers.__version__) >= Version("5.23"):
        assert "BloomForCausalLM.forward does something after its decoder stack" in str(refused.value)
    assert "forward" not in bloom.__dict__


def test_model_forward_keeps_its_signature_for_the_trainer():
    """The HF Trainer drops every dataset column model.forward's signature does not name."""
    model = ds_longseq.enable(make_model("llama", torch.float32), STREAMBP)
    assert {"input_ids", "attention_mask", "labels"} <= set(inspect.signature(model.forward).parameters)


def test_layers_and_model_forward_carry_the_attention_settings_of_the_config():
    """``long_seq.attention`` reaches every StreamBP layer and the model forward as one ``AttentionSettings``."""
    from ds_longseq.forwards.attn_spec import AttentionSettings

    config = {**STREAMBP, "attention": {"kv_block_size": 4, "single_call": False}}
    model = ds_longseq.enable(make_model("llama", torch.float32), config)
    expected = AttentionSettings(kv_block_size=4, single_call=False)
    assert [layer.forward.attention for layer in model.model.layers] == [expected] * len(model.model.layers)
    assert model.forward.settings.attention == expected


@pytest.mark.parametrize("config", [{"streambp": {"enabled": True, "chunk_size": 8}},
                                    {"mini_seq": {"enabled": True}, "offload": {"keep_every": 2}}],
                         ids=["streambp", "mini_seq_offload"])
def test_training_call_makes_no_cache_under_streambp_or_offload(config):
    """The model forward defaults a training call to use_cache=False where the layers stream or keep their inputs
    themselves (the stock default would keep every layer's K/V, and layers given a cache run their stock forward)."""
    model = ds_longseq.enable(make_model("llama", torch.float32), config)
    assert model.config.use_cache
    assert model(**make_batch()).past_key_values is None


def test_bad_config_is_rejected_before_anything_changes():
    model = make_model("llama", torch.float32)
    with pytest.raises(LongSeqConfigError, match="chunk_size must be a positive integer"):
        ds_longseq.enable(model, {"streambp": {"enabled": True, "chunk_size": -1}})
    assert not ds_longseq.is_enabled(model) and model.config._attn_implementation == "sdpa"


def test_attention_dropout_is_accepted_without_sequence_parallelism():
    """StreamBP's chunk attention applies it (tests/test_dropout.py: exact by mask replay); mini_seq keeps the stock
    attention. Sequence parallelism refuses it at enable (tests/test_dropout.py)."""
    for config in (STREAMBP, {"mini_seq": {"enabled": True}}):
        model = make_model("llama", torch.float32, attention_dropout=0.1)
        ds_longseq.enable(model, config)
        model(**make_batch()).loss.backward()


def test_gradient_checkpointing_with_streambp_is_rejected():
    model = ds_longseq.enable(make_model("llama", torch.float32), STREAMBP)
    set_activation_checkpointing(model, True)
    model.train()
    with pytest.raises(RuntimeError, match="activation_checkpointing_disable"):
        model(**make_batch())


def test_4d_mask_and_logits_to_keep_are_rejected():
    model = ds_longseq.enable(make_model("llama", torch.float32), STREAMBP)
    batch = make_batch()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(**batch, logits_to_keep=1)
    batch["attention_mask"] = torch.ones(2, 1, 37, 37)
    with pytest.raises(ValueError, match="2D"):
        model(**batch)


def test_streambp_layer_saves_only_its_input():
    model = ds_longseq.enable(make_model("qwen2", torch.float32), STREAMBP)
    layer = model.model.layers[1]
    h = torch.randn(2, 37, 64, requires_grad=True)
    pos = torch.arange(37).unsqueeze(0)
    cos_sin = model.model.rotary_emb(h, pos)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(h, position_embeddings=cos_sin, position_ids=pos)
    assert len(saved) == 1 and saved[0] is h
    out.square().sum().backward()
    assert h.grad is not None and all(p.grad is not None for p in layer.parameters())
