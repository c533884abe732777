"""Forwards: what a technique installs on a Hugging Face model, built on ``ds_longseq.ops``.

Plain callables and hooks, not ``nn.Module``s (a patched model keeps its own modules and weights): replacement
``forward``s of decoder layers (StreamBP's: ``streambp_layer``; a host-memory checkpoint: ``checkpoint_layer``), of
MLPs (``mlp``), norms and activations (``approx_forwards``), recurrent mixers sharded by heads under sequence
parallelism (``head_sharding_forward``, over ``ops.head_sharding``) or with their scan run from the carried state
under StreamBP (``scan_from_state_forward``, over ``ops.scan_from_state``), and of the causal LM itself
(``causal_lm``, its per-token outputs: ``token_outputs``); the attention and mask functions registered with
transformers as "ds_longseq" (``attention_interface``) and what callers pass them (``attn_spec``); the cache a
chunk's stock layer is given (``layer_cache``); the sequence-parallel forward hook (``sp_model``); and what these
share: layer-input offload per model (``layer_input_offload``), StreamBP's automatic chunk size (``auto_chunk``),
MoE router logits under chunking (``moe``), the linears a pass never reads (``unread_outputs``), whether StreamBP
keeps each layer's attention output for its backward (``keep_attention``), the replay and ZeRO-3 checks
(``replay``, ``zero3``). Named ``modules`` before 2026-11-27.
"""

from ds_longseq.forwards.attention_interface import ATTN_IMPLEMENTATION, longseq_attention, longseq_mask
from ds_longseq.forwards.attn_spec import AttentionSettings, AttnSpec
from ds_longseq.forwards.causal_lm import CausalLMForward, CausalLMSettings, LMHeadLossForward
from ds_longseq.forwards.checkpoint_layer import CheckpointLayerForward
from ds_longseq.forwards.layer_input_offload import HostMemoryError, LayerInputOffload
from ds_longseq.forwards.mlp import MiniSeqMLPForward
from ds_longseq.forwards.streambp_layer import LayerParts, StreamBPLayerForward

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AttentionSettings",
    "AttnSpec",
    "longseq_attention",
    "longseq_mask",
    "CausalLMForward",
    "CausalLMSettings",
    "LMHeadLossForward",
    "StreamBPLayerForward",
    "LayerParts",
    "CheckpointLayerForward",
    "MiniSeqMLPForward",
    "LayerInputOffload",
    "HostMemoryError",
]
