"""DeepSpeed integration: ``initialize`` with the ``long_seq`` config section, sequence-parallel batches."""

from ds_longseq.engine.initialize import (
    MIN_DEEPSPEED_VERSION,
    check_sequence_length,
    initialize,
    initialize_with,
    split_config,
)
from ds_longseq.engine.sequence_parallel import (
    sequence_parallel_groups,
    sequence_parallel_rank_and_size,
    shard_batch,
)

__all__ = [
    "initialize",
    "initialize_with",
    "split_config",
    "check_sequence_length",
    "MIN_DEEPSPEED_VERSION",
    "shard_batch",
    "sequence_parallel_groups",
    "sequence_parallel_rank_and_size",
]
