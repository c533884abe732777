"""DeepSpeed integration: ``initialize`` with the ``long_seq`` config section."""

from ds_longseq.engine.initialize import MIN_DEEPSPEED_VERSION, check_sequence_length, initialize, split_config

__all__ = ["initialize", "split_config", "check_sequence_length", "MIN_DEEPSPEED_VERSION"]
