"""Families found from structure (``ds_longseq.families.discovery``) and the runtime guard of StreamBP layers.

The sweep (``tests/test_model_sweep.py``) runs every shipped family; these tests build the cases it cannot
meet on a stock model: a subclass whose forward changes the logits, an attention module that computes
inline, a layer whose attention drops the chunk's spec, and the settings refused on discovered families.
"""

import pytest
import torch
import transformers

import ds_longseq
from ds_longseq import UnsupportedModelError
from ds_longseq.compat import pop_cache
from ds_longseq.families.discovery import HEAD_TEMPLATES, head_kind
from tests import discovery_record, model_zoo
from tests.helpers import clone, compare, loss_and_grads, make_batch, make_model

STREAMBP = {"streambp": {"enabled": True, "chunk_size": 8}, "lm_head": {"enabled": True, "chunk_size": 16}}


def test_every_head_template_is_recognised_in_this_transformers():
    """Each representative's own forward is recognised as its kind (else the table is stale)."""
    for kind, names in HEAD_TEMPLATES.items():
        for name in names:
            cls = getattr(transformers, name)
            assert head_kind(cls.__new__(cls)) == kind, name


class ScaledLlama(transformers.LlamaForCausalLM):
    """A family whose forward does something ds_longseq does not re-implement (a temperature)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        outputs = self.model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(outputs.last_hidden_state) / 0.7
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_unknown_head_is_refused_naming_the_class():
    stock = make_model("llama", torch.float32)
    model = ScaledLlama(stock.config)
    with pytest.raises(UnsupportedModelError, match=r"ScaledLlama.forward does something after its decoder stack"):
        ds_longseq.enable(model, STREAMBP)
    assert not ds_longseq.is_enabled(model)


def test_subclass_with_the_stock_forward_is_discovered_and_exact():
    """A user subclass that keeps Llama's forward is found from structure and runs exactly (float64)."""

    class MyLlama(transformers.LlamaForCausalLM):
        pass

    stock = make_model("llama", torch.float64)
    model = MyLlama(stock.config).to(torch.float64)
    model.load_state_dict(stock.state_dict())
    adapter = ds_longseq.patch.check_model(model, STREAMBP)
    assert adapter.spec.discovered and adapter.spec.head_kind == "plain"
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    errs = compare(loss_and_grads(ds_longseq.enable(clone(model), STREAMBP), batch), ref)
    assert max(errs.values()) < 1e-10, errs


def _inline_attention(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """Llama attention computed inline (no attention interface): under StreamBP it would see its chunk only."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    groups = q.shape[1] // k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True
    )
    return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


def test_runtime_guard_refuses_inline_attention_at_the_first_forward():
    model = make_model("llama", torch.float32)
    attn = model.model.layers[1].self_attn
    attn.forward = _inline_attention.__get__(attn)  # the class still looks routed: only the guard can tell
    ds_longseq.enable(model, STREAMBP)
    with pytest.raises(NotImplementedError, match=r"LlamaForCausalLM.model.layers\[1\] \(LlamaDecoderLayer\) "
                                                  r"wrote its keys/values through its KV cache's update\(\) 0 times"):
        model(**make_batch())


def test_runtime_guard_refuses_attention_that_skips_the_interface():
    """The cache is updated, but the attention is computed inline on the chunk's keys only."""
    model = make_model("llama", torch.float32)
    attn = model.model.layers[0].self_attn

    def forward(hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        out, _ = _inline_attention(attn, hidden_states, position_embeddings)
        cache = pop_cache(kwargs)  # cache= from transformers 5.24, past_key_values= before
        if cache is not None:  # the chunk's keys go through the cache, the prefix is never read
            cache.update(torch.zeros(1, 1, hidden_states.shape[1], 1), torch.zeros(1, 1, 1, 1), 0)
        return out, None

    attn.forward = forward
    ds_longseq.enable(model, STREAMBP)
    with pytest.raises(NotImplementedError, match=r"layers\[0\].*never called the attention function"):
        model(**make_batch())


def test_layer_positional_arguments_that_cannot_be_named_are_refused():
    """Positional arguments after the hidden states are bound to the layer's parameter names (GPT-2 passes its
    cache so, Gemma 4 its per-layer input); more than the signature names are refused."""
    model = make_model("llama", torch.float32)
    ds_longseq.enable(model, STREAMBP)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 9, 64, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"layers\[0\].*9 positional argument\(s\) after the hidden "
                       r"states, which StreamBP cannot name"):
        layer(hidden, *[None] * 9)


@pytest.mark.parametrize("bad", ["dtype", "shape"])
def test_per_layer_input_streambp_cannot_cut_is_refused(bad):
    """Gemma 4's per-layer input is cut into chunks with the hidden states: one not (B, T, ...) in their dtype
    is refused at the layer, naming it."""
    model = model_zoo.tiny_model("gemma4_text", torch.float64)
    batch = model_zoo.tiny_batch("gemma4_text")

    def hook(module, args, kwargs):
        per_layer = args[1].float() if bad == "dtype" else args[1][:, :1]
        return (args[0], per_layer, *args[2:]), kwargs

    model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    ds_longseq.enable(model, STREAMBP)
    with pytest.raises(NotImplementedError, match=r"layers\[0\] \(Gemma4TextDecoderLayer\) gets per_layer_input of "
                       r"\(2, \d+, 16\) torch.float(32|64), not a \(B, T, ...\)"):
        model(**batch)


def test_mini_seq_mlp_with_extra_arguments_is_refused():
    model = make_model("llama", torch.float32)
    ds_longseq.enable(model, {"mini_seq": {"enabled": True, "mlp_num_chunks": 2}})
    with pytest.raises(NotImplementedError, match=r"LlamaMLP is called with arguments besides its input"):
        model.model.layers[0].mlp(torch.randn(1, 4, 64), torch.ones(1))


def test_discovered_family_refuses_what_is_not_verified_on_it():
    """Approx-BP's norm folding (no fold map) and sequence parallelism (no parity test) on a discovered family."""

    class MyLlama(transformers.LlamaForCausalLM):
        pass

    model = MyLlama(make_model("llama", torch.float32).config)
    with pytest.raises(UnsupportedModelError, match=r"approx_bp.norm='ms_rmsnorm': MyLlama is a family found"):
        ds_longseq.enable(model, {"approx_bp": {"norm": "ms_rmsnorm"}})
    with pytest.raises(UnsupportedModelError, match=r"sequence_parallel on MyLlama: .*found from its structure"):
        ds_longseq.patch.check_model(model, {"sequence_parallel": {"size": 2}, "streambp": {"enabled": True}})
    assert not ds_longseq.is_enabled(model)


class _CumulativeMixer(torch.nn.Module):
    """A token mixer that neither attends through the interface nor carries its state through the cache API."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, hidden_states, **kwargs):
        return self.proj(hidden_states).cumsum(1)


def test_hybrid_layers_are_found_and_unknown_mixers_refused():
    """Qwen3-Next's Gated DeltaNet layers carry their state through the linear-attention cache API: found as the
    recurrent mixer (the sweep checks the family exact); a layer mixing tokens through anything else is refused
    before compute, naming it."""
    config = transformers.Qwen3NextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=101, layer_types=["linear_attention", "full_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    )
    model = transformers.Qwen3NextForCausalLM(config)
    adapter = ds_longseq.patch.check_model(model, STREAMBP)
    first, second = adapter.layers
    assert adapter.spec.mixer_attr == "linear_attn" and adapter.mixer(first) is first.linear_attn
    assert adapter.attention(first) is None and adapter.mixer(second) is None
    model.model.layers[0].linear_attn = _CumulativeMixer(64)
    with pytest.raises(UnsupportedModelError, match=r"layers\[0\] \(Qwen3NextDecoderLayer\) have no attention module, "
                                                    r"no token mixer carrying its state .* not one MLP-like child"):
        ds_longseq.enable(model, STREAMBP)
    # the unknown mixer as the layer's only parameterised child: taken for a token-wise block (NemotronH's MLP
    # blocks), then caught by the first forward's probe, naming the layer
    del model.model.layers[0].mlp
    model.model.layers[0].mlp = lambda hidden_states: hidden_states
    ours = ds_longseq.enable(model, STREAMBP)
    try:
        with pytest.raises(NotImplementedError, match=r"layers\[0\] \(Qwen3NextDecoderLayer, a layer with no token "
                                                      r"mixer\) mixes tokens"):
            ours(input_ids=torch.randint(0, 101, (1, 20)), labels=torch.randint(0, 101, (1, 20))).loss.backward()
    finally:
        ds_longseq.disable(model)


def test_chunked_attention_mask_no_attention_applies_is_refused():
    """A chunked-attention mask (Llama 4) asked of ds_longseq's mask function (which stays 2D) must be applied by
    the attention of some layer (attention.CHUNK_ATTR), else the forward is refused: it is told apart from a
    sliding-window mask of the same size."""
    from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

    from ds_longseq.forwards.attention_interface import longseq_mask, mask_audit

    chunked = chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    with pytest.raises(NotImplementedError, match=r"chunked-attention masks of \[4\] tokens but ds_longseq's attention "
                       r"applied chunks of none"):
        with mask_audit():
            assert longseq_mask(1, 9, 9, mask_function=chunked, attention_mask=torch.ones(1, 9), local_size=4) is None
    window = sliding_window_causal_mask_function(4)
    with pytest.raises(NotImplementedError, match=r"sliding-window masks of \[4\] tokens"):
        with mask_audit():
            assert longseq_mask(1, 9, 9, mask_function=window, attention_mask=torch.ones(1, 9), local_size=4) is None


def test_window_kept_in_the_mask_only_is_refused_after_the_forward():
    """A model that builds a sliding-window mask but never passes sliding_window to the attention (Qwen2-MoE's
    layout) is refused by the mask audit before any loss is returned."""
    import copy

    model = make_model("mistral", torch.float32, sliding_window=6)
    ds_longseq.enable(model, STREAMBP)
    attention_config = copy.copy(model.config)  # what Mistral's attention reads its window from
    attention_config.sliding_window = None  # the masks (built from model.config) keep the window of 6
    for layer in model.model.layers:
        layer.self_attn.config = attention_config
    with pytest.raises(NotImplementedError, match=r"sliding-window masks of \[6\] tokens but its attention modules"):
        model(**make_batch())


def test_hidden_scaling_head_with_a_bias_is_refused():
    """MiniCPM3 divides the hidden states by logits_scaling before its LM head; the chunked head divides the logits
    instead, the same only without a head bias: with one, refused naming why."""
    model = model_zoo.tiny_model("minicpm3", torch.float64)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features, dtype=torch.float64))
    with pytest.raises(UnsupportedModelError, match=r"MiniCPM3ForCausalLM scales the hidden states before an LM "
                       r"head with a bias"):
        ds_longseq.enable(model, STREAMBP)


class _ScaledHead(torch.nn.Linear):
    """An LM head with a learned per-token logit scale (Dory's layout)."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__(head.in_features, head.out_features, bias=False)
        self.weight = head.weight
        self.logit_scale = torch.nn.Parameter(torch.ones(head.out_features))

    def forward(self, hidden_states):
        return super().forward(hidden_states) * self.logit_scale


class _ExtraParameterHead(torch.nn.Linear):
    """The stock forward, with a parameter it does not use: still not what the chunked head computes with."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__(head.in_features, head.out_features, bias=False)
        self.weight = head.weight
        self.temperature = torch.nn.Parameter(torch.ones(()))


@pytest.mark.parametrize("head_cls", [_ScaledHead, _ExtraParameterHead])
@pytest.mark.parametrize("subclass", [False, True], ids=["written", "discovered"])
def test_lm_head_that_is_more_than_a_linear_is_refused(head_cls, subclass):
    """The chunked head computes hidden @ weight.T (+ bias): a head with its own forward or parameters would have
    them silently skipped (a written family, Llama, and a discovered one, a Llama subclass)."""
    model = make_model("llama", torch.float32)
    if subclass:
        model = type("MyLlama", (transformers.LlamaForCausalLM,), {})(model.config)
    model.lm_head = head_cls(model.lm_head)
    with pytest.raises(UnsupportedModelError, match=rf"{head_cls.__name__}.*not a plain torch.nn.Linear|lm_head is "
                       "not a plain torch.nn.Linear"):
        ds_longseq.enable(model, STREAMBP)
    assert not ds_longseq.is_enabled(model)


def test_decoder_one_level_down_and_a_head_of_another_name_are_found():
    """OPT keeps its decoder stack at model.model.decoder and calls it so; BioGPT names its LM head
    output_projection. Both are read from structure and their forwards recognised as the plain head (the sweep
    checks them exact); a forward calling some other submodule of the base model is not."""
    opt = model_zoo.tiny_model("opt", torch.float32)
    adapter = ds_longseq.patch.check_model(opt, STREAMBP)
    assert adapter.spec.decoder_attr == "model.decoder" and adapter.base_model is opt.model.decoder
    assert adapter.layers == list(opt.model.decoder.layers) and adapter.spec.head_kind == "plain"
    assert head_kind(opt) is None  # its forward calls self.model.decoder: not the template without that path
    biogpt = model_zoo.tiny_model("biogpt", torch.float32)
    adapter = ds_longseq.patch.check_model(biogpt, STREAMBP)
    assert adapter.spec.lm_head_attr == "output_projection" and adapter.spec.head_kind == "plain"
    assert head_kind(biogpt, head_attr="lm_head") is None

    class EmbeddingsOnly(transformers.OPTForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model.decoder.embed_tokens(input_ids)
            logits = self.lm_head(hidden)
            return transformers.modeling_outputs.CausalLMOutputWithPast(logits=logits)

    with pytest.raises(UnsupportedModelError, match=r"EmbeddingsOnly.forward does something after its decoder"):
        ds_longseq.enable(EmbeddingsOnly(opt.config), STREAMBP)


def test_stock_masks_that_ignore_position_ids_are_told_apart():
    """transformers separates packed documents only where the decoder gives its mask builders the position ids:
    by keyword (Llama), in a mask_kwargs dict and its copy (Gemma 3), through a variable bound to a builder
    (Mistral), beside an encoder's bidirectional mask (GPT-2); not gpt-oss's or OPT's, nor a forward that builds
    no mask through them."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Model
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssModel
    from transformers.models.llama.modeling_llama import LlamaModel
    from transformers.models.mistral.modeling_mistral import MistralModel
    from transformers.models.opt.modeling_opt import OPTDecoder

    from ds_longseq.families.discovery import masks_see_packed_rows

    for cls in (LlamaModel, Gemma3TextModel, MistralModel, GPT2Model):
        assert masks_see_packed_rows(cls), cls.__name__
    for cls in (GptOssModel, OPTDecoder):
        assert not masks_see_packed_rows(cls), cls.__name__

    class OwnMask(LlamaModel):
        def forward(self, input_ids=None, position_ids=None, **kwargs):
            mask = self._my_mask(input_ids, position_ids)
            return mask

    assert not masks_see_packed_rows(OwnMask)


# --- the families discovery recognised in earlier transformers releases (tests/discovery_record.py) ---------


def test_recorded_families_are_still_recognised():
    """Every family the record for this transformers (its own, else the newest older one) lists is still
    recognised: a transformers release that rewrites code discovery reads fails here, naming each family and
    the reason, instead of only turning the family's sweep result into a refusal. Newly recognised families
    are reported as a warning (write this version's record: python -m tests.discovery_record --write)."""
    import warnings

    record = discovery_record.record_for(transformers.__version__)
    if record is None:
        pytest.skip(f"no record at or below transformers {transformers.__version__} in tests/discovery_records: "
                    f"write one with {discovery_record.COMMAND}")
    key, recorded = record
    outcomes = discovery_record.discover(discovery_record.families(recorded))
    gone = discovery_record.lost(recorded, outcomes)
    assert not gone, discovery_record.describe_lost(gone, key)
    new = discovery_record.recognised_beyond(recorded, outcomes)
    if new:
        warnings.warn(f"discovery recognises families the transformers {key} record does not list: "
                      f"{', '.join(new)} (record them: {discovery_record.COMMAND})", stacklevel=1)


def test_mutation_family_discovery_stops_recognising_is_reported(monkeypatch):
    """Discovery made to miss Llama's attention interface (as a transformers release renaming it would): the
    comparison names llama with the reason discovery now gives, and leaves Mistral (its own attention) alone;
    a recorded model_type transformers no longer has is reported too."""
    from transformers.models.llama.modeling_llama import LlamaAttention

    from ds_longseq.families import discovery

    record = discovery_record.record_for(transformers.__version__)
    assert record is None or {"llama", "mistral"} <= set(record[1]), "the mutation must hit recorded families"
    routes = discovery._routes_through_interface
    monkeypatch.setattr(discovery, "_routes_through_interface", lambda cls: cls is not LlamaAttention and routes(cls))
    families = ["llama", "mistral", "no_such_family"]
    gone = discovery_record.lost(families, discovery_record.discover(families))
    assert list(gone) == ["llama", "no_such_family"], gone
    assert "(LlamaAttention) does not compute through transformers' attention interface" in gone["llama"][0]
    assert "no longer has it as a causal-LM model_type" in gone["no_such_family"][0]
    message = discovery_record.describe_lost(gone, "5.24")
    assert "  llama:\n    - LlamaForCausalLM.model.layers[i].self_attn (LlamaAttention)" in message, message


def test_record_for_takes_the_newest_record_at_or_below(tmp_path):
    """A transformers without its own record is compared with the newest older one (5.25.1 -> 5.24, not 5.26;
    minor versions compared as numbers: 5.9 < 5.10); one older than every record has none."""
    import json

    for key in ("5.9", "5.10", "5.24", "5.26"):
        (tmp_path / f"{key}.json").write_text(json.dumps({"recognised": [f"family_{key}"]}))
    assert discovery_record.record_for("5.25.1", tmp_path) == ("5.24", ["family_5.24"])
    assert discovery_record.record_for("5.24.0", tmp_path) == ("5.24", ["family_5.24"])
    assert discovery_record.record_for("5.11.0.dev0", tmp_path) == ("5.10", ["family_5.10"])
    assert discovery_record.record_for("5.8.2", tmp_path) is None
