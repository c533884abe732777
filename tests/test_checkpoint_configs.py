"""Real checkpoints' configs, not only transformers' defaults (issue 39 item 4).

Published configs carry fields that transformers' defaults leave alone: Qwen1.5-MoE sets ``sliding_window`` with
``use_sliding_window: false`` (transformers then builds a sliding-window mask of 0 tokens that no layer reads),
GPT-2 carries ``summary_first_dropout: 0.1`` (its double-heads model's) and GPT-NeoX ``classifier_dropout: 0.1``
(its token classifier's). ds_longseq computes what stock computes there (float64, 1e-10), and with the dropouts the
layers apply at their published values it computes what stock computes with the same masks (GPT-2 below;
docs/DROPOUT.md). The family sweep's published-config column (tests/model_zoo.py, ``VARIANTS``) runs every family
with its applied dropouts at 0.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ds_longseq
from tests.helpers import compare, grads_of, reference_loss

STREAMBP = {"streambp": {"enabled": True, "chunk_size": 8}, "attention": {"kv_block_size": 4},
            "lm_head": {"enabled": True, "chunk_size": 16}}
TINY = dict(vocab_size=101, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")


def _batch(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 101, (2, 37), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 31:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, :5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _worst_against_stock(model, seed: int | None = None) -> float:
    """Largest relative error of ds_longseq's StreamBP (+ chunked head) against the stock model in float64 (same RNG
    seed for both when given: a dropout applied once before the layers draws the same mask)."""
    batch = _batch()
    if seed is not None:
        torch.manual_seed(seed)
    stock = grads_of(model, lambda: reference_loss(model, batch, torch.float64))
    ours_model = ds_longseq.enable(copy.deepcopy(model), STREAMBP)
    if seed is not None:
        torch.manual_seed(seed)
    ours = grads_of(ours_model, lambda: ours_model(**batch).loss)
    return max(compare(ours, stock).values())


def test_qwen2_moe_window_set_but_off_computes_what_stock_computes():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        **TINY, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
        num_experts_per_tok=2, experts_implementation="eager",
        use_sliding_window=False, sliding_window=4096, max_window_layers=21,  # Qwen1.5-MoE-A2.7B's config
    )
    assert config.layer_types == ["full_attention"] * 2  # no layer slides: the window-0 mask stock builds is unread
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config).double().train()
    assert _worst_against_stock(model) < 1e-10


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_classification_head_dropouts_are_not_refused(family):
    """GPT-2's summary_first_dropout and GPT-NeoX's classifier_dropout at their published 0.1, every dropout the
    causal LM applies at 0: trained exactly."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(**TINY, n_layer=2, n_embd=32, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        assert config.summary_first_dropout == 0.1
        model = GPT2LMHeadModel(config)
    else:
        config = GPTNeoXConfig(**TINY, num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                               intermediate_size=64)
        assert config.classifier_dropout == 0.1 and config.hidden_dropout == config.attention_dropout == 0.0
        model = GPTNeoXForCausalLM(config)
    assert _worst_against_stock(model.double().train()) < 1e-10


def test_a_dropout_before_the_layers_is_not_refused():
    """GPT-2's embedding dropout runs once, before the layers StreamBP re-forwards from their saved input: with the
    same seed, stock and ds_longseq draw the same mask (and a different seed gives another gradient: the dropout
    is on)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**TINY, n_layer=2, n_embd=32, n_head=2, resid_pdrop=0.0, attn_pdrop=0.0,
                                       embd_pdrop=0.3)).double().train()
    assert _worst_against_stock(model, seed=5) < 1e-10
    batch = _batch()
    runs = []
    for seed in (5, 6):
        torch.manual_seed(seed)
        runs.append(grads_of(model, lambda: reference_loss(model, batch, torch.float64)))
    assert max(compare(runs[0], runs[1]).values()) > 1e-2


def test_gpt2_published_dropouts_exact_by_mask_replay():
    """GPT-2's published 0.1 on its embeddings, its attention probabilities and its residual branches (its double-heads
    model's summary_first_dropout is not the causal LM's), under StreamBP with key tiles of 4: each chunk's
    recompute draws its forward's masks (the module dropouts from the chunk's region, the attention's from each
    tile's own generator), against the stock model (float64 eager attention) run whole with the masks its forward
    drew (tests/mask_replay.py), float64, 1e-10."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.helpers import float64_eager_attention
    from tests.mask_replay import against_mask_replay

    torch.manual_seed(0)
    model = float64_eager_attention(GPT2LMHeadModel(GPT2Config(**TINY, n_layer=2, n_embd=32, n_head=2)).double())
    assert model.config.attn_pdrop == model.config.resid_pdrop == model.config.embd_pdrop == 0.1
    ours = ds_longseq.enable(copy.deepcopy(model), STREAMBP).train()
    model.train()
    batch = _batch()
    ours(**batch).loss.backward()  # the first training forward's one-time checks
    errs, recorder = against_mask_replay(ours, model, batch, attention_heads=2)
    # the embeddings' and 2 residual dropouts per layer, the attention probabilities of each layer
    assert len(recorder.masks) == 1 + 2 * 2 and len(recorder.tap.whole()) == 2
    assert max(errs.values()) < 1e-10, errs
