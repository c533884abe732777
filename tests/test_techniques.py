"""The technique layout: a technique added from this one file, with no edit anywhere else.

``Stamp`` and ``Ledger`` below are complete techniques: a config section each (parsed, checked and
round-tripped like the built-in ones), what they check on a model, what they install, what they run after
and what they conflict with. ``enable()`` must apply them in the declared order (Ledger is registered
first but declares it runs after Stamp and after StreamBP), refuse the declared conflict when the config
is parsed, report their model checks with the built-in ones, and ``disable()`` must undo what they did.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ds_longseq
from ds_longseq.config import LongSeqConfigError
from ds_longseq.techniques import EnableContext, Technique, active_techniques, register, unregister

INSTALLED: list[str] = []  # the order in which the techniques below installed themselves


@dataclass
class StampConfig:
    """Adds a constant to the final norm's output (a visible, undoable change)."""

    enabled: bool = False
    """Switch the technique on."""
    value: float = 1.0
    """The constant added."""


@dataclass
class LedgerConfig:
    """Records, on the model, which techniques were installed before it."""

    enabled: bool = False
    """Switch the technique on."""
    max_layers: int = 8
    """Refuse models with more decoder layers than this (a model check)."""


class Ledger(Technique):
    name = "ledger"
    Config = LedgerConfig
    run_after = ("stamp", "streambp")
    conflicts_with = {"mini_seq": "the ledger only records StreamBP runs; disable long_seq.mini_seq"}

    def check(self, ctx: EnableContext) -> list[str]:
        n = len(ctx.adapter.layers)
        limit = ctx.config.ledger.max_layers
        return [] if n <= limit else [f"long_seq.ledger.max_layers={limit} but the model has {n} layers"]

    def install(self, ctx: EnableContext) -> None:
        INSTALLED.append(self.name)
        ctx.handle.set_instance_attr(ctx.model, "ledger", [type(t).__name__ for t in ctx.handle.techniques])


class Stamp(Technique):
    name = "stamp"
    Config = StampConfig

    def install(self, ctx: EnableContext) -> None:
        INSTALLED.append(self.name)
        norm = ctx.adapter.final_norm
        stock, value = norm.forward, ctx.config.stamp.value
        ctx.handle.set_instance_attr(norm, "forward", lambda hidden: stock(hidden) + value)


@pytest.fixture
def techniques():
    INSTALLED.clear()
    register(Ledger)  # registered first: the order must come from run_after, not from registration
    register(Stamp)
    yield
    unregister(Ledger)
    unregister(Stamp)


def tiny_llama(layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).double().eval()


CFG = {"streambp": {"enabled": True, "chunk_size": 4}, "ledger": {"enabled": True}, "stamp": {"enabled": True}}


def test_sections_parse_check_and_round_trip(techniques):
    cfg = ds_longseq.LongSeqConfig.from_dict({**CFG, "stamp": {"enabled": True, "value": 0.5}})
    assert cfg.stamp.value == 0.5 and cfg.ledger.max_layers == 8 and cfg.section("stamp") is cfg.stamp
    assert ds_longseq.LongSeqConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(LongSeqConfigError, match=r"long_seq.ledger.max_layers must be a positive integer, got 0"):
        ds_longseq.LongSeqConfig.from_dict({"ledger": {"enabled": True, "max_layers": 0}})
    with pytest.raises(LongSeqConfigError, match="unknown key long_seq.stamp.'valu'"):
        ds_longseq.LongSeqConfig.from_dict({"stamp": {"enabled": True, "valu": 1.0}})


@pytest.mark.kernel_paths
def test_enable_applies_them_in_the_declared_order_and_disable_undoes(techniques):
    model = tiny_llama()
    ids = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        stock = model(ids).logits
    cfg = ds_longseq.LongSeqConfig.from_dict(CFG)
    assert [type(t).__name__ for t in active_techniques(cfg)] == ["StreamBP", "Stamp", "Ledger"]
    ds_longseq.enable(model, CFG)
    assert INSTALLED == ["stamp", "ledger"] and model.ledger == ["StreamBP", "Stamp"]
    with torch.no_grad():
        stamped = model(ids).logits
    head = model.lm_head.weight.sum(dim=1)  # the stamp adds value * (row sums of the head) to every logit
    torch.testing.assert_close(stamped, stock + head, rtol=0, atol=1e-12)
    ds_longseq.disable(model)
    assert "ledger" not in model.__dict__
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock, rtol=0, atol=0)  # the stock forward again: bitwise


def test_the_declared_conflict_is_refused_when_the_config_is_parsed(techniques):
    with pytest.raises(LongSeqConfigError) as info:
        ds_longseq.LongSeqConfig.from_dict({"mini_seq": {"enabled": True}, "ledger": {"enabled": True}})
    assert "long_seq.ledger and long_seq.mini_seq are both enabled: the ledger only records StreamBP runs" in str(
        info.value
    )


def test_model_checks_are_reported_with_the_built_in_ones_before_anything_changes(techniques):
    model = tiny_llama(layers=3)
    model.loss_type = "ForMaskedLM"  # the chunked head's own refusal, reported in the same error
    cfg = {**CFG, "ledger": {"enabled": True, "max_layers": 2}, "lm_head": {"enabled": True}}
    with pytest.raises(ds_longseq.UnsupportedModelError) as info:
        ds_longseq.enable(model, cfg)
    text = str(info.value)
    assert "model.loss_type='ForMaskedLM': the chunked lm_head computes the causal-LM loss only" in text
    assert "long_seq.ledger.max_layers=2 but the model has 3 layers" in text
    assert INSTALLED == [] and not ds_longseq.is_enabled(model) and "forward" not in model.model.norm.__dict__


def test_a_run_after_circle_or_unknown_name_is_refused(techniques):
    class Loop(Technique):
        name = "loop"
        Config = LedgerConfig
        run_after = ("ledger",)

    class Knot(Technique):
        name = "knot"
        Config = LedgerConfig
        run_after = ("no_such_technique",)

    Ledger.run_after = ("stamp", "streambp", "loop")
    register(Loop)
    try:
        with pytest.raises(LongSeqConfigError, match="form a circle"):
            active_techniques(ds_longseq.LongSeqConfig.from_dict({"ledger": {"enabled": True},
                                                                  "loop": {"enabled": True}}))
        register(Knot)
        with pytest.raises(LongSeqConfigError, match="run_after 'no_such_technique', which is not a registered"):
            active_techniques(ds_longseq.LongSeqConfig())
    finally:
        Ledger.run_after = ("stamp", "streambp")
        unregister(Loop)
        unregister(Knot)


def test_registering_twice_or_a_non_technique_is_refused(techniques):
    with pytest.raises(ValueError, match="already registered"):
        register(Ledger)
    with pytest.raises(TypeError, match="Technique subclass"):
        register(LedgerConfig)


def test_the_built_in_techniques_are_registered_and_the_section_goes_with_unregister():
    names = list(ds_longseq.config.registered_techniques())
    assert set(names) == {"approx_bp", "sequence_parallel", "offload", "streambp", "mini_seq", "lm_head", "adjoint"}
    assert "stamp" not in ds_longseq.config.registered_techniques()
    with pytest.raises(LongSeqConfigError, match="unknown key long_seq.'stamp'"):
        ds_longseq.LongSeqConfig.from_dict({"stamp": {"enabled": True}})


def test_forward_only_config_keeps_what_a_reference_model_needs():
    """A model that only runs forwards beside the trained one (TRL DPO's reference) gets the sections of the
    techniques that declare forward_only (sequence parallelism, the chunked head) and those no technique owns
    (attention, watchdog); StreamBP, offload and the rest stay off."""
    from ds_longseq.config import LongSeqConfig
    from ds_longseq.techniques import forward_only_config

    cfg = LongSeqConfig.from_dict({
        "streambp": {"enabled": True, "chunk_size": 64}, "offload": {"layer_inputs": "cpu"},
        "sequence_parallel": {"size": 2}, "lm_head": {"enabled": True, "chunk_size": 32},
        "attention": {"kv_block_size": 16}, "watchdog": {"heartbeat_s": 2.0, "peer_timeout_s": 30.0},
    })
    ref = forward_only_config(cfg)
    default = LongSeqConfig()
    assert (ref.sequence_parallel, ref.lm_head, ref.attention, ref.watchdog) == (
        cfg.sequence_parallel, cfg.lm_head, cfg.attention, cfg.watchdog)
    assert ref.sequence_parallel is not cfg.sequence_parallel  # copies: the policy's sections are its own
    assert (ref.streambp, ref.offload, ref.mini_seq, ref.approx_bp) == (
        default.streambp, default.offload, default.mini_seq, default.approx_bp)
    assert sorted(t.name for t in active_techniques(ref)) == ["lm_head", "sequence_parallel"]
