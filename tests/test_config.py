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


def test_a_key_in_the_wrong_section_names_the_section_it_belongs_to():
    """``streambp.kv_block_size`` (the attention tile's old place) and any other misplaced key: the unknown-key
    message says where the key lives."""
    with pytest.raises(LongSeqConfigError) as info:
        LongSeqConfig.from_dict({"streambp": {"enabled": True, "kv_block_size": 256}, "mlp_num_chunks": 4})
    assert info.value.problems == [
        "unknown key long_seq.streambp.'kv_block_size': valid keys are ['auto_budget_gib', 'auto_free_fraction', "
        "'chunk_size', 'enabled', 'keep_attention_output']; 'kv_block_size' is long_seq.attention.kv_block_size: "
        "move it there",
        "unknown key long_seq.'mlp_num_chunks': valid keys are ['adjoint', 'approx_bp', 'attention', 'lm_head', "
        "'mini_seq', 'offload', 'sequence_parallel', 'streambp', 'watchdog']; 'mlp_num_chunks' is "
        "long_seq.mini_seq.mlp_num_chunks: move it there",
    ]
    with pytest.raises(LongSeqConfigError) as info:
        LongSeqConfig.from_dict({"streambp": {"chunk_sise": 8}})
    assert "move it there" not in str(info.value)  # a typo is in no section: no hint


def test_keep_every_without_a_layer_technique_is_one_problem():
    """The offload technique's ``needs_one_of`` is the only rule: one mistake, one line, naming the setting."""
    with pytest.raises(LongSeqConfigError) as info:
        LongSeqConfig.from_dict({"lm_head": {"enabled": True}, "offload": {"keep_every": 2}})
    assert len(info.value.problems) == 1, info.value.problems
    assert info.value.problems[0].startswith(
        "long_seq.offload.keep_every=2 needs long_seq.streambp or long_seq.mini_seq: ")
    assert "keep_every 1" in info.value.problems[0]  # the fix
    with pytest.raises(LongSeqConfigError) as info:
        LongSeqConfig.from_dict({"offload": {"layer_inputs": "cpu", "keep_every": 2}})
    assert info.value.problems == [info.value.problems[0]] and info.value.problems[0].startswith(
        "long_seq.offload.layer_inputs='cpu' with keep_every=2 needs long_seq.streambp or long_seq.mini_seq")


def test_a_config_built_in_code_is_checked_by_the_same_rules():
    """``validate`` (what ``enable`` runs on a LongSeqConfig it is handed) applies the annotations' rules and the
    sections' own ``problems()`` as ``from_dict`` does."""
    built = LongSeqConfig()
    built.streambp.auto_free_fraction = 1.5
    built.watchdog.peer_timeout_s = 2.0
    with pytest.raises(LongSeqConfigError) as info:
        built.validate()
    assert info.value.problems == [
        "long_seq.streambp.auto_free_fraction must be a fraction in (0, 1], got 1.5",
        "long_seq.streambp.auto_budget_gib and auto_free_fraction are only used with chunk_size='auto' (got "
        "chunk_size=1024): set chunk_size to 'auto', or remove them",
        "long_seq.watchdog.peer_timeout_s=2 must exceed 3 x heartbeat_s=1: a live rank could be declared dead "
        "between two heartbeats; raise peer_timeout_s or lower heartbeat_s",
    ]


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
        # a field that also takes a named value lists it ("auto")
        "long_seq.streambp.chunk_size must be a positive integer or 'auto', got 0",
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


def test_a_registered_section_brings_its_own_rules():
    """A technique's own section is checked like the built-in ones: its fields by their annotations (a ``Rule``
    wording the good values), its ``problems()`` between fields; every problem at once."""
    from dataclasses import dataclass
    from typing import Annotated

    from ds_longseq.config import Rule
    from ds_longseq.techniques import Technique, register, unregister

    @dataclass
    class WindowConfig:
        enabled: bool = False
        """Switch it on."""
        share: Annotated[float, Rule("a share in (0, 1)", lambda v: v < 1)] = 0.5
        """A share."""
        low: int = 1
        """The lower bound."""
        high: int = 2
        """The upper bound."""

        def problems(self) -> list[str]:
            return [] if self.low < self.high else [f"long_seq.window.low={self.low} must be below high={self.high}"]

    class Window(Technique):
        name = "window"
        Config = WindowConfig

    register(Window)
    try:
        assert LongSeqConfig.from_dict({"window": {"enabled": True, "share": 0.25}}).window.share == 0.25
        with pytest.raises(LongSeqConfigError) as info:
            LongSeqConfig.from_dict({"window": {"enabled": True, "share": 1.5, "low": 3, "high": 0}})
        assert info.value.problems == [
            "long_seq.window.share must be a share in (0, 1), got 1.5",
            "long_seq.window.high must be a positive integer, got 0",
            "long_seq.window.low=3 must be below high=0",
        ]
    finally:
        unregister(Window)
