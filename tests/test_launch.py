"""launch/: examples/sft.py under mpirun on 2 CPU ranks, and the launch scripts' command lines.

The mpirun test needs an MPI launcher and mpi4py (``bash .ci/install_mpi.sh`` installs MPICH's
mpirun and mpi4py from PyPI); the others run fake ``mpirun``/``deepspeed`` executables that
print what they were given, so they need neither MPI nor a second rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN_SH = os.path.join(ROOT, "launch", "mpirun.sh")
MULTINODE_SH = os.path.join(ROOT, "launch", "multinode.sh")
HOSTFILE_EXAMPLE = os.path.join(ROOT, "launch", "hostfile.example")
# How DeepSpeed's launcher reads a hostfile line (deepspeed/launcher/runner.py, _parse_hostfile).
DS_HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def _find_mpirun() -> str | None:
    # pip's mpich puts mpirun next to the interpreter, which need not be on PATH (a venv's bin).
    return shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@pytest.mark.parametrize("flavour", ["mpich", "openmpi"])
def test_mpirun_sh_trains_on_two_ranks(tmp_path, flavour):
    """MPICH's mpirun from PyPI, and a real Open MPI (Debian's openmpi-bin), for which mpirun.sh points
    mpi4py at Open MPI's libmpi."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (bash .ci/install_mpi.sh)")
    if flavour == "mpich":
        mpirun = _find_mpirun()
        if mpirun is None:
            pytest.skip("no mpirun on PATH (bash .ci/install_mpi.sh installs MPICH's from PyPI)")
        extra = {"PYTHONPATH": ROOT}  # this checkout's package, whatever pip last installed
    else:
        mpirun, extra = "mpirun.openmpi", {"PYTHONPATH": ROOT, "MPI_ARGS": "--oversubscribe"}
        if shutil.which(mpirun) is None:
            pytest.skip("no mpirun.openmpi: bash .ci/install_multinode.sh installs Open MPI")
    from tests.dist_utils import free_port

    save_dir = tmp_path / "run"
    env = dict(
        os.environ,
        NP="2",
        MPIRUN=mpirun,
        PYTHON=sys.executable,
        # Honoured once sft.py passes it to init_distributed(distributed_port=...); DeepSpeed's
        # MPI discovery uses 29500 otherwise.
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        **extra,
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MPI4PY_LIBMPI"):  # leave discovery to DeepSpeed
        env.pop(name, None)
    proc = subprocess.run(
        ["bash", MPIRUN_SH, "--max-steps", "2", "--seq-len", "1024", "--save-dir", str(save_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"launch/mpirun.sh ({flavour}) failed ({proc.returncode}):\n{output[-6000:]}"
    assert "on 2 rank(s)" in output, output[-4000:]
    assert ("-x MPI4PY_LIBMPI" in output) == (flavour == "openmpi")
    with open(save_dir / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f]
    assert [m["step"] for m in metrics] == [1, 2]


def test_launch_scripts_parse_and_hostfile_example_is_valid():
    for script in (MPIRUN_SH, MULTINODE_SH):
        proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert proc.returncode == 0, f"bash -n {script}:\n{proc.stderr}"
    with open(HOSTFILE_EXAMPLE) as f:
        lines = [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
    assert lines and all("slots=" in line for line in lines)
    assert all(DS_HOSTFILE_LINE.match(line) for line in lines), lines


def _fake(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# Prints its arguments one per line and the hostfile it was given, as the launcher would see it.
FAKE_MPIRUN = """\
if [[ "$1" == --version ]]; then echo "$FAKE_VERSION"; exit 0; fi
prev=""
for a in "$@"; do
  echo "ARG $a"
  if [[ "$prev" == -hostfile ]]; then sed 's/^/HOST /' "$a"; fi
  prev="$a"
done
"""


def _run_script(script, env_extra, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "NP", "HOSTFILE")}
    env.update(env_extra)
    return subprocess.run(["bash", script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("flavour", ["mpich", "openmpi"])
def test_mpirun_sh_hostfile_and_flavours(tmp_path, flavour):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=8\n\nnode2 slots=8  # second\n")
    version = "HYDRA build details:\n    Version: 5.0.2" if flavour == "mpich" else "mpirun (Open MPI) 4.1.5"
    env = {
        "MPIRUN": _fake(tmp_path, "mpirun", FAKE_MPIRUN),
        "PYTHON": _fake(tmp_path, "python", "exit 0\n"),  # passes the mpi4py check
        "FAKE_VERSION": version,
        "HOSTFILE": str(hostfile),
        "MASTER_PORT": "29612",
        "TMPDIR": str(tmp_path),  # where mpirun.sh writes the converted hostfile
    }
    proc = _run_script(MPIRUN_SH, env, "--seq-len", "4096", "--save-dir", "a dir")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    args = [line[4:] for line in lines if line.startswith("ARG ")]
    hosts = [line[5:] for line in lines if line.startswith("HOST ")]
    assert args[:2] == ["-np", "16"]  # the sum of the slots
    if flavour == "mpich":
        assert hosts == ["node1:8", "node2:8"]  # Hydra's format
        assert "-x" not in args
    else:
        assert hosts == hostfile.read_text().splitlines()  # Open MPI reads DeepSpeed's format
        assert "MASTER_PORT" in args and args[args.index("MASTER_PORT") - 1] == "-x"
        assert ("--allow-run-as-root" in args) == (os.geteuid() == 0)
    tail = args[args.index("-m"):]
    # every rank sets torchrun's variables from MPI first (ds_longseq.processes.mpi_env), then runs the script
    assert tail[:5] == ["-m", "mpi4py", "-m", "ds_longseq.processes.mpi_env", os.path.join(ROOT, "examples", "sft.py")]
    assert tail[5:] == ["--ds_config", os.path.join(ROOT, "ds_configs", "zero2_streambp.json"),
                        "--seq-len", "4096", "--save-dir", "a dir"]
    assert not list(tmp_path.glob("mpich_hosts.*"))  # the converted hostfile is cleaned up

    # a script of the user's: its own arguments, no --ds_config added
    script = tmp_path / "train.py"
    script.write_text("")
    args = [line[4:] for line in _run_script(MPIRUN_SH, {**env, "SCRIPT": str(script)}, "--deepspeed", "ds.json")
            .stdout.splitlines() if line.startswith("ARG ")]
    assert args[args.index("ds_longseq.processes.mpi_env") + 1:] == [str(script), "--deepspeed", "ds.json"]
    proc = _run_script(MPIRUN_SH, {**env, "SCRIPT": str(tmp_path / "missing.py")})
    assert proc.returncode == 2 and "no script at" in proc.stderr

    env.update(NP="3", MPI_ARGS="-ppn 2 --verbose")
    args = [line[4:] for line in _run_script(MPIRUN_SH, env).stdout.splitlines() if line.startswith("ARG ")]
    assert args[:2] == ["-np", "3"] and args[args.index("-ppn") + 1] == "2" and "--verbose" in args


def test_mpirun_sh_without_mpi4py_says_how_to_install(tmp_path):
    env = {"MPIRUN": _fake(tmp_path, "mpirun", FAKE_MPIRUN), "PYTHON": _fake(tmp_path, "python", "exit 1\n")}
    proc = _run_script(MPIRUN_SH, env)
    assert proc.returncode == 2 and "install_mpi.sh" in proc.stderr


def test_multinode_sh_command(tmp_path):
    deepspeed = _fake(tmp_path, "deepspeed", 'for a in "$@"; do echo "ARG $a"; done\n')
    proc = _run_script(MULTINODE_SH, {"DEEPSPEED": deepspeed, "HOSTFILE": str(tmp_path / "missing")})
    assert proc.returncode == 2 and "no hostfile" in proc.stderr

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# comment\nworker-0 slots=4\nworker-1 slots=4\n")
    # PREFLIGHT=0: these hosts do not exist (tests/test_multinode.py runs the preflight against real ssh).
    env = {"DEEPSPEED": deepspeed, "HOSTFILE": str(hostfile), "NUM_NODES": "1", "DS_LAUNCH_ARGS": "--no_ssh_check",
           "PREFLIGHT": "0", "SSH_PORT": "2222"}
    proc = _run_script(MULTINODE_SH, env, "--max-steps", "3", "--save-dir", "a dir")
    assert proc.returncode == 0, proc.stderr
    args = [line[4:] for line in proc.stdout.splitlines() if line.startswith("ARG ")]
    assert args == [
        "--hostfile", str(hostfile), "--master_addr", "worker-0", "--master_port", "29500", "--ssh_port", "2222",
        "--num_nodes", "1", "--no_ssh_check", os.path.join(ROOT, "examples", "sft.py"),
        "--ds_config", os.path.join(ROOT, "ds_configs", "zero3_streambp.json"),
        "--max-steps", "3", "--save-dir", "a dir",
    ]


def _preflight_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("preflight", os.path.join(ROOT, "launch", "preflight.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_preflight_check_names_each_mismatched_node():
    """launch/preflight.py's comparison on its own (tests/test_multinode.py runs it over real ssh)."""
    preflight = _preflight_module()
    good = {"hostname": "a", "python": "3.11.7", "torch": "2.13.0", "deepspeed": "0.19.8", "ds_longseq": "0.1.0",
            "ds_longseq_path": "/repo/ds_longseq", "ds_longseq_digest": "abc", "gpus": 8, "errors": []}
    answers = {
        "node1": good,
        "node2": dict(good, ds_longseq_digest="def"),  # same version, other sources (an edited checkout)
        "node3": dict(good, gpus=4),
        "node4": {"errors": ["not reachable over passwordless ssh (...)"]},
    }
    hosts = {"node1": 8, "node2": 8, "node3": 8, "node4": 8}
    problems = preflight.check(hosts, answers, num_gpus=None)
    assert problems == [
        "node node3: slots=8 in the hostfile but 4 GPU(s) visible there: one rank per GPU, so set slots <= its GPUs "
        "(or NUM_GPUS)",
        "node node4: not reachable over passwordless ssh (...)",
        "node node2: ds_longseq's sources (digest of its .py files) is def, node node1 has abc: every node needs "
        "the same environment (same checkout, same pip install)",
    ]
    assert preflight.check({"node1": 8}, {"node1": good}, num_gpus=8) == []
    # An unreachable first node: the others are compared with the first node that answered.
    unreachable = {"errors": ["not reachable"]}
    problems = preflight.check({"a": 8, "b": 8, "c": 8}, {"a": unreachable, "b": good, "c": dict(good, torch="2.12")},
                               num_gpus=None)
    assert problems == ["node a: not reachable", "node c: torch is 2.12, node b has 2.13.0: every node needs the same "
                        "environment (same checkout, same pip install)"]


def test_preflight_hostfile_errors(tmp_path):
    preflight = _preflight_module()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# nodes\nnode1 slots=2\nnode1 slots=2\nnode2 gpus=2\n")
    hosts, problems = preflight.parse_hostfile(str(hostfile))
    assert hosts == {"node1": 2}
    assert problems == [
        f"{hostfile}:3: host node1 is listed twice", f"{hostfile}:4: 'node2 gpus=2' is not '<host> slots=<N>'"
    ]
    assert preflight.parse_hostfile(str(tmp_path / "none"))[1][0].startswith("no hostfile at")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "preflight.py"), "--hostfile", str(hostfile)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "listed twice" in proc.stderr
