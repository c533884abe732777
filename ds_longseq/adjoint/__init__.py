"""Adjoint sharding for residual state-space model stacks (paper 002).

Public names:
    SSMConfig, ResidualSSMForCausalLM, SelectiveSSMLayer: the paper's residual selective diagonal SSM LM
        (plain autograd by default; ``ds_longseq.enable`` with ``long_seq.adjoint`` switches its
        training forward to adjoint sharding).
    AdjointPlan, make_plan, adjoint_layer_backward: the gradient algorithm.
    split_layers: the layer split across ranks.
    ssm_stack, SSMStack, MambaLayerMaps: the models adjoint sharding drives (ours, transformers' Mamba-1).

See docs/ADJOINT.md for the math, what is exact, and the measured costs.
"""

from ds_longseq.adjoint.distributed import split_layers
from ds_longseq.adjoint.model import ResidualSSMForCausalLM, SelectiveSSMLayer, SSMConfig, SSMOutput
from ds_longseq.adjoint.sharding import AdjointPlan, adjoint_layer_backward, make_plan
from ds_longseq.adjoint.stacks import MambaLayerMaps, SSMStack, ssm_stack

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
]
