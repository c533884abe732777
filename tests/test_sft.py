"""examples/sft.py end to end on 2 CPU ranks through the DeepSpeed launcher: resume and crash safety."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tmp_path, stage=2):
    with open(os.path.join(ROOT, "ds_configs", f"zero{stage}_streambp.json")) as f:
        config = json.load(f)
    config["long_seq"]["streambp"]["chunk_size"] = 96  # 256 tokens: 3 chunks, the last one short
    config["long_seq"]["lm_head"]["chunk_size"] = 5
    path = tmp_path / f"zero{stage}.json"
    path.write_text(json.dumps(config))
    return str(path)


def run_sft(config, save_dir, *extra, expect_ok=True, timeout=600):
    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not on PATH: pip install deepspeed")
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(_port()), os.path.join(ROOT, "examples", "sft.py"),
           "--ds_config", config, "--seq-len", "256", "--save-dir", str(save_dir), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"sft.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _port():
    sys.path.insert(0, ROOT)
    from tests.dist_utils import free_port

    return free_port()


def losses(save_dir):
    with open(os.path.join(save_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_resume_after_a_crash_during_save_matches_an_uninterrupted_run(tmp_path):
    config = _config(tmp_path)
    straight = tmp_path / "straight"
    run_sft(config, straight, "--max-steps", "4")
    assert (straight / "loss.png").exists() and (straight / "hf_model" / "config.json").exists()
    assert (straight / "latest").read_text() == "step4"

    crashed = tmp_path / "crashed"
    proc = run_sft(config, crashed, "--max-steps", "4", "--save-every", "2", "--_crash-during-save-at-step", "4",
                   expect_ok=False)
    assert proc.returncode != 0
    # The step-4 checkpoint was being written when the run died: ``latest`` still names step 2.
    assert (crashed / "latest").read_text() == "step2"
    assert (crashed / "step4").exists()

    run_sft(config, crashed, "--max-steps", "4", "--resume")
    assert (crashed / "latest").read_text() == "step4"
    a, b = losses(straight), losses(crashed)
    assert len(a) == len(b) == 4
    # Same data order, same weights and optimizer state after step 2: float32 CPU runs repeat
    # bit for bit up to reduction order; 1e-6 relative leaves room for nothing else.
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-6 * abs(x), (a, b)


def test_bad_input_fails_before_training(tmp_path):
    config = _config(tmp_path)
    proc = run_sft(config, tmp_path / "bad", "--max-steps", "2", "--seq-len", "64", expect_ok=False)
    assert proc.returncode != 0
    assert "chunk_size=96 exceeds the sequence length 64" in proc.stdout + proc.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
