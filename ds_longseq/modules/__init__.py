"""Modules: replacement forwards for Hugging Face layers, built on ``ds_longseq.ops``."""

from ds_longseq.modules.attention import ATTN_IMPLEMENTATION, longseq_attention, longseq_mask
from ds_longseq.modules.attn_spec import AttentionSettings, AttnSpec
from ds_longseq.modules.causal_lm import CausalLMForward, LMHeadLossForward
from ds_longseq.modules.decoder_layer import CheckpointLayerForward, StreamBPLayerForward
from ds_longseq.modules.mlp import MiniSeqMLPForward
from ds_longseq.modules.offload import HostMemoryError, LayerInputOffload

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionSettings",
    "AttnSpec",
    "longseq_attention",
    "longseq_mask",
    "CausalLMForward",
    "LMHeadLossForward",
    "StreamBPLayerForward",
    "CheckpointLayerForward",
    "MiniSeqMLPForward",
    "LayerInputOffload",
    "HostMemoryError",
]
