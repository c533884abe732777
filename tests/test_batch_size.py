"""DeepSpeed's batch triple read once, as DeepSpeed reads it (issue 62, item 2).

A config giving ``train_batch_size`` and a micro-batch but no ``gradient_accumulation_steps`` made DeepSpeed
accumulate ``train_batch_size / micro`` micro-batches while the scripts, reading the accumulation with a default
of 1, called ``engine.step()`` once per "step": no optimizer step ever ran. Here:

- every combination of the three keys (absent or a value) on 1, 2 and 4 replicas reads as DeepSpeed's own config
  class resolves it, or is refused where DeepSpeed would assert;
- the optimizer steps exactly at the last micro-batch of each step, for every form of the triple, on one rank and
  on two (a real DeepSpeed engine, stepping as the scripts' loops do);
- an inconsistent triple (``16 = 3 x 1 x 1``) is the resolver's refusal, before any model is built;
- the reported case end to end: examples/sft.py with ``train_batch_size: 4`` and a micro-batch of 1 steps the
  optimizer at every one of its --max-steps, each with a gradient norm in metrics.jsonl.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest

from ds_longseq.batch_size import BatchSizeError, batch_size_problems, read_batch_size
from ds_longseq.resolver import Launch, RunCannotStart, resolve
from tests.dist_utils import run_distributed

KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class _DataParallel:
    """The one mpu method DeepSpeed's config reads for its world size: the data-parallel replicas."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def get_data_parallel_world_size(self) -> int:
        return self.replicas


def _deepspeed_reads(config: dict, replicas: int, monkeypatch) -> tuple[int, int, int] | None:
    """(train, micro, accumulation) as DeepSpeed's DeepSpeedConfig resolves ``config`` on ``replicas``; None where
    it refuses it."""
    from deepspeed.runtime import config as ds_config_module

    monkeypatch.setattr(ds_config_module.dist, "get_rank", lambda *a, **k: 0)  # no process group in this test
    try:
        c = ds_config_module.DeepSpeedConfig(dict(config), mpu=_DataParallel(replicas))
    except AssertionError:
        return None
    return c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps


def test_every_combination_of_the_three_keys_reads_as_deepspeed_does(monkeypatch):
    values = (None, 1, 2, 3, 4, 6, 16)
    checked = refused = 0
    for replicas in (1, 2, 4):
        for triple in itertools.product(values, repeat=3):
            config = {k: v for k, v in zip(KEYS, triple, strict=True) if v is not None}
            if not config.get("train_batch_size") and not config.get("train_micro_batch_size_per_gpu"):
                with pytest.raises(BatchSizeError, match="neither train_batch_size nor"):
                    read_batch_size(config, replicas)
                continue
            expected = _deepspeed_reads(config, replicas, monkeypatch)
            try:
                ours = read_batch_size(config, replicas)
            except BatchSizeError as err:
                assert expected is None, (config, replicas, expected, str(err))
                assert batch_size_problems(config, replicas) == [str(err)]
                refused += 1
                continue
            assert expected == (ours.train_batch, ours.micro_batch, ours.gradient_accumulation), (config, replicas)
            assert batch_size_problems(config, replicas) == []
            checked += 1
    assert checked > 100 and refused > 100, (checked, refused)  # both sides of the rule exercised


def test_bad_values_and_auto_are_refused_naming_the_key():
    with pytest.raises(BatchSizeError, match="gradient_accumulation_steps must be a positive integer.*got 0"):
        read_batch_size({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 0}, 1)
    with pytest.raises(BatchSizeError, match='train_micro_batch_size_per_gpu is "auto", which only the Hugging Face'):
        read_batch_size({"train_micro_batch_size_per_gpu": "auto"}, 1)
    # "auto" filled as the Trainer fills it: the global batch from the micro-batch, accumulation and replicas
    auto = {key: "auto" for key in KEYS}
    assert read_batch_size(auto, 2, micro_batch=2, gradient_accumulation=3).train_batch == 12
    assert batch_size_problems(auto, 2) == []  # the Trainer checks its own numbers
    with pytest.raises(BatchSizeError, match="train_batch_size 16.*set train_batch_size to 3, or leave it out"):
        read_batch_size({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3,
                         "gradient_accumulation_steps": 1}, 1)
    with pytest.raises(BatchSizeError, match="a multiple of 3 .*: 15 or 18"):
        read_batch_size({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3}, 1)


def test_an_inconsistent_triple_is_the_resolvers_refusal():
    bad = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1}
    with pytest.raises(RunCannotStart) as caught:
        resolve(bad, Launch(world=1))
    assert [rule for rule, _ in caught.value.by_rule] == ["deepspeed.batch_size"]
    # the replicas are the ranks over the sequence-parallel size: 4 ranks at SP 2 are 2 replicas
    sp = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
          "long_seq": {"sequence_parallel": {"size": 2}}}
    resolve(sp, Launch(world=4))
    with pytest.raises(RunCannotStart, match="do not fit 4 data-parallel replica"):
        resolve({**sp, "long_seq": {}}, Launch(world=4))
    resolve(bad)  # the ranks not known yet: the rule waits for them


# (train, micro, accumulation) each form of the triple gives, on one replica: micro 2, accumulation 3
FORMS = [
    {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
    {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2},
    {"train_batch_size": 6, "gradient_accumulation_steps": 3},
    {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
    {"train_batch_size": 6},
    {"train_micro_batch_size_per_gpu": 2},
]


def _steps_per_micro_batch(rank: int, forms: list[dict]) -> list[tuple[int, int, list[int]]]:
    """For each form: (the accumulation read here, DeepSpeed's, the engine's global step after each micro-batch of
    two optimizer steps run as the scripts' loops run them)."""
    import deepspeed
    import torch
    import torch.distributed as dist

    import ds_longseq.engine
    from ds_longseq.batch_size import read_batch_size as read

    out = []
    for form in forms:
        config = {**{k: v * dist.get_world_size() if k == "train_batch_size" else v for k, v in form.items()},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "gradient_clipping": 0}
        batch = read(config, dist.get_world_size())
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        engine, _, _, _ = ds_longseq.engine.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config)
        steps = []
        for _step in range(2):
            for _micro in range(batch.gradient_accumulation):
                x = torch.randn(batch.micro_batch, 4)
                engine.backward(engine(x).square().mean())
                engine.step()
                steps.append(engine.global_steps)
        out.append((batch.gradient_accumulation, engine.gradient_accumulation_steps(), steps))
        del engine
        deepspeed.runtime.utils.empty_cache()
    return out


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_optimizer_steps_at_the_last_micro_batch_of_every_step(ranks):
    for rank_result in run_distributed(_steps_per_micro_batch, world_size=ranks, args=(FORMS,), timeout=300):
        for form, (ours, deepspeeds, steps) in zip(FORMS, rank_result, strict=True):
            assert ours == deepspeeds, form
            # one optimizer step at the last micro-batch of each step, none before
            assert steps == [0] * (ours - 1) + [1] + [1] * (ours - 1) + [2], (form, steps)


def test_sft_with_a_global_batch_size_steps_the_optimizer_every_step(tmp_path):
    """The reported case: zero2_streambp with train_batch_size 4, a micro-batch of 1 and no accumulation key."""
    from tests.test_sft import _config, run_sft

    path = _config(tmp_path)
    with open(path) as f:
        config = json.load(f)
    config.pop("gradient_accumulation_steps")
    config["train_batch_size"] = 4
    config["gradient_clipping"] = 1.0
    with open(path, "w") as f:
        json.dump(config, f)
    save = tmp_path / "run"
    proc = run_sft(path, save, "--max-steps", "2", "--save-every", "0", num_ranks=1, seq_len=128)
    assert "1 per micro-batch x 4 accumulated x 1 replica(s)" in proc.stdout + proc.stderr
    with open(save / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [row["step"] for row in rows] == [1, 2]  # --max-steps counts optimizer steps, one line each
    assert all(row["grad_norm"] is not None for row in rows), rows  # an optimizer step ran at each
    import torch

    state = torch.load(os.path.join(save, "step2", "mp_rank_00_model_states.pt"), weights_only=False)
    assert state["global_steps"] == 2
