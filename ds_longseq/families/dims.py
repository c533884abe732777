"""A decoder-only model's sizes, read from its transformers config: what memory estimates scale with.

Holds:
    ModelDims: hidden, MLP and expert widths, layers, heads, vocabulary; parameter counts (whole model, one layer,
        LoRA); ``chunk_work_per_token``: the bytes one decoder layer's forward and backward hold per token of a chunk;
        ``attention_output_bytes``: the bytes per token of one layer's kept attention output.

Used by the planner (``ds_longseq.plan``) and by StreamBP's automatic chunk size (``forwards.auto_chunk``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

__all__ = ["ModelDims"]


def _attribute(config, key: str, default=None):
    """``config.key``; for an attribute that varies across the layers of a heterogeneous config (Gemma 4's head dim:
    transformers raises a RuntimeError reading it globally) the largest layer's, which bounds a memory estimate."""
    try:
        return getattr(config, key, default)
    except RuntimeError:
        values = [v for layer in getattr(config, "per_layer_config", None) or ()
                  if (v := getattr(layer, key, None)) is not None]
        return max(values) if values else default


@dataclass(frozen=True)
class ModelDims:
    """A decoder-only model's sizes (MoE: ``num_experts`` routed experts of ``expert_intermediate_size``)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool = False
    num_experts: int = 0
    expert_intermediate_size: int = 0
    experts_per_token: int = 0  # routed experts each token goes through (MoE)
    attention_softcap: bool = False  # attention logits soft-capped (Gemma 2): attention runs the math kernel

    @classmethod
    def from_config(cls, config) -> "ModelDims":
        """From a transformers config object or its ``config.json`` dict (a ``text_config`` inside wins)."""
        read = (lambda k, d=None: config.get(k, d)) if isinstance(config, Mapping) else (
            lambda k, d=None: _attribute(config, k, d))

        def get(key, default=None):
            value = read(key, default)
            # a per-layer list (Gemma 3n's intermediate_size): the widest layer's, which bounds a memory estimate
            return max(value) if isinstance(value, (list, tuple)) and value else value
        text = get("text_config")
        if text:
            return cls.from_config(text)
        d = get("hidden_size") or get("n_embd") or get("d_model")
        layers = get("num_hidden_layers") or get("n_layer") or get("num_layers")
        heads = get("num_attention_heads") or get("n_head")
        if not (d and layers and heads and get("vocab_size")):
            raise ValueError("the model config has no hidden_size / num_hidden_layers / num_attention_heads / "
                             "vocab_size: the planner needs a decoder's sizes (pass its config.json)")
        experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts") or 0
        ffn = get("intermediate_size") or get("n_inner") or 4 * d
        return cls(
            hidden_size=d,
            intermediate_size=ffn,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or d // heads,
            vocab_size=get("vocab_size"),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
            num_experts=int(experts or 0),
            expert_intermediate_size=int(get("moe_intermediate_size") or ffn) if experts else 0,
            experts_per_token=int(get("num_experts_per_tok") or get("moe_topk") or 0) if experts else 0,
            attention_softcap=bool(get("attn_logit_softcapping")),
        )

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP or experts, two norms)."""
        d, dh = self.hidden_size, self.head_dim
        attn = d * dh * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * dh * d
        if self.num_experts:  # routed experts and the router
            mlp = 3 * d * self.expert_intermediate_size * self.num_experts + d * self.num_experts
        else:
            mlp = 3 * d * self.intermediate_size
        return attn + mlp + 2 * d

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tied_embeddings else 2) + self.num_layers * self.layer_params + self.hidden_size

    def lora_params(self, rank: int) -> int:
        """LoRA parameters at ``rank`` on q, k, v, o, gate, up, down of every layer (r x (in + out) each)."""
        d, dh = self.hidden_size, self.head_dim
        q, kv, o = d + self.num_heads * dh, d + self.num_kv_heads * dh, self.num_heads * dh + d
        ffn = self.intermediate_size
        return rank * self.num_layers * (q + 2 * kv + o + 3 * (d + ffn))

    @property
    def token_mlp_width(self) -> int:
        """The MLP width one token goes through: the dense MLP's, or its routed experts' together."""
        if self.num_experts:
            return self.expert_intermediate_size * max(self.experts_per_token, 1)
        return self.intermediate_size

    def attention_output_bytes(self, dtype_bytes: int) -> int:
        """Bytes per token of one layer's kept attention output (``streambp.keep_attention_output``): the output of
        every head (heads x head dim, in the activations' dtype) and each head's log-sum-exp (float32, float64 for a
        float64 model)."""
        return self.num_heads * (self.head_dim * dtype_bytes + max(dtype_bytes, 4))

    def chunk_work_per_token(self, dtype_bytes: int, kv_tile: int | None = None, score_bytes: int = 4) -> float:
        """Bytes one decoder layer holds per token of a chunk while StreamBP runs the chunk forward and backward.

        ANALYTIC (counted from the layer's structure, not fitted; ``benchmarks/auto_chunk.py`` measures it 1.3x
        above the real slope on CPU, so a budget it keeps is kept): the activations autograd saves for the chunk
        (the two norms' inputs and outputs, q, k, v and their rotated copies, the attention output, the MLP's gate,
        up, activation and product, the router's logits) plus the backward's transient gradients of the widest of
        them (the MLP's and the residual's), all in the activations' dtype (``dtype_bytes``). The fused attention
        kernels hold no score tile; where attention runs the math kernel (a soft-capped model:
        ``attention_softcap``) the score and probability tiles of every head over ``kv_tile`` keys count too,
        ``score_bytes`` each.
        """
        d, ffn = self.hidden_size, self.token_mlp_width
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        saved = 6 * d + 3 * q + 3 * kv + 4 * ffn + self.num_experts
        transient = 2 * ffn + 2 * d
        tile = 2 * self.num_heads * kv_tile * score_bytes if kv_tile and self.attention_softcap else 0
        return (saved + transient) * dtype_bytes + tile
