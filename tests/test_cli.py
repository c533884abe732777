"""The ``ds-longseq`` command: the shipped configs found by name from any directory, the launcher it starts without
one, and the installed wheel run from a temporary directory with mpi4py missing (the README's environment has
none), so that missing package data or a run that needs the repository fails here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from ds_longseq import cli
from ds_longseq.config_files import ConfigFileError, find_ds_config, shipped_configs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_shipped_configs_are_the_repository_ones():
    """ds_configs/ (what the docs' commands name) is the package data, not a copy that could drift."""
    names = shipped_configs()
    assert {"zero2_streambp", "zero3_ulysses_streambp", "trainer_zero2_streambp"} <= set(names)
    assert os.path.realpath(os.path.join(ROOT, "ds_configs")) == os.path.realpath(os.path.dirname(
        names["zero2_streambp"]))


def test_find_ds_config_path_wins_then_shipped_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = shipped_configs()["zero2_streambp"]
    for value in ("zero2_streambp", "zero2_streambp.json", "ds_configs/zero2_streambp.json"):
        assert find_ds_config(value) == shipped, value
    (tmp_path / "zero2_streambp").write_text("{}")  # an existing path wins over the shipped name
    assert find_ds_config("zero2_streambp") == "zero2_streambp"
    for missing in ("nope", str(tmp_path / "elsewhere" / "zero3_streambp.json")):  # never a silent substitute
        with pytest.raises(ConfigFileError, match="no such file, nor the name of a shipped") as err:
            find_ds_config(missing)
        assert "zero3_ulysses_streambp" in str(err.value)


def test_configs_lists_every_shipped_config_and_prints_one(capsys):
    assert cli.main(["configs"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in shipped_configs())
    assert "ZeRO-2, StreamBP, chunked LM head" in out
    assert cli.main(["configs", "zero3_ulysses_streambp"]) == 0
    config = json.loads(capsys.readouterr().out)
    assert config["long_seq"]["sequence_parallel"]["size"] == 2
    assert cli.main(["configs", "nope"]) == 2 and "shipped" in capsys.readouterr().err
    assert cli.main(["frobnicate"]) == 2 and "unknown subcommand" in capsys.readouterr().err


def test_train_without_a_launcher_starts_deepspeeds(monkeypatch, tmp_path, capsys):
    """The command the launcher would run: this same command on every rank, the launch flags left out; and what
    is refused before any rank starts."""
    for name in ("CROSS_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK",
                 "SLURM_PROCID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "_cuda_count", lambda: 0)
    started = []
    monkeypatch.setattr(cli, "run_forwarding_signals", lambda command: started.append(command) or 7)
    argv = ["--max-steps", "3", "--save-dir", str(tmp_path / "run")]
    assert cli.main(["train", "--num_gpus", "4", "--master_port", "29999", *argv]) == 7  # the launcher's status
    command = started.pop()
    assert command[:3] == [sys.executable, "-u", "-m"] and command[3] == "deepspeed.launcher.runner"
    assert command[command.index("--num_gpus") + 1] == "4" and command[command.index("--master_port") + 1] == "29999"
    assert command[-len(argv) - 4:] == ["--no_local_rank", "--module", "ds_longseq.cli", "train"] + argv
    assert "over 4 CPU ranks" in capsys.readouterr().err
    assert cli.main(["train", *argv]) == 7 and started.pop()[command.index("--num_gpus") + 1] == "2"  # the default

    refusals = {
        ("--ds_config", "zero3_ulysses_streambp", "--num_gpus", "3"): "sequence_parallel size 2 does not divide the 3",
        ("--num_gpus", "0"): "--num_gpus must be >= 1",
        ("--ds_config", "nope.json"): "nor the name of a shipped DeepSpeed config",
        ("--seq-len", "0"): "--seq-len must be positive",
    }
    for flags, message in refusals.items():
        assert cli.main(["train", *flags, *argv]) == 2, flags
        assert message in capsys.readouterr().err, flags
    # one parser, abbreviations off: --num_gpu is refused here, not by the ranks after they started (argparse's exit)
    with pytest.raises(SystemExit) as caught:
        cli.main(["train", "--num_gpu", "1", *argv])
    assert caught.value.code == 2 and "unrecognized arguments: --num_gpu" in capsys.readouterr().err
    monkeypatch.setenv("CROSS_RANK", "0")  # under DeepSpeed's launcher: its ranks, not --num_gpus
    assert cli.main(["train", "--num_gpus", "2", *argv]) == 2 and "leave --num_gpus out" in capsys.readouterr().err
    assert not started


def test_the_launcher_keeps_cuda_visible_devices():
    """``CUDA_VISIBLE_DEVICES=2,3 ds-longseq train`` runs on devices 2 and 3: DeepSpeed's runner drops the variable
    when --num_gpus is passed (and starts the ranks on 0 and 1), so the command names the devices with --include,
    which its own parser and checks accept."""
    from deepspeed.launcher import runner

    rest = ["--max-steps", "3"]
    command = cli.launcher_command(2, 29999, rest, cuda=True, env={"CUDA_VISIBLE_DEVICES": "2,3"})
    args = runner.parse_args(command[command.index("deepspeed.launcher.runner") + 1:])
    assert args.include == "localhost:2,3" and args.num_gpus == -1 and args.num_nodes == -1
    assert args.user_script == "ds_longseq.cli" and args.user_args == ["train", *rest] and args.module
    one = cli.launcher_command(1, 29999, rest, cuda=True, env={"CUDA_VISIBLE_DEVICES": "5, 6"})
    assert one[one.index("--include") + 1] == "localhost:5"  # the first of them, as torch numbers them
    for cuda, env in ((True, {}), (False, {"CUDA_VISIBLE_DEVICES": "2,3"})):  # none set, or CPU ranks
        plain = cli.launcher_command(2, 29999, rest, cuda=cuda, env=env)
        assert "--include" not in plain and plain[plain.index("--num_gpus") + 1] == "2"


def test_sigterm_to_the_command_ends_every_process_it_started(tmp_path):
    """SIGTERM to ``ds-longseq train`` (SLURM's first signal; a container's PID 1 gets it from the runtime) reaches
    the launcher, its launch process and both CPU ranks: nothing of the run is left alive, and the status says the
    signal (128 + 15)."""
    import signal
    import time

    save = tmp_path / "sigterm_run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "ds_longseq.cli", "train", "--max-steps", "100000", "--seq-len",
                             "64", "--save-dir", str(save), "--save-every-minutes", "0"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ours() -> list[int]:
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if str(save).encode() in f.read() and int(pid) != proc.pid:
                        pids.append(int(pid))
            except OSError:
                continue
        return pids

    deadline = time.monotonic() + 240
    while not (save / "metrics.jsonl").exists():  # the ranks are training
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.5)
    assert len(ours()) >= 3  # the runner (or launch process) and two ranks
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while ours() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ours(), "processes of the run survived the command's SIGTERM"


def _install_wheel(tmp_path) -> tuple[str, dict[str, str]]:
    """Build the package's wheel from a copy of its sources and install it into a target directory; returns the
    console script and an environment with that directory (not the repository) on the path and mpi4py hidden."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "ds_longseq"), src / "ds_longseq",
                    ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True, cwd=src)
    (wheel,) = (tmp_path / "dist").glob("ds_longseq-*.whl")
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True)
    hide = tmp_path / "hide" / "mpi4py"  # what the README's environment lacks: DeepSpeed's MPI discovery needs it
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mpi4py'\", name='mpi4py')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "hide"), str(target)])
    return str(target / "bin" / "ds-longseq"), env


def _runner(command, env, work):
    def run(*argv):
        proc = subprocess.run([command, *argv], cwd=work, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, (argv, proc.stderr[-3000:])
        return proc

    return run


@pytest.mark.slow  # CI time: the command the launcher runs is checked by default above, the launcher by the others
def test_installed_wheel_starts_the_launcher_over_two_cpu_ranks(tmp_path):
    """Plain ``ds-longseq train`` from the wheel, without a launcher or mpi4py: DeepSpeed's launcher over 2 CPU
    ranks, whose ranks import the installed package too."""
    command, env = _install_wheel(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    two = _runner(command, env, work)("train", "--max-steps", "2", "--seq-len", "64", "--save-dir", "two")
    assert "starting DeepSpeed's launcher over 2 CPU ranks" in two.stderr
    assert "summary: 2 steps on 2 rank(s)" in two.stdout and (work / "two" / "hf_model" / "config.json").is_file()


def test_installed_wheel_trains_from_another_directory(tmp_path):
    """``ds-longseq`` from the wheel (its configs package data), in a directory with no ds_configs/, without
    mpi4py: ``configs`` lists them; ``train --num_gpus 1`` runs one process (no MPI discovery)."""
    command, env = _install_wheel(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    run = _runner(command, env, work)

    proc = run("configs", "--path", "zero2_streambp")
    assert proc.stdout.strip().startswith(str(tmp_path / "site" / "ds_longseq" / "configs")), proc.stdout
    flags = ("--max-steps", "2", "--seq-len", "64", "--ds_config", "ds_configs/zero2_streambp.json")
    one = run("train", "--num_gpus", "1", *flags, "--save-dir", "one")
    assert "running as one process (rank 0 of 1)" in one.stderr and "mpi4py" not in one.stderr
    summary = one.stderr.split("start-up summary:", 1)[1]  # logged before the first step
    for line in ("model: the built-in tiny Llama", "64 tokens per sequence",
                 "long_seq: lm_head, streambp (chunk_size 1024; attention outputs kept where memory allows",
                 "memory: the planner's estimate", "checkpoints: every 30 min and after the last step"):
        assert line in summary, (line, summary[:2000])
    assert "summary: 2 steps on 1 rank(s)" in one.stdout
    assert (work / "one" / "hf_model" / "config.json").is_file() and (work / "one" / "latest").is_file()
    assert str(tmp_path / "site" / "ds_longseq") in subprocess.run(
        [sys.executable, "-c", "import ds_longseq; print(ds_longseq.__file__)"], cwd=work, env=env,
        capture_output=True, text=True).stdout  # the wheel's copy ran, not the repository's


def test_ops_to_build_names_the_ops_not_built_yet(tmp_path, monkeypatch):
    """The first launch's silence explained: the ops the config needs and the cache does not hold, named."""
    from ds_longseq.toolkit.distributed import _extensions_dir, ops_to_build

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    offload = {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    assert [op for op, _ in ops_to_build(offload, on_cuda=False)] == ["deepspeed_shm_comm", "cpu_adam", "async_io"]
    assert [op for op, _ in ops_to_build({}, on_cuda=True)] == []
    os.makedirs(os.path.join(_extensions_dir(), "deepspeed_shm_comm"))
    assert [op for op, _ in ops_to_build(offload, on_cuda=False)] == ["cpu_adam", "async_io"]
