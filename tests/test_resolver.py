"""One resolver for whether a run can start (issue 52, item 2): ``ds_longseq.resolver.resolve`` runs every start rule
registered beside its section (``ds_longseq.rules.start_rule``), and every entry point goes through it.

- every registered rule is enumerated and found once: a bad input for each breaks that rule alone, its good twin
  passes, and a rule without a bad input here fails the test (so a new rule comes with its case);
- the same refusal, word for word, from every entry point (the engine, the planner and its command line, the
  preflight, the scripts' start-up, the ``ds-longseq train`` command, the Trainer);
- a config resolved once is checked again against what becomes known (the ranks, the ring degree) without
  parsing again, and a parsed section goes back into the DeepSpeed config as the object, not through a dict.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib

import pytest

from ds_longseq.config import LongSeqConfig
from ds_longseq.logging import warn_once
from ds_longseq.resolver import Launch, Resolved, RunCannotStart, RunShape, resolve
from ds_longseq.rules import start_rule, start_rules

SP2 = {"sequence_parallel": {"size": 2}}
CASES: dict[str, tuple[dict, dict, Launch, RunShape]] = {
    # rule: (bad DeepSpeed config, its good twin, launch, run); each bad one breaks that rule alone
    "sequence_parallel.length_unit": ({"long_seq": SP2}, {"long_seq": SP2}, Launch(), RunShape(seq_len=255)),
    "streambp.chunk_within_sequence": ({"long_seq": {"streambp": {"enabled": True, "chunk_size": 512}}},
                                       {"long_seq": {"streambp": {"enabled": True, "chunk_size": 64}}},
                                       Launch(), RunShape(seq_len=256)),
    "mini_seq.chunks_within_sequence": ({"long_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 8}}},
                                        {"long_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 4}}},
                                        Launch(), RunShape(seq_len=5)),
    "sequence_parallel.matches_deepspeed": ({"sequence_parallel_size": 4, "long_seq": SP2},
                                            {"sequence_parallel_size": 2, "long_seq": SP2}, Launch(), RunShape()),
    "sequence_parallel.no_data_parallel_size": ({"data_parallel_size": 1, "long_seq": SP2},
                                                {"data_parallel_size": 1}, Launch(), RunShape()),
    "sequence_parallel.divides_world": ({"long_seq": SP2}, {"long_seq": SP2}, Launch(world=3), RunShape()),
    "sequence_parallel.needs_deepspeed": ({"long_seq": SP2}, {}, Launch(deepspeed=False), RunShape()),
    "run.positive_length": ({}, {}, Launch(), RunShape(seq_len=0)),
    "deepspeed.zero_stage": ({"zero_optimization": {"stage": 4}}, {"zero_optimization": {"stage": 3}}, Launch(),
                             RunShape()),
    "deepspeed.sequence_parallel_size": ({"sequence_parallel_size": 0}, {"sequence_parallel_size": 1}, Launch(),
                                         RunShape()),
    "techniques.engine": ({"zero_optimization": {"stage": 3}, "long_seq": {"adjoint": {"enabled": True}}},
                          {"zero_optimization": {"stage": 2}, "long_seq": {"adjoint": {"enabled": True}}}, Launch(),
                          RunShape()),
    "deepspeed.batch_size": ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3,
                              "gradient_accumulation_steps": 1},
                             {"train_batch_size": 15, "train_micro_batch_size_per_gpu": 3,
                              "gradient_accumulation_steps": 5}, Launch(world=1), RunShape()),
    "deepspeed.monitor": ({"csv_monitor": {"enabled": "yes please"}}, {"csv_monitor": {"enabled": False}},
                          Launch(deepspeed=True), RunShape()),
}
GOOD_TWIN_LAUNCH = {"sequence_parallel.divides_world": Launch(world=4), "sequence_parallel.needs_deepspeed": Launch(
    deepspeed=False)}
GOOD_TWIN_RUN = {"sequence_parallel.length_unit": RunShape(seq_len=256), "run.positive_length": RunShape(seq_len=1)}


@pytest.fixture(autouse=True)
def _techniques_registered():
    """The techniques registered (their engine problems are a rule); the warnings this file triggers forgotten after
    it (``warn_once`` logs a message once per process: another test may wait for the same one)."""
    import ds_longseq.techniques  # noqa: F401

    yield
    warn_once.cache_clear()


def test_every_registered_rule_is_found_once():
    rules = start_rules()
    assert set(rules) == set(CASES), ("each start rule needs a case here", set(rules) ^ set(CASES))
    homes = {rule.home for rule in rules.values()}
    assert homes == {"ds_longseq.config", "ds_longseq.ops.sp_layout", "ds_longseq.resolver"}, homes
    for name, (bad, good, launch, run) in CASES.items():
        rule = rules[name]
        if rule.warns:
            warned = resolve(bad, launch, run).warnings
            assert len(warned) == 1, (name, warned)
            assert resolve(good, launch, run).warnings == (), name
            continue
        with pytest.raises(RunCannotStart) as caught:
            resolve(bad, launch, run)
        assert [found for found, _ in caught.value.by_rule] == [name], (name, caught.value.by_rule)
        resolve(good, GOOD_TWIN_LAUNCH.get(name, launch), GOOD_TWIN_RUN.get(name, run))


def test_a_rule_exists_once_and_waits_for_what_it_needs():
    with pytest.raises(ValueError, match="already registered"):
        start_rule("deepspeed.zero_stage")(lambda start: [])
    with pytest.raises(ValueError, match="a rule may need"):
        start_rule("x.y", needs=("model",))
    # nothing known of the ranks or the length: those rules wait, and run once it is known, without a new parse
    resolved = resolve({"long_seq": SP2})
    assert "sequence_parallel.divides_world" not in resolved.ran and "sequence_parallel.length_unit" not in resolved.ran
    with pytest.raises(RunCannotStart, match="does not divide the 3 ranks"):
        resolved.check(launch=Launch(world=3))
    at_four = resolved.check(launch=Launch(world=4), run=RunShape(seq_len=256))
    assert {"sequence_parallel.divides_world", "sequence_parallel.length_unit"} <= at_four.ran
    # the ring degree chosen from the model (Ulysses x ring) asks 2 P | length: the length rule runs again
    with pytest.raises(RunCannotStart, match="not divisible by 2 x sequence_parallel size 2"):
        at_four.check(run=RunShape(seq_len=258, ring=2))


def test_every_problem_at_once_and_the_header_says_whose():
    with pytest.raises(RunCannotStart) as caught:
        resolve({"zero_optimization": {"stage": 4}, "long_seq": SP2}, Launch(world=3), RunShape(seq_len=255))
    assert [rule for rule, _ in caught.value.by_rule] == [  # by rule name, whatever the import order
        "deepspeed.zero_stage", "sequence_parallel.divides_world", "sequence_parallel.length_unit"]
    assert str(caught.value).startswith("this run cannot start (3 problems)")
    # a section that does not parse: its problems, and DeepSpeed's keys checked against the defaults
    with pytest.raises(RunCannotStart) as caught:
        resolve({"zero_optimization": {"stage": 4}, "long_seq": {"streambp": {"enabeld": True}}})
    assert [rule for rule, _ in caught.value.by_rule] == ["long_seq", "deepspeed.zero_stage"]
    assert str(caught.value).startswith("invalid long_seq config (2 problems)")


BAD = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 4}, "long_seq": {"streambp": {
    "enabled": True}}}
REFUSAL = "zero_optimization.stage=4 is not supported: use one of (0, 1, 2, 3)"
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def _entry_points(tmp_path: pathlib.Path):
    """(name, call that runs the entry point on the BAD config): each must refuse it with REFUSAL."""
    import torch

    import ds_longseq.engine
    from ds_longseq import plan
    from ds_longseq.cli import _check_ranks_fit
    from ds_longseq.toolkit import distributed
    from tests.helpers import make_model

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BAD))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))

    def engine():
        ds_longseq.engine.initialize_with(lambda **kw: None, model=make_model("llama", torch.float32), config=BAD)

    def planner_cli():
        code = plan.main(["--model", str(tmp_path), "--ds-config", str(path), "--seq-len", "64"])
        raise SystemExit(code)

    def scripts():
        distributed.start_distributed(str(path), seq_len=64)

    return [
        ("engine.split_config", lambda: ds_longseq.engine.split_config(BAD)),
        ("engine.initialize", engine),
        ("plan.Setup.from_configs", lambda: plan.Setup.from_configs(BAD)),
        ("python -m ds_longseq.plan", planner_cli),
        ("engine.memory_preflight", lambda: ds_longseq.engine.memory_preflight(LLAMA, BAD, 64)),
        ("toolkit.read_ds_config", lambda: distributed.read_ds_config(str(path))),
        ("toolkit.start_distributed", scripts),
        ("ds-longseq train (before it starts ranks)", lambda: _check_ranks_fit(str(path), 2)),
    ]


def test_every_entry_point_refuses_through_the_resolver(tmp_path, monkeypatch, capsys):
    """The same words from each; and each went through ``Resolved.check`` (the one place the rules run)."""
    checks = []
    real = Resolved.check

    def spy(self, *args, **kwargs):
        checks.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Resolved, "check", spy)
    for name, call in _entry_points(tmp_path):
        checks.clear()
        with pytest.raises((RunCannotStart, SystemExit)) as caught:
            call()
        said = str(caught.value) if not (isinstance(caught.value, SystemExit) and caught.value.code == 2) else \
            capsys.readouterr().err
        assert REFUSAL in said, (name, said)
        assert checks, f"{name} did not go through the resolver"


def test_the_trainer_resolves_its_section_without_deepspeed():
    """The Trainer's entry point without a DeepSpeed config: the resolver's rule that sequence parallelism needs
    DeepSpeed, the same words as ``resolve`` gives."""
    import torch
    from transformers import TrainingArguments

    from ds_longseq.trainer import LongSeqTrainer
    from tests.helpers import make_model

    args = TrainingArguments(output_dir="/tmp/unused_ds_longseq_resolver", use_cpu=True, report_to=[])
    with pytest.raises(RunCannotStart) as caught:
        LongSeqTrainer(model=make_model("llama", torch.float32), args=args, long_seq=SP2)
    assert [rule for rule, _ in caught.value.by_rule] == ["sequence_parallel.needs_deepspeed"]


def test_no_rule_outside_the_resolver_and_no_dict_round_trip():
    """The retired copies are gone (toolkit's check_parallel_args and check_monitor_config, split_config's inline
    checks), and no module turns a parsed section back into a dict to have it parsed again."""
    root = pathlib.Path(__file__).resolve().parents[1] / "ds_longseq"
    defined, round_trips = [], []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in ("check_parallel_args", "check_monitor_config"):
                defined.append(f"{path.relative_to(root)}:{node.name}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to_dict"
                    and path.name != "config.py"):
                round_trips.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not defined and not round_trips, (defined, round_trips)


def test_the_scripts_hand_the_parsed_section_on_as_the_object(tmp_path, monkeypatch):
    from ds_longseq.toolkit import distributed

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "long_seq": {"streambp": {"enabled": True}}}))
    monkeypatch.setattr(distributed, "init_process_group", lambda: (0, 1))
    _, _, config, long_seq, _ = distributed.start_distributed(str(path), seq_len=64)
    assert config["long_seq"] is long_seq and isinstance(long_seq, LongSeqConfig)
    monkeypatch.setattr(distributed, "init_process_group", lambda: (0, 3))
    path.write_text(json.dumps({"long_seq": SP2}))
    with pytest.raises(SystemExit, match=f"(?s)--ds_config {path}: this run cannot start .*does not divide the 3"):
        distributed.start_distributed(str(path), seq_len=64)
    assert os.path.exists(path)


IMPORTED_FIRST = ["", "import ds_longseq.plan", "import ds_longseq.resolver", "import ds_longseq.config",
                  "import ds_longseq.techniques", "import ds_longseq.ops.sp_layout"]
PROBE = """
import json, sys
{first}
from ds_longseq.resolver import Launch, RunCannotStart, RunShape, resolve
answers = []
for config, launch, run in [
    ({{"zero_optimization": {{"stage": 3}}, "long_seq": {{"adjoint": {{"enabled": True}}}}}}, {{}}, {{}}),
    ({{"long_seq": {{"lm_head": {{"enabled": True}}, "offload": {{"keep_every": 2}}}}}}, {{}}, {{}}),
    ({{"long_seq": {{"streambp": {{"enabled": True}}, "mini_seq": {{"enabled": True}}}}}}, {{}}, {{}}),
    ({{"long_seq": {{"sequence_parallel": {{"size": 2}}}}}}, {{"world": 3}}, {{"seq_len": 255}}),
]:
    try:
        resolve(config, Launch(**launch), RunShape(**run))
        answers.append(None)
    except RunCannotStart as err:
        answers.append(err.by_rule)
print(json.dumps(answers))
"""


def test_the_same_config_gets_the_same_answer_whatever_was_imported_first():
    """Issue 62 item 12: the techniques' rules (conflicts, needs, engine problems) and the layout's length rule were
    in force only if their modules had been imported before ``resolve`` ran. Fresh processes, each importing
    something else first, give every config the same refusal."""
    import subprocess
    import sys

    answers = {}
    for first in IMPORTED_FIRST:
        proc = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True,
                              timeout=300, cwd=pathlib.Path(__file__).parent.parent)
        assert proc.returncode == 0, proc.stderr[-2000:]
        answers[first] = json.loads(proc.stdout.splitlines()[-1])
    reference = answers[""]
    assert all(answer is not None for answer in reference), reference  # every config here is refused
    assert [[rule for rule, _ in found] for found in reference] == [
        ["techniques.engine"], ["long_seq"], ["long_seq"],
        ["sequence_parallel.divides_world", "sequence_parallel.length_unit"]]
    for first, answer in answers.items():
        assert answer == reference, (first, answer)
