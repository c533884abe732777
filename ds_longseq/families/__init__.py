"""One home for model knowledge: the families ds_longseq can run and where their parts live.

Techniques (``ds_longseq.techniques``) ask this package where a model's layers, MLPs, routers, norms and
head are, and refuse a model it does not know with :class:`UnsupportedModelError`.

Holds:
    decoder: the Hugging Face decoder families (``FamilySpec`` per ``model_type``, ``DecoderLMAdapter``).
    ssm: residual state-space stacks for adjoint sharding (Mamba-1/2 and ``ResidualSSMForCausalLM``).
    residual_ssm: ds_longseq's own residual selective SSM language model (paper 002).

Imported lazily (``ds_longseq.lazy``): ``dims`` (a model's sizes, pure arithmetic) loads without torch.
"""

from typing import TYPE_CHECKING

from ds_longseq.lazy import lazy_exports

if TYPE_CHECKING:  # the names below, imported on first use (ds_longseq.lazy)
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

__getattr__, __dir__ = lazy_exports(__name__, __file__)

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
