"""Two "nodes" on this machine: the DeepSpeed hostfile launcher over pdsh/ssh and Open MPI, end to end.

Each node is an sshd listening on its own loopback address (127.0.0.1, 127.0.0.2) in its own UTS
namespace (``unshare --uts``), so processes started through it see the hostname node1 or node2, as
on two machines; key-based ssh for this test only (a throwaway key and host key, an ssh wrapper on
PATH that adds ``-F <test config>``: nothing in ~/.ssh is read or changed). ``launch/multinode.sh``
and ``launch/mpirun.sh`` run examples/sft.py across the two nodes, one rank each, and the losses must
equal a single-node 2-rank run's; the preflight names each bad node; a node's launcher killed
mid-run stops the job, named, and ``--resume`` reproduces the uninterrupted losses.

Needs root, sshd, ssh, pdsh, unshare (and mpirun.openmpi for the Open MPI test): ``bash
.ci/install_multinode.sh``. Without them the tests skip, naming that script.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ds_longseq.toolkit.faults import FAULT_INJECT_ENV
from tests.dist_utils import free_port
from tests.test_sft import ROOT, _config, losses

MULTINODE_SH = os.path.join(ROOT, "launch", "multinode.sh")
MPIRUN_SH = os.path.join(ROOT, "launch", "mpirun.sh")
NODES = ("127.0.0.1", "127.0.0.2")
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

SSHD_CONFIG = """\
Port {port}
ListenAddress {addr}
HostKey {dir}/host_key
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {dir}/sshd_{index}.pid
AcceptEnv PYTHONPATH
"""

SSH_CONFIG = """\
Host 127.0.0.*
  Port {port}
  IdentityFile {dir}/client_key
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  BatchMode yes
  LogLevel ERROR
"""

# Every `ssh` of the launchers (pdsh, DeepSpeed's ssh check, Open MPI's orted start, the preflight)
# comes through here. TEST_NODE2_SSH_OPTS gives node 2 a different environment (the version test).
SSH_WRAPPER = """\
#!/bin/sh
extra=""
for a in "$@"; do [ "$a" = 127.0.0.2 ] && extra="$TEST_NODE2_SSH_OPTS"; done
exec /usr/bin/ssh -F {dir}/ssh_config $extra "$@"
"""


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (an sshd per node, unshare --uts)"
    for tool in ("ssh", "ssh-keygen", "pdsh", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    if not os.access(SSHD, os.X_OK):
        return "no sshd"
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        return "unshare --uts is not permitted here (a container without CAP_SYS_ADMIN)"
    return None


@dataclass
class Cluster:
    dir: Path
    env: dict
    hostfile: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = _missing()
    if why:
        pytest.skip(f"{why}: bash .ci/install_multinode.sh installs what the multi-node tests need")
    d = tmp_path_factory.mktemp("cluster")
    for key in ("client_key", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True)
    shutil.copy(d / "client_key.pub", d / "authorized_keys")
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
    port = free_port()
    procs = []
    for index, addr in enumerate(NODES, 1):
        config = d / f"sshd_{index}.config"
        config.write_text(SSHD_CONFIG.format(port=port, addr=addr, dir=d, index=index))
        log = open(d / f"sshd_{index}.log", "w")  # noqa: SIM115 - open for the server's lifetime
        procs.append(subprocess.Popen(
            ["unshare", "--uts", "sh", "-c", f'hostname node{index} && exec "$0" -D -e -f "$1"', SSHD, str(config)],
            stdout=log, stderr=subprocess.STDOUT,
        ))
    (d / "ssh_config").write_text(SSH_CONFIG.format(port=port, dir=d))
    (d / "bin").mkdir()
    wrapper = d / "bin" / "ssh"
    wrapper.write_text(SSH_WRAPPER.format(dir=d))
    wrapper.chmod(0o755)
    hostfile = d / "hostfile"
    hostfile.write_text("# two nodes, one rank each\n127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    # Variables for the remote ranks go through DeepSpeed's .deepspeed_env mechanism (DS_ENV_FILE names
    # the file): one thread per rank, as in the single-node reference, for the same reduction order.
    (d / "ds_env").write_text("OMP_NUM_THREADS=1\n")
    env = dict(os.environ, PATH=f"{d / 'bin'}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1",
               PYTHON=sys.executable, HOSTFILE=str(hostfile), DS_ENV_FILE=str(d / "ds_env"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TEST_NODE2_SSH_OPTS"):
        env.pop(name, None)
    try:
        deadline = time.monotonic() + 30
        for index, addr in enumerate(NODES, 1):
            while True:
                proc = subprocess.run(["ssh", addr, "hostname"], env=env, capture_output=True, text=True)
                if proc.returncode == 0:
                    assert proc.stdout.strip() == f"node{index}", proc.stdout
                    break
                if time.monotonic() > deadline:
                    logs = (d / f"sshd_{index}.log").read_text()
                    pytest.fail(f"sshd of node{index} ({addr}) did not answer: {proc.stderr}\n{logs}")
                time.sleep(0.3)
        yield Cluster(d, env, hostfile)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def run_launcher(cluster, script, config, save_dir, *args, env_extra=None, timeout=600):
    env = dict(cluster.env, DS_CONFIG=config, MASTER_PORT=str(free_port()), **(env_extra or {}))
    cmd = ["bash", script, "--seq-len", "256", "--save-dir", str(save_dir), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, uninterrupted_sft):
    """Config and losses of an uninterrupted single-node 2-rank run (4 steps, checkpoints every 2)."""
    return _config(tmp_path_factory.mktemp("single")), uninterrupted_sft(2)


def _assert_same_losses(expected, got):
    assert len(got) == len(expected) == 4, (expected, got)
    # Same ranks, same data, same reduction order: float32 CPU runs repeat to rounding.
    for x, y in zip(expected, got, strict=True):
        assert abs(x - y) <= 1e-6 * abs(x), (expected, got)


def test_two_node_pdsh_launch_matches_single_node(cluster, reference, tmp_path):
    config, expected = reference
    proc = run_launcher(cluster, MULTINODE_SH, config, tmp_path / "run", "--max-steps", "4", "--save-every", "2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "preflight: OK, 2 node(s), 2 rank(s)" in out
    # pdsh prefixes each node's output with its name; rank 0's summary counts both ranks.
    assert "127.0.0.2: " in out and "127.0.0.1: summary: 4 steps on 2 rank(s)" in out, out[-4000:]
    _assert_same_losses(expected, losses(tmp_path / "run"))


def test_preflight_only_reports_each_node(cluster, tmp_path):
    proc = run_launcher(cluster, MULTINODE_SH, _config(tmp_path), tmp_path / "run", env_extra={"PREFLIGHT": "only"})
    assert proc.returncode == 0, proc.stderr
    assert "127.0.0.1: slots=1 host=node1" in proc.stderr and "127.0.0.2: slots=1 host=node2" in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was launched


def _fake_deepspeed_dir(tmp_path) -> Path:
    """A directory with a deepspeed 0.0.1 package, imported first by a Python whose PYTHONPATH names it.

    PYTHONPATH, not PYTHONUSERBASE: every interpreter (a virtualenv, pyenv, conda, the system python)
    puts PYTHONPATH ahead of its site-packages, while a virtualenv without system site-packages has no
    user site at all, so a fake there would go unseen and the run would pass the preflight and train.
    """
    base = tmp_path / "fake_deepspeed"
    (base / "deepspeed").mkdir(parents=True)
    (base / "deepspeed" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    return base


@pytest.mark.parametrize("fault", ["unreachable node", "slots vs NUM_GPUS", "port in use", "other version on node2"])
def test_bad_cluster_fails_before_training_naming_the_node(cluster, tmp_path, fault):
    env_extra, hostfile, expected = {}, cluster.hostfile, ""
    held = None
    if fault == "unreachable node":
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("127.0.0.1 slots=1\n127.0.0.3 slots=1\n")  # no sshd listens there
        expected = "node 127.0.0.3: not reachable over passwordless ssh"
    elif fault == "slots vs NUM_GPUS":
        env_extra["NUM_GPUS"] = "2"
        expected = "node 127.0.0.1: NUM_GPUS=2 but the hostfile gives it slots=1"
    elif fault == "port in use":
        held = socket.socket()
        held.bind(("", 0))
        held.listen()
        env_extra["MASTER_PORT"] = str(held.getsockname()[1])
        expected = f"node 127.0.0.1: MASTER_PORT {env_extra['MASTER_PORT']} is in use on this node, the master"
    else:
        # Only node2's ssh sends PYTHONPATH (SetEnv; the sshds AcceptEnv it): only node2 sees the fake.
        env_extra["TEST_NODE2_SSH_OPTS"] = f"-o SetEnv=PYTHONPATH={_fake_deepspeed_dir(tmp_path)}"
        expected = "node 127.0.0.2: deepspeed is 0.0.1, node 127.0.0.1 has "
    env_extra["HOSTFILE"] = str(hostfile)
    try:
        env = dict(cluster.env, DS_CONFIG=_config(tmp_path), MASTER_PORT=str(free_port()))
        env.update(env_extra)
        proc = subprocess.run(["bash", MULTINODE_SH, "--save-dir", str(tmp_path / "run")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        if held is not None:
            held.close()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "preflight failed" in proc.stderr and "PREFLIGHT=0" in proc.stderr
    assert not (tmp_path / "run").exists()  # no rank started


def _processes():
    """(pid, argv as bytes) of every process still readable in /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                yield int(entry), f.read().split(b"\0")
        except OSError:
            continue


def _launcher_pid(node_rank: int, save_dir: Path) -> int | None:
    """PID of DeepSpeed's per-node launcher (``deepspeed.launcher.launch``) for ``node_rank`` of this run."""
    for pid, argv in _processes():
        # The python process itself, not pdsh's or ssh's, whose arguments carry the same remote command.
        if (os.path.basename(argv[0]).startswith(b"python") and b"deepspeed.launcher.launch" in argv
                and f"--node_rank={node_rank}".encode() in argv and str(save_dir).encode() in argv):
            return pid
    return None


def _kill_run(save_dir: Path) -> None:
    """SIGKILL every process of this run still alive (the ones whose arguments name its --save-dir)."""
    for pid, argv in _processes():
        if str(save_dir).encode() in argv and pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.slow  # heavy: the default run keeps the two-node pdsh launch
def test_killed_node_launcher_stops_the_job_and_resume_matches(cluster, reference, tmp_path):
    config, expected = reference
    save_dir = tmp_path / "run"
    # Rank 1 (node2) sleeps in step 3, after the step-2 checkpoint; then node2's launcher is SIGKILLed,
    # as when a node is lost. Its rank must die with it and the job end, naming it. The fault goes to
    # the remote ranks as the cluster's other variables do: in this run's own .deepspeed_env file.
    fault = f"{FAULT_INJECT_ENV}=sigkill:1:3:sleep"
    ds_env = tmp_path / "ds_env"
    ds_env.write_text((cluster.dir / "ds_env").read_text() + fault + "\n")
    env = dict(cluster.env, DS_CONFIG=config, MASTER_PORT=str(free_port()), DS_ENV_FILE=str(ds_env))
    cmd = ["bash", MULTINODE_SH, "--seq-len", "256", "--save-dir", str(save_dir), "--max-steps", "4",
           "--save-every", "2"]
    log = open(tmp_path / "launch.log", "w+")  # noqa: SIM115 - read back below
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not ((save_dir / "latest").exists() and (save_dir / "latest").read_text() == "step2"):
            assert proc.poll() is None, log.seek(0) or log.read()[-6000:]
            assert time.monotonic() < deadline, "the run never reached its step-2 checkpoint"
            time.sleep(0.5)
        time.sleep(1.0)
        pid = _launcher_pid(1, save_dir)
        assert pid is not None, "node2's deepspeed.launcher.launch not found"
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=180)
        elapsed = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_run(save_dir)  # a failed test must not leave ranks behind (they hold the ports and the CPU)
    log.seek(0)
    out = log.read()
    assert proc.returncode != 0, out[-6000:]
    assert "ds_longseq watchdog: rank 1 (host node2, node 1, local rank 0" in out, out[-6000:]
    assert elapsed < 120, elapsed
    assert _launcher_pid(0, save_dir) is None  # nothing left running on node1 either
    assert (save_dir / "latest").read_text() == "step2"

    proc = run_launcher(cluster, MULTINODE_SH, config, save_dir, "--max-steps", "4", "--resume")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    _assert_same_losses(expected, losses(save_dir))


@pytest.mark.slow  # heavy: the default run keeps the two-node pdsh launch
def test_openmpi_two_nodes_match_single_node(cluster, reference, tmp_path):
    if shutil.which("mpirun.openmpi") is None:
        pytest.skip("no mpirun.openmpi: bash .ci/install_multinode.sh installs Open MPI")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (bash .ci/install_mpi.sh)")
    config, expected = reference
    proc = run_launcher(cluster, MPIRUN_SH, config, tmp_path / "run", "--max-steps", "4", "--save-every", "2",
                        env_extra={"MPIRUN": "mpirun.openmpi", "PYTHONPATH": ROOT})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "-hostfile " + str(cluster.hostfile) in out and "MPI4PY_LIBMPI" in out
    assert "summary: 4 steps on 2 rank(s)" in out, out[-4000:]
    _assert_same_losses(expected, losses(tmp_path / "run"))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
