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
from ds_longseq.toolkit.save_dir import clear_earlier_run, earlier_run
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


# -- torn files (item 7) -----------------------------------------------------------------------------------------------


def test_a_metrics_file_cut_short_loses_its_last_line_only(tmp_path, caplog):
    from ds_longseq.toolkit.checkpoint import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n{"step": 3, "lo')  # killed mid-append
    assert [row["step"] for row in read_metrics(str(path))] == [1, 2]
    assert "its last line was cut short" in caplog.text
    path.write_text('{"step": 1, "loss": 2.5}\n\n{"step": 2, "loss": 2.4}\n')  # whole: nothing said
    assert [row["step"] for row in read_metrics(str(path))] == [1, 2]
    path.write_text('{"step": 1, "loss": 2.5}\nnot json\n{"step": 3, "loss": 2.4}\n')  # not a kill: refused, named
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2 is not a metrics row"):
        read_metrics(str(path))
    assert read_metrics(str(tmp_path / "none.jsonl")) == []


def test_a_manifest_cut_short_or_of_another_format_is_named(tmp_path):
    import json

    from ds_longseq.engine.manifest import MANIFEST, ManifestError, read_manifest, resume_problem

    step = tmp_path / "step4"
    step.mkdir()
    (step / MANIFEST).write_text('{"format": 1, "step": 4, "fil')
    assert "is not valid JSON" in resume_problem(str(step), {"parameters": {}})
    with pytest.raises(ManifestError, match="point 'latest' at an earlier complete step"):
        read_manifest(str(step))
    (step / MANIFEST).write_text(json.dumps({"format": 99, "step": 4, "files": {}}))
    assert "has checkpoint format 99; this ds_longseq reads format 1" in resume_problem(str(step), {"parameters": {}})


# -- a converted checkpoint tied to its source (item 6) ----------------------------------------------------------------


def test_a_converted_form_is_reused_only_for_the_checkpoint_it_came_from(tmp_path):
    """A run that wrote step100/ over another's must not load the other's step100.universal/: the converted form
    carries the source's manifest hash, and a mismatch converts again (here the conversion of a fake checkpoint then
    fails, which shows it ran instead of the stale form being loaded)."""
    import json

    from ds_longseq.engine.manifest import MANIFEST
    from ds_longseq.engine.reshape import SOURCE_STAMP, UniversalConversionError, source_stamp, to_universal

    step = tmp_path / "step100"
    step.mkdir()
    (step / MANIFEST).write_text(json.dumps({"format": 1, "step": 100, "run": "first"}))
    universal = tmp_path / "step100.universal"
    universal.mkdir()
    (universal / SOURCE_STAMP).write_text(source_stamp(str(step)))
    shapes = {"world_size": 2, "sequence_parallel_size": 1}
    kwargs = dict(leader=True, saved=shapes, now={**shapes, "world_size": 1}, prefix="--resume")
    assert to_universal(str(tmp_path), "step100", **kwargs) == "step100.universal"  # its own: reused
    (step / MANIFEST).write_text(json.dumps({"format": 1, "step": 100, "run": "second"}))  # another run's step100
    with pytest.raises(UniversalConversionError):
        to_universal(str(tmp_path), "step100", **kwargs)
    assert not universal.exists()  # the stale form is gone, not loaded


# -- node-local disks: one tag for every rank (item 9) ---------------------------------------------------------------

FACTS = {"model_class": "Tiny", "parameters": {"w": [2, 2]}, "world_size": 2, "sequence_parallel_size": 1,
         "zero_stage": 2, "micro_batch": 1, "gradient_accumulation": 1}


def _node_dir(path, steps, latest):
    """A node's own save directory: complete checkpoints ``steps`` (a file each, and their manifest), ``latest``."""
    from ds_longseq.engine.manifest import write_manifest

    for step in steps:
        (path / f"step{step}").mkdir(parents=True)
        (path / f"step{step}" / "mp_rank_00_model_states.pt").write_bytes(b"x" * step)
        write_manifest(str(path / f"step{step}"), FACTS, step)
    (path / "latest").write_text(f"step{latest}")
    return str(path)


def _agree(rank: int, dirs: list[str]):
    from ds_longseq.toolkit.checkpoint import agreed_checkpoint

    try:
        return agreed_checkpoint(dirs[rank], FACTS)
    except SystemExit as err:
        return f"refused: {err}"


def test_ranks_on_node_local_disks_resume_one_step_or_refuse_together(tmp_path):
    """Node 1 crashed between its own and node 0's update of ``latest``: its ``latest`` names step2, node 0's step3.
    Every rank resumes global rank 0's step3 (node 1 has it); where node 1 lacks it, every rank refuses naming rank 1
    and what is missing, instead of loading different steps on different nodes."""
    from tests.dist_utils import run_distributed

    dirs = [_node_dir(tmp_path / "node0", (2, 3), 3), _node_dir(tmp_path / "node1", (2, 3), 2)]
    assert run_distributed(_agree, world_size=2, args=(dirs,), timeout=120) == ["step3", "step3"]
    dirs[1] = _node_dir(tmp_path / "node1b", (2,), 2)
    for answer in run_distributed(_agree, world_size=2, args=(dirs,), timeout=120):
        assert answer.startswith("refused: --resume: rank 1 (on ") and "step3 is not there" in answer, answer


# -- one run per save directory, one owner per file system (items 8 and 5) ---------------------------------------------


def test_a_locked_save_dir_refuses_a_second_run_until_the_first_ends(tmp_path):
    from ds_longseq.toolkit.save_dir import claim_save_dir

    first = claim_save_dir(str(tmp_path), 0)
    assert first.owner and len(first.run_id) == 12
    with pytest.raises(SystemExit, match=rf"is in use by another run \(run {first.run_id}, pid {os.getpid()} on "):
        claim_save_dir(str(tmp_path), 0)
    first.release()
    again = claim_save_dir(str(tmp_path), 0)
    assert again.run_id != first.run_id
    again.release()


def test_rotation_removes_this_runs_checkpoints_only(tmp_path):
    """--save-total-limit counts and removes the run's own checkpoints: another run's (or one from before run ids)
    beside them stays."""
    import json

    from ds_longseq.engine.manifest import MANIFEST
    from ds_longseq.toolkit.checkpoint import prune_checkpoints

    for step, run in ((1, "ours"), (2, "theirs"), (3, "ours"), (4, None), (5, "ours")):
        (tmp_path / f"step{step}").mkdir()
        manifest = {"format": 1, "step": step, "files": {}, **({"run_id": run} if run else {})}
        (tmp_path / f"step{step}" / MANIFEST).write_text(json.dumps(manifest))
    (tmp_path / "latest").write_text("step5")
    assert prune_checkpoints(str(tmp_path), 2, run_id="ours") == ["step1"]
    assert sorted(os.listdir(tmp_path)) == ["latest", "step2", "step3", "step4", "step5"]


def _claim_as_a_node(rank: int, dirs: list[str]):
    os.environ["LOCAL_RANK"] = "0"  # every rank its node's first: two "nodes" on this machine
    from ds_longseq.toolkit.save_dir import claim_save_dir

    claim = claim_save_dir(dirs[rank], rank)
    return claim.owner, claim.run_id


def test_one_owner_per_file_system(tmp_path):
    """Two nodes over one shared save directory: global rank 0 alone renames and prunes in it (two owners raced each
    other's prunes into FileNotFoundError); over node-local disks each node owns its own copy."""
    from tests.dist_utils import run_distributed

    shared = run_distributed(_claim_as_a_node, world_size=2, args=([str(tmp_path / "shared")] * 2,), timeout=120)
    assert [owner for owner, _ in shared] == [True, False] and shared[0][1] == shared[1][1]
    local = run_distributed(_claim_as_a_node, world_size=2,
                            args=([str(tmp_path / "node0"), str(tmp_path / "node1")],), timeout=120)
    assert [owner for owner, _ in local] == [True, True] and local[0][1] == local[1][1]


@pytest.mark.slow  # two launcher runs at once (CI time): the lock's logic runs by default above
def test_a_second_run_beside_a_running_one_is_refused_and_the_first_goes_on(tmp_path):
    import signal
    import subprocess
    import time

    from tests.test_sft import ROOT, _port

    config, save = _config(tmp_path), tmp_path / "D"

    def command(*extra):
        return ["deepspeed", "--num_gpus", "1", "--master_port", str(_port()), os.path.join(ROOT, "examples", "sft.py"),
                "--ds_config", config, "--seq-len", "128", "--save-dir", str(save), *extra]

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    first = subprocess.Popen(command("--max-steps", "100000", "--save-every-minutes", "0"), env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (save / "metrics.jsonl").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.5)
        second = subprocess.run(command("--max-steps", "2"), env=env, cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"--save-dir {save} is in use by another run (run " in second.stdout + second.stderr
        rows = len((save / "metrics.jsonl").read_text().splitlines())
        time.sleep(3)
        assert first.poll() is None and len((save / "metrics.jsonl").read_text().splitlines()) > rows  # goes on
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=60)


# -- the other ranks wait for rank 0's conversion without a collective (item 13) ---------------------------------------


def test_the_other_ranks_watch_for_rank_0s_conversion(tmp_path, monkeypatch):
    """A conversion longer than a collective's timeout (NCCL's default 30 minutes) must not kill the waiting ranks:
    they poll the save directory for the converted form, or rank 0's failure, of this very checkpoint (stale ones of
    another are ignored), and give up with one line after a bound, or when rank 0's work is not visible at all."""
    import threading

    from ds_longseq.engine import reshape

    out, source = tmp_path / "step4.universal", "manifest sha256 abc"
    (tmp_path / "step4.universal.failed").write_text("manifest sha256 OLD\nan earlier failure")  # another's: ignored
    (tmp_path / "step4.universal.converting").write_text(source)

    def finish():
        out.mkdir()
        (out / reshape.SOURCE_STAMP).write_text(source)

    timer = threading.Timer(1.5, finish)
    timer.start()
    assert reshape._await_conversion(str(out), source, "--resume", "step4") is None
    timer.join()
    failed_out = tmp_path / "step5.universal"
    (tmp_path / "step5.universal.failed").write_text(f"{source}\nExtracting failed: no exp_avg")
    assert reshape._await_conversion(str(failed_out), source, "--resume", "step5") == "Extracting failed: no exp_avg"
    monkeypatch.setattr(reshape, "VISIBLE_WITHIN_S", 0.5)
    with pytest.raises(SystemExit, match="is not visible here: resuming on another shape needs a file system"):
        reshape._await_conversion(str(tmp_path / "step6.universal"), source, "--resume", "step6")
    (tmp_path / "step7.universal.converting").write_text(source)
    monkeypatch.setattr(reshape, "CONVERSION_WAIT_S", 1.0)
    with pytest.raises(SystemExit, match="rank 0's conversion of step7 has not finished after"):
        reshape._await_conversion(str(tmp_path / "step7.universal"), source, "--resume", "step7")
