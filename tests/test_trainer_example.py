"""examples/trainer_sft.py end to end on 2 CPU ranks through the DeepSpeed launcher: the Hugging Face
Trainer (ds_configs/trainer_zero2_streambp.json) and TRL's SFTTrainer (ZeRO-3, sequence parallel 2)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from tests.test_dpo_example import run_example
from tests.test_sft import ROOT, _config

STEPS = 4


def trainer_config(tmp_path, stage=2, sp=None):
    """ds_configs/trainer_zero2_streambp.json with chunks that stream the example's 256 tokens (see
    tests/test_sft._config), at ZeRO ``stage``; at ZeRO-3 with SP 2 the shipped trainer_zero3_ulysses_streambp.json
    (the Trainer's sequence-parallel preset), with the same chunks."""
    if (stage, sp) == (3, 2):
        return _config(tmp_path, name="trainer_zero3_ulysses_streambp.json")
    path = _config(tmp_path, name="trainer_zero2_streambp.json", sp=sp)
    with open(path) as f:
        config = json.load(f)
    if stage == 3:
        config["zero_optimization"] = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def check_outputs(out, proc, summary):
    """Loss logged every step and finite; the saved model loads into the stock class, finite logits."""
    from transformers import AutoModelForCausalLM

    assert f"summary: {summary}, seq_len 256" in proc.stdout
    with open(out / "trainer_state.json") as f:
        logged = [h for h in json.load(f)["log_history"] if "loss" in h]
    assert [h["step"] for h in logged] == list(range(1, STEPS + 1))
    assert all(math.isfinite(h["loss"]) and h["loss"] > 0 for h in logged), logged
    assert (out / "loss.png").stat().st_size > 0
    assert "ds_longseq" not in (out / "hf_model" / "config.json").read_text()
    model = AutoModelForCausalLM.from_pretrained(out / "hf_model", dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = torch.randint(32, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 16, 256) and torch.isfinite(logits).all()
    return logged


@pytest.mark.slow  # CI time: the default run keeps the same script under TRL with the shipped SP preset
def test_trainer_example(tmp_path):
    out = tmp_path / "trainer"
    proc = run_example("trainer_sft.py", trainer_config(tmp_path), out, "--max-steps", str(STEPS), timeout=300)
    check_outputs(out, proc, f"LongSeqTrainer, {STEPS} steps on 2 rank(s)")


def test_trl_example_zero3_sequence_parallel(tmp_path):
    out = tmp_path / "trl"
    proc = run_example("trainer_sft.py", trainer_config(tmp_path, stage=3, sp=2), out, "--trl",
                       "--max-steps", str(STEPS), timeout=300)
    logged = check_outputs(
        out, proc, f"LongSeqSFTTrainer, {STEPS} steps on 2 rank(s) (sequence parallel 2 x data parallel 1)"
    )
    assert all(0.0 <= h["mean_token_accuracy"] <= 1.0 for h in logged), logged  # TRL's own metric
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out / "hf_model").pad_token_id == 0  # TRL saves its tokenizer too


def test_trl_missing_is_a_clear_error(tmp_path):
    """Without TRL, --trl stops before anything starts, saying what to install."""
    fake = tmp_path / "no_trl" / "trl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named trl (simulated)')\n")
    paths = [str(fake.parent), ROOT, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "trainer_sft.py"), "--trl"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2  # bad input (tests/test_bad_input.py)
    assert "--trl needs TRL, which is not installed: pip install 'trl>=1.9'" in proc.stderr


@pytest.mark.parametrize("accelerate_config", [pytest.param("accelerate_deepspeed.yaml", marks=pytest.mark.slow),
                                               "accelerate_alst.yaml"])
def test_accelerate_launch_trl_sequence_parallel(tmp_path, accelerate_config):
    """`accelerate launch` runs examples/trainer_sft.py --trl (TRL's SFTTrainer) at sequence parallelism 2 on 2 CPU
    ranks: with launch/accelerate_deepspeed.yaml (its DeepSpeed config file swapped for one with
    long_seq.sequence_parallel.size 2: accelerate's DeepSpeed config is the script's default --ds_config), and with
    launch/accelerate_alst.yaml (TRL's ALST config with a long_seq section in its DeepSpeed JSON: parallelism_config's
    sp_size sets the size, its sp_handler settings are ignored with a warning)."""
    import shutil

    from tests.dist_utils import run_job
    from tests.test_dpo_example import _port

    if shutil.which("accelerate") is None:
        raise AssertionError("the accelerate launcher is not on PATH: pip install accelerate")
    text = open(os.path.join(ROOT, "launch", accelerate_config)).read()
    assert "deepspeed_config_file: ds_configs/trainer_zero2_streambp.json" in text
    config = tmp_path / "accelerate.yaml"
    alst = "parallelism_config_sp_size: 2" in text
    ds_json = trainer_config(tmp_path, sp=None if alst else 2)
    config.write_text(text.replace("ds_configs/trainer_zero2_streambp.json", ds_json))
    out = tmp_path / "out"
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = run_job(
        ["accelerate", "launch", "--config_file", str(config), "--main_process_port", str(_port()),
         os.path.join(ROOT, "examples", "trainer_sft.py"), "--trl", "--seq-len", "256",
         "--max-steps", str(STEPS), "--output-dir", str(out)],
        cwd=ROOT, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_outputs(out, proc, f"LongSeqSFTTrainer, {STEPS} steps on 2 rank(s) (sequence parallel 2 x data parallel 1)")
    assert ("sp_handler settings {'sp_attn_implementation': 'sdpa'} are ignored" in proc.stderr) == alst
