"""The checkpoint manifest (engine/manifest.py): what a resume checks before DeepSpeed loads anything, each case on
a directory laid out as save_checkpoint leaves it (another shape of run: tests/test_reshape.py)."""

from __future__ import annotations

import copy
import json

import pytest

from ds_longseq.engine.manifest import MANIFEST, MODEL_STATES, resume_problem, write_manifest

FACTS = {"model_class": "LlamaForCausalLM", "world_size": 4, "sequence_parallel_size": 2, "zero_stage": 3,
         "micro_batch": 1, "gradient_accumulation": 1,
         "parameters": {"model.embed_tokens.weight": [256, 64], "model.layers.0.mlp.up_proj.weight": [128, 64]}}


@pytest.fixture
def checkpoint(tmp_path):
    step = tmp_path / "step3"
    step.mkdir()
    (step / MODEL_STATES).write_bytes(b"x" * 100)
    (step / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"y" * 50)
    write_manifest(str(step), FACTS, 3)
    return step


def test_the_run_that_wrote_it_resumes(checkpoint):
    saved = json.loads((checkpoint / MANIFEST).read_text())
    assert saved["step"] == 3 and saved["files"] == {MODEL_STATES: 100,
                                                     "zero_pp_rank_0_mp_rank_00_optim_states.pt": 50}
    assert resume_problem(str(checkpoint), FACTS) is None


def test_another_model_is_named(checkpoint):
    wider = copy.deepcopy(FACTS)
    wider["parameters"]["model.layers.0.mlp.up_proj.weight"] = [256, 64]
    problem = resume_problem(str(checkpoint), wider)
    assert "was written by another model" in problem and "up_proj.weight is [128, 64] there, [256, 64] here" in problem
    deeper = copy.deepcopy(FACTS)
    deeper["parameters"]["model.layers.1.mlp.up_proj.weight"] = [128, 64]
    assert "model.layers.1.mlp.up_proj.weight is absent there" in resume_problem(str(checkpoint), deeper)


def test_half_written_or_missing_or_not_a_checkpoint(checkpoint, tmp_path):
    shard = checkpoint / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"y" * 20)  # cut short
    problem = resume_problem(str(checkpoint), FACTS)
    assert "is incomplete: 1 of its 2 files missing or cut short" in problem and "20 bytes of 50" in problem
    shard.unlink()
    assert "optim_states.pt: missing" in resume_problem(str(checkpoint), FACTS)
    assert "is not there ('latest' names it)" in resume_problem(str(tmp_path / "step9"), FACTS)
    other = tmp_path / "photos"
    other.mkdir()
    assert "is not a DeepSpeed checkpoint" in resume_problem(str(other), FACTS)
    (other / MODEL_STATES).write_bytes(b"z")  # a checkpoint from before manifests: DeepSpeed's checks only
    assert resume_problem(str(other), FACTS) is None
