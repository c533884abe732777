"""Each entry point parses the ``long_seq`` section once: the typed ``LongSeqConfig`` flows from there to where it
is used (the preflight, the planner, ``enable``, DeepSpeed's engine) instead of being parsed again from a dict.

A spy on ``LongSeqConfig.from_dict`` (the one parser) counts its calls, whatever they are given, through each
entry point: ``engine.initialize``, the planner's command line, the memory preflight, and the examples' setup
(``toolkit.setup_run``, what examples/sft.py, dpo.py and grpo.py call before training).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from ds_longseq.config import LongSeqConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG_SEQ = {"streambp": {"enabled": True, "chunk_size": 32}, "lm_head": {"enabled": True, "chunk_size": 16}}
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}


@pytest.fixture
def parses(monkeypatch) -> list:
    """The arguments of every ``LongSeqConfig.from_dict`` call from here on (``LongSeqConfig.of`` goes through it
    for a dict, so it is counted too)."""
    calls = []
    parse = LongSeqConfig.from_dict.__func__

    def counting(cls, data):
        calls.append(data)
        return parse(cls, data)

    monkeypatch.setattr(LongSeqConfig, "from_dict", classmethod(counting))
    return calls


class _StandInEngine:
    """What ``deepspeed.initialize`` returns, as far as the entry points read it."""

    def __init__(self, model):
        self.module = model
        self.device = torch.device("cpu")
        self.optimizer = None


def _stand_in_initialize(seen: list):
    def initialize(*, model, config, **kwargs):
        seen.append(config)
        return _StandInEngine(model), None, None, None

    return initialize


def test_engine_initialize_parses_once(parses):
    """A dict config: parsed by split_config; the preflight (seq_len=) and enable are handed the parsed object."""
    import ds_longseq
    import ds_longseq.engine
    from tests.helpers import make_model

    seen = []
    model = make_model("llama", torch.float32)
    ds_longseq.engine.initialize_with(_stand_in_initialize(seen), model=model, seq_len=64, config={
        "train_micro_batch_size_per_gpu": 1, "long_seq": LONG_SEQ})
    assert len(parses) == 1 and parses[0] == LONG_SEQ, parses
    assert ds_longseq.is_enabled(model) and "long_seq" not in seen[0]  # it ran through: enable, then DeepSpeed


def test_planner_command_line_parses_once(parses, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "long_seq": LONG_SEQ}))
    from ds_longseq import plan

    assert plan.main(["--model", str(tmp_path), "--ds-config", str(ds), "--seq-len", "8192", "--lora-rank", "16"]) == 0
    assert "method streambp" in capsys.readouterr().out
    assert len(parses) == 1 and parses[0] == LONG_SEQ, parses
    assert plan.main(["--model", str(tmp_path), "--seq-len", "8192", "--lora-rank", "16"]) == 0  # its default config
    assert len(parses) == 2, parses


def test_planner_setup_reads_a_parsed_section_as_it_is(parses):
    from ds_longseq import plan

    parsed = LongSeqConfig.from_dict({"mini_seq": {"enabled": True}, "offload": {"layer_inputs": "cpu"}})
    parses.clear()
    in_config = plan.Setup.from_configs({"long_seq": parsed})
    given = plan.Setup.from_configs({"long_seq": {"streambp": {"enabled": True}}}, long_seq=parsed)  # it wins
    for setup in (in_config, given):
        assert setup.method == "mst" and setup.offload_layer_inputs and setup.chunk_size == 1024
    assert parses == []


def test_memory_preflight_parses_once(parses):
    from ds_longseq.engine import memory_preflight

    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "long_seq": LONG_SEQ}
    GIB = 1024**3
    assert memory_preflight(LLAMA_8B, ds, 8192, lora_rank=16, device="cuda", memory=(80 * GIB, 500 * GIB)).fits
    assert len(parses) == 1 and parses[0] == LONG_SEQ, parses
    parsed = LongSeqConfig.from_dict(LONG_SEQ)
    assert memory_preflight(LLAMA_8B, {**ds, "long_seq": parsed}, 8192, lora_rank=16, device="cuda",
                            memory=(80 * GIB, 500 * GIB)).fits
    assert len(parses) == 2, parses  # the parsed section is read as it is


def test_example_setup_parses_once(parses, monkeypatch, tmp_path):
    """examples/sft.py's setup (``toolkit.setup_run``): start_distributed parses the DeepSpeed JSON's section;
    the preflight, engine.initialize and enable get the object. One process, DeepSpeed's engine stood in for."""
    import deepspeed

    import ds_longseq
    from ds_longseq.toolkit import distributed, setup_run

    config = json.load(open(os.path.join(ROOT, "ds_configs", "zero2_streambp.json")))
    config["long_seq"] = LONG_SEQ
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    monkeypatch.setattr(distributed, "init_process_group", lambda: (0, 1))  # one process: no process group
    seen = []
    monkeypatch.setattr(deepspeed, "initialize", _stand_in_initialize(seen))
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import sft
    finally:
        sys.path.pop(0)
    args = sft.parse_args(["--ds_config", str(path), "--seq-len", "64", "--max-steps", "1",
                           "--save-dir", str(tmp_path / "run")])
    run = setup_run(args)
    assert len(parses) == 1 and parses[0] == LONG_SEQ, parses
    assert ds_longseq.is_enabled(run.model) and run.long_seq.streambp.chunk_size == 32 and len(seen) == 1


def _trainer_body(rank: int, workdir: str, model_dir: str, given: str):
    """A LongSeqTrainer built and trained one step on this rank, its section in the DeepSpeed config (``given``
    "ds") or passed as ``long_seq=`` (a dict, or an already parsed LongSeqConfig: "object"); returns how many
    times the section was parsed."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from ds_longseq.trainer import LongSeqTrainer
    from tests.test_trainer import _samples, collate, ds_config

    calls = []
    parse = LongSeqConfig.from_dict.__func__
    LongSeqConfig.from_dict = classmethod(lambda cls, data: calls.append(data) or parse(cls, data))
    try:
        config = ds_config(2, 1)
        section = config.pop("long_seq")
        if given == "ds":
            config["long_seq"] = section
        args = TrainingArguments(
            output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=2, max_steps=1, report_to=[],
            use_cpu=True, disable_tqdm=True, save_strategy="no", remove_unused_columns=False, optim="sgd",
            deepspeed=config if given != "no_ds" else None,
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        long_seq = {"ds": None, "no_ds": section, "object": LongSeqConfig.from_dict(section)}[given]
        before = len(calls)  # "object": the caller's own parse, before the entry point
        trainer = LongSeqTrainer(model=model, args=args, train_dataset=_samples(4), data_collator=collate,
                                 long_seq=long_seq)
        trainer.train()
        return len(calls) - before
    finally:
        LongSeqConfig.from_dict = classmethod(parse)


@pytest.mark.parametrize("given, parsed", [
    ("ds", 1), pytest.param("object", 0, marks=pytest.mark.slow), pytest.param("no_ds", 1, marks=pytest.mark.slow),
])  # CI time: one 2-rank Trainer run each
def test_trainer_parses_once(tmp_path, given, parsed):
    """The Trainer entry point: the section taken out of the DeepSpeed config is parsed once, in ``__init__``, and
    the engine accelerate builds in ``train`` gets the parsed object (``engine.initialize_with``), as does
    ``enable``; a section passed already parsed is not parsed again; without DeepSpeed, ``long_seq=`` once."""
    from tests.dist_utils import run_distributed
    from tests.test_trainer import save_tiny_llama

    save_tiny_llama(str(tmp_path / "init"))
    counts = run_distributed(_trainer_body, 1, (str(tmp_path), str(tmp_path / "init"), given), timeout=300)
    assert counts == [parsed]
