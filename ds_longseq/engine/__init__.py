"""DeepSpeed integration: ``initialize`` with the ``long_seq`` config section, sequence-parallel batches,
the peer watchdog; ``engine.manifest`` and ``engine.reshape`` (imported by name) hold what a checkpoint records and
the resume on another number of ranks, for the scripts' toolkit and the Trainer alike."""

from ds_longseq.engine.initialize import (
    DEFAULT_DISTRIBUTED_PORT,
    MIN_DEEPSPEED_VERSION,
    check_sequence_length,
    initialize,
    initialize_with,
    split_config,
)
from ds_longseq.engine.preflight import PreflightError, available_memory, memory_preflight
from ds_longseq.engine.sp_groups import (
    WholeSequenceCalls,
    data_parallel_rank_and_size,
    sequence_from_shards,
    sequence_parallel_groups,
    sequence_parallel_rank_and_size,
    shard_batch,
    shard_sequence,
    sp_layout_of,
)
from ds_longseq.ops.sp_layout import SPLayout
from ds_longseq.processes.watchdog import PEER_GONE_EXIT_CODE, active_watch, start_watchdog

__all__ = [
    "initialize",
    "initialize_with",
    "split_config",
    "check_sequence_length",
    "memory_preflight",
    "available_memory",
    "PreflightError",
    "MIN_DEEPSPEED_VERSION",
    "DEFAULT_DISTRIBUTED_PORT",
    "shard_batch",
    "shard_sequence",
    "sequence_from_shards",
    "sp_layout_of",
    "SPLayout",
    "WholeSequenceCalls",
    "data_parallel_rank_and_size",
    "sequence_parallel_groups",
    "sequence_parallel_rank_and_size",
    "start_watchdog",
    "active_watch",
    "PEER_GONE_EXIT_CODE",
]
