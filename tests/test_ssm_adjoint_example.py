"""examples/ssm_adjoint.py: the task has no short-range shortcut; one process, 2 CPU ranks through the
DeepSpeed launcher (layers split in 2 stages), resume, bad arguments. The layer split must not change
the math: the 2-rank run's losses equal the one-process run's."""

import json
import os
import subprocess
import sys

import pytest

from ds_longseq.toolkit import TopicRecallTask
from tests.test_sft import ROOT, _port

TINY = ["--seq-len", "96", "--query-every", "8", "--num-clues", "4", "--hidden-size", "16", "--state-size", "4",
        "--num-layers", "2", "--chunk-size", "40"]


@pytest.mark.parametrize("task", [TopicRecallTask(), TopicRecallTask(seq_len=96, query_every=8, num_clues=4),
                                  TopicRecallTask(num_topics=7, num_clues=1, query_every=2)],
                         ids=["default", "tiny", "7-topics"])
def test_answers_can_only_come_from_the_briefing(task):
    """No shortcut: after the briefing (BOS, clues, SEP) the input is QUERY tokens and filler drawn the
    same way for every topic; no answer token is ever an input; the clues are the only topic-specific
    inputs; every QUERY is answered at the next label, and only there."""
    filler0 = task.ANSWER0 + task.num_topics + task.num_topics * task.CLUES_PER_TOPIC
    assert filler0 == task.filler0 and task.vocab_size == filler0 + task.num_filler
    answers = set(range(task.ANSWER0, task.ANSWER0 + task.num_topics))
    briefing = 2 + task.num_clues
    topics = set()
    for index in range(40):
        row = task.row(index)
        ids, labels = row["input_ids"], row["labels"]
        assert ids.shape == labels.shape == (task.seq_len,)
        labelled = (labels != -100).nonzero().flatten()
        assert len(labelled) >= 2
        (answer,) = set(labels[labelled].tolist())  # one topic per row
        assert answer in answers
        topics.add(answer)
        for t in labelled.tolist():
            assert t >= briefing + 1 and ids[t - 1] == task.QUERY  # answers the QUERY just before
            assert answer not in ids[:t].tolist()  # the answer is never an input: it cannot be copied
        assert not answers & set(ids.tolist())
        clue0 = task.ANSWER0 + task.num_topics + (answer - task.ANSWER0) * task.CLUES_PER_TOPIC
        assert ids[0] == task.BOS and ids[briefing - 1] == task.SEP
        assert all(clue0 <= c < clue0 + task.CLUES_PER_TOPIC for c in ids[1 : briefing - 1].tolist())
        after = ids[briefing:]
        is_query = after == task.QUERY
        assert is_query.sum() == len(labelled)
        assert ((after[~is_query] >= filler0) & (after[~is_query] < filler0 + task.num_filler)).all()
    assert len(topics) == task.num_topics  # 40 rows see every topic


def run(save_dir, *extra, num_ranks=None, expect_ok=True):
    script = os.path.join(ROOT, "examples", "ssm_adjoint.py")
    if num_ranks is None:
        cmd = [sys.executable, script]
        env_extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "RANK": "0", "WORLD_SIZE": "1",
                     "LOCAL_RANK": "0"}
    else:
        cmd = ["deepspeed", "--num_gpus", str(num_ranks), "--master_port", str(_port()), script]
        env_extra = {}
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([*cmd, "--save-dir", str(save_dir), *TINY, *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, **env_extra))
    if expect_ok and proc.returncode != 0:
        raise AssertionError(
            f"ssm_adjoint.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def losses(save_dir):
    with open(os.path.join(save_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_one_process_and_two_stages_train_the_same(tmp_path):
    run(tmp_path / "one", "--max-steps", "6")
    one = losses(tmp_path / "one")
    assert len(one) == 6 and one[-1] < one[0]  # the answer tokens are learned first: the loss falls
    for name in ("loss.png", "model.pt", "ssm_config.json", "latest", "eval.json"):
        assert (tmp_path / "one" / name).exists(), name
    run(tmp_path / "two", "--max-steps", "6", num_ranks=2)
    # float32: the two stages compute the same sums as one process, in the same order, up to the
    # data-parallel average (x2 then /2)
    assert losses(tmp_path / "two") == pytest.approx(one, rel=1e-5)


@pytest.mark.slow  # heavy: the default run keeps the GRPO example's resume
def test_resume_continues_with_the_same_losses(tmp_path):
    run(tmp_path / "full", "--max-steps", "6")
    run(tmp_path / "cut", "--max-steps", "3")
    run(tmp_path / "cut", "--max-steps", "6", "--resume")
    assert losses(tmp_path / "cut") == pytest.approx(losses(tmp_path / "full"), rel=1e-6)


@pytest.mark.parametrize(
    "extra,message",
    [(["--seq-len", "20"], "too short for the task"), (["--truncation", "0"], "T-bar) must be >= 1"),
     (["--resume"], "no checkpoint"), (["--save-every", "-1"], "--save-every must be >= 0")],
)
def test_bad_arguments_fail_before_training(tmp_path, extra, message):
    proc = run(tmp_path / "bad", *extra, expect_ok=False)
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr
