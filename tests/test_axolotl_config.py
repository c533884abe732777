"""The axolotl plugin's checks without axolotl (``ds_longseq.integrations.axolotl_config``): the ``long_seq:`` block in
axolotl's pydantic schema, parsed by ds_longseq's own parser; where the section comes from (the YAML, the DeepSpeed
config, both); and every axolotl setting refused beside it, each in its one line. pydantic comes with DeepSpeed, so
these run wherever ds_longseq does; tests/test_axolotl.py runs the plugin inside axolotl (the floor run)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pydantic", reason="the plugin's schema is a pydantic model")

from ds_longseq.config import LongSeqConfig, LongSeqConfigError  # noqa: E402
from ds_longseq.config_files import ConfigFileError  # noqa: E402
from ds_longseq.integrations.axolotl_config import (  # noqa: E402
    AXOLOTL_RULES,
    PLUGIN,
    AxolotlConfigError,
    LongSeqArgs,
    axolotl_problems,
    lists_the_plugin,
    read_long_seq,
)
from ds_longseq.resolver import Launch, RunCannotStart, resolve  # noqa: E402

BLOCK = {"streambp": {"enabled": True, "chunk_size": 12}, "lm_head": {"enabled": True, "chunk_size": 16}}
ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
         "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
BAD = {"streambp": {"enabled": True, "chunk_size": 0}, "lm_head": {"chunk": 16}}


def _problems_of(fn) -> list[str]:
    with pytest.raises(LongSeqConfigError) as info:
        fn()
    return info.value.problems


def test_the_block_in_axolotls_schema_is_parsed_by_ds_longseq():
    from pydantic import ValidationError

    assert LongSeqArgs(long_seq=BLOCK).long_seq == BLOCK  # stays a dict in axolotl's config
    assert LongSeqArgs().long_seq is None
    with pytest.raises(ValidationError) as info:
        LongSeqArgs(long_seq=BAD)
    problems = _problems_of(lambda: LongSeqConfig.from_dict(BAD))
    assert len(problems) == 2
    for problem in problems:  # the parser's words, under pydantic's heading
        assert problem in str(info.value)


def test_which_configs_list_the_plugin():
    """axolotl calls every registered plugin for every config of the process: the plugin acts on those listing it."""
    assert lists_the_plugin({"plugins": [PLUGIN]}) and lists_the_plugin({"plugins": [
        "axolotl.integrations.liger.LigerPlugin", "ds_longseq.integrations.LongSeqPlugin"]})
    assert not lists_the_plugin({"plugins": ["axolotl.integrations.liger.LigerPlugin"]}) and not lists_the_plugin({})


def test_the_block_resolves_as_at_every_entry_point():
    found = read_long_seq({"long_seq": BLOCK})
    assert found.config == resolve({"long_seq": BLOCK}, launch=Launch(deepspeed=False)).long_seq
    assert found.for_trainer is found.config  # no DeepSpeed config carries it: the Trainer is handed the block
    # the resolver's problems alone: its own error, word for word
    with pytest.raises(RunCannotStart) as ours:
        read_long_seq({"long_seq": BAD})
    with pytest.raises(RunCannotStart) as theirs:
        resolve({"long_seq": BAD}, launch=Launch(deepspeed=False))
    assert str(ours.value) == str(theirs.value)
    # against the DeepSpeed config and the ranks: 2 ranks per sequence cannot group 3
    block = {**BLOCK, "sequence_parallel": {"size": 2}}
    cfg = {"long_seq": block, "deepspeed": ZERO2, "max_steps": 3}
    with pytest.raises(RunCannotStart) as ours:
        read_long_seq(cfg, world=3)
    with pytest.raises(RunCannotStart) as theirs:
        resolve({**ZERO2, "long_seq": block}, launch=Launch(world=3, deepspeed=True))
    assert str(ours.value) == str(theirs.value)
    assert "sequence_parallel size 2 does not divide the 3 ranks" in str(ours.value)


def test_where_the_section_comes_from(tmp_path):
    config = LongSeqConfig.from_dict(BLOCK)
    # in the DeepSpeed config alone (a dict, or a file): read there, as the Trainer reads it
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**ZERO2, "long_seq": BLOCK}))
    for deepspeed in ({**ZERO2, "long_seq": BLOCK}, str(path)):
        found = read_long_seq({"deepspeed": deepspeed})
        assert found.config == config and found.for_trainer is None
    # in both, the same settings (the defaults spelt out in one): the DeepSpeed config's, where the Trainer reads it
    spelt = {**BLOCK, "streambp": {**BLOCK["streambp"], "keep_attention_output": "auto"}, "mini_seq": {}}
    found = read_long_seq({"long_seq": spelt, "deepspeed": str(path)})
    assert found.config == config and found.for_trainer is None
    # in both, different: refused, naming both
    other = {**BLOCK, "lm_head": {"enabled": True, "chunk_size": 32}}
    assert _problems_of(lambda: read_long_seq({"long_seq": other, "deepspeed": str(path)})) == [
        f"long_seq is in the YAML and in the DeepSpeed config {str(path)!r} with different settings: keep the YAML "
        "block (the one source) and remove the DeepSpeed config's long_seq section"]
    # nowhere
    assert _problems_of(lambda: read_long_seq({"deepspeed": ZERO2})) == [
        f"plugins lists {PLUGIN} but the config has no long_seq block: add one (long_seq: {{streambp: {{enabled: "
        "true}, ...}; docs/AXOLOTL.md), or remove the plugin"]
    with pytest.raises(ConfigFileError, match="cannot read the DeepSpeed config"):
        read_long_seq({"long_seq": BLOCK, "deepspeed": str(tmp_path / "missing.json")})


# rule -> [(axolotl's config besides the block, the block, ranks, the one line)]
SP2 = {**BLOCK, "sequence_parallel": {"size": 2}}
RULE_CASES = {
    "_trainer_the_plugin_wraps": [({"rl": "dpo"}, BLOCK, None, (
        "rl: 'dpo' trains through axolotl's RL trainers, which the ds_longseq plugin does not wrap (it wraps the "
        "causal-LM trainer): remove the plugin, or train DPO / GRPO with ds-longseq dpo / grpo or TRL's trainers with "
        "with_long_seq (docs/TRAINER.md)"))],
    "_axolotl_context_parallel": [({"context_parallel_size": 2}, BLOCK, None, (
        "context_parallel_size=2 is axolotl's own sequence parallelism (ring-flash-attn), which would cut the "
        "sequences ds_longseq already cuts: remove context_parallel_size and set long_seq.sequence_parallel.size: 2"))],
    "_tiled_mlp": [({"tiled_mlp": True}, BLOCK, None, (
        "tiled_mlp: true is axolotl's ALST tiled MLP, which replaces the MLP forward ds_longseq runs itself: remove "
        "tiled_mlp (StreamBP already runs the MLP a chunk at a time; without StreamBP, long_seq.mini_seq tiles the "
        "MLP)"))],
    "_checkpointing_under_streambp": [({"gradient_checkpointing": True}, BLOCK, None, (
        "gradient_checkpointing: true recomputes the decoder layers that long_seq.streambp already recomputes chunk "
        "by chunk from their inputs: remove gradient_checkpointing (StreamBP keeps only each layer's input; "
        "long_seq.offload.layer_inputs: cpu moves those to host memory)"))],
    "_packed_rows_ds_longseq_can_read": [
        ({"sample_packing": True, "attn_implementation": None, "attn_decontaminates_packing": False}, BLOCK, None, (
            "sample_packing with attn_implementation=None keeps axolotl's per-document attention_mask (1, 2, 3, ...) "
            "beside the restarting position ids, which ds_longseq does not read as documents: use attn_implementation "
            "sdpa or eager (axolotl then drops the mask and ds_longseq finds the documents from the position ids), or "
            "turn sample_packing off")),
        ({"sample_packing": True, "pretraining_dataset": [{"path": "c4"}], "pretrain_multipack_attn": False}, BLOCK,
         None, ("sample_packing with pretrain_multipack_attn: false packs documents without position ids, so nothing "
                "tells the model where one ends: set pretrain_multipack_attn: true (the documents then restart their "
                "position ids, which ds_longseq reads), or turn sample_packing off")),
    ],
    "_deepspeed_for_several_processes": [
        ({"fsdp_config": {"fsdp_version": 2}}, BLOCK, None, (
            "fsdp / fsdp_config: ds_longseq runs through DeepSpeed (ZeRO-2 / ZeRO-3), not FSDP: remove the FSDP "
            "settings and set deepspeed: <a DeepSpeed JSON> (docs/AXOLOTL.md)")),
        ({}, BLOCK, 2, (
            "2 processes without deepspeed: ds_longseq runs several processes through DeepSpeed: set deepspeed: <a "
            "DeepSpeed JSON> (ZeRO-2: docs/AXOLOTL.md), or run one process")),
    ],
    "_steps_under_sequence_parallelism": [({"deepspeed": ZERO2, "warmup_steps": 0}, SP2, 2, (
        "long_seq.sequence_parallel.size=2 without max_steps: axolotl counts every rank a data-parallel replica when "
        "it turns num_epochs into steps, but 2 ranks share each sequence, so the run would stop after 1/2 of an "
        "epoch: set max_steps"))],
    "_warmup_under_sequence_parallelism": [
        ({"deepspeed": ZERO2, "max_steps": 3, "warmup_ratio": 0.1}, SP2, 2, (
            "long_seq.sequence_parallel.size=2 with warmup_ratio: 0.1: axolotl sizes the warmup from a step count that "
            "takes every rank for a data-parallel replica, 2 times too few under sequence parallelism: set "
            "warmup_steps (0 for none)")),
        ({"deepspeed": ZERO2, "max_steps": 3}, SP2, 2, (
            "long_seq.sequence_parallel.size=2 with axolotl's default warmup: axolotl sizes the warmup from a step "
            "count that takes every rank for a data-parallel replica, 2 times too few under sequence parallelism: set "
            "warmup_steps (0 for none)")),
    ],
}
CASES = [(rule, *case) for rule, cases in RULE_CASES.items() for case in cases]


def test_every_rule_has_a_case():
    assert {rule.__name__ for rule in AXOLOTL_RULES} == set(RULE_CASES)


@pytest.mark.parametrize("rule, cfg, block, world, line", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_axolotl_setting_is_refused_in_one_line(rule, cfg, block, world, line):
    assert "\n" not in line
    assert axolotl_problems(cfg, LongSeqConfig.from_dict(block), world) == [line]
    # through the plugin's check of the whole config: that line alone
    assert _problems_of(lambda: read_long_seq({**cfg, "long_seq": block}, world=world)) == [line]
    # what makes the rule fire, taken away: nothing refused
    fixed = {"max_steps": 3, "warmup_steps": 0} if "sequence_parallelism" in rule else {
        "deepspeed": ZERO2} if world else {key: None for key in cfg}
    assert axolotl_problems({**cfg, **fixed}, LongSeqConfig.from_dict(block), world) == []


def test_what_is_not_refused():
    ok = {"sample_packing": True, "attn_implementation": "sdpa", "attn_decontaminates_packing": True,
          "context_parallel_size": 1, "tiled_mlp": False, "gradient_checkpointing": False, "world_size": 1}
    assert axolotl_problems(ok, LongSeqConfig.from_dict(BLOCK), 1) == []
    # checkpointing without StreamBP (the chunked head alone) is the user's choice
    head_only = LongSeqConfig.from_dict({"lm_head": {"enabled": True}})
    assert axolotl_problems({"gradient_checkpointing": True}, head_only) == []


def test_every_problem_at_once():
    """The resolver's problems and the axolotl settings', in one error (the resolver's first)."""
    problems = _problems_of(lambda: read_long_seq({"long_seq": BAD, "tiled_mlp": True}))
    resolver = _problems_of(lambda: resolve({"long_seq": BAD}, launch=Launch(deepspeed=False)))
    assert problems[:-1] == resolver and problems[-1].startswith("tiled_mlp: true is axolotl's ALST tiled MLP")
    with pytest.raises(AxolotlConfigError, match=r"^ds_longseq cannot train this axolotl config \(3 problems\):"):
        read_long_seq({"long_seq": BAD, "tiled_mlp": True})
