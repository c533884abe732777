"""Every causal-LM family transformers ships, in both sweep modes: exact against the stock model, or refused.

A crash or a silent difference fails (``tests/model_sweep.py`` says what "exact" checks and why it holds
at 1e-10). ``docs/SUPPORTED_MODELS.md`` must be what the sweep gives now. The mutation controls break
ds_longseq on purpose and check the sweep notices: a check that cannot fail proves nothing.
"""

import pytest
import torch

import ds_longseq
from ds_longseq.ops.kv_stream import KVStream
from tests import model_sweep, model_zoo

FAMILIES = model_zoo.causal_lm_model_types()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_is_exact_or_refused(model_type):
    """Both modes on the default config, StreamBP on the published-style config (model_zoo.VARIANTS)."""
    results = [model_sweep.cached_check(model_type, mode, variant) for mode, variant in model_sweep.COLUMNS]
    failed = [r for r in results if not r.ok]
    assert not failed, failed


def test_supported_models_doc_is_current():
    """docs/SUPPORTED_MODELS.md is the sweep's table (regenerate: python -m tests.model_sweep --write).

    The table is of one transformers release, the one it names. setup.py admits later ones, whose new
    families the per-family test above still checks (exact or refused); their table is regenerated
    when the suite is run on them and the doc updated."""
    import re

    import transformers

    documented = re.search(r"model_type` of transformers (\S+) ", model_sweep.DOC.read_text()).group(1)
    if documented != transformers.__version__:
        pytest.skip(f"docs/SUPPORTED_MODELS.md is for transformers {documented}, this is "
                    f"{transformers.__version__}: regenerate it with python -m tests.model_sweep --write")
    expected = model_sweep.render_markdown(model_sweep.sweep())
    assert model_sweep.DOC.read_text() == expected, "run: python -m tests.model_sweep --write"


def test_sweep_coverage_target():
    """Issue 27's floor: at least 70 families exact in both modes (the doc test pins the exact list)."""
    results = model_sweep.sweep()
    exact = {r.model_type for r in results if r.outcome == "exact"}
    both = [t for t in exact if all(model_sweep.cached_check(t, m).outcome == "exact" for m in model_sweep.MODES)]
    assert len(both) >= 70, sorted(both)


# --- features the default batch does not reach ---------------------------------------------------------


def _llama4_batch(packed: bool) -> dict:
    """Llama 4 (attention chunks of 8) at 40 tokens: row 0 left-padded by 5 (transformers counts the chunks
    from the first real token, so they do not start at a multiple of 8), or two packed rows of documents
    of 11, 17 and 12 tokens (restarting position_ids: the chunks count from each document's start)."""
    batch = model_zoo.tiny_batch("llama4_text")
    batch["attention_mask"][:] = 1
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in (11, 17, 12)]).expand(2, -1)
    else:
        batch["attention_mask"][0, :5] = 0
        batch["input_ids"][0, :5] = 0
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    if packed:
        del batch["attention_mask"]  # packed rows are told apart by position_ids alone (as transformers does)
        batch["labels"][:, [11, 28]] = -100  # no document predicts the next one's first token (as ds_longseq)
        batch["use_cache"] = False  # with a cache transformers does not look for packed rows
    return batch


@pytest.mark.parametrize("packed", [False, True], ids=["left_padding", "packed"])
def test_llama4_chunked_attention_with_left_padding_and_packing(packed):
    batch = _llama4_batch(packed)
    for mode in model_sweep.MODES:
        result = model_sweep.check_family("llama4_text", mode, batch=batch)
        assert result.outcome == "exact", result


@pytest.mark.parametrize("packed", [False, True], ids=["left_padding", "packed"])
def test_mutation_chunks_counted_from_key_0_are_caught(monkeypatch, packed):
    """Attention chunks counted from the row's key 0 (not its first real token, not each document's first)
    must be a difference."""
    import ds_longseq.ops.chunk_attention as attention  # KeyLimits.query_lo calls it for every attention path
    from ds_longseq.compat import packed_chunks_count_from_documents

    if packed and not packed_chunks_count_from_documents():
        pytest.skip("this transformers counts packed rows' attention chunks from the row's key 0 itself (5.16: no "
                    "per-document positions in its masks), which is what the mutation computes")
    bounds = attention.query_lower_bounds
    monkeypatch.setattr(attention, "query_lower_bounds", lambda *a: bounds(*a[:4], None))
    assert model_sweep.check_family("llama4_text", "streambp", batch=_llama4_batch(packed)).outcome == "different"


def test_unrecorded_router_logits_are_refused():
    """A mixture of experts whose decoder records no router logits (transformers 5.16's Granite-MoE: its stock forward
    fails on the load-balancing loss, so the sweep checks it with the loss off) with output_router_logits set is
    refused at the first forward in both modes, naming the fix, not a crash."""
    import transformers

    model = model_zoo.tiny_model("granitemoe", torch.float64)
    model.config.output_router_logits = True
    batch = model_zoo.tiny_batch("granitemoe")
    if model_sweep._stock_forward_runs(model, batch):
        pytest.skip(f"transformers {transformers.__version__}'s Granite-MoE records its router logits")
    for config in model_sweep.MODES.values():
        ds_longseq.enable(model, config)
        try:
            with pytest.raises(NotImplementedError, match="records no router logits.*output_router_logits=False"):
                model(**batch)
        finally:
            ds_longseq.disable(model)


@pytest.mark.parametrize("model_type", ["gemma2", "vaultgemma"])
def test_softcapped_attention_under_sdpa_is_refused(model_type):
    """Attention logits soft-capped (Gemma 2's attn_logit_softcapping) on a model set to SDPA, which has no softcap
    (transformers 5.16 drops it there; the sweep builds these families eager): refused at enable where ds_longseq's
    attention replaces the model's, naming eager; mini_seq keeps the stock attention and runs."""
    from ds_longseq.compat import set_attn_implementation

    model = model_zoo.tiny_model(model_type, torch.float64)
    set_attn_implementation(model.config, "sdpa")  # past 5.24's check: its Gemma 2 takes no SDPA
    with pytest.raises(ds_longseq.UnsupportedModelError, match="sdpa.*attn_logit_softcapping.*"
                                                                "attn_implementation='eager'"):
        ds_longseq.patch.check_model(model, model_sweep.MODES["streambp"])
    ds_longseq.patch.check_model(model, model_sweep.MODES["mini_seq"])


def test_mutation_dropped_attention_chunks_are_caught(monkeypatch):
    """Llama 4 attending across its attention chunks must not pass (refused by the mask audit, or different)."""
    from ds_longseq.families.decoder import DecoderLMAdapter

    monkeypatch.setattr(DecoderLMAdapter, "attention_chunks", lambda self: [])
    assert model_sweep.check_family("llama4_text", "streambp").outcome == "refused"


def test_mutation_unreplayed_dropout_is_caught(monkeypatch):
    """GPT-2's published config (dropout 0.1 on embeddings, attention probabilities, residuals) with the chunk
    re-forwards drawing fresh masks (no replayed regions) must be a difference against the mask-replay reference."""
    assert model_sweep.check_family("gpt2", "streambp", variant="published").outcome == "exact"
    monkeypatch.setattr("ds_longseq.forwards.streambp_layer.replay_draws", lambda *a, **k: None)
    assert model_sweep.check_family("gpt2", "streambp", variant="published").outcome == "different"


# RoPE scalings users extend context with, each with its scaling length (16) below the test length (40), so
# dynamic NTK rescales and LongRoPE takes its long factors; Llama's rotary embedding holds 8 frequencies.
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                 "long_factor": [1.0 + i for i in range(8)], "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


_TINY_CONFIG = model_zoo.tiny_config


def _with_rope(monkeypatch, scaling: dict | None):
    def scaled(model_type, variant="default"):
        config = _TINY_CONFIG(model_type, variant)
        if scaling is not None:
            config.rope_parameters = {**config.rope_parameters, **scaling}
            # dynamic NTK rescales past max_position_embeddings, the others take it as the extended length
            config.max_position_embeddings = 16 if scaling["rope_type"] == "dynamic" else 64
        return config

    monkeypatch.setattr(model_zoo, "tiny_config", scaled)


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_rope_scalings_are_exact(monkeypatch, kind):
    """Each RoPE scaling is exact in both modes, and changes the model (so the check bites)."""
    _with_rope(monkeypatch, ROPE_SCALINGS[kind])
    for mode in model_sweep.MODES:
        result = model_sweep.check_family("llama", mode)
        assert result.outcome == "exact", result
    batch = model_zoo.tiny_batch("llama")
    with torch.no_grad():
        scaled = model_zoo.tiny_model("llama")(**batch).loss
        _with_rope(monkeypatch, None)
        plain = model_zoo.tiny_model("llama")(**batch).loss
    assert not torch.isclose(scaled, plain, rtol=1e-6), kind


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_under_sequence_parallelism(monkeypatch, kind):
    """Dynamic NTK and LongRoPE pick frequencies from the largest position a forward sees: a rank's shard is
    not the whole sequence, so sequence parallelism is refused before anything runs."""
    import ds_longseq
    from ds_longseq import UnsupportedModelError

    _with_rope(monkeypatch, ROPE_SCALINGS[kind])
    model = model_zoo.tiny_model("llama")
    with pytest.raises(UnsupportedModelError, match=rf"rope_type='{kind}'.*each rank sees only its shard"):
        ds_longseq.patch.check_model(model, {"sequence_parallel": {"size": 2}, "streambp": {"enabled": True}})
    _with_rope(monkeypatch, ROPE_SCALINGS["yarn"])  # a static scaling is not
    ds_longseq.patch.check_model(model_zoo.tiny_model("llama"), {"sequence_parallel": {"size": 2},
                                                                 "streambp": {"enabled": True}})


def test_layers_that_attend_their_cached_keys_keep_the_prefix_mode(monkeypatch):
    """Only layers that attend something other than what they cache (MLA) switch to whole-cache mode, which
    copies the prefix every chunk; the others attend the prefix in place."""
    def refuse(self):
        raise AssertionError("whole-cache mode asked for")

    monkeypatch.setattr(KVStream, "prefer_concat", refuse)
    for family in ("llama", "gemma2", "gpt_oss", "llama4_text"):
        assert model_sweep.check_family(family, "streambp").outcome == "exact", family


def test_mutation_dropped_latent_prefix_gradient_is_caught(monkeypatch):
    """DeepSeek-V3 (whole-cache mode: the cached latent is expanded by the layer) without the gradient that
    reaches the prefix's latent through the layer's own code must be a difference."""
    from ds_longseq.ops.chunk_grads import ChunkGrads

    backward = ChunkGrads.backward

    def dropped(self, *args, extra=(), **kwargs):
        backward(self, *args, extra=extra, **kwargs)
        return (None,) * len(extra)

    monkeypatch.setattr(ChunkGrads, "backward", dropped)
    assert model_sweep.check_family("deepseek_v3", "streambp").outcome == "different"


# --- mutation controls: each breaks one exactness ingredient, on a family the sweep runs exactly --------


def test_mutation_dropped_prefix_keys_is_caught(monkeypatch):
    """StreamBP's chunks attending only their own keys (no prefix) must be reported as a difference."""
    monkeypatch.setattr(KVStream, "prefix", lambda self: (None, None))
    assert model_sweep.check_family("llama", "streambp").outcome == "different"


def test_mutation_skipped_router_aux_loss_is_caught(monkeypatch):
    """A mixture of experts without its load-balancing term must be reported as a difference."""
    monkeypatch.setattr("ds_longseq.forwards.causal_lm.router_aux_loss_wanted", lambda *args: False)
    assert model_sweep.check_family("mixtral", "streambp").outcome == "different"


def test_mutation_dropped_attention_sinks_is_caught(monkeypatch):
    """gpt-oss without its attention sinks (s_aux) must be reported as a difference."""
    import ds_longseq.ops.chunk_attention as attention

    monkeypatch.setattr(attention, "with_sink_logits", lambda out, lse, sinks: (out, lse))
    assert model_sweep.check_family("gpt_oss", "streambp").outcome == "different"


def test_mutation_stock_fallback_is_caught(monkeypatch):
    """A layer that quietly runs its stock forward instead of the chunked one is not exact."""
    from ds_longseq.forwards.streambp_layer import StreamBPLayerForward

    monkeypatch.setattr(StreamBPLayerForward, "__call__", lambda self, *a, **k: self.orig_forward(*a, **k))
    result = model_sweep.check_family("llama", "streambp")
    assert result.outcome == "different" and "chunked path ran on 0" in result.detail, result


def test_float64_context_restores_torch():
    """The full-float64 patch is undone on exit (later tests see stock torch)."""
    x = torch.ones(2, dtype=torch.float64)
    with model_sweep.full_float64():
        assert x.float().dtype == torch.float64 and x.to(torch.float32).dtype == torch.float64
    assert x.float().dtype == torch.float32 and x.to(torch.float32).dtype == torch.float32


def test_mutation_detached_per_layer_inputs_are_caught(monkeypatch):
    """Gemma 4's per-layer inputs ride through StreamBP with the hidden states; cut off from their gradient (the
    per-layer embedding and projection then learn nothing) it must be reported as a difference."""
    from ds_longseq.forwards.streambp_layer import _TokenInputs

    split = _TokenInputs.split

    def detached(self, x_c):
        hidden, extra = split(self, x_c)
        return hidden, {key: value.detach() for key, value in extra.items()}

    monkeypatch.setattr(_TokenInputs, "split", detached)
    assert model_sweep.check_family("gemma4_text", "streambp").outcome == "different"


def test_mutation_shared_kv_gradient_not_sent_back_is_caught(monkeypatch):
    """Gemma 4's last layers attend an earlier layer's keys/values; if their gradient never reaches the producing
    layer (its K/V projections then learn only from its own queries) it must be reported as a difference."""
    from ds_longseq.ops.kv_stream import SharedKV

    def fresh(self):  # each consumer gets its own zeros, which the producer never sees
        return (torch.zeros(self.k.shape, dtype=self.k.dtype), torch.zeros(self.v.shape, dtype=self.v.dtype))

    monkeypatch.setattr(SharedKV, "grad_buffers", fresh)
    result = model_sweep.check_family("gemma4_text", "streambp")
    assert result.outcome == "different" and "layers.0.self_attn." in result.detail, result


def test_gemma3n_stacked_streams_are_cut_on_their_token_dim():
    """Gemma 3n's layers take their AltUp streams stacked, (S, B, T, d): StreamBP cuts dim 2 (the sweep checks the
    result exact); the streams are found from the config, and a layer handed (B, T, d) then is refused, naming it."""
    from ds_longseq.families.decoder import decoder_adapter

    model = model_zoo.tiny_model("gemma3n_text", torch.float64)
    assert decoder_adapter(model).stacked_streams() == model.config.altup_num_inputs == 4
    assert decoder_adapter(model_zoo.tiny_model("gemma4_text", torch.float64)).stacked_streams() is None
    assert model_sweep.cached_check("gemma3n_text", "streambp").outcome == "exact"
    ds_longseq.enable(model, model_sweep.MODES["streambp"])
    try:
        layer = model.model.layers[1]
        with pytest.raises(NotImplementedError, match=r"layers\[1\].*\(2, 40, 64\), not \(S=4, B, T, d\)"):
            layer(torch.zeros(2, 40, 64, dtype=torch.float64), attention_mask=torch.ones(2, 40, dtype=torch.long))
    finally:
        ds_longseq.disable(model)


def test_mutation_streams_swapped_between_chunks_are_caught(monkeypatch):
    """Stacked streams packed side by side per token must come back in their own order; a chunk output packed
    with two streams swapped must be reported as a difference."""
    from ds_longseq.forwards.streambp_layer import _TokenInputs

    pack = _TokenInputs.pack_output

    def swapped(self, out_c):
        return pack(self, out_c[[1, 0, *range(2, out_c.shape[0])]] if out_c.dim() == 4 else out_c)

    monkeypatch.setattr(_TokenInputs, "pack_output", swapped)
    assert model_sweep.check_family("gemma3n_text", "streambp").outcome == "different"
