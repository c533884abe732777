"""Tiny, randomly initialised instances of every causal-LM ``model_type`` the installed transformers ships.

Holds:
    causal_lm_model_types: every ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, sorted.
    tiny_config: a family's default config shrunk to a width of 64 with every layer kind it mixes present once,
        its features (sliding windows, chunked attention, KV sharing, RoPE scaling) biting at 40 tokens.
    tiny_model: the stock causal LM built from :func:`tiny_config`, re-initialised so attention is peaked.
    untrained_model: the same as transformers initialises it, never run: for reading structure (discovery).
    tiny_batch: input_ids, attention_mask and labels for a family, with padding and masked prompt tokens.
    OVERRIDES: the per-family config kwargs the field-name driven shrinking cannot work out, each with why.
    UNBUILDABLE: the families whose tiny model cannot be built or run in float64 on CPU, each with why.

The shrinking is driven by field names (``hidden_size``/``n_embd``/``d_model`` ... -> 64, every dropout -> 0,
every sliding window -> 6) and applied to every sub-config (a vision tower of a multimodal causal LM is
built too, so it must be tiny as well). Per-layer lists (``layer_types``, ``mlp_layer_types``,
``no_rope_layers`` ...) and layer-index lists (``mlp_only_layers``, ``attn_layer_indices`` ...) are read on
the full-size default config: the tiny config keeps the first layer of each distinct combination of them, in
order, so every layer kind the family mixes appears once with as few layers as possible.
"""

from __future__ import annotations

import copy
import re

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = [
    "OVERRIDES",
    "UNBUILDABLE",
    "VOCAB",
    "causal_lm_model_types",
    "tiny_batch",
    "tiny_config",
    "tiny_model",
    "untrained_model",
]

VOCAB = 101
"""The vocabulary size of every tiny model (every family accepts it)."""

# --- generic, field-name driven shrinking ------------------------------------------------------------------

_WIDTH = 64
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 16
_FFN = 96
_EXPERT_FFN = 32
_EXPERTS = 4
_TOP_K = 2
_WINDOW = 6  # every sliding window: well inside the 40-token test sequence
_MAX_POSITIONS = 512

# field -> size; applied where the default is a positive int (0 / None mean "off" and stay so)
_SIZES = {
    **dict.fromkeys(
        ("hidden_size", "n_embd", "d_model", "emb_dim", "embedding_dim", "word_embed_proj_dim",
         "hidden_size_global", "backbone_hidden_size"),
        _WIDTH,
    ),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
         "encoder_attention_heads", "attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
         "swa_num_attention_heads"),
        _HEADS,
    ),
    **dict.fromkeys(
        ("head_dim", "attention_head_dim", "kv_channels", "d_head", "dim_head", "d_kv", "attention_head_size",
         "swa_head_dim", "global_head_dim"),
        _HEAD_DIM,
    ),
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "n_inner", "dff", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim",
         "ffn_hidden_size", "intermediate_size_mlp", "dim_ff", "d_inner", "dense_intermediate_size",
         "prefix_dense_intermediate_size", "feed_forward_size", "mlp_dim"),
        _FFN,
    ),
    **dict.fromkeys(
        ("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
         "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size", "shared_intermediate_size"),
        _EXPERT_FFN,
    ),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), _EXPERTS),
    "zero_expert_num": 2,  # LongCat-Flash's identity experts (256 next to 512 routed ones)
    # expert groups (DeepSeek-V3-style group-limited routing): 2 groups of 2 experts, the best 1 group kept
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    "topk_group": 1,
    # MLA: small ranks, and a query/key head (16 + 8) wider than the value head (16) as in the real models
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "o_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 24,
    # sparse-attention indexers (DSA): a key budget below the sequence length so the selection bites
    **dict.fromkeys(("index_head_dim", "indexer_head_dim"), _HEAD_DIM),
    **dict.fromkeys(("index_n_heads", "indexer_n_heads"), 2),
    "index_topk": 8,
    # state-space / linear-attention mixers: 8 heads of 16 = expand (2) x width
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), _HEAD_DIM),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    "mamba_d_ssm": 128,
    # factorised / side embeddings and other small widths (ELECTRA, RemBERT, RoCBert, Zaya's router, ...)
    **dict.fromkeys(("embedding_size", "input_embedding_size", "pronunciation_embed_dim", "shape_embed_dim",
                     "router_hidden_size", "prompt_mid_dim"), 32),
    **dict.fromkeys(("output_embedding_size", "ext_pw_out_channel", "depthwise_separable_out_channel",
                     "nemo_conv_channels"), _WIDTH),
    "adapter_rank": 8,
    "dim_model_base": 8,  # MiniCPM: logits scaled by dim_model_base / hidden_size (256 / 2560 in MiniCPM3-4B)
    # attention features that must bite at 40 tokens
    "attention_chunk_size": 8,  # Llama 4's chunked attention layers
    "floor_scale": 4,  # Llama 4's attention temperature tuning: log1p(floor((pos + 1) / floor_scale))
    "local_attention": 2 * _WINDOW,  # ModernBERT-decoder derives sliding_window = local_attention // 2
    "hidden_size_per_layer_input": 16,  # Gemma 3n / 4 per-layer embeddings
    "laurel_rank": 8,
    "hc_lowrank": 16,
    "ple_embed_dim": 32,
    "rotary_dim": 8,  # GPT-J / CodeGen: partial rotary (8 of 16), as the real models rotate 64 of 256
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 8),
    **dict.fromkeys(("chunk_size", "mamba_chunk_size"), 16),  # the chunked scan runs 3 (uneven) chunks
    **dict.fromkeys(("linear_num_key_heads", "indexer_kv_heads"), 2),
    **dict.fromkeys(("linear_num_value_heads", "linear_num_heads"), _HEADS),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), _HEAD_DIM),
    # vision / audio towers that come with a multimodal causal LM: built, never run, so just small
    **dict.fromkeys(("out_hidden_size", "projector_input_dim", "projector_output_dim", "vision_output_dim",
                     "adapter_in_dim", "adapter_out_dim", "adapter_input_size"), _WIDTH),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
                     "max_source_positions", "context_length", "model_max_length"), _MAX_POSITIONS),
}
_KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "swa_num_key_value_heads", "num_query_groups")
_DERIVED_WHEN_NONE = {"head_dim": _HEAD_DIM, "num_key_value_heads": _KV_HEADS}
_TOP_K_FIELDS = ("num_experts_per_tok", "moe_top_k", "moe_k", "moe_topk", "top_k_experts", "num_experts_per_token")
_SHARED_EXPERT_FIELDS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers")
# other stacks (encoders of encoder-decoders, towers): 2 layers, no kinds to keep
_OTHER_LAYER_FIELDS = ("encoder_layers", "num_encoder_layers", "num_blocks", "conf_num_hidden_layers", "depth")
_VOCAB_FIELDS = re.compile(r"vocab_size$|^vocab_size_per_layer_input$|^vocab_offset$|^encoder_hash_byte_group_vocab$")
_WINDOW_FIELDS = ("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
                  "window_size", "keep_window_size")
_DROPOUT_FIELDS = re.compile(r"dropout|pdrop|drop_path|layerdrop|_drop$")
_JITTER_FIELDS = ("router_jitter_noise", "input_jitter_noise", "moe_jitter_eps", "jitter_noise")
_TOKEN_FIELDS = re.compile(r"^(pad|bos|eos|unk|sep|cls|mask|decoder_start|forced_eos|forced_bos|eod)_token_id$")
_INDEX_LIST_NAME = re.compile(r"layers$|layer_ids$|idxs$|indices$|indexes$")


def causal_lm_model_types() -> list[str]:
    """Every causal-LM ``model_type`` of the installed transformers, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _num_layers_field(d: dict) -> str | None:
    for name in _LAYER_FIELDS:
        if isinstance(d.get(name), int) and d[name] > 0:
            return name
    return None


def _layer_plan(d: dict, layers_field: str, values: dict) -> tuple[list[int], dict]:
    """The layers to keep (indices into the default's) and the per-layer fields re-indexed to them.

    A field is per-layer when it is a list as long as the layer count, a layer-index list when it is a list of
    layer indices named like one (``mlp_only_layers``, ``attn_layer_indices`` ...). A layer's kind is its values
    in all of them: the first layer of each kind is kept, in order, and at least 2 layers. Kinds are read on
    ``d`` (the full-size default), the kept layers' values taken from ``values`` (the shrunk fields).
    """
    n = d[layers_field]
    per_layer, index_lists = {}, {}
    for key, value in d.items():
        if not isinstance(value, list) or not value:
            continue
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        indexish = ints and _INDEX_LIST_NAME.search(key) and all(0 <= v < n for v in value)
        if indexish and (len(value) != n or sorted(value) == list(range(n))):
            index_lists[key] = set(value)
        elif len(value) == n and n > 1:
            per_layer[key] = value
    overrides = d.get("per_layer_config") or {}
    overrides = {int(k): v for k, v in overrides.items()} if isinstance(overrides, dict) else {}
    formula = {"per_layer_config": lambda i: repr(sorted(overrides.get(i, {}).items()))}
    if isinstance(d.get("first_k_dense_replace"), int):
        formula["first_k_dense_replace"] = lambda i: i < d["first_k_dense_replace"]
    if isinstance(d.get("num_dense_layers"), int):
        formula["num_dense_layers"] = lambda i: i < d["num_dense_layers"]
    if isinstance(d.get("num_kv_shared_layers"), int):  # the last k layers reuse earlier layers' keys/values
        formula["num_kv_shared_layers"] = lambda i: i >= n - d["num_kv_shared_layers"]
    kinds, keep = set(), []
    for i in range(n):
        kind = tuple(repr(v[i]) for v in per_layer.values())
        kind += tuple(i in v for v in index_lists.values())
        kind += tuple(f(i) for f in formula.values())
        if kind not in kinds:
            kinds.add(kind)
            keep.append(i)
    for i in range(n):  # at least two layers (layer-to-layer plumbing runs once)
        if len(keep) >= 2:
            break
        if i not in keep:
            keep.append(i)
    keep.sort()
    out = {layers_field: len(keep)}
    for key, value in per_layer.items():
        shrunk = values.get(key, value)
        out[key] = [(shrunk if len(shrunk) == n else value)[i] for i in keep]
    for key, members in index_lists.items():
        out[key] = [j for j, i in enumerate(keep) if i in members]
    for key, kind_of in formula.items():
        if key != "per_layer_config":
            out[key] = sum(1 for i in keep if kind_of(i))
    return keep, out


def _scale_sections(sections: list[int], total: int) -> list[int]:
    """Integer sections (M-RoPE) rescaled to sum to ``total``, each at least 1 while that fits."""
    old = sum(sections)
    new = [max(1, int(s * total / old)) for s in sections]
    while sum(new) > total:
        new[new.index(max(new))] -= 1
    while sum(new) < total:
        new[0] += 1
    return new


def _shrink_rope(rope: dict, rotary_half: int) -> dict:
    """Rope parameters at the tiny size: a scaled RoPE's original length below the 40-token sequence."""
    rope = copy.deepcopy(rope)
    if not isinstance(rope, dict):
        return rope
    if all(isinstance(v, dict) for v in rope.values()) and rope:  # per layer type (Gemma 3, ...)
        return {k: _shrink_rope(v, rotary_half) for k, v in rope.items()}
    if rope.get("rope_type", "default") != "default":
        for key in ("original_max_position_embeddings",):
            if isinstance(rope.get(key), int):
                rope[key] = 16
        if isinstance(rope.get("max_position_embeddings"), int):
            rope["max_position_embeddings"] = _MAX_POSITIONS
    for key in ("short_factor", "long_factor"):  # LongRoPE: one factor per rotary frequency
        if isinstance(rope.get(key), list):
            old = rope[key]
            rope[key] = [old[i * len(old) // rotary_half] for i in range(rotary_half)]
    if isinstance(rope.get("mrope_section"), list):
        rope["mrope_section"] = _scale_sections(rope["mrope_section"], rotary_half)
    return rope


def _shrink(d: dict, published: bool = False) -> dict:
    """The field-name driven shrinking of one config level (a dict from ``to_dict``), sub-configs not included.
    ``published``: windows and their switch, and dropouts, stay as the default has them (see :func:`tiny_config`)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, bool) or isinstance(value, dict):
            continue
        if key in _SIZES and isinstance(value, int) and value > 0:
            out[key] = _SIZES[key]
        elif key in _SIZES and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            # per-layer sizes (Gemma 3n's intermediate_size): scaled, the largest to the tiny size
            out[key] = [max(1, round(_SIZES[key] * v / max(value))) if v > 0 else v for v in value]
        elif key in _DERIVED_WHEN_NONE and value is None:
            # None is "derive it" in most families, but some read the field as is (Ministral, Nemotron)
            out[key] = _DERIVED_WHEN_NONE[key]
        elif key in _KV_HEAD_FIELDS and isinstance(value, int) and value > 1:
            out[key] = _KV_HEADS  # multi-query (1) stays multi-query
        elif key in _TOP_K_FIELDS and isinstance(value, int) and value > 0:
            out[key] = min(value, _TOP_K)
        elif key in _SHARED_EXPERT_FIELDS and isinstance(value, int) and value > 1:
            out[key] = 1
        elif _VOCAB_FIELDS.search(key) and isinstance(value, int) and value > VOCAB:
            out[key] = VOCAB
        elif key in _WINDOW_FIELDS and (value is None or isinstance(value, int)) and not published:
            out[key] = _WINDOW
        elif _DROPOUT_FIELDS.search(key) and isinstance(value, float) and not published:
            out[key] = 0.0
        elif key in _JITTER_FIELDS and isinstance(value, float):
            out[key] = 0.0
    for key in _LAYER_FIELDS + _OTHER_LAYER_FIELDS:
        if isinstance(d.get(key), int) and not isinstance(d[key], bool) and d[key] > 2:
            out[key] = 2
    if "use_sliding_window" in d and not published:
        out["use_sliding_window"] = True
    if d.get("is_decoder") is False:  # BertLMHeadModel & co. attend bidirectionally unless told they decode
        out["is_decoder"] = True
    return out


def _fix_tokens(d: dict, out: dict, vocab: int) -> None:
    """Special token ids the tiny vocabulary does not hold -> 0 (pad), 1 (bos), 2 (eos and the rest)."""
    fallback = {"pad_token_id": 0, "bos_token_id": 1}
    for key, value in d.items():
        if not _TOKEN_FIELDS.match(key):
            continue
        if isinstance(value, int) and value >= vocab:
            out[key] = fallback.get(key, 2)
        elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
            out[key] = [v if v < vocab else 2 for v in value]


def _tiny_dict(config, published: bool = False) -> dict:
    """The kwargs shrinking one config level and, recursively, its sub-configs.

    Attributes a config derives in ``__post_init__`` come back from ``to_dict`` and are passed again, so
    they are given values consistent with the tiny sizes (MLA's ``head_dim`` is its ``qk_rope_head_dim``).
    """
    d = config.to_dict()
    out = _shrink(d, published)
    if isinstance(d.get("kv_lora_rank"), int):  # MLA: one latent for all heads, no GQA
        if "num_key_value_heads" in d:
            out["num_key_value_heads"] = out.get("num_attention_heads", _HEADS)
        if "head_dim" in d:
            out["head_dim"] = _SIZES["qk_rope_head_dim"]
    experts = [out.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")]
    if any(experts):  # a top-k of None (DeepSeek-V2's default) cannot route
        for key in _TOP_K_FIELDS:
            if key in d and d[key] is None:
                out[key] = _TOP_K
    layers_field = _num_layers_field(d)
    keep: list[int] = []
    if layers_field is not None:
        # the sliding-window switch off by default (Qwen2/3, SmolLM3 ...): read the kinds with it on (and half
        # the layers past max_window_layers)
        reference = d
        if d.get("use_sliding_window") is False and not published:
            switched = {"use_sliding_window": True, "sliding_window": _WINDOW, "layer_types": None}
            if "max_window_layers" in d:
                switched["max_window_layers"] = d[layers_field] // 2
                out["max_window_layers"] = 1
            reference = type(config)(**{**_plain(d), **switched}).to_dict()
        keep, plan = _layer_plan(reference, layers_field, {**reference, **out})
        out.update(plan)
        for alias in _LAYER_FIELDS:  # a second layer count (an alias some configs also store) agrees
            if alias != layers_field and isinstance(d.get(alias), int) and d[alias] > 0:
                out[alias] = plan[layers_field]
    vocab = out.get("vocab_size", d.get("vocab_size"))
    if isinstance(vocab, int):
        _fix_tokens(d, out, vocab)
    rope = d.get("rope_parameters")
    if isinstance(rope, dict):
        out["rope_parameters"] = _shrink_rope(rope, _rotary_half(d, out))
    per_layer = d.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer and layers_field is not None:
        out["per_layer_config"] = _shrink_per_layer(d, out, per_layer, keep)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, transformers.PretrainedConfig):
            out[name] = {**_plain(sub.to_dict()), **_tiny_dict(sub, published)}
    return out


def _shrink_per_layer(d: dict, tiny: dict, per_layer: dict, keep: list[int]) -> dict:
    """A heterogeneous config's per-layer overrides on the kept layers, each scaled like the global value.

    A layer whose head_dim is 512 where the rest have 256 gets 32 where the rest have 16: the tiny model keeps
    the heterogeneity, at the tiny size.
    """
    tiny_global = {**d, **tiny}
    out = {}
    for new_index, old_index in enumerate(keep):
        layer = {int(k): v for k, v in per_layer.items()}.get(old_index)
        if not layer:
            continue
        scaled = {}
        for key, value in layer.items():
            old, tiny = d.get(key), tiny_global.get(key)
            if isinstance(value, int) and isinstance(old, int) and isinstance(tiny, int) and old > 0:
                scaled[key] = max(1, round(value * tiny / old))
            else:
                scaled[key] = value
        out[new_index] = scaled
    return out


def _rotary_half(d: dict, out: dict) -> int:
    """Half the rotary dimension of the tiny config (the number of RoPE frequencies)."""
    merged = {**d, **out}
    # MLA rotates only its qk_rope_head_dim slice
    head_dim = merged.get("qk_rope_head_dim") or merged.get("head_dim") or _WIDTH // (
        merged.get("num_attention_heads") or _HEADS)
    factor = (merged.get("rope_parameters") or {}).get("partial_rotary_factor") or merged.get(
        "partial_rotary_factor", 1.0)
    return max(1, int(head_dim * factor) // 2)


def _plain(d: dict) -> dict:
    """A ``to_dict`` without the bookkeeping keys a config constructor does not take back (transformers 5.16's DBRX
    sub-configs reject their own ``output_attentions``: ``DbrxConfig(**DbrxConfig().to_dict())`` raises there)."""
    drop = {"transformers_version", "architectures", "_name_or_path", "id2label", "label2id", "dtype",
            "output_hidden_states", "output_attentions", "return_dict", "problem_type", "chunk_size_feed_forward"}
    return {k: v for k, v in d.items() if k not in drop}


# --- per-family adjustments --------------------------------------------------------------------------------

_QWEN4_EXP_TEXT = {
    # the default leaves the QSA indexer unset (None) while its full-attention layers are indexed ones: a small
    # indexer with a 16-token budget in blocks of 4, so the selection bites at 40 tokens
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}
OVERRIDES: dict[str, dict] = {
    # Falcon-H1's multipliers are all 1.0 by default; its checkpoints scale the LM head, the embeddings, the
    # attention and the SSM (e.g. lm_head_multiplier 0.0390625 in Falcon-H1-0.5B): values that bite
    "falcon_h1": {"lm_head_multiplier": 0.6, "embedding_multiplier": 1.7, "mlp_multipliers": [0.9, 1.3],
                  "key_multiplier": 0.8, "attention_out_multiplier": 1.2, "attention_in_multiplier": 0.9,
                  "ssm_multipliers": [1.1, 0.9, 1.2, 0.8, 1.05], "ssm_in_multiplier": 1.1, "ssm_out_multiplier": 0.95},
    # no attention layer by default (attn_layer_indices None, a pure Mamba-2 stack); Bamba-9B has some
    "bamba": {"attn_layer_indices": [1]},
    # layer kinds come from periods: Mamba+dense, Mamba+MoE and attention+dense (the three the default mixes)
    "jamba": {"num_hidden_layers": 3, "attn_layer_period": 3, "attn_layer_offset": 2, "expert_layer_period": 2,
              "expert_layer_offset": 1},
    # the default is all Mamba layers; the Granite-4.0-H checkpoints mix attention layers in
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # block_types is a pattern cycled over the layers: 2 layers of the default pattern would have no attention
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Mamba-2 calls its SSM heads num_heads: 8 heads of 16 = expand (2) x 64
    "mamba2": {"num_heads": 8},
    # 4 key heads (2 value heads each) so sequence parallelism of 2 and 4 shards the Gated DeltaNet by heads
    # (tests/test_hybrids.py); Qwen3-Next-80B: 16 key heads, 2 value heads each
    "qwen3_next": {"linear_num_key_heads": 4, "linear_num_value_heads": 8},
    "olmo_hybrid": {"linear_num_key_heads": 4, "linear_num_value_heads": 8},
    # the default makes every layer attention (full_attn_idxs None = all); LFM2 mixes short-conv layers in
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    # the default has layer_types None (unbuildable); LFM2-8B-A1B: dense conv layers first, MoE conv and
    # attention layers after
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "conv", "full_attention"], "num_dense_layers": 1},
    # the default has no RoPE parameters (unbuildable); North models: RoPE on sliding layers, NoPE full layers
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": None},
    },
    "qwen4_exp_text": _QWEN4_EXP_TEXT,
    "qwen4_exp": {"text_config": _QWEN4_EXP_TEXT},
    # one shared attention block reused by every hybrid layer: with a single hybrid layer its weight tying
    # finds nothing to tie and the build fails, so two hybrid layers after a Mamba one
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["mamba", "hybrid", "hybrid"]},
    # the same: the shared attention block (with one adapter per hybrid layer) reused by two hybrid layers
    "zamba2": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
               "hybrid_layer_ids": [1, 2]},
    # with a cache its forward copies the recurrent states into it in place, which breaks backward (and its
    # cached path assumes query/key heads as wide as value heads): a training forward needs no cache
    "xlstm": {"use_cache": False},
    # BigBird's block-sparse attention is bidirectional with random blocks, so a decoder runs full attention
    # (and below (5 + 2 x 3) x block_size = 704 tokens the model switches to it anyway)
    "big_bird": {"attention_type": "original_full"},
    # XLM's LM head attends bidirectionally unless causal
    "xlm": {"causal": True},
    # lightning attention in blocks of 16, so the 40 tokens span intra- and inter-block paths (default 256)
    "minimax": {"block_size": 16},
    # the default has neither sparse-attention nor dense-MLP layers (MiniMax-M3 mixes both in): one of each
    # kind, with index blocks of 8 tokens, the top 2 blocks kept
    "minimax_m3_vl_text": {"layer_types": ["full_attention", "minimax_m3_sparse"],
                           "mlp_layer_types": ["dense", "sparse"],
                           "index_block_size": 8, "index_topk_blocks": 2, "index_local_blocks": 1},
    # layer 0 has no attention norm (an Identity): the kinds are full (layer 0), sliding, full with a norm
    "modernbert-decoder": {"num_hidden_layers": 3,
                           "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
    # Dory: input layers, a recurrent block run n_recurrent_loops times, output layers; one of each, so the
    # recurrent layer runs twice in one forward (its per-layer counts must add up to num_hidden_layers)
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # Gemma 4 with every layer feature its checkpoints use: per-layer inputs (the default), the last 2 layers
    # reusing the K/V of the last earlier layer of their type (E2B/E4B), an MoE block beside each dense MLP
    # (26B-A4B), values equal to keys on full layers and those layers' wider heads (31B)
    "gemma4_text": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                    "per_layer_config": {1: {"head_dim": 32}, 3: {"head_dim": 32}}, "num_kv_shared_layers": 2,
                    "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16,
                    "attention_k_eq_v": True},
    # X-MOD routes through per-language adapters and refuses to run without a language
    "xmod": {"default_language": "en_XX"},
    # the default fails its own validation (an assistant has no per-layer inputs)
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # the default leaves the experts unset (None: unbuildable); dots.llm1: a dense first layer, routed experts
    # and shared ones after
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1},
    # the default's attention config has no rope_theta (unbuildable); DBRX-132B: 8 KV heads for 48 query
    # heads (GQA) and 4 of 16 experts, where the default has 1 KV head and top-1
    # clip_qkv None crashes (clamp(None, None)): DBRX-132B clips at 8, here 2 so the clipping bites
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 2.0}, "ffn_config": {"moe_top_k": 2}},
    # dots3: the sliding layers are plain attention whose head_dim must be the MLA query/key head (16 + 8)
    # of their per-layer config (qk_nope 24 there, scaled like the default's 192 against 128)
    "dots3_note_text": {"head_dim": 32},
    "dots3_note": {"text_config": {"head_dim": 32}},
    # its forward builds a cache from the top config, which has no num_hidden_layers (a stock bug): a
    # training forward needs no cache
    "blt": {"use_cache": False},
    # Reformer: axial position embeddings factor the (training) sequence length, 40 = 8 x 5, their widths
    # sum to the hidden size; chunks of 8 so local attention spans chunks; seeded hashing (deterministic)
    "reformer": {"is_decoder": True, "axial_pos_shape": [8, 5], "axial_pos_embds_dim": [32, 32],
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "num_buckets": 4, "hash_seed": 0},
}
"""model_type -> config kwargs applied last (after the generic shrinking), each with why. A dict under a
sub-config's name (``text_config``) is merged into that sub-config's kwargs."""

UNBUILDABLE: dict[str, str] = {
    "gemma3n": "its vision tower is a timm model (TimmWrapperModel): needs the timm library, not installed "
               "(gemma3n_text is the same decoder)",
    "git": "image captioner: the loss skips the image-token positions that come first (needs pixel_values)",
    "musicgen": "audio-codebook LM: input_ids are (batch x num_codebooks, seq) codes, labels (batch, seq, "
                "num_codebooks), one embedding per codebook",
    "musicgen_melody": "audio-codebook LM: input_ids are (batch x num_codebooks, seq) codes, labels (batch, seq, "
                       "num_codebooks), one embedding per codebook",
    "xglm": "its eager attention clamps with torch.full(finfo(float64).min) in the default float32 dtype: overflows "
            "in float64 (no SDPA path)",
    "inkling2_text": "its MoE casts the router input to float32 against float64 weights and accumulates experts in "
                     "a float32 buffer: fails in float64, with or without the sweep's float64 casts",
    "inkling2_loop_text": "its MoE (inkling2_text's) casts the router input to float32 against float64 weights and "
                          "accumulates experts in a float32 buffer: fails in float64",
    "prophetnet": "NaN loss in float64 whenever an attention_mask is given (finite in float32): its n-gram "
                  "stream masks overflow finfo(float64).min to -inf",
    "gemma4_assistant": "speculative-decoding drafter: every layer reads the target model's keys/values "
                        "(needs inputs_embeds and shared_kv_states)",
    "gemma4_unified_assistant": "speculative-decoding drafter: every layer reads the target model's keys/values "
                                "(needs inputs_embeds and shared_kv_states)",
}
"""model_type -> why its tiny model cannot be built or cannot run a float64 forward+backward on CPU."""


def _model_class(model_type: str):
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    return getattr(transformers, name)


VARIANTS = ("default", "published")
"""``default``: the family's default config with its features switched on at 40 tokens (windows of 6, every
dropout 0). ``published``: what published checkpoints' configs carry next to transformers' defaults (issue 39):
sliding windows at their default size and switch (Qwen's ``use_sliding_window: false`` with a window set, a window
longer than the sequence), the dropout fields at their defaults (GPT-2's 0.1 on its embeddings, attention
probabilities and residuals; ``tests/model_sweep.py`` checks them against the stock model replaying the masks),
RoPE scaling where the default has plain RoPE (:data:`PUBLISHED_ROPES`), the attention and MLP bias switches
on, and the LM head tied where the default unties it and untied where it ties it."""

PUBLISHED_ROPES = (
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "linear", "factor": 4.0},
)
"""The published variant's RoPE scaling, the first the family accepts: YaRN (Qwen2.5's long-context recipe; 4 x 128
= the tiny max positions; its attention factor, 1 + 0.1 ln 4, scales every score), else linear position
interpolation (families whose configs validate their own kinds, e.g. Phi-3 takes LongRoPE only: none then)."""
_BIAS_SWITCHES = ("attention_bias", "mlp_bias")


def _published_changes(d: dict, rope_choice: int) -> dict:
    """One config level's published-variant changes (``d``: the default's ``to_dict``): the bias switches on, the
    head's tying flipped, RoPE scaling :data:`PUBLISHED_ROPES`[``rope_choice``] where the default has plain RoPE
    (none past the list's end)."""
    out = {key: True for key in _BIAS_SWITCHES if d.get(key) is False}
    if isinstance(d.get("tie_word_embeddings"), bool):
        out["tie_word_embeddings"] = not d["tie_word_embeddings"]
    rope = d.get("rope_parameters")
    if (isinstance(rope, dict) and rope.get("rope_type") == "default" and "rope_theta" in rope
            and "max_position_embeddings" in d and rope_choice < len(PUBLISHED_ROPES)):
        out["rope_parameters"] = {**rope, **PUBLISHED_ROPES[rope_choice]}
    return out


def _with_published(kwargs: dict, default, rope_choice: int, dropped: frozenset[str]) -> dict:
    """``kwargs`` with the published changes of every config level, less the change kinds in ``dropped``."""
    kwargs = copy.deepcopy(kwargs)
    levels = [(kwargs, default)] + [
        (kwargs[name], getattr(default, name)) for name in getattr(default, "sub_configs", {}) or {}
        if isinstance(getattr(default, name, None), transformers.PretrainedConfig)
        and isinstance(kwargs.get(name), dict)
    ]
    for level_kwargs, level in levels:
        changes = _published_changes(level.to_dict(), rope_choice)
        for key, value in changes.items():
            kind = "bias" if key in _BIAS_SWITCHES else key
            if kind not in dropped:
                if key == "rope_parameters" and isinstance(level_kwargs.get(key), dict):
                    value = {**level_kwargs[key], **PUBLISHED_ROPES[rope_choice]}
                level_kwargs[key] = value
    return kwargs


def tiny_config(model_type: str, variant: str = "default") -> transformers.PretrainedConfig:
    """The family's config, tiny, with its layer kinds present at 40 tokens: the default with its features on, or
    the ``published`` variant (:data:`VARIANTS`, its dropouts at their defaults)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: one of {VARIANTS}")
    if model_type not in CONFIG_MAPPING:  # a family newer than the installed transformers (the floor run's 5.16)
        import pytest

        pytest.skip(f"transformers {transformers.__version__} does not ship model_type {model_type!r}")
    override = OVERRIDES.get(model_type, {})
    try:
        default = transformers.AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - a default the family's own validation rejects: build it as overridden
        default = transformers.AutoConfig.for_model(model_type, **override)
    published = variant == "published"
    kwargs = _tiny_dict(default, published)
    _merge(kwargs, copy.deepcopy(override), set(getattr(default, "sub_configs", {}) or {}))
    cls = _model_class(model_type)
    # eager where the attention logits are soft-capped: SDPA has no softcap (transformers 5.16 drops Gemma 2's there,
    # 5.24 marks such families eager-only), and ds_longseq refuses SDPA with one
    softcapped = getattr(default.get_text_config(), "attn_logit_softcapping", None) is not None
    kwargs["attn_implementation"] = "sdpa" if getattr(cls, "_supports_sdpa", False) and not softcapped else "eager"
    kwargs["experts_implementation"] = "eager"  # grouped_mm has no float64 kernel
    if published:
        config = _published_config(model_type, kwargs, default)
    else:
        config = CONFIG_MAPPING[model_type](**kwargs)
    # the causal LM class takes one of the sub-configs (Musicgen's decoder): return that one
    if not isinstance(config, cls.config_class):
        for name in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, name, None)
            if isinstance(sub, cls.config_class):
                sub._attn_implementation = config._attn_implementation
                sub._experts_implementation = config._experts_implementation
                return sub
    return config


def _published_config(model_type: str, kwargs: dict, default) -> transformers.PretrainedConfig:
    """The published variant's config: every change the family's config accepts. A family that rejects one (DBRX
    refuses untied embeddings, Dots3's experts a bias, Phi-3 any RoPE scaling but LongRoPE) keeps its default
    there; the next RoPE scaling is tried before none."""
    first_error = None
    for dropped in (frozenset(), frozenset({"tie_word_embeddings"}), frozenset({"bias"}),
                    frozenset({"tie_word_embeddings", "bias"})):
        for rope_choice in range(len(PUBLISHED_ROPES) + 1):
            try:
                return CONFIG_MAPPING[model_type](**_with_published(kwargs, default, rope_choice, dropped))
            except Exception as error:  # noqa: BLE001 - the family's own validation: try fewer changes
                first_error = first_error or error
    raise first_error


def _merge(kwargs: dict, override: dict, sub_configs: set[str]) -> None:
    for key, value in override.items():
        if key in sub_configs and isinstance(value, dict) and isinstance(kwargs.get(key), dict):
            kwargs[key].update(value)
        else:
            kwargs[key] = value


def dropout_fields(config) -> list[tuple[transformers.PretrainedConfig, str]]:
    """(config level, field) of every non-zero float dropout field of ``config`` and its sub-configs."""
    out = []
    levels = [config] + [getattr(config, n) for n in getattr(config, "sub_configs", {}) or {}
                         if isinstance(getattr(config, n, None), transformers.PretrainedConfig)]
    for level in levels:
        for key, value in vars(level).items():
            if _DROPOUT_FIELDS.search(key) and isinstance(value, float) and value > 0:
                out.append((level, key))
    return out


def tiny_model(model_type: str, dtype: torch.dtype = torch.float64, seed: int = 0, variant: str = "default",
               **fields):
    """The stock causal LM of :func:`tiny_config`, re-initialised for peaked attention, in ``dtype``; ``fields``:
    config fields set on its (text) config first (another shape: more heads).

    The stock init (std 0.02) makes attention nearly uniform, which would hide masking bugs: norms' weights
    become 1 + 0.1 randn (0.1 randn where the norm computes 1 + weight), embeddings normal(0, 1), the rest
    normal(0, 0.15). Parameters whose stock value is structural (state-space decays, skip terms, convolution
    kernels ...) go back to it where the re-initialised model's forward is not finite.
    """
    config = tiny_config(model_type, variant)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, value in fields.items():
        setattr(text, key, value)
    torch.manual_seed(seed)
    # the mapped class itself: AutoModelForCausalLM does not take every config it maps (Musicgen's decoder)
    model = _model_class(model_type)._from_config(config)
    stock = {name: p.detach().clone() for name, p in model.named_parameters() if _STRUCTURAL.search(name)}
    _reinit(model)
    model.to(dtype)
    if stock and not _finite_forward(model, model_type):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in stock:
                    p.copy_(stock[name])
    return model



def untrained_model(model_type: str) -> torch.nn.Module:
    """The stock causal LM of :func:`tiny_config` (default variant) as transformers initialises it, in float32.

    For reading its structure and code (``tests/discovery_record.py``): unlike :func:`tiny_model` it is not
    re-initialised and runs no forward, which is most of the cost of building every family.
    """
    return _model_class(model_type)._from_config(tiny_config(model_type))

# candidates for a structural stock value: state-space decays (A_log, A), skip terms (D), time-step biases,
# recurrent gates' decays (RG-LRU's a_param, RWKV's time_*), short causal convolutions
_STRUCTURAL = re.compile(
    r"(^|\.)(A_log|A|D|dt_bias|a_param|\w*decay\w*|time_\w+)$|conv1d\.(weight|bias)$|dt_proj\.bias$"
)


def _finite_forward(model, model_type: str) -> bool:
    try:
        with torch.no_grad():
            logits = model(**{k: v for k, v in tiny_batch(model_type).items() if k != "labels"}).logits
    except Exception:  # noqa: BLE001 - a model that does not run is not this check's business
        return True
    return bool(torch.isfinite(logits).all())


def _reinit(model) -> None:
    # a norm whose stock weight is all zeros computes (1 + weight) (Gemma, Qwen3-Next ...): its neutral value is 0
    norm_weights, plus_one = set(), set()
    for mod_name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and "norm" in type(module).__name__.lower():
            key = f"{mod_name}.weight" if mod_name else "weight"
            norm_weights.add(key)
            if not weight.detach().any():
                plus_one.add(key)
    embeddings = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in plus_one:
                p.copy_(0.1 * torch.randn_like(p))
            elif name in norm_weights or name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name in embeddings:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.15)


def tiny_batch(model_type: str, batch: int = 2, seq_len: int = 40, seed: int = 1) -> dict:
    """input_ids, attention_mask and labels: row 0 right-padded by 4 tokens, row 1's first 7 labels masked.

    Real tokens avoid the family's special ids (padding, multimodal placeholders) that change what a model
    does with a token; padded positions hold the padding id.
    """
    config = tiny_config(model_type)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab = text.vocab_size
    special = set()
    for cfg in (config, text):
        for key, value in cfg.to_dict().items():
            if key.endswith(("token_id", "token_index")) and isinstance(value, int):
                special.add(value)
    allowed = torch.tensor([i for i in range(vocab) if i not in special] or list(range(vocab)))
    g = torch.Generator().manual_seed(seed)
    ids = allowed[torch.randint(0, len(allowed), (batch, seq_len), generator=g)]
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    mask[0, seq_len - 4:] = 0
    pad = getattr(text, "pad_token_id", None)
    ids[mask == 0] = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    labels = ids.clone()
    labels[mask == 0] = -100
    if batch > 1:
        labels[1, :7] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}

