"""examples/grpo.py end to end on 2 CPU ranks through the DeepSpeed launcher (ZeRO-2), and its bad input."""

import math

import pytest
import torch

from ds_longseq.toolkit import RolloutData, completion_tokens, rollout_micro_batch, synthetic_group
from tests.test_dpo_example import (
    CharTokenizer,
    _write,
    assert_same_run,
    metrics,
    refused_before_start,
    run_example,
)
from tests.test_sft import _config, _tiny_hf_model_with_tokenizer

GRPO_FLAGS = ("--num-iterations", "2", "--lr", "1e-3", "--epsilon", "0.05", "--beta", "0.04")


@pytest.fixture(scope="module")
def grpo_default_run(tmp_path_factory):
    """The embedded default, 6 steps: (config, save dir, CompletedProcess)."""
    tmp = tmp_path_factory.mktemp("grpo")
    config = _config(tmp)
    out = tmp / "grpo"
    return config, out, run_example("grpo.py", config, out, "--max-steps", "6", *GRPO_FLAGS)


def test_embedded_default_favours_high_reward_completions(grpo_default_run):
    """2 updates per batch (so the ratio to the old policy moves off 1 and clipping bites) with a KL
    term to the frozen initial policy."""
    _, out, proc = grpo_default_run
    assert "summary: 6 steps x 2 update(s) on 2 rank(s)" in proc.stdout
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    keys = ("loss", "loss/update1", "loss/update2", "clip_ratio", "kl", "adv_logp", "reward_mean", "tokens/s")
    for r in rows:
        for key in keys:
            assert math.isfinite(r[key]), r
    # The mean advantage-weighted log-prob, measured before each step's updates, rises: the policy
    # moves probability to the completions with more rule-following tokens (seed 0: about -5.5e-3
    # -> +0.3 over 6 steps; the test asks for any clear rise).
    assert rows[-1]["adv_logp"] - rows[0]["adv_logp"] > 0.05, [r["adv_logp"] for r in rows]
    # The second update of a batch starts where the first moved the policy, in the advantages' direction:
    # its surrogate loss is lower, and some of its tokens leave the 0.05 clip range.
    assert sum(r["loss/update2"] < r["loss/update1"] for r in rows[1:]) >= 4, rows
    assert max(r["clip_ratio"] for r in rows) > 0
    assert rows[-1]["kl"] > 0 and 0 < rows[0]["reward_mean"] < 1
    assert (out / "grpo.png").stat().st_size > 0 and (out / "hf_model" / "config.json").exists()


@pytest.mark.slow  # heavy: the default run keeps test_sft_lora's and the Trainer's resume
def test_resume_continues_the_run_exactly(grpo_default_run, tmp_path):
    """Stopped after 3 of 6 steps and resumed: the same rows as the straight run, every update's loss,
    the KL to the (rebuilt) reference and the pre-update log-probs included."""
    config, straight, _ = grpo_default_run
    cut = tmp_path / "cut"
    run_example("grpo.py", config, cut, "--max-steps", "3", *GRPO_FLAGS)
    proc = run_example("grpo.py", config, cut, "--max-steps", "6", *GRPO_FLAGS, "--resume")
    assert "summary: 3 steps x 2 update(s) on 2 rank(s)" in proc.stdout
    assert_same_run(metrics(straight), metrics(cut), ("loss/update1", "loss/update2", "kl", "adv_logp", "clip_ratio"))


def test_rollout_rows_rewards_and_completion_tokens(tmp_path):
    path = _write(tmp_path / "r.jsonl", [{"prompt": "ab", "completions": ["cd", "e"], "rewards": [1, 0.5]}])
    data = RolloutData(path, CharTokenizer(), seq_len=5, scale_rewards="group")
    batch, rewards = rollout_micro_batch(data.__getitem__, range(1))
    assert batch["labels"].tolist() == [[-100, -100, 99, 100, -100], [-100, -100, 101, -100, -100]]
    assert rewards.tolist() == [1.0, 0.5] and data.group_size == 2
    assert completion_tokens(batch) == 3


# bitwise by construction: integer token ids, same seed
def test_synthetic_rewards_follow_the_corruption_level():
    group = synthetic_group(3, 64, seed=0)
    assert group["rewards"][0] == 1.0 and group["rewards"][-1] == 0.0
    assert group["rewards"] == sorted(group["rewards"], reverse=True)
    for row in group["rows"]:
        assert row["input_ids"].shape == (64,) and int((row["labels"] != -100).sum()) >= 16
    assert torch.equal(synthetic_group(3, 64, seed=0)["rows"][1]["input_ids"], group["rows"][1]["input_ids"])


GOOD = {"prompt": "a", "completions": ["b", "c"], "rewards": [1.0, 0.0]}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "a", "completions": ["b", "c"]}, r"r\.jsonl:3: missing 'rewards'"),
        ({"prompt": "a", "completions": ["b", ""], "rewards": [1, 0]}, r"r\.jsonl:3: completion 1 is empty"),
        ({"prompt": "a", "completions": ["b", "c", "d"], "rewards": [1, 0, 0]},
         r"r\.jsonl:3: 3 completions, but the first line has 2: every prompt needs the same number G"),
        ({"prompt": "a", "completions": ["b", "c"], "rewards": [1]}, r"r\.jsonl:3: 2 completions but 1 rewards"),
        ({"prompt": "a", "completions": ["b", "c"], "rewards": [1, "x"]},
         r"r\.jsonl:3: 'rewards' must be a list of finite numbers"),
    ],
    ids=["missing-rewards", "empty-completion", "different-G", "reward-count", "non-numeric-reward"],
)
def test_bad_rollouts_name_the_file_line(tmp_path, bad, message):
    path = _write(tmp_path / "r.jsonl", [GOOD, "", bad])
    with pytest.raises(ValueError, match=message):
        RolloutData(path, CharTokenizer(), seq_len=8, scale_rewards="group")


def test_group_of_one_needs_another_reward_scale(tmp_path):
    path = _write(tmp_path / "r.jsonl", [{"prompt": "a", "completions": ["b"], "rewards": [1.0]}])
    with pytest.raises(ValueError, match=r"r\.jsonl:1: groups of 1 completion with --scale-rewards group"):
        RolloutData(path, CharTokenizer(), seq_len=8, scale_rewards="group")
    assert RolloutData(path, CharTokenizer(), seq_len=8, scale_rewards="batch").group_size == 1


def test_group_of_one_fails_before_training_through_the_launcher(tmp_path):
    model_dir = tmp_path / "model"
    _tiny_hf_model_with_tokenizer(model_dir)
    data = _write(tmp_path / "r.jsonl", [{"prompt": "the quick", "completions": [" brown fox"], "rewards": [1.0]}])
    proc = run_example("grpo.py", _config(tmp_path), tmp_path / "bad", "--model", str(model_dir), "--data", data,
                       "--max-steps", "2", expect_ok=False)
    assert proc.returncode != 0
    assert ("r.jsonl:1: groups of 1 completion with --scale-rewards group: a group of size 1 has no reward standard "
            "deviation") in proc.stdout + proc.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_bad_flags_are_refused_before_start():
    for argv, message in ((["--num-iterations", "0"], "--num-iterations must be >= 1, got 0"),
                          (["--epsilon", "1.5"], "--epsilon must be in (0, 1), got 1.5"),
                          (["--beta", "-1"], "--beta must be >= 0, got -1.0")):
        err = refused_before_start("grpo.py", *argv)
        assert message in err, err[-3000:]
