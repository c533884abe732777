"""Autograd ops: pure functions and ``torch.autograd.Function``s. No transformers; DeepSpeed only where an op is its
(ZeRO-3 gathering in sparse_inputs, the async I/O op in disk_store), imported lazily.

Imported lazily (``ds_longseq.lazy``): the package holds torch-free arithmetic too (``sp_layout``,
``chunk_sizes``) that the planner imports without torch.
"""

from typing import TYPE_CHECKING

from ds_longseq.lazy import lazy_exports

if TYPE_CHECKING:  # the names below, imported on first use (ds_longseq.lazy)
    from ds_longseq.ops.activation_checkpoint import checkpoint_apply
    from ds_longseq.ops.chunk_attention import chunk_causal_attention, query_lower_bounds
    from ds_longseq.ops.disk_store import DiskOffloader, DiskStore, DiskTensor
    from ds_longseq.ops.documents import doc_starts, mask_document_starts
    from ds_longseq.ops.host_store import (
        HostBufferPool,
        LayerInputOffloader,
        OffloadedTensor,
        SavedTensor,
        host_available_bytes,
    )
    from ds_longseq.ops.kv_stream import KVStream
    from ds_longseq.ops.linear_scan import LinearScan, adjoint_scan, linear_scan, truncated_adjoint
    from ds_longseq.ops.lm_head_loss import (
        TOKEN_HEAD_OUTPUTS,
        TokenHeadOutputs,
        chunked_lm_head_loss,
        chunked_token_logprobs,
        chunked_token_outputs,
        shift_causal_labels,
        softcap_logits,
    )
    from ds_longseq.ops.objectives import (
        DPO_LOSS_TYPES,
        GRPO_LOSS_TYPES,
        TokenLogprobs,
        dpo_loss,
        group_advantages,
        grpo_loss,
    )
    from ds_longseq.ops.sparse_inputs import Recompute, SparseInputs
    from ds_longseq.ops.streambp_autograd import chunk_bounds, streambp_apply
    from ds_longseq.ops.tokenwise_chunks import mini_sequence_apply

__getattr__, __dir__ = lazy_exports(__name__, __file__)

__all__ = [
    "chunk_causal_attention",
    "query_lower_bounds",
    "doc_starts",
    "mask_document_starts",
    "chunked_lm_head_loss",
    "chunked_token_logprobs",
    "chunked_token_outputs",
    "TokenHeadOutputs",
    "TOKEN_HEAD_OUTPUTS",
    "TokenLogprobs",
    "dpo_loss",
    "group_advantages",
    "grpo_loss",
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "shift_causal_labels",
    "softcap_logits",
    "mini_sequence_apply",
    "KVStream",
    "chunk_bounds",
    "streambp_apply",
    "checkpoint_apply",
    "HostBufferPool",
    "LayerInputOffloader",
    "SavedTensor",
    "OffloadedTensor",
    "DiskStore",
    "DiskOffloader",
    "DiskTensor",
    "host_available_bytes",
    "linear_scan",
    "adjoint_scan",
    "truncated_adjoint",
    "LinearScan",
    "Recompute",
    "SparseInputs",
]
