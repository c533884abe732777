"""LongSeqConfig parsing: schema, every problem reported at once, no-effect warnings."""

import warnings

import pytest

from ds_longseq import LongSeqConfig, LongSeqConfigError


def test_defaults_and_round_trip():
    cfg = LongSeqConfig.from_dict({"streambp": {"enabled": True, "chunk_size": 512}, "lm_head": {"enabled": True}})
    assert cfg.streambp.enabled and cfg.streambp.chunk_size == 512 and cfg.attention.kv_block_size is None
    assert cfg.lm_head.chunk_size == 1024 and not cfg.mini_seq.enabled
    assert LongSeqConfig.from_dict(cfg.to_dict()) == cfg
    assert LongSeqConfig.from_dict(None) == LongSeqConfig() and not LongSeqConfig().any_enabled
    assert LongSeqConfig.from_dict({"attention": {"kv_block_size": 256}}).attention.kv_block_size == 256
    with pytest.raises(LongSeqConfigError, match="attention.kv_block_size must be a positive integer"):
        LongSeqConfig.from_dict({"attention": {"kv_block_size": 0}})


def test_streambp_kv_block_size_is_a_deprecated_alias_of_attention_kv_block_size():
    with pytest.warns(FutureWarning, match="streambp.kv_block_size is deprecated: set long_seq.attention"):
        cfg = LongSeqConfig.from_dict({"streambp": {"enabled": True, "kv_block_size": 256}})
    assert cfg.attention.kv_block_size == 256 and cfg.streambp.kv_block_size is None
    assert LongSeqConfig.from_dict(cfg.to_dict()) == cfg  # round-trips under the new name, no warning
    with pytest.warns(FutureWarning):  # the same value under both names is one setting
        same = LongSeqConfig.from_dict({"streambp": {"kv_block_size": 8}, "attention": {"kv_block_size": 8}})
    assert same.attention.kv_block_size == 8
    with pytest.raises(LongSeqConfigError, match=r"streambp.kv_block_size=8 and long_seq.attention.kv_block_size=4 "
                                                 "disagree"):
        LongSeqConfig.from_dict({"streambp": {"kv_block_size": 8}, "attention": {"kv_block_size": 4}})
    with pytest.raises(LongSeqConfigError, match="streambp.kv_block_size must be a positive integer"):
        LongSeqConfig.from_dict({"streambp": {"enabled": True, "kv_block_size": 0}})  # named as written
    built = LongSeqConfig()
    built.streambp.kv_block_size = 16  # set on the object: moved when it is validated
    with pytest.warns(FutureWarning):
        built.validate()
    assert built.attention.kv_block_size == 16


def test_every_problem_is_listed_in_one_error():
    with pytest.raises(LongSeqConfigError) as info:
        LongSeqConfig.from_dict(
            {
                "streambp": {"enabled": True, "chunk_sise": 8, "chunk_size": 0},
                "mini_seq": {"enabled": True, "mlp_num_chunks": -2},
                "lm_head": {"enabled": "yes", "chunk_size": 2.5},
                "ulysess": {},
            }
        )
    problems = info.value.problems
    text = str(info.value)
    assert len(problems) == 7, problems
    for needle in [
        "long_seq.streambp.'chunk_sise'",
        "long_seq.streambp.chunk_size must be a positive integer, got 0",
        "long_seq.mini_seq.mlp_num_chunks must be a positive integer, got -2",
        "long_seq.lm_head.enabled must be true or false, got 'yes'",
        "long_seq.lm_head.chunk_size must be a positive integer, got 2.5",
        "unknown key long_seq.'ulysess'",
        "both enabled",
    ]:
        assert needle in text, needle


@pytest.mark.parametrize("bad", [[1], {"streambp": 3}, {"streambp": {"chunk_size": True}}])
def test_wrong_types(bad):
    with pytest.raises(LongSeqConfigError):
        LongSeqConfig.from_dict(bad)


def test_a_plain_literal_field_takes_its_choices_only():
    """``sequence_parallel.recurrent`` is ``Literal["heads", "pass_state"]`` (no None): its choices are named."""
    assert LongSeqConfig.from_dict({"sequence_parallel": {"size": 2}}).sequence_parallel.recurrent == "heads"
    with pytest.raises(LongSeqConfigError, match="recurrent must be 'heads' or 'pass_state', got 'rings'"):
        LongSeqConfig.from_dict({"sequence_parallel": {"size": 2, "recurrent": "rings"}})


def test_options_of_a_disabled_section_warn():
    with pytest.warns(UserWarning, match="long_seq.streambp.enabled is false"):
        LongSeqConfig.from_dict({"streambp": {"chunk_size": 128}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LongSeqConfig.from_dict({"streambp": {"enabled": False}})
