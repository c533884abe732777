"""A save directory holding an earlier run's checkpoints (issue 62, item 1).

The same ``ds-longseq train ... --save-dir D`` run twice trained the second time, then crashed at its last save
(``step2.partial -> step2``: directory not empty), leaving ``latest`` on the first run's weights. Now it is decided
at start, before the model loads: ``--resume`` continues the earlier run, ``--start-over`` removes it (saying in one
line what), and anything else is refused in one line naming both (exit 2).
"""

from __future__ import annotations

import os
import time

import pytest

from ds_longseq.cli import main as cli_main
from ds_longseq.toolkit.checkpoint import clear_earlier_run, earlier_run
from tests.test_sft import _config, run_sft


def _fake_run(save_dir, steps=(1, 2)):
    """The files a finished run leaves (contents do not matter to the decision)."""
    os.makedirs(save_dir, exist_ok=True)
    for step in steps:
        os.makedirs(save_dir / f"step{step}")
        (save_dir / f"step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (save_dir / "latest").write_text(f"step{steps[-1]}")
    (save_dir / "metrics.jsonl").write_text("{}\n")
    os.makedirs(save_dir / "hf_model")
    os.makedirs(save_dir / f"step{steps[-1]}.universal")
    (save_dir / "notes.txt").write_text("the user's own file")


def test_earlier_run_is_found_and_cleared_to_the_users_own_files(tmp_path):
    assert earlier_run(str(tmp_path / "new")) == [] and earlier_run(str(tmp_path)) == []
    _fake_run(tmp_path)
    assert earlier_run(str(tmp_path)) == ["step1/", "step2/", "latest"]
    removed = clear_earlier_run(str(tmp_path))
    assert removed == ["hf_model", "latest", "metrics.jsonl", "step1", "step2", "step2.universal"]
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]  # nothing of the user's touched


@pytest.mark.parametrize("flags, words", [
    ((), ["holds an earlier run's checkpoints (step1/, step2/, latest)", "--resume", "--start-over"]),
    (("--resume", "--start-over"), ["--resume and --start-over both given"]),
])
def test_a_save_dir_with_an_earlier_run_is_refused_in_one_line(tmp_path, capsys, flags, words):
    _fake_run(tmp_path / "D")
    status = cli_main(["train", "--num_gpus", "1", "--max-steps", "2", "--seq-len", "64",
                       "--save-dir", str(tmp_path / "D"), *flags])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert earlier_run(str(tmp_path / "D")) == ["step1/", "step2/", "latest"]  # nothing removed


def test_the_same_command_twice(tmp_path):
    """The reported case, end to end: the second run is refused before training; with --start-over it trains and
    saves (no crash at its last save), and ``latest`` names its own checkpoint."""
    config, save = _config(tmp_path), tmp_path / "D"
    run_sft(config, save, "--max-steps", "2", num_ranks=1, seq_len=128)
    first = os.path.getmtime(save / "step2")
    again = run_sft(config, save, "--max-steps", "2", num_ranks=1, seq_len=128, expect_ok=False)
    assert again.returncode == 2 and "pass --resume to continue it, or --start-over" in again.stdout + again.stderr
    assert "Traceback" not in again.stdout + again.stderr
    time.sleep(0.01)
    over = run_sft(config, save, "--max-steps", "2", "--start-over", num_ranks=1, seq_len=128)
    assert "--start-over: removed the earlier run's" in over.stdout + over.stderr
    assert (save / "latest").read_text().strip() == "step2" and os.path.getmtime(save / "step2") > first
    assert not any(name.endswith(".partial") for name in os.listdir(save))
    assert len((save / "metrics.jsonl").read_text().splitlines()) == 2
    assert (save / "hf_model" / "config.json").exists()
