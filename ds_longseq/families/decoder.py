"""Decoder families: which Hugging Face causal LMs ds_longseq knows and where their parts live.

Holds:
    FamilySpec, FAMILIES: what differs between decoder families; the specs written by hand (one each).
    SUPPORTED_MODEL_TYPES: model_type -> ForCausalLM class name of the written specs (the others are
        discovered: docs/SUPPORTED_MODELS.md lists every family's result).
    UnsupportedModelError: raised before compute for a model (or setting) ds_longseq cannot run exactly.
    DecoderLMAdapter / decoder_adapter: access to layers, MLPs, routers, activations, norms and LM head,
        and the structural checks every technique relies on.
    softcap_under_sdpa_problem: why a model set to SDPA cannot run under ds_longseq's attention (a logit softcap).
    ACTIVATION_KINDS, norm_kind: activation and norm classes by the function they compute.
    PER_TOKEN_LAYER_INPUTS: decoder-layer arguments holding one entry per token besides the hidden states.
    RECURRENT_MASK_KWARGS: decoder-layer arguments holding a recurrent mixer's own padding mask.
    KV_SHARING_KWARG: the decoder-layer argument cross-layer K/V sharing goes through.

A spec names where a family's parts are (decoder stack, layers, attention, MLP, router, LM head) and what
else is family-specific: its dropout and MLP-noise fields, its final-logit softcap, its head kind, its
mixture-of-experts block, the norms Approx-BP can fold. :data:`FAMILIES` holds the specs written by hand
and tested family by family (the override table); every other causal LM gets a spec read from its
structure by ``families.discovery`` or is refused with the reason. What each technique requires of a
family is checked by that technique (``ds_longseq.techniques``), reading these facts.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from ds_longseq.compat import get_attn_implementation
from ds_longseq.families.discovery import (
    discover_spec,
    head_kind,
    is_plain_linear,
    is_state_mixer,
    logit_scale,
    masks_see_packed_rows,
)

__all__ = [
    "FamilySpec",
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "DecoderLMAdapter",
    "decoder_adapter",
    "softcap_under_sdpa_problem",
    "norm_kind",
    "ACTIVATION_KINDS",
    "PER_TOKEN_LAYER_INPUTS",
    "RECURRENT_MASK_KWARGS",
    "KV_SHARING_KWARG",
]

KV_SHARING_KWARG = "shared_kv_states"
"""The argument through which layers share keys/values across layers (Gemma 3n, Gemma 4): a per-forward
mapping, layer type -> (keys, values), written by each type's last "store" layer and read by the later
"reuse" layers instead of computing their own (``DecoderLMAdapter.kv_sharing``)."""

PER_TOKEN_LAYER_INPUTS = frozenset({"per_layer_input"})
"""Decoder-layer arguments (by parameter name, given by position or keyword) that hold one entry per token,
(B, T, ...) like the hidden states, in the hidden states' dtype: StreamBP cuts them into the same chunks and
gives them exact gradients. Gemma 3n's and Gemma 4's per-layer inputs (a per-token embedding plus a projection
of the input embeddings, gating a residual branch at the end of each layer)."""

RECURRENT_MASK_KWARGS = frozenset({"mamba_attention_mask"})
"""Decoder-layer arguments holding a (B, T) padding mask for the layer's recurrent mixer alone, beside the
attention's ``attention_mask`` (Falcon-H1 runs attention and Mamba side by side): StreamBP gives each chunk its
own tokens' slice."""

ACTIVATION_KINDS: dict[str, str] = {
    "SiLUActivation": "silu",  # transformers' ACT2FN["silu"]
    "SiLU": "silu",  # torch.nn.SiLU (ACT2FN["swish"])
    "GELUActivation": "gelu",  # erf GELU
    "GELU": "gelu",  # torch.nn.GELU, either form
    "GELUTanh": "gelu",  # ACT2FN["gelu_pytorch_tanh"] (Gemma)
    "PytorchGELUTanh": "gelu",
    "NewGELUActivation": "gelu",  # the tanh formula in Python (GPT-2's gelu_new)
}
"""Activation module class name -> the stock function it computes (what Approx-BP's step derivative approximates)."""


_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_LLAMA_NORM_FOLDS = (
    ("input_layernorm", _QKV),
    ("post_attention_layernorm", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
)
_QK_NORMS = (
    ("self_attn.q_norm", "normalises each head's query before RoPE, not the input of a linear layer"),
    ("self_attn.k_norm", "normalises each head's key before RoPE, not the input of a linear layer"),
)
_POST_NORMS = (
    ("post_attention_layernorm", "normalises the attention output before the residual add, not a linear layer's input"),
    ("post_feedforward_layernorm", "normalises the MLP output before the residual add, not a linear layer's input"),
)


@dataclass(frozen=True)
class FamilySpec:
    """What ds_longseq must know about one model family beyond the shared layout."""

    causal_lm_class: str
    """The ``*ForCausalLM`` class name transformers gives this ``model_type``."""
    decoder_attr: str = "model"
    """Attribute of the ``*ForCausalLM`` holding the decoder stack (embeddings, layers, final norm); dotted for one
    nested deeper (OPT's ``model.decoder``)."""
    layers_attr: str = "layers"
    """Attribute of the decoder stack holding the decoder layers (an ``nn.ModuleList``); each layer's
    attention module is ``self_attn`` and writes its K/V through ``past_key_values.update``."""
    attn_attr: str = "self_attn"
    """Attribute of a decoder layer holding its attention module."""
    mixer_attr: str | None = None
    """Attribute of a decoder layer holding a recurrent token mixer instead of (or beside) its attention: a
    linear-attention, state-space or short-convolution module carrying its state through transformers'
    linear-attention cache API (``discovery.is_state_mixer``: Qwen3.5's ``linear_attn``, Bamba's ``mamba``);
    None for a family of attention layers only."""
    mixer_scan_function: str | None = None
    """The function of the recurrent mixer's modeling module that runs its multi-token scan from zeros whatever
    state the mixer reads (Jamba's ``mamba_selective_scan``: the fused kernel takes no initial state): StreamBP
    runs it from the carried state instead (``forwards.scan_from_state_forward``); None where the mixer's own code
    continues from its state."""
    mlp_attr: str | None = "mlp"
    """Attribute of a decoder layer holding its MLP (dense, or the mixture-of-experts block); None when
    the layers have no single such module (see ``mlp_part_attrs``; with neither, mini_seq is refused)."""
    mlp_part_attrs: tuple[str, ...] = ()
    """Where ``mlp_attr`` is None: the attributes of a layer's MLP parts, each a block of its own called on the same
    hidden states (Granite-MoE-hybrid's ``block_sparse_moe`` and ``shared_mlp``, whose outputs the layer sums);
    mini_seq chunks each part on its own. Empty for a single MLP, or for bare projections (OPT's ``fc1`` /
    ``fc2``, which chunked one by one would still hold the whole intermediate activation)."""
    token_wise_layers: tuple[int, ...] = ()
    """Layers with no token mixer at all (NemotronH's MLP and MoE blocks): their one parameterised child under
    ``mlp_attr`` is their MLP, StreamBP runs them chunk by chunk with nothing carried, and both StreamBP and
    mini_seq check on the first forward that its outputs do not depend on other tokens
    (``forwards.replay.check_token_wise``)."""
    mlp_free_layers: tuple[int, ...] = ()
    """Layers that are a token mixer (and norms) only, with no MLP (NemotronH's attention and Mamba blocks):
    mini_seq leaves them stock."""
    lm_head_attr: str = "lm_head"
    """Attribute of the ``*ForCausalLM`` holding the LM head (an ``nn.Linear``)."""
    dropout_fields: tuple[str, ...] = ("attention_dropout",)
    """Config fields that are dropout probabilities inside a decoder layer. StreamBP and mini_seq replay their draws
    exactly in the chunk re-forwards (``ops.draws``), and StreamBP's chunk attention applies the attention-probability
    ones from each tile's own generator, under sequence parallelism too (each rank its own seed)."""
    final_logit_softcap_field: str | None = None
    """Config field of a final-logit softcap (``cap * tanh(logits / cap)`` after the LM head) that the
    chunked LM head must apply, or None."""
    moe_block_class: str | None = None
    """Class name of the family's mixture-of-experts block (a layer's MLP); layers whose MLP is
    another class are dense. None for dense families."""
    moe_attr: str | None = None
    """Attribute of a decoder layer holding its mixture-of-experts block when that is not the MLP (beside other
    MLP parts: Granite-MoE-hybrid's ``block_sparse_moe`` next to ``shared_mlp``); None: the MLP is the block."""
    router_attr: str = "gate"
    """Attribute of the mixture-of-experts block holding its router, whose output is
    ``(router_logits (N, E), ...)``."""
    mlp_noise_fields: tuple[str, ...] = ()
    """Config fields of random noise inside the MLP (router jitter): StreamBP and mini_seq both recompute the MLP in
    backward and draw it again exactly (``ops.draws``)."""
    norm_folds: tuple[tuple[str, tuple[str, ...]], ...] = _LLAMA_NORM_FOLDS
    """Per decoder layer, each norm that only feeds linear maps and those maps' weights (paths inside
    the layer; in-features on the weight's last dim): what ``approx_bp.norm`` folds. The final norm
    folds into the LM head."""
    unfoldable_norms: tuple[tuple[str, str], ...] = ()
    """Norms inside a decoder layer that ``approx_bp.norm`` cannot fold, and why: the family is refused."""
    final_norm_attr: str = "norm"
    """Attribute of the decoder stack holding the norm before the LM head."""
    head_kind: str = "plain"
    """What the class's ``forward`` computes after the decoder stack (``discovery.HEAD_TEMPLATES``); checked
    against the installed transformers' code when the adapter is made."""
    norm_folds_known: bool = True
    """Whether ``norm_folds`` / ``unfoldable_norms`` describe every norm of the layers (written and tested
    for this family); a discovered family has no map, so ``approx_bp.norm`` is refused on it."""
    window_from: str | None = None
    """Where the sliding window of a family that keeps it in the mask only is read: "module" (the attention
    module's ``sliding_window`` attribute, set on its sliding layers only: Qwen2-MoE) or "config"
    (``config.sliding_window`` on every layer: PhiMoE); None: the attention call passes it."""
    attention_problem: str | None = None
    """Why ds_longseq's chunk attention cannot replace this family's (StreamBP and sequence parallelism are
    refused with it; mini_seq and the chunked head, which keep the stock attention, still apply), or None."""
    discovered: bool = False
    """Read from the model's structure (``discovery.discover_spec``) rather than written in :data:`FAMILIES`."""
    sequence_parallel_verified: bool = True
    """Whether sequence parallelism was proven exact on this family by a 2-rank parity test: every written family;
    a discovered one only where ``discovery.OVERRIDES`` says so (its test named there). The shard context must
    reach the attention, and nothing in the layers may use rank-local positions (Llama 4's temperature tuning
    counts them from its cache's length: ``DecoderLMAdapter.cache_positioned_attention``)."""


_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
"""transformers' RoPE kinds whose frequencies follow the longest position of each forward."""


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec("LlamaForCausalLM"),
    "mistral": FamilySpec("MistralForCausalLM"),
    "qwen2": FamilySpec("Qwen2ForCausalLM"),
    "qwen3": FamilySpec("Qwen3ForCausalLM", unfoldable_norms=_QK_NORMS),
    # q/k RMSNorm over all heads' projections, norms after attention and MLP
    "olmo2": FamilySpec("Olmo2ForCausalLM", norm_folds=(), unfoldable_norms=_QK_NORMS + _POST_NORMS),
    # sliding-window layers alternating with full ones, attention-logit softcap (passed to the
    # attention function as ``softcap``), final-logit softcap, pre/post feed-forward norms
    "gemma2": FamilySpec(
        "Gemma2ForCausalLM", final_logit_softcap_field="final_logit_softcapping", unfoldable_norms=_POST_NORMS,
        head_kind="final_softcap",
    ),
    # five sliding-window layers per full one, each kind with its own RoPE base, q/k RMSNorm,
    # optional softcaps as in Gemma 2, scaled embeddings
    "gemma3_text": FamilySpec(
        "Gemma3ForCausalLM",
        final_logit_softcap_field="final_logit_softcapping",
        unfoldable_norms=_QK_NORMS + _POST_NORMS,
        head_kind="final_softcap",
    ),
    # fused qkv_proj and gate_up_proj, optional partial rotary, residual dropout inside the layer
    "phi3": FamilySpec(
        "Phi3ForCausalLM",
        dropout_fields=("attention_dropout", "resid_pdrop"),
        norm_folds=(
            ("input_layernorm", ("self_attn.qkv_proj.weight",)),
            ("post_attention_layernorm", ("mlp.gate_up_proj.weight",)),
        ),
    ),
    # Qwen3 attention; sparse MoE blocks (top-k of num_experts, optionally renormalised), dense MLPs
    # on config.mlp_only_layers; load-balancing loss from the routers' logits
    "qwen3_moe": FamilySpec(
        "Qwen3MoeForCausalLM", moe_block_class="Qwen3MoeSparseMoeBlock", unfoldable_norms=_QK_NORMS,
        head_kind="moe_aux",
    ),
    # Mistral attention; sparse MoE blocks (top-2 of 8, renormalised), router jitter in training
    "mixtral": FamilySpec(
        "MixtralForCausalLM",
        moe_block_class="MixtralSparseMoeBlock",
        mlp_noise_fields=("router_jitter_noise",),
        head_kind="moe_aux",
        # the router's (E, d) weight and the experts' (E, 2I, d) gate/up weights consume the norm's output
        norm_folds=(
            ("input_layernorm", _QKV),
            ("post_attention_layernorm", ("mlp.gate.weight", "mlp.experts.gate_up_proj")),
        ),
    ),
}
"""Every known decoder family by ``model_type``."""

SUPPORTED_MODEL_TYPES = {name: spec.causal_lm_class for name, spec in FAMILIES.items()}


class UnsupportedModelError(ValueError):
    """The model (or one of its settings) cannot be run by ds_longseq without a wrong gradient."""


@dataclass
class DecoderLMAdapter:
    """Accessors for a stock ``*ForCausalLM`` decoder-only model."""

    model: torch.nn.Module
    spec: FamilySpec

    @property
    def final_logit_softcap(self) -> float | None:
        """The family's final-logit softcap value for this model, or None."""
        field = self.spec.final_logit_softcap_field
        return None if field is None else getattr(self.model.config, field, None)

    @property
    def logit_scale(self) -> float:
        """The factor the family's forward puts on the logits right after the LM head (1.0: none)."""
        return logit_scale(self.model, self.spec.head_kind)

    @property
    def base_model(self) -> torch.nn.Module:
        """The decoder stack (e.g. ``model.model``, OPT's ``model.model.decoder``): embeddings, layers, final norm."""
        return operator.attrgetter(self.spec.decoder_attr)(self.model)

    @property
    def layers(self) -> list[torch.nn.Module]:
        return list(getattr(self.base_model, self.spec.layers_attr))

    @property
    def lm_head(self) -> torch.nn.Linear:
        return getattr(self.model, self.spec.lm_head_attr)

    def _index(self, layer: torch.nn.Module) -> int:
        return next(i for i, other in enumerate(self.layers) if other is layer)

    def token_wise(self, layer: torch.nn.Module) -> bool:
        """Whether ``layer`` has no token mixer (``FamilySpec.token_wise_layers``)."""
        return bool(self.spec.token_wise_layers) and self._index(layer) in self.spec.token_wise_layers

    def mlp(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        """The layer's MLP (or mixture-of-experts block); None for a layer with none (``mlp_free_layers``)."""
        if self.spec.mlp_attr is None or self.spec.mlp_free_layers and self._index(layer) in self.spec.mlp_free_layers:
            return None
        return getattr(layer, self.spec.mlp_attr, None)

    def mlp_parts(self, layer: torch.nn.Module) -> list[torch.nn.Module]:
        """What mini_seq chunks in ``layer``: its MLP, else its MLP parts (``FamilySpec.mlp_part_attrs``) that it
        holds; empty for a layer with neither (``mlp_free_layers``)."""
        if self.spec.mlp_attr is not None:
            mlp = self.mlp(layer)
            return [] if mlp is None else [mlp]
        if self.spec.mlp_free_layers and self._index(layer) in self.spec.mlp_free_layers:
            return []
        return [part for name in self.spec.mlp_part_attrs if (part := getattr(layer, name, None)) is not None]

    def attention(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        """The layer's attention module; None for a layer whose token mixer is recurrent (:meth:`mixer`), even
        under the same attribute name (Kimi Linear's ``self_attn`` is either), and for a token-wise layer."""
        module = getattr(layer, self.spec.attn_attr, None)
        if module is None or is_state_mixer(type(module)) or self.token_wise(layer):
            return None
        return module

    def query_projection(self, layer: torch.nn.Module) -> torch.nn.Linear | None:
        """The ``nn.Linear`` computing the layer's queries alone: the attention's ``q_proj`` beside separate
        ``k_proj`` and ``v_proj`` (PEFT's base layer when it carries an adapter); None for fused or absent ones."""
        attention = self.attention(layer)
        if attention is None or not all(hasattr(attention, n) for n in ("q_proj", "k_proj", "v_proj")):
            return None
        return _plain_linear(attention.q_proj)

    def key_value_projections(self, layer: torch.nn.Module) -> tuple[torch.nn.Linear, torch.nn.Linear] | None:
        """The ``nn.Linear``s computing the layer's keys and values apart (``k_proj``, ``v_proj``; PEFT's base
        layers under adapters), or None (fused, shared between them, or absent)."""
        attention = self.attention(layer)
        if attention is None or self.query_projection(layer) is None:
            return None
        k, v = _plain_linear(attention.k_proj), _plain_linear(attention.v_proj)
        return None if k is None or v is None or k is v else (k, v)

    def mlp_output_projection(self, layer: torch.nn.Module) -> torch.nn.Linear | None:
        """The ``nn.Linear`` computing the MLP's output (``down_proj``; PEFT's base layer under an adapter), or None
        (no such module: a mixture of experts, another layout)."""
        mlp = self.mlp(layer)
        return None if mlp is None else _plain_linear(getattr(mlp, "down_proj", None))

    def mixer(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        """The layer's recurrent token mixer carrying a state from chunk to chunk (``FamilySpec.mixer_attr``), or
        None for an attention layer."""
        if self.spec.mixer_attr is None:
            return None
        module = getattr(layer, self.spec.mixer_attr, None)
        return module if module is not None and is_state_mixer(type(module)) else None

    def mask_only_windows(self) -> list[tuple[torch.nn.Module, int]]:
        """(layer, sliding window) of each layer whose family keeps the window in the mask only (``window_from``)."""
        source = self.spec.window_from
        if source is None:
            return []
        out = []
        for layer in self.layers:
            if source == "module":
                window = getattr(self.attention(layer), "sliding_window", None)
            else:
                window = getattr(self.model.config.get_text_config(), "sliding_window", None)
            if isinstance(window, int):
                out.append((layer, window))
        return out

    def attention_chunks(self) -> list[tuple[torch.nn.Module, int]]:
        """(layer, attention chunk size) of each chunked-attention layer: ``config.layer_types[i] ==
        "chunked_attention"`` with ``config.attention_chunk_size`` (Llama 4), the convention transformers'
        mask builders read."""
        config = self.model.config.get_text_config()
        types, chunk = getattr(config, "layer_types", None), getattr(config, "attention_chunk_size", None)
        if not types or not isinstance(chunk, int):
            return []
        return [(layer, chunk) for layer, kind in zip(self.layers, types, strict=False) if kind == "chunked_attention"]

    def sliding_masks_read(self) -> bool:
        """Whether any layer reads a sliding-window mask. transformers' forward of several families builds the
        ``"sliding_attention"`` mask whatever the layers are and hands each layer the mask of its
        ``config.layer_types`` entry: a config without a sliding type in ``layer_types`` has no layer reading it
        (Qwen1.5-MoE's published config, ``use_sliding_window: false`` with a ``sliding_window`` set: transformers
        builds a window-0 mask nobody reads). Without ``layer_types``: assumed read."""
        types = getattr(self.model.config.get_text_config(), "layer_types", None)
        if not types:
            return True
        return any("sliding" in str(kind) for kind in types)

    def kv_sharing(self) -> dict[int, tuple[str, str]]:
        """Layer index -> ("store" | "reuse", key) of each layer taking part in cross-layer K/V sharing, read from
        its attention module: Gemma 3n's and Gemma 4's ``store_full_length_kv`` (writes its keys/values to
        :data:`KV_SHARING_KWARG` under its ``layer_type``) and ``is_kv_shared_layer`` (attends those of its
        ``layer_type`` instead of its own). transformers 5.16's Gemma 3n keys them by the storing layer's index
        instead: its own ``layer_idx``, and a reusing layer's ``kv_shared_layer_index``."""
        out = {}
        for i, layer in enumerate(self.layers):
            attn = self.attention(layer)
            for flag, role in (("is_kv_shared_layer", "reuse"), ("store_full_length_kv", "store")):
                if getattr(attn, flag, False) is True:
                    by_index = hasattr(attn, "kv_shared_layer_index")  # 5.16's Gemma 3n
                    key = (attn.kv_shared_layer_index if role == "reuse" else attn.layer_idx) if by_index else (
                        getattr(attn, "layer_type", None))
                    out[i] = (role, key)
                    break
        return out

    def stock_masks_see_packed_rows(self) -> bool:
        """Whether the stock attention keeps packed documents apart: the decoder stack gives transformers' mask
        builders the position ids (``discovery.masks_see_packed_rows``); gpt-oss's and OPT's do not."""
        return masks_see_packed_rows(type(self.base_model))

    def stacked_streams(self) -> int | None:
        """How many hidden-state streams the layers take stacked on a leading dim, (S, B, T, d) instead of
        (B, T, d): Gemma 3n's AltUp (``config.altup_num_inputs``, the layers predict and correct all S streams
        per token and attend with one of them); None for the usual (B, T, d)."""
        streams = getattr(self.model.config.get_text_config(), "altup_num_inputs", None)
        return streams if isinstance(streams, int) and streams > 1 else None

    def cache_positioned_attention(self) -> list[torch.nn.Module]:
        """Attention modules that position their queries by the cache's length (``cache.get_seq_length()`` plus
        the query's index): Llama 4's attention temperature tuning on its no-RoPE layers
        (``attn_temperature_tuning`` and not ``use_rope``). Under sequence parallelism they need the shard's
        global offset there (``forwards.sp_model.ShardOffsetCache``)."""
        attns = [self.attention(layer) for layer in self.layers]
        return [
            a for a in attns if getattr(a, "attn_temperature_tuning", False) and not getattr(a, "use_rope", True)
        ]

    def length_dependent_rope(self) -> list[str]:
        """The RoPE kinds of this model whose frequencies depend on the largest position a forward sees
        (transformers' ``dynamic_rope_update``: NTK-aware "dynamic" and LongRoPE's short/long switch), sorted;
        read from ``rope_parameters`` (one for all layers or one per layer type) and the older ``rope_scaling``."""
        config = self.model.config.get_text_config()
        kinds = set()
        for params in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
            if not isinstance(params, dict):
                continue
            per_type = bool(params) and all(isinstance(v, dict) for v in params.values())
            for p in params.values() if per_type else [params]:
                kind = p.get("rope_type", p.get("type"))
                if kind in _LENGTH_DEPENDENT_ROPE:
                    kinds.add(kind)
        return sorted(kinds)

    @property
    def final_norm(self) -> torch.nn.Module:
        return getattr(self.base_model, self.spec.final_norm_attr)

    def activations(self, layer: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
        """(path in the layer, module, stock kind) of every SiLU/GELU activation module in ``layer``."""
        return [
            (name, m, ACTIVATION_KINDS[type(m).__name__])
            for name, m in layer.named_modules()
            if type(m).__name__ in ACTIVATION_KINDS
        ]

    @property
    def where(self) -> str:
        """How error messages name the layer list, e.g. ``LlamaForCausalLM.model.layers``."""
        return f"{type(self.model).__name__}.{self.spec.decoder_attr}.{self.spec.layers_attr}"

    def structure_problems(self) -> list[str]:
        """Why this model's parts are not where its family keeps them (empty when they are)."""
        spec, cls, where = self.spec, type(self.model).__name__, self.where
        problems = []
        try:
            decoder = self.base_model
        except AttributeError:
            decoder = None
        layers = getattr(decoder, spec.layers_attr, None)
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
            problems.append(f"{where} is not a non-empty ModuleList")
            layers = []
        if not is_plain_linear(getattr(self.model, spec.lm_head_attr, None)):
            problems.append(f"{cls}.{spec.lm_head_attr} is not a plain torch.nn.Linear (its own forward or "
                            "parameters would be skipped by ds_longseq's chunked head)")
        attns = [getattr(layer, spec.attn_attr, None) for layer in layers]
        bidirectional = [i for i, attn in enumerate(attns) if getattr(attn, "is_causal", True) is False]
        if bidirectional:
            problems.append(
                f"{where}{bidirectional} have {spec.attn_attr}.is_causal=False (bidirectional attention, e.g. "
                "config.use_bidirectional_attention=True): ds_longseq trains causal LMs only; set it to False"
            )
        for i, layer in enumerate(layers):
            mlp = self.mlp(layer)
            if spec.moe_block_class is not None and type(mlp).__name__ == spec.moe_block_class:
                if not isinstance(getattr(mlp, spec.router_attr, None), torch.nn.Module):
                    problems.append(
                        f"{where}[{i}].{spec.mlp_attr} ({spec.moe_block_class}) has no .{spec.router_attr} router"
                    )
        return problems

    def router(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        """The router of ``layer``'s mixture-of-experts block, or None for a dense layer."""
        mlp = self.mlp(layer) if self.spec.moe_attr is None else getattr(layer, self.spec.moe_attr, None)
        if self.spec.moe_block_class is None or type(mlp).__name__ != self.spec.moe_block_class:
            return None
        return getattr(mlp, self.spec.router_attr)


def softcap_under_sdpa_problem(model: torch.nn.Module) -> str | None:
    """Why ds_longseq's attention would not compute ``model``'s stock one: it soft-caps the attention logits as the
    model's eager attention does (``attn_logit_softcapping``, passed as ``softcap``: Gemma 2, VaultGemma), and the
    model is set to SDPA, which has no softcap (transformers 5.16 drops it there, 5.24 refuses SDPA for such
    families); None otherwise."""
    config = model.config.get_text_config()
    cap = getattr(config, "attn_logit_softcapping", None)
    if cap is None or get_attn_implementation(config) != "sdpa":
        return None
    return (f"{type(model).__name__} is set to attn_implementation='sdpa', which runs its attention without the logit "
            f"softcap (attn_logit_softcapping={cap}) that ds_longseq's attention applies as eager does, so the "
            "gradients would differ: load the model with attn_implementation='eager'")


def decoder_adapter(model: torch.nn.Module) -> DecoderLMAdapter:
    """The adapter of a ``*ForCausalLM``, its structure checked.

    A class :data:`FAMILIES` names gets its written spec (checked against the installed transformers' code:
    its head must still be the kind the spec says); any other one is read from its structure
    (:func:`~ds_longseq.families.discovery.discover_spec`).

    Raises:
        UnsupportedModelError: a part cannot be located, its attention does not go through transformers'
            attention interface, or its forward does something ds_longseq does not re-implement (every
            problem listed, with the class).
    """
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
    cls = type(model).__name__
    spec = FAMILIES.get(model_type)
    if spec is not None and cls == spec.causal_lm_class:
        kind = head_kind(model)
        problems = [] if kind == spec.head_kind else [
            f"{cls}.forward is not the {spec.head_kind!r} head this ds_longseq release was tested with "
            f"(found {kind!r}): this transformers version changed it; upgrade ds_longseq or use the tested one"
        ]
    else:
        spec, problems = discover_spec(model, FamilySpec)
    if spec is not None:
        adapter = DecoderLMAdapter(model, spec)
        problems += adapter.structure_problems()
    if problems:
        raise UnsupportedModelError(
            f"ds_longseq cannot be enabled on {cls} (model_type={model_type!r}):\n  - " + "\n  - ".join(problems)
        )
    return adapter


def norm_kind(norm: torch.nn.Module) -> str | None:
    """ "rms" for a Llama-style RMSNorm (``weight * normalised``), "layer" for ``nn.LayerNorm``, else None."""
    if isinstance(norm, torch.nn.LayerNorm):
        return "layer"
    if type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon"):
        return "rms"
    return None


def _plain_linear(module) -> torch.nn.Linear | None:
    """``module`` if it is an ``nn.Linear``, PEFT's wrapped base layer if that is one, else None."""
    if isinstance(module, torch.nn.Linear):
        return module
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, torch.nn.Linear) else None
