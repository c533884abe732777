"""Resuming on another shape of run (engine/reshape.py): a checkpoint written at one number of ranks continues at
another through DeepSpeed's universal checkpoint, with the uninterrupted run's losses and optimizer states; what
cannot continue is refused before compute, naming why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ds_longseq.engine.manifest import MANIFEST
from ds_longseq.engine.reshape import planned_shape, shape_change
from tests.dist_utils import run_distributed
from tests.test_sft import _config, losses, run_sft

SAVED = {"world_size": 4, "sequence_parallel_size": 2, "zero_stage": 3, "micro_batch": 1, "gradient_accumulation": 1}


def test_what_continues_and_what_is_refused():
    """Two data-parallel replicas of 1 x 1 (4 ranks at SP 2) continue on 2 ranks at SP 2 only with accumulation 2 (the
    same global batch); the stage and NVMe refuse."""
    where = "run/step3"
    same = shape_change(SAVED, dict(SAVED), checkpoint_dir=where)
    assert same == (False, None)
    half = {**SAVED, "world_size": 2}
    changed, why = shape_change(SAVED, half, checkpoint_dir=where)
    assert changed and "global batch was 2 sequences per step (1 x 1 accumulated x 2 replica(s)), this run's is 1" \
        in why
    assert why.endswith("set gradient_accumulation_steps to 2"), why
    assert shape_change(SAVED, {**half, "gradient_accumulation": 2}, checkpoint_dir=where) == (True, None)
    assert shape_change(SAVED, {**SAVED, "sequence_parallel_size": 1, "world_size": 2}, checkpoint_dir=where) == (
        True, None)  # SP 2 x DP 2 -> SP 1 x DP 2: the same 2 replicas
    dp4 = {**SAVED, "sequence_parallel_size": 1}
    three = shape_change(dp4, {**dp4, "world_size": 3}, checkpoint_dir=where)[1]
    assert "whose product with the 3 replica(s) is 4" in three, three
    # the same ranks with another accumulation (issue 62 item 4: 4 -> 2 re-read samples 400-403 at step 101): refused
    acc4 = {**SAVED, "gradient_accumulation": 4}
    changed, why = shape_change(acc4, {**acc4, "gradient_accumulation": 2}, checkpoint_dir=where)
    assert not changed and ("global batch was 8 sequences per step (1 x 4 accumulated x 2 replica(s)), this run's is 4 "
                            "(1 x 2 accumulated x 2 replica(s))") in why
    assert why.endswith("set gradient_accumulation_steps to 4"), why
    # ... and the same global batch cut otherwise (micro-batch 2 x 2 for 1 x 4) continues, no conversion needed
    assert shape_change(acc4, {**acc4, "micro_batch": 2, "gradient_accumulation": 2}, checkpoint_dir=where) == (
        False, None)
    nvme = shape_change(SAVED, {**half, "gradient_accumulation": 2}, checkpoint_dir=where, nvme=True)[1]
    assert "DeepSpeed's universal load skips an optimizer offloaded to NVMe" in nvme, nvme
    stage = shape_change(SAVED, {**SAVED, "zero_stage": 2}, checkpoint_dir=where)[1]
    assert stage.startswith("run/step3 was written by 4 ranks (sequence parallel 2 x data parallel 2), ZeRO-3; this "
                            "run has 4 ranks") and "use ZeRO-3" in stage
    assert planned_shape({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1,
                          "gradient_accumulation_steps": 2}, world=2, sp_size=1) == {
        "world_size": 2, "sequence_parallel_size": 1, "zero_stage": 2, "micro_batch": 1, "gradient_accumulation": 2}
    # the batch as DeepSpeed reads it: a global batch of 8 on 2 replicas of micro-batch 2 accumulates 2
    assert planned_shape({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, world=4, sp_size=2)[
        "gradient_accumulation"] == 2


def test_each_step_reads_the_same_samples_on_any_shape_with_the_same_global_batch():
    """The data position is step x global batch: every (accumulation, replicas, micro-batch) with the same product
    reads the same sample ids in each step (toolkit.data.micro_batch_indices), so a reshaped resume continues on the
    rows the uninterrupted run would have read."""
    from ds_longseq.toolkit.data import micro_batch_indices

    def ids(step, gas, replicas, micro_bs):
        return sorted(i for micro in range(gas) for replica in range(replicas)
                      for i in micro_batch_indices(step, micro, gas, replica, replicas, micro_bs))

    for step in range(5):
        shapes = [(1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2), (2, 1, 2)]  # 4 rows per step each
        assert all(ids(step, *shape) == list(range(4 * step, 4 * step + 4)) for shape in shapes), step


def _universal_states(checkpoint, out) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter: {fp32, exp_avg, exp_avg_sq}} of a checkpoint, through DeepSpeed's own conversion (its per-parameter
    files: the gathered master weights and Adam moments, whatever the ranks that wrote it)."""
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
                    "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], check=True, capture_output=True, timeout=300)
    keys = ("fp32", "exp_avg", "exp_avg_sq")
    return {p.name: {k: torch.load(p / f"{k}.pt", weights_only=False)["param"] for k in keys}
            for p in sorted((out / "zero").iterdir()) if p.is_dir()}  # beside them: optimizer_state.pt


def _states_right_after_resume(rank: int, argv: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """examples/sft.py's set-up and resume on this rank (``argv``: its flags, with --resume), then, before any step,
    every trainable parameter's fp32 master weight and Adam moments gathered from the engine (DeepSpeed's
    ``safe_get_full_*``, collective over the ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from ds_longseq.cli.train import parse_args
    from ds_longseq.toolkit.checkpoint import start_or_resume
    from ds_longseq.toolkit.run import setup_run

    args = parse_args(argv)
    run = setup_run(args)
    start_or_resume(run.engine, args.save_dir, os.path.join(args.save_dir, "metrics.jsonl"), resume_run=True,
                    max_steps=args.max_steps, rank=run.rank)
    return {name: {"fp32": safe_get_full_fp32_param(p).cpu(),
                   **{k: safe_get_full_optimizer_state(p, k).cpu() for k in ("exp_avg", "exp_avg_sq")}}
            for name, p in run.engine.module.named_parameters() if p.requires_grad}


def test_two_ranks_resume_on_one_with_accumulation_two(tmp_path, uninterrupted_sft):
    """2 ranks (data parallel 2) for 2 steps, resumed on 1 rank with gradient accumulation 2 (the same global
    batch, the same samples per step): right after the load, every parameter's fp32 master weight and Adam moments
    on the one rank equal what the 2 ranks saved (read by DeepSpeed's own conversion of their shards: a resume that
    reloaded the weights and reset the optimizer fails here); the losses of steps 3 and 4 and, after step 3, the
    states equal the uninterrupted 2-rank run's. The original checkpoint stays untouched."""
    config = _config(tmp_path)
    cut = tmp_path / "cut"
    run_sft(config, cut, "--max-steps", "2", "--save-every", "1")
    manifest = (cut / "step2" / MANIFEST).read_text()
    with open(config) as f:
        gas2 = {**json.load(f), "gradient_accumulation_steps": 2}
    (tmp_path / "gas2.json").write_text(json.dumps(gas2))
    saved = _universal_states(cut / "step2", tmp_path / "saved")
    [loaded] = run_distributed(_states_right_after_resume, 1, ([
        "--ds_config", str(tmp_path / "gas2.json"), "--seq-len", "256", "--save-dir", str(cut), "--max-steps", "4",
        "--resume"],))
    assert loaded.keys() == saved.keys() and len(saved) > 10
    for name, states in saved.items():
        for key, value in states.items():  # the same numbers, moved: exactly equal
            assert torch.equal(loaded[name][key], value), f"{name} {key}"
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


@pytest.mark.parametrize("stage", [pytest.param(3, marks=pytest.mark.slow), 2])  # ZeRO-2: the default preset's
@pytest.mark.parametrize(("before", "after"), [
    # the case: 2 data-parallel groups of SP 2 -> one, accumulating 2 (several 4-rank runs on 2 cores)
    pytest.param((4, 2, 1), (2, 2, 2), marks=pytest.mark.slow),
    ((2, 2, 2), (2, 1, 1)),  # SP 2 x DP 1 accumulating 2 -> SP 1 x DP 2
], ids=["4r-sp2-to-2r-sp2-gas2", "2r-sp2-gas2-to-2r-dp2"])
def test_zero_sequence_parallel_shapes(tmp_path, before, after, stage):
    """ZeRO-3 and ZeRO-2 (tests.test_sft's chunks), (ranks, SP size, accumulation) ``before`` for 2 steps, then
    ``after`` to step 4, against 4 uninterrupted steps at ``before``: the same losses. ZeRO-2 under sequence
    parallelism records the SP size as its tensor-parallel degree, which DeepSpeed's conversion refused (issue 62,
    item 3: engine.reshape stages the checkpoint for it); there also the fp32 master weights and Adam moments right
    after the load equal what was saved."""
    base = _config(tmp_path, stage=stage)
    first = _with(base, tmp_path / "before.json", sp=before[1], gradient_accumulation_steps=before[2])
    second = _with(base, tmp_path / "after.json", sp=after[1], gradient_accumulation_steps=after[2])
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    run_sft(first, straight, "--max-steps", "4", num_ranks=before[0])
    run_sft(first, cut, "--max-steps", "2", "--save-every", "1", num_ranks=before[0])
    if stage == 2:  # the states right after the load, against DeepSpeed's own reading of the saved shards
        saved = _universal_states(_staged(cut / "step2"), tmp_path / "saved")
        [loaded, _] = run_distributed(_states_right_after_resume, after[0], ([
            "--ds_config", second, "--seq-len", "256", "--save-dir", str(cut), "--max-steps", "4", "--resume"],))
        assert loaded.keys() == saved.keys() and len(saved) > 10
        for name, states in saved.items():
            for key, value in states.items():
                assert torch.equal(loaded[name][key], value), f"{name} {key}"
    run_sft(second, cut, "--max-steps", "4", "--resume", num_ranks=after[0])
    assert len(losses(cut)) == 4
    for x, y in zip(losses(cut), losses(straight), strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (losses(cut), losses(straight))


def _staged(checkpoint):
    """The directory DeepSpeed's conversion reads for ``checkpoint`` (engine.reshape's staging where it needs one)."""
    from ds_longseq.engine.manifest import read_manifest
    from ds_longseq.engine.reshape import _staged_for_conversion

    return _staged_for_conversion(str(checkpoint), read_manifest(str(checkpoint))) or checkpoint


@pytest.mark.slow  # three 1- and 2-rank runs
def test_lora_resumes_on_another_number_of_ranks(tmp_path):
    """LoRA (its checkpoints hold the adapter alone; the frozen base is rebuilt from the model): 2 ranks for 2 steps
    resumed on 1 rank with accumulation 2 give the uninterrupted 2-rank run's losses and, after step 3, the adapter's
    fp32 master weights and Adam moments."""
    lora = ("--lora-rank", "4", "--lr", "1e-2")
    config = _config(tmp_path)
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    run_sft(config, straight, "--max-steps", "4", "--save-every", "1", "--save-total-limit", "0", *lora)
    run_sft(config, cut, "--max-steps", "2", "--save-every", "1", *lora)
    gas2 = _with(config, tmp_path / "gas2.json", gradient_accumulation_steps=2)
    out = run_sft(gas2, cut, "--max-steps", "4", "--save-every", "1", "--save-total-limit", "0", "--resume", *lora,
                  num_ranks=1)
    assert "loading DeepSpeed's universal form of it" in out.stdout + out.stderr
    for x, y in zip(losses(cut), losses(straight), strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (losses(cut), losses(straight))
    ours, theirs = _universal_states(cut / "step3", tmp_path / "ours"), _universal_states(straight / "step3",
                                                                                          tmp_path / "theirs")
    assert ours.keys() == theirs.keys() and ours and all("lora_" in name for name in ours)
    for name, states in theirs.items():
        for key, value in states.items():
            torch.testing.assert_close(ours[name][key], value, rtol=1e-5, atol=1e-7, msg=f"{name} {key}")
