"""Adjoint sharding for residual state-space model stacks (paper 002).

Public names:
    SSMConfig, ResidualSSMForCausalLM, SelectiveSSMLayer: the paper's residual selective diagonal SSM LM
        (plain autograd by default; ``ds_longseq.enable`` with ``long_seq.adjoint`` switches its
        training forward to adjoint sharding).
    AdjointPlan, make_plan, adjoint_layer_backward: the gradient algorithm.
    split_layers: the layer split across ranks.
    HFAdjointForward: the training forward installed on a transformers Mamba model.
    ssm_stack, SSMStack, MambaLayerMaps: the models adjoint sharding drives (ours, transformers' Mamba-1/2),
        re-exported from ``ds_longseq.families``, their home.

See docs/ADJOINT.md for the math, what is exact, and the measured costs.
"""

from ds_longseq.adjoint.hf_forward import HFAdjointForward
from ds_longseq.adjoint.pipeline import split_layers
from ds_longseq.adjoint.sharding import AdjointPlan, adjoint_layer_backward, make_plan
from ds_longseq.families.residual_ssm import ResidualSSMForCausalLM, SelectiveSSMLayer, SSMConfig, SSMOutput
from ds_longseq.families.ssm import MambaLayerMaps, SSMStack, ssm_stack

__all__ = [
    "SSMConfig",
    "SSMOutput",
    "ResidualSSMForCausalLM",
    "SelectiveSSMLayer",
    "AdjointPlan",
    "make_plan",
    "adjoint_layer_backward",
    "split_layers",
    "ssm_stack",
    "SSMStack",
    "MambaLayerMaps",
    "HFAdjointForward",
]
