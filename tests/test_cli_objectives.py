"""``ds-longseq dpo`` and ``ds-longseq grpo`` as ``ds-longseq train`` is for SFT (the launcher started without one,
``--num_gpus 1`` as one process, shipped configs by name, the built-in model and data, the exit statuses), and
``--report-to`` turning DeepSpeed's monitors on under --save-dir: TensorBoard, CSV and W&B (offline: the run's
``.wandb`` file read back here)."""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys

import pytest

from ds_longseq import cli
from ds_longseq.toolkit.metrics import WANDB_STEP
from ds_longseq.toolkit.report_to import report_to_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER_VARIABLES = ("CROSS_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK",
                      "SLURM_PROCID", "RANK", "WORLD_SIZE")
BAD_FLAG = {"dpo": (("--beta", "0"), "--beta must be > 0, got 0.0"),
            "grpo": (("--num-iterations", "0"), "--num-iterations must be >= 1, got 0")}


@pytest.fixture
def no_launcher(monkeypatch):
    """No launcher around this process, no GPU, and the launcher ``ds-longseq`` would start recorded, not run."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "_cuda_count", lambda: 0)
    started = []
    monkeypatch.setattr(cli, "run_forwarding_signals", lambda command: started.append(command) or 7)
    return started


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_objective_without_a_launcher_starts_deepspeeds(objective, no_launcher, monkeypatch, tmp_path, capsys):
    """The launcher runs this same subcommand on every rank, the launch flags left out; bad input is refused (2)
    before any rank starts, and under a launcher --num_gpus is refused naming the subcommand."""
    argv = ["--max-steps", "3", "--save-dir", str(tmp_path / "run"), "--report-to", "csv"]
    assert cli.main([objective, "--num_gpus", "3", "--master_port", "29999", *argv]) == 7  # the launcher's status
    command = no_launcher.pop()
    assert command[3] == "deepspeed.launcher.runner" and command[command.index("--num_gpus") + 1] == "3"
    assert command[-len(argv) - 4:] == ["--no_local_rank", "--module", "ds_longseq.cli", objective, *argv]
    assert "over 3 CPU ranks" in capsys.readouterr().err
    assert cli.main([objective, *argv]) == 7 and no_launcher.pop()[command.index("--num_gpus") + 1] == "2"

    flags, message = BAD_FLAG[objective]
    refusals = {flags: message,
                ("--ds_config", "zero3_ulysses_streambp", "--num_gpus", "3"): "size 2 does not divide the 3",
                ("--report-to", "tensorbord"): "--report-to tensorbord: unknown destination 'tensorbord': pass a "
                                               "comma-separated list of tensorboard, csv, wandb, or none",
                ("--report-to", "none,csv"): "none turns every monitor off: pass it alone"}
    for flags, message in refusals.items():
        assert cli.main([objective, *argv, *flags]) == 2, flags
        assert message in capsys.readouterr().err, flags
    monkeypatch.setenv("CROSS_RANK", "0")  # under DeepSpeed's launcher: its ranks, not --num_gpus
    assert cli.main([objective, "--num_gpus", "2", *argv]) == 2
    assert f"leave --num_gpus out, or run `ds-longseq {objective}` without a launcher" in capsys.readouterr().err
    assert not no_launcher


def test_report_to_a_missing_package_names_the_install(no_launcher, monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert cli.main(["dpo", "--save-dir", str(tmp_path), "--report-to", "csv,wandb"]) == 2
    assert ("--report-to wandb: the wandb package is not installed: pip install wandb, or leave wandb out of "
            "--report-to") in capsys.readouterr().err
    assert cli.main(["dpo", "--save-dir", str(tmp_path), "--report-to", "csv"]) == 7  # csv needs no package
    assert no_launcher.pop()[-2:] == ["--report-to", "csv"]


def test_report_to_turns_the_monitor_sections_on_under_the_save_dir(monkeypatch, tmp_path):
    config = {"train_micro_batch_size_per_gpu": 1, "csv_monitor": {"enabled": True, "output_path": "/elsewhere"},
              "wandb": {"enabled": False, "team": "mine"}, "tensorboard": {"enabled": True}}
    assert report_to_config(config, None, str(tmp_path)) is config  # not given: the config decides
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    on = report_to_config(config, "csv,wandb", str(tmp_path))
    assert on["csv_monitor"] == {"enabled": True, "output_path": str(tmp_path), "job_name": "csv_monitor"}
    assert on["wandb"] == {"enabled": True, "team": "mine", "project": "ds-longseq"}
    assert on["tensorboard"] == {"enabled": True}  # not named: as the config has it
    assert os.environ["WANDB_DIR"] == str(tmp_path)  # where DeepSpeed's wandb.init (no dir) puts the run
    assert config["csv_monitor"]["output_path"] == "/elsewhere"  # the caller's config untouched
    monkeypatch.setenv("WANDB_DIR", "/mine")
    monkeypatch.setenv("WANDB_PROJECT", "theirs")
    assert report_to_config(config, "wandb", str(tmp_path))["wandb"]["project"] == "theirs"
    assert os.environ["WANDB_DIR"] == "/mine"
    off = report_to_config(config, "none", str(tmp_path))
    assert [off[key]["enabled"] for key in ("csv_monitor", "wandb", "tensorboard")] == [False] * 3
    assert "comet" not in off


def wandb_history(run_dir: str) -> list[dict]:
    """The history rows of the one offline W&B run under ``run_dir/wandb/``, read from its ``.wandb`` file.

    The file is a LevelDB-style log of W&B's protobuf ``Record`` messages (wandb has no reader of its own since the
    Go core replaced the Python one): a 7-byte header (":W&B", magic, version), then 32 KiB blocks of chunks, each
    with a 7-byte header (CRC, length, kind: 1 full, 2 first, 3 middle, 4 last; a block's tail under 7 bytes is
    padding).
    """
    from wandb.proto import wandb_internal_pb2

    runs = [d for d in os.listdir(os.path.join(run_dir, "wandb")) if d.startswith("offline-run-")]
    assert len(runs) == 1, runs
    folder = os.path.join(run_dir, "wandb", runs[0])
    (name,) = [f for f in os.listdir(folder) if f.endswith(".wandb")]
    with open(os.path.join(folder, name), "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def _run(objective: str, tmp_path, *argv: str) -> subprocess.CompletedProcess:
    """``python -m ds_longseq.cli OBJECTIVE --num_gpus 1 ...`` from ``tmp_path`` (no launcher), W&B offline with its
    settings, cache and data kept under ``tmp_path``; the run must succeed."""
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARIABLES, "MASTER_PORT", "LOCAL_RANK")
           and not k.startswith("WANDB_")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1",
               WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
               WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"), WANDB_DATA_DIR=str(tmp_path / "wandb_data"))
    proc = subprocess.run([sys.executable, "-m", "ds_longseq.cli", objective, "--num_gpus", "1", *argv], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _csv_column(path) -> list[tuple[int, float]]:
    with open(path) as f:
        return [(int(step), float(value)) for step, value in list(csv.reader(f))[1:]]


def test_dpo_one_process_reports_to_wandb_tensorboard_and_csv(tmp_path):
    """The built-in DPO job as one process with every destination on. Two micro-batches a step: DeepSpeed's own
    events reach W&B at 2, 4, 6 samples, so rows logged at their optimizer step (1, 2, 3) would be behind W&B's step
    and dropped; the history must hold every row, on the WANDB_STEP axis, with metrics.jsonl's values."""
    pytest.importorskip("tensorboard")
    with open(os.path.join(ROOT, "ds_configs", "zero2_streambp.json")) as f:
        config = json.load(f)
    config["gradient_accumulation_steps"] = 2
    (tmp_path / "gas2.json").write_text(json.dumps(config))
    save = tmp_path / "dpo"
    proc = _run("dpo", tmp_path, "--ds_config", "gas2.json", "--max-steps", "3", "--seq-len", "64", "--lr", "1e-3",
                "--save-dir", "dpo", "--report-to", "wandb,tensorboard,csv")
    assert "summary: 3 steps on 1 rank(s)" in proc.stdout
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]

    history = [h for h in wandb_history(str(save)) if WANDB_STEP in h]
    assert [h[WANDB_STEP] for h in history] == [1, 2, 3]
    for key in ("loss", "rewards/margins", "lr", "tokens/s"):  # JSON both ways: the same float
        assert [h[f"Train/ds_longseq/{key}"] for h in history] == [r[key] for r in rows], key
    assert _csv_column(save / "csv_monitor" / "Train_ds_longseq_loss.csv") == [(r["step"], r["loss"]) for r in rows]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(save / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("Train/ds_longseq/rewards/accuracies")
    assert [(s.step, s.value) for s in scalars] == [(r["step"], pytest.approx(r["rewards/accuracies"])) for r in rows]


def test_grpo_one_process_with_a_shipped_config_by_name(tmp_path):
    """The built-in GRPO job, the config named as shipped, from a directory without ds_configs/; --report-to csv."""
    save = tmp_path / "grpo"
    proc = _run("grpo", tmp_path, "--ds_config", "zero2_streambp", "--max-steps", "2", "--seq-len", "64",
                "--save-dir", "grpo", "--report-to", "csv")
    assert "summary: 2 steps x 1 update(s) on 1 rank(s)" in proc.stdout
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and (save / "grpo.png").is_file()
    assert _csv_column(save / "csv_monitor" / "Train_ds_longseq_adv_logp.csv") == [(1, rows[0]["adv_logp"]),
                                                                                    (2, rows[1]["adv_logp"])]
    assert not (save / "wandb").exists() and not (save / "tensorboard").exists()


@pytest.mark.slow  # two CPU ranks through DeepSpeed's launcher, for each objective; one process runs by default
@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_objective_starts_the_launcher_over_two_cpu_ranks(objective, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARIABLES, "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "ds_longseq.cli", objective, "--max-steps", "2", "--seq-len", "64",
                           "--save-dir", "run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "starting DeepSpeed's launcher over 2 CPU ranks" in proc.stderr
    assert "on 2 rank(s)" in proc.stdout and (tmp_path / "run" / "hf_model" / "config.json").is_file()
