"""Model adapters: which Hugging Face causal LMs ds_longseq supports and where their parts live.

Holds:
    SUPPORTED_MODEL_TYPES: model_type -> ForCausalLM class name.
    UnsupportedModelError: raised at ``enable()`` with every reason at once.
    DecoderLMAdapter / get_adapter: access to layers, MLPs and LM head, plus the checks.

All four supported families share the stock layout (``model.model.layers[i].self_attn`` calling
``past_key_values.update``, ``layer.mlp``, ``model.model.norm``, ``model.lm_head``). A family
joins this table once a test compares it against the stock model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_longseq.config import LongSeqConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "UnsupportedModelError", "DecoderLMAdapter", "get_adapter"]

SUPPORTED_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
    """The model (or one of its settings) cannot be run by ds_longseq without a wrong gradient."""


@dataclass
class DecoderLMAdapter:
    """Accessors for a stock ``*ForCausalLM`` decoder-only model."""

    model: torch.nn.Module

    @property
    def base_model(self) -> torch.nn.Module:
        """The decoder stack (``model.model``): embeddings, layers, final norm."""
        return self.model.model

    @property
    def layers(self) -> list[torch.nn.Module]:
        return list(self.model.model.layers)

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.lm_head

    def mlp(self, layer: torch.nn.Module) -> torch.nn.Module:
        return layer.mlp


def get_adapter(model: torch.nn.Module, config: LongSeqConfig) -> DecoderLMAdapter:
    """Check that ``config`` can be applied to ``model`` exactly; raise listing every problem."""
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
    cls = type(model).__name__
    expected = SUPPORTED_MODEL_TYPES.get(model_type)
    if expected is None or cls != expected:
        supported = ", ".join(sorted(SUPPORTED_MODEL_TYPES.values()))
        raise UnsupportedModelError(
            f"ds_longseq cannot patch {cls} (model_type={model_type!r}): supported classes are {supported}. "
            "Load the model with AutoModelForCausalLM, or disable long_seq for this model."
        )
    problems = []
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        problems.append(f"{cls}.model.layers is not a non-empty ModuleList")
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        problems.append(f"{cls}.lm_head is not a torch.nn.Linear")
    if config.streambp.enabled and getattr(hf_config, "attention_dropout", 0.0):
        problems.append(
            f"config.attention_dropout={hf_config.attention_dropout}: streambp re-forwards chunks in backward and "
            "cannot replay dropout masks; set config.attention_dropout=0.0"
        )
    if config.mini_seq.enabled and isinstance(layers, torch.nn.ModuleList):
        if not all(isinstance(getattr(layer, "mlp", None), torch.nn.Module) for layer in layers):
            problems.append(f"{cls} decoder layers have no .mlp module for mini_seq")
    loss_type = getattr(model, "loss_type", None)
    if config.lm_head.enabled and loss_type not in (None, "ForCausalLM"):
        problems.append(f"model.loss_type={loss_type!r}: the chunked lm_head computes the causal-LM loss only")
    if problems:
        raise UnsupportedModelError(f"ds_longseq cannot be enabled on {cls}:\n  - " + "\n  - ".join(problems))
    return DecoderLMAdapter(model)
