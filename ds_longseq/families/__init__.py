"""One home for model knowledge: the families ds_longseq can run and where their parts live.

Techniques (``ds_longseq.techniques``) ask this package where a model's layers, MLPs, routers, norms and
head are, and refuse a model it does not know with :class:`UnsupportedModelError`.

Holds:
    decoder: the Hugging Face decoder families (``FamilySpec`` per ``model_type``, ``DecoderLMAdapter``).
    ssm: residual state-space stacks for adjoint sharding (Mamba-1/2 and ``ResidualSSMForCausalLM``).
    residual_ssm: ds_longseq's own residual selective SSM language model (paper 002).
"""

from ds_longseq.families.decoder import (
    ACTIVATION_KINDS,
    FAMILIES,
    SUPPORTED_MODEL_TYPES,
    DecoderLMAdapter,
    FamilySpec,
    UnsupportedModelError,
    decoder_adapter,
    norm_kind,
)
from ds_longseq.families.residual_ssm import ResidualSSMForCausalLM, SelectiveSSMLayer, SSMConfig, SSMOutput
from ds_longseq.families.ssm import UNSUPPORTED_SSM_FAMILIES, Mamba2LayerMaps, MambaLayerMaps, SSMStack, ssm_stack

__all__ = [
    "ACTIVATION_KINDS",
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "DecoderLMAdapter",
    "FamilySpec",
    "UnsupportedModelError",
    "decoder_adapter",
    "norm_kind",
    "ResidualSSMForCausalLM",
    "SelectiveSSMLayer",
    "SSMConfig",
    "SSMOutput",
    "SSMStack",
    "MambaLayerMaps",
    "Mamba2LayerMaps",
    "ssm_stack",
    "UNSUPPORTED_SSM_FAMILIES",
]
