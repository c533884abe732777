"""examples/dpo.py end to end on 2 CPU ranks through the DeepSpeed launcher (ZeRO-2), and its bad input."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest

from ds_longseq.toolkit import PreferenceData, preference_micro_batch
from tests.test_sft import ROOT, _config, _port, _tiny_hf_model_with_tokenizer


def run_example(script, config, save_dir, *extra, expect_ok=True, timeout=300):
    """``deepspeed --num_gpus 2 examples/<script> --seq-len 256`` on CPU ranks; the CompletedProcess."""
    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not on PATH: pip install deepspeed")
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(_port()), os.path.join(ROOT, "examples", script),
           "--ds_config", config, "--seq-len", "256", "--save-dir", str(save_dir), *extra]
    # The launched script's sys.path[0] is examples/: PYTHONPATH makes the ranks import this checkout's package.
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath))
    if expect_ok and proc.returncode != 0:
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if re.match(r"\[rank\d+\]: \w*Error", line)]
        raise AssertionError(f"{script} failed ({proc.returncode}):\n" + "\n".join(errors)
                             + f"\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def metrics(save_dir):
    with open(os.path.join(save_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same_run(a: list[dict], b: list[dict], keys: tuple[str, ...]) -> None:
    """Two runs' metrics rows agree step by step: float32 CPU runs with the same data, weights and
    optimizer state repeat bit for bit up to reduction order, so 1e-6 relative (1e-9 absolute for
    values near 0) leaves room for nothing else."""
    assert [r["step"] for r in a] == [r["step"] for r in b], (a, b)
    for x, y in zip(a, b, strict=True):
        for key in keys:
            assert abs(x[key] - y[key]) <= 1e-6 * abs(x[key]) + 1e-9, (key, x, y)


@pytest.fixture(scope="module")
def dpo_default_run(tmp_path_factory):
    """The embedded default, 8 steps at lr 1e-3: (config, save dir, CompletedProcess)."""
    tmp = tmp_path_factory.mktemp("dpo")
    config = _config(tmp)
    out = tmp / "dpo"
    return config, out, run_example("dpo.py", config, out, "--max-steps", "8", "--lr", "1e-3")


def test_embedded_default_learns_the_preference(dpo_default_run):
    _, out, proc = dpo_default_run
    assert "summary: 8 steps on 2 rank(s)" in proc.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:
        for key in ("loss", "rewards/accuracies", "rewards/margins", "tokens/s"):
            assert math.isfinite(r[key]), r
    # Step 1 runs the untouched policy: it IS the reference, so every margin is 0 and the loss ln 2
    # (float32 log-probs of 128 tokens summed: 1e-5 covers their round-off between two model copies).
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-5 and abs(rows[0]["rewards/margins"]) < 1e-5
    # At 1e-3 the loss is ~0.36 by step 4 and ~2e-3 by step 8 (seed 0); 0.5 leaves a wide margin.
    assert rows[-1]["loss"] < 0.5 and rows[-1]["rewards/margins"] > 0 and rows[-1]["rewards/accuracies"] == 1.0
    assert (out / "dpo.png").stat().st_size > 0 and (out / "hf_model" / "config.json").exists()


@pytest.mark.slow  # heavy: the default run keeps the GRPO and SSM examples' resume
def test_resume_continues_the_run_exactly(dpo_default_run, tmp_path):
    """Stopped after 4 of 8 steps and resumed from its checkpoint: the same 8 rows as the straight
    run (the reference model is rebuilt as the initial policy, the policy and optimizer come from the
    checkpoint); resuming a finished run is refused before anything is written."""
    config, straight, _ = dpo_default_run
    cut = tmp_path / "cut"
    run_example("dpo.py", config, cut, "--max-steps", "4", "--save-every", "2", "--lr", "1e-3")
    assert (cut / "latest").read_text() == "step4" and (cut / "step2").exists()
    proc = run_example("dpo.py", config, cut, "--max-steps", "8", "--lr", "1e-3", "--resume")
    assert "summary: 4 steps on 2 rank(s)" in proc.stdout
    assert (cut / "latest").read_text() == "step8"
    assert_same_run(metrics(straight), metrics(cut), ("loss", "rewards/margins", "rewards/accuracies"))

    before = (cut / "metrics.jsonl").read_text()
    proc = run_example("dpo.py", config, cut, "--max-steps", "8", "--lr", "1e-3", "--resume", expect_ok=False)
    assert proc.returncode != 0
    assert "is at step 8, and --max-steps is 8: nothing left to train; raise --max-steps" in proc.stdout + proc.stderr
    assert (cut / "metrics.jsonl").read_text() == before and (cut / "latest").read_text() == "step8"


class CharTokenizer:
    pad_token_id, eos_token_id = 0, 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_preference_rows_mask_the_prompt_and_put_chosen_first(tmp_path):
    path = _write(tmp_path / "pairs.jsonl", [{"prompt": "ab", "chosen": "cd", "rejected": "e"}])
    data = PreferenceData(path, CharTokenizer(), seq_len=6)
    batch, ref = preference_micro_batch(data.__getitem__, range(1))
    assert batch["input_ids"].tolist() == [[97, 98, 99, 100, 0, 0], [97, 98, 101, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 99, 100, -100, -100], [-100, -100, 101, -100, -100, -100]]
    assert ref is None and not data.precomputed_ref
    path = _write(tmp_path / "ref.jsonl", [{"prompt": "ab", "chosen": "c", "rejected": "d", "ref_chosen_logp": -1.5,
                                             "ref_rejected_logp": -2}])
    _, ref = preference_micro_batch(PreferenceData(path, CharTokenizer(), seq_len=6).__getitem__, range(1))
    assert ref.tolist() == [-1.5, -2.0]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "ab", "chosen": "c"}, r"pairs\.jsonl:3: missing 'rejected': each line needs 'prompt', 'chosen'"),
        ({"prompt": "ab", "chosen": "", "rejected": "d"}, r"pairs\.jsonl:3: 'chosen' is empty \(no tokens\)"),
        ({"prompt": "abcdefgh", "chosen": "c", "rejected": "d"}, r"pairs\.jsonl:3: the prompt fills --seq-len 6"),
        ({"prompt": "a", "chosen": "c", "rejected": "d", "ref_chosen_logp": -1.0},
         r"pairs\.jsonl:3: give both 'ref_chosen_logp' and 'ref_rejected_logp', or neither"),
        ('{"prompt": "a", "chosen": "c",', r"pairs\.jsonl:3: not valid JSON"),
    ],
    ids=["missing-rejected", "empty-chosen", "prompt-too-long", "half-reference", "bad-json"],
)
def test_bad_pairs_name_the_file_line(tmp_path, bad, message):
    # Line 2 is blank: line numbers count the file's lines.
    path = _write(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}, "", bad])
    with pytest.raises(ValueError, match=message):
        PreferenceData(path, CharTokenizer(), seq_len=6)


def test_bad_jsonl_fails_before_training_through_the_launcher(tmp_path):
    model_dir = tmp_path / "model"
    _tiny_hf_model_with_tokenizer(model_dir)
    data = _write(tmp_path / "pairs.jsonl", [{"prompt": "the quick", "chosen": " brown fox", "rejected": ""}])
    proc = run_example("dpo.py", _config(tmp_path), tmp_path / "bad", "--model", str(model_dir), "--data", data,
                       "--max-steps", "2", expect_ok=False)
    assert proc.returncode != 0
    assert "pairs.jsonl:1: 'rejected' is empty (no tokens)" in proc.stdout + proc.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def refused_before_start(script, *argv):
    """examples/<script> ``argv`` as a plain python run (no launcher); its stderr. The flag checks run before
    DeepSpeed starts: reaching the process-group start-up would fail with another error."""
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=pythonpath))
    assert proc.returncode != 0
    return proc.stderr


def test_bad_flags_are_refused_before_start():
    for argv, message in ((["--beta", "0"], "--beta must be > 0, got 0.0"),
                          (["--label-smoothing", "0.5"], "--label-smoothing must be in [0, 0.5), got 0.5")):
        err = refused_before_start("dpo.py", *argv)
        assert message in err, err[-3000:]
