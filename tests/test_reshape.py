"""Resuming on another shape of run (toolkit/reshape.py): a checkpoint written at one number of ranks continues at
another through DeepSpeed's universal checkpoint, with the uninterrupted run's losses and optimizer states; what
cannot continue is refused before compute, naming why."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ds_longseq.toolkit.manifest import MANIFEST
from ds_longseq.toolkit.reshape import planned_shape, shape_change
from tests.test_sft import _config, losses, run_sft

SAVED = {"world_size": 4, "sequence_parallel_size": 2, "zero_stage": 3, "micro_batch": 1, "gradient_accumulation": 1}


def test_what_continues_and_what_is_refused():
    """Two data-parallel replicas of 1 x 1 (4 ranks at SP 2) continue on 2 ranks at SP 2 only with accumulation 2 (the
    same global batch); the stage, LoRA and NVMe refuse."""
    where = "run/step3"
    same = shape_change(SAVED, dict(SAVED), checkpoint_dir=where)
    assert same == (False, None)
    half = {**SAVED, "world_size": 2}
    changed, why = shape_change(SAVED, half, checkpoint_dir=where)
    assert changed and "global batch was 2 sequences per step, this run's is 1" in why
    assert why.endswith("set gradient_accumulation_steps to 2"), why
    assert shape_change(SAVED, {**half, "gradient_accumulation": 2}, checkpoint_dir=where) == (True, None)
    assert shape_change(SAVED, {**SAVED, "sequence_parallel_size": 1, "world_size": 2}, checkpoint_dir=where) == (
        True, None)  # SP 2 x DP 2 -> SP 1 x DP 2: the same 2 replicas
    dp4 = {**SAVED, "sequence_parallel_size": 1}
    three = shape_change(dp4, {**dp4, "world_size": 3}, checkpoint_dir=where)[1]
    assert "whose product with the 3 replica(s) is 4" in three, three
    for kwargs, words in [({"lora": True}, "leaves the frozen weights out"), ({"nvme": True}, "NVMe")]:
        assert words in shape_change(SAVED, {**half, "gradient_accumulation": 2}, checkpoint_dir=where, **kwargs)[1]
    stage = shape_change(SAVED, {**SAVED, "zero_stage": 2}, checkpoint_dir=where)[1]
    assert stage.startswith("run/step3 was written by 4 ranks (sequence parallel 2 x data parallel 2), ZeRO-3; this "
                            "run has 4 ranks") and "use ZeRO-3" in stage
    assert planned_shape({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 2}, world=2,
                         sp_size=1) == {"world_size": 2, "sequence_parallel_size": 1, "zero_stage": 2, "micro_batch": 1,
                                        "gradient_accumulation": 2}


def _universal_states(checkpoint, out) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter: {fp32, exp_avg, exp_avg_sq}} of a checkpoint, through DeepSpeed's own conversion (its per-parameter
    files: the gathered master weights and Adam moments, whatever the ranks that wrote it)."""
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
                    "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], check=True, capture_output=True, timeout=300)
    keys = ("fp32", "exp_avg", "exp_avg_sq")
    return {p.name: {k: torch.load(p / f"{k}.pt", weights_only=False)["param"] for k in keys}
            for p in sorted((out / "zero").iterdir()) if p.is_dir()}  # beside them: optimizer_state.pt


def test_two_ranks_resume_on_one_with_accumulation_two(tmp_path, uninterrupted_sft):
    """2 ranks (data parallel 2) for 2 steps, resumed on 1 rank with gradient accumulation 2 (the same global
    batch, the same samples per step): the losses of steps 3 and 4 and, after step 3, every parameter's fp32 master
    weight and Adam moments equal the uninterrupted 2-rank run's (a resume that reloaded the weights and reset the
    optimizer would change the moments and step 4's loss). The original checkpoint stays untouched."""
    config = _config(tmp_path)
    cut = tmp_path / "cut"
    run_sft(config, cut, "--max-steps", "2", "--save-every", "1")
    manifest = (cut / "step2" / MANIFEST).read_text()
    with open(config) as f:
        gas2 = {**json.load(f), "gradient_accumulation_steps": 2}
    (tmp_path / "gas2.json").write_text(json.dumps(gas2))
    proc = run_sft(str(tmp_path / "gas2.json"), cut, "--max-steps", "4", "--save-every", "1", "--resume",
                   "--save-total-limit", "0", num_ranks=1)  # every checkpoint kept: step2/ is looked at below
    out = proc.stdout + proc.stderr
    assert "was written by 2 ranks at sequence-parallel size 1, this run has 1 at 1: loading DeepSpeed's universal" \
        in out, out[-3000:]
    assert (cut / "step2.universal" / "zero").is_dir() and (cut / "step2" / MANIFEST).read_text() == manifest

    straight = uninterrupted_sft(2)
    resumed = losses(cut)
    assert len(resumed) == 4
    for x, y in zip(resumed, straight, strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (resumed, straight)
    ours = _universal_states(cut / "step3", tmp_path / "ours")
    theirs = _universal_states(uninterrupted_sft(2, save_dir=True) / "step3", tmp_path / "theirs")
    assert ours.keys() == theirs.keys() and len(ours) > 10
    for name, states in theirs.items():
        for key, value in states.items():  # float32, the same sums in another order (accumulation vs replicas)
            torch.testing.assert_close(ours[name][key], value, rtol=1e-5, atol=1e-7, msg=f"{name} {key}")


def _with(config: str, path, **changes) -> str:
    with open(config) as f:
        data = json.load(f)
    for key, value in changes.items():
        if key == "sp":
            data["long_seq"]["sequence_parallel"] = {"size": value}
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.slow  # several 2- and 4-rank runs on 2 cores
@pytest.mark.parametrize(("before", "after"), [
    ((4, 2, 1), (2, 2, 2)),  # the case: 2 data-parallel groups of SP 2 -> one, accumulating 2
    ((2, 2, 2), (2, 1, 1)),  # SP 2 x DP 1 accumulating 2 -> SP 1 x DP 2
], ids=["4r-sp2-to-2r-sp2-gas2", "2r-sp2-gas2-to-2r-dp2"])
def test_zero3_sequence_parallel_shapes(tmp_path, before, after):
    """ZeRO-3 (tests.test_sft's chunks), (ranks, SP size, accumulation) ``before`` for 2 steps, then ``after`` to
    step 4, against 4 uninterrupted steps at ``before``: the same losses."""
    base = _config(tmp_path, stage=3)
    first = _with(base, tmp_path / "before.json", sp=before[1], gradient_accumulation_steps=before[2])
    second = _with(base, tmp_path / "after.json", sp=after[1], gradient_accumulation_steps=after[2])
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    run_sft(first, straight, "--max-steps", "4", num_ranks=before[0])
    run_sft(first, cut, "--max-steps", "2", "--save-every", "1", num_ranks=before[0])
    run_sft(second, cut, "--max-steps", "4", "--resume", num_ranks=after[0])
    assert len(losses(cut)) == 4
    for x, y in zip(losses(cut), losses(straight), strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (losses(cut), losses(straight))
