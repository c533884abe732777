"""The one package that touches third parties' private names: DeepSpeed's, transformers', torch's, the Trainer
family's (transformers' Trainer, TRL, accelerate) and bitsandbytes', one module per library.

Modules:
    versions: TESTED_VERSIONS, the lowest and highest release of each dependency the suite runs on; every
        difference between the two ends is in the modules below, named by the release it covers.
    transformers_shims: activation checkpointing under either name, ``_attn_implementation``, the output collector,
        Gemma 4's K/V-shared slicing, the KV cache keyword, packed chunk counting, keys left out on save.
    torch_shims: a module's parameters read as other tensors, a modeling module's function stood in for, a
        tensor's version counter, matrix products left uncomputed below autograd, torch.distributed's default
        group and store.
    deepspeed_shims: DeepSpeed's sequence-parallel group and all-to-all, ZeRO-3's leaf flag and partition mark,
        ``deepspeed.initialize`` stood in for, checkpoint parallel dimensions, ZeRO-1/2 flat buffers detached.
    deepspeed_repairs: ZeRO-3's gradient average under sequence parallelism (keyed on checked releases) and what
        the universal-checkpoint load leaves wrong.
    trainer_shims: the Hugging Face Trainer's, TRL's and accelerate's internals.
    weight_formats: GGUF-loaded models made plain, bitsandbytes' 4-bit linears kept off their CPU repacking.
    touches: TOUCHES_ELSEWHERE, the few touches of third-party internals or objects that must sit outside this
        package, each with its reason (tests/test_compat.py fails on any other).

Every name here is private to its library and may move in any release; ``setup.py``'s ranges are the versions the
test suite ran with (docs/VERSIONS.md). Callers import from ``ds_longseq.compat``; the names below are its public
API, each defined in the module above that covers its library.

Not here, each listed in ``TOUCHES_ELSEWHERE`` with its reason: ``torch.ops.aten._*`` attention kernels in
``ops/tile_kernels.py``'s kernel table (torch's operator registry, each kernel tested against the math path on every
device that runs it), the per-instance patch of ``techniques/base.py``, and a few documented hooks.
"""

from __future__ import annotations

from ds_longseq.compat.deepspeed_repairs import (
    ZERO3_SP_AVERAGE_VERSIONS,
    fix_zero3_sequence_parallel_average,
    repair_universal_load,
    zero3_sequence_parallel_problem,
)
from ds_longseq.compat.deepspeed_shims import (
    Z3_LEAF_ATTR,
    checkpoint_parallel_dims_keys,
    deepspeed_initialize_replaced,
    deepspeed_sp_group,
    dim_zero_all_to_all,
    full_numel,
    is_zero3_partitioned,
    zero_flat_buffers_detached,
)
from ds_longseq.compat.torch_shims import (
    default_process_group,
    default_store,
    module_function_replaced,
    parameters_replaced,
    products_uncomputed,
    tensor_version,
)
from ds_longseq.compat.touches import TOUCHES_ELSEWHERE
from ds_longseq.compat.trainer_shims import (
    accelerate_parallelism_hidden,
    accelerator_gather_replaced,
    dataloader_resharded,
    trainer_checkpointing_turned_off,
    trainer_counts_batch_tokens,
    trainer_loss_scale,
    trainer_micro_batch_size,
    trainer_num_items_in_batch,
    trainer_prepared_inputs,
    trl_entropy_bonus_enabled,
    trl_makes_fused_head_calls,
    trl_metrics,
)
from ds_longseq.compat.transformers_shims import (
    CACHE_KWARGS,
    CHECKPOINTING_OFF_CALL,
    KV_SHARED_SLICING,
    activation_checkpointing_on,
    cache_kwarg,
    check_output_capturing,
    get_attn_implementation,
    keys_ignored_on_save,
    output_collector,
    packed_chunks_count_from_documents,
    pop_cache,
    set_activation_checkpointing,
    set_attn_implementation,
    unsliced_kv_shared_inputs,
)
from ds_longseq.compat.versions import TESTED_VERSIONS
from ds_longseq.compat.weight_formats import drop_gguf_quantization_marker, keep_4bit_weights_unpacked

__all__ = [
    "TESTED_VERSIONS",
    "activation_checkpointing_on",
    "set_activation_checkpointing",
    "CHECKPOINTING_OFF_CALL",
    "get_attn_implementation",
    "set_attn_implementation",
    "output_collector",
    "check_output_capturing",
    "KV_SHARED_SLICING",
    "unsliced_kv_shared_inputs",
    "CACHE_KWARGS",
    "cache_kwarg",
    "pop_cache",
    "packed_chunks_count_from_documents",
    "keys_ignored_on_save",
    "deepspeed_sp_group",
    "dim_zero_all_to_all",
    "Z3_LEAF_ATTR",
    "is_zero3_partitioned",
    "full_numel",
    "deepspeed_initialize_replaced",
    "checkpoint_parallel_dims_keys",
    "zero_flat_buffers_detached",
    "ZERO3_SP_AVERAGE_VERSIONS",
    "zero3_sequence_parallel_problem",
    "fix_zero3_sequence_parallel_average",
    "repair_universal_load",
    "parameters_replaced",
    "module_function_replaced",
    "tensor_version",
    "products_uncomputed",
    "default_process_group",
    "default_store",
    "drop_gguf_quantization_marker",
    "keep_4bit_weights_unpacked",
    "trainer_checkpointing_turned_off",
    "trainer_counts_batch_tokens",
    "trainer_micro_batch_size",
    "trainer_num_items_in_batch",
    "trainer_prepared_inputs",
    "trainer_loss_scale",
    "trl_metrics",
    "trl_entropy_bonus_enabled",
    "trl_makes_fused_head_calls",
    "accelerator_gather_replaced",
    "accelerate_parallelism_hidden",
    "dataloader_resharded",
    "TOUCHES_ELSEWHERE",
]
