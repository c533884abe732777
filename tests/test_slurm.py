"""SLURM: the process group from SLURM's variables (synthetic ones for 2 nodes x 2 tasks, uneven tasks per node, host
lists), and launch/slurm.sbatch on a real SLURM (``bash .ci/install_slurm.sh``: munge, slurmctld and two slurmd on
this machine, the nodes node1 and node2, each slurmd in its own UTS namespace; one node where that is not permitted):
a job over both nodes, one task each, trains with the DeepSpeed launcher's losses (rank 1 on node2 as its local rank
0); DeepSpeed's own ``--launcher slurm`` does too; a job whose task is killed and which is requeued with ``scontrol
requeue`` ends with every loss of an uninterrupted DeepSpeed-launcher run; ``scancel`` leaves no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from ds_longseq.processes.process_group import first_host, launcher_environment, slurm_environment
from tests.test_sft import ROOT, _config, losses

SBATCH = os.path.join(ROOT, "launch", "slurm.sbatch")


def _task(procid: int, node: int, local: int, **more) -> dict[str, str]:
    """The variables srun gives task ``procid`` of job 1234's step 0 over node01 and node02, 2 tasks each."""
    return {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_NODEID": str(node),
            "SLURM_LOCALID": str(local), "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_JOB_NODELIST": "node[01-02]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", **more}


def test_slurm_variables_map_to_ranks_on_two_nodes():
    for procid in range(4):
        env = slurm_environment(_task(procid, node=procid // 2, local=procid % 2))
        assert env == {"RANK": str(procid), "WORLD_SIZE": "4", "LOCAL_RANK": str(procid % 2), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "node01", "MASTER_PORT": "21234"}, (procid, env)
    uneven = slurm_environment(_task(3, node=1, local=0, SLURM_STEP_TASKS_PER_NODE="3,1"))  # 3 tasks, then 1
    assert (uneven["LOCAL_RANK"], uneven["LOCAL_WORLD_SIZE"]) == ("0", "1")
    # a step over part of the job's nodes: its own list and count, not the job's
    part = slurm_environment(_task(0, 0, 0, SLURM_STEP_NODELIST="node02", SLURM_STEP_NUM_TASKS="2"))
    assert (part["MASTER_ADDR"], part["WORLD_SIZE"]) == ("node02", "2")


@pytest.mark.parametrize(("nodelist", "first"), [
    ("vm", "vm"), ("a,b", "a"), ("gpu[003-005,9],cpu1", "gpu003"), ("rack1-n[7,2-3]", "rack1-n7"),
    ("x[08-09],y[1-2]", "x08"),
])
def test_first_host_of_a_compressed_host_list(nodelist, first):
    assert first_host(nodelist) == first
    if shutil.which("scontrol"):  # SLURM's own expansion agrees
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        if out.returncode == 0:
            assert out.stdout.split()[0] == first


def test_batch_script_itself_is_not_a_launched_task(monkeypatch):
    """sbatch's batch step has SLURM_PROCID=0 and SLURM_NTASKS=N but no job step: a script run there directly (not
    through srun) is one process, not rank 0 of N waiting for the others."""
    for name in ("CROSS_RANK", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK",
                 "SLURM_STEP_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert launcher_environment() is None
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("PMI_RANK", "0")  # srun --mpi=pmi2 sets it too: SLURM's variables still win
    assert launcher_environment() == "srun"


@pytest.mark.parametrize(("restart", "has_latest", "expected"), [
    ("0", True, ["--start-over"]),  # the first start: the earlier run is removed, as asked
    ("1", True, ["--resume"]),  # a requeue: the job's own checkpoints continue, never removed
    ("1", False, ["--start-over"]),  # requeued before its first checkpoint: nothing of its own yet
])
def test_sbatch_starts_over_on_the_first_start_only(tmp_path, restart, has_latest, expected):
    """--start-over in a requeueable job: the first start removes the earlier run's checkpoints; a requeued job,
    whose save directory's ``latest`` is its own, resumes instead (no SLURM needed: srun is a stub printing what it
    runs)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text("#!/bin/sh\nshift 3\necho \"$@\"\n")  # drops --kill-on-bad-exit, --export, bash
    (stub / "srun").chmod(0o755)
    save = tmp_path / "run"
    save.mkdir()
    if has_latest:
        (save / "latest").write_text("step4")
    env = dict(os.environ, PATH=f"{stub}:{os.environ['PATH']}", SLURM_JOB_ID="7", SLURM_NTASKS="1",
               SLURM_JOB_NODELIST="node1", MASTER_ADDR="127.0.0.1", SLURM_RESTART_COUNT=restart, SCRIPT="train")
    out = subprocess.run(["bash", SBATCH, "--save-dir", str(save), "--start-over", "--max-steps", "8"], env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()[-1].split()
    flags = [word for word in out if word in ("--start-over", "--resume")]
    assert flags == expected, out
    assert out[out.index("--save-dir") + 1] == str(save) and "--max-steps" in out


def _slurm_up() -> None:
    if shutil.which("sbatch") is None:
        pytest.skip("no SLURM here: bash .ci/install_slurm.sh installs and starts one")
    state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if state.returncode != 0 or not {"idle", "mixed", "allocated"} & set(state.stdout.split()):
        pytest.skip(f"SLURM does not answer ({state.stderr.strip() or state.stdout.strip()}): bash "
                    ".ci/install_slurm.sh starts it")


def _nodes() -> list[str]:
    """The cluster's node names (node1 node2 from .ci/install_slurm.sh; one, this host's name, where it could not
    give each slurmd its own hostname)."""
    listed = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True, timeout=30).stdout.split()
    out = subprocess.run(["scontrol", "show", "hostnames", ",".join(listed)], capture_output=True, text=True,
                         timeout=30)
    return out.stdout.split()


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode(errors="replace").split("\0") if "=" in item)


def _submit(tmp_path, *args: str, fault: str | None = None, sbatch: tuple[str, ...] = ("-n", "2")) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("DS_LONGSEQ_FAULT_INJECT", None)
    if fault is not None:  # toolkit/faults.py: the first attempt only (a requeued job has SLURM_RESTART_COUNT)
        env["DS_LONGSEQ_FAULT_INJECT"] = fault
    out = subprocess.run(["sbatch", "--parsable", *sbatch, "--time", "15", SBATCH, *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().split(";")[0]


def _state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "GONE")


def _wait(condition, what: str, timeout: float = 300, every: float = 0.5, explain=lambda: ""):
    """``condition()``'s first true value, polled every ``every`` s; past ``timeout`` s an AssertionError naming
    ``what`` with ``explain()`` (the job's state as SLURM sees it) appended."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}\n{explain()}")


def _job_report(job: str) -> str:
    """What a person would look at when a job does not start: the job, the node's state and SLURM's last words."""
    parts = []
    for cmd in (["scontrol", "show", "job", job], ["sinfo", "-R"], ["tail", "-n", "15", "/var/log/slurm/slurmctld.log"],
                ["tail", "-n", "15", "/var/log/slurm/slurmd.log"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        parts.append(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    return "\n".join(parts)


def _tasks(marker: str) -> dict[int, int]:
    """{SLURM_PROCID: pid} of the training processes whose command line holds ``marker`` (the run's save dir)."""
    found = {}
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
            env = _environ(int(pid))
        except (OSError, ValueError):
            continue
        if marker in cmd and "ds_longseq.cli" in cmd and "SLURM_STEP_ID" in env:
            found[int(env["SLURM_PROCID"])] = int(pid)
    return found


def test_two_nodes_one_task_each(tmp_path, uninterrupted_sft):
    """launch/slurm.sbatch over SLURM's two nodes (node1, node2: two slurmd on this host, each with its own
    hostname), one task each: rank 1 runs on node2 as its node's local rank 0 and reaches rank 0 at node1; the losses
    equal the DeepSpeed launcher's 2-rank run."""
    _slurm_up()
    if len(_nodes()) < 2:
        pytest.skip(f"one SLURM node here ({_nodes()}): .ci/install_slurm.sh gives two where unshare --uts works")
    save = tmp_path / "run"
    job = _submit(tmp_path, "--ds_config", _config(tmp_path), "--seq-len", "256", "--max-steps", "2", "--save-dir",
                  str(save), sbatch=("--nodes", "2", "--ntasks-per-node", "1"))
    try:
        placed = _wait(lambda: (t := _tasks(str(save))) and len(t) == 2 and t, "both tasks",
                       explain=lambda: _job_report(job))
        envs = {procid: _environ(pid) for procid, pid in placed.items()}
        _wait(lambda: _state(job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), "the job", timeout=600,
              explain=lambda: _job_report(job))
        log = (tmp_path / f"ds-longseq-{job}.out").read_text()
        assert _state(job) in ("COMPLETED", "GONE"), log[-3000:]
    finally:
        subprocess.run(["scancel", job], timeout=30)
    where = {procid: (env["SLURMD_NODENAME"], env["SLURM_NODEID"], env["SLURM_LOCALID"])
             for procid, env in envs.items()}
    assert where == {0: ("node1", "0", "0"), 1: ("node2", "1", "0")}, where
    assert "2 task(s) on node[1-2], rendezvous node1:" in log and "summary: 2 steps on 2 rank(s)" in log, log[-3000:]
    for x, y in zip(losses(save), uninterrupted_sft(2)[:2], strict=True):
        assert abs(x - y) <= 1e-6 * abs(y), (losses(save), uninterrupted_sft(2))


def test_sbatch_job_killed_and_requeued_ends_with_the_launchers_losses(tmp_path, uninterrupted_sft):
    """launch/slurm.sbatch, 2 tasks, tests.test_sft's config (the DeepSpeed launcher's reference run): task 1 hangs
    before step 3's backward (the fault hook, first attempt only) and is SIGKILLed from outside once step 2's
    checkpoint is complete, which fails the job (srun ends the other task); ``scontrol requeue`` runs the same script
    again, which finds ``latest`` and resumes. Every step's loss, before the kill and after the resume, equals the
    uninterrupted DeepSpeed-launcher run's."""
    _slurm_up()
    save = tmp_path / "run"
    job = _submit(tmp_path, "--ds_config", _config(tmp_path), "--seq-len", "256", "--max-steps", "4",
                  "--save-every", "1", "--save-dir", str(save), fault="sigkill:1:3:sleep")
    try:
        _wait(lambda: (save / "latest").is_file() and (save / "latest").read_text() == "step2",
              "step 2's checkpoint")
        os.kill(_wait(lambda: _tasks(str(save)).get(1), "task 1"), signal.SIGKILL)
        _wait(lambda: _state(job) in ("FAILED", "CANCELLED", "COMPLETED", "GONE"), "the job to end")
        assert _state(job) == "FAILED", _state(job)
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        # SLURM holds a requeued job back 2 minutes (its EligibleTime); a user in a hurry brings that forward, but not
        # to "now": slurmd refuses a job started in the same second as its previous attempt's kill ("Job credential
        # revoked", the attempt fails at once; seen in CI), which is what docs/LAUNCHING.md says to do
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+5"], check=True, timeout=30)
        out = tmp_path / f"ds-longseq-{job}.out"
        # the state reads FAILED until the requeue has gone through: wait for the second attempt's first line
        _wait(lambda: "resuming from it (restart 1)" in out.read_text(), "the requeued attempt to start",
              explain=lambda: _job_report(job))
        _wait(lambda: _state(job) in ("COMPLETED", "FAILED"), "the requeued job", timeout=600,
              explain=lambda: _job_report(job))
        log = out.read_text()
        assert _state(job) == "COMPLETED", log[-3000:]
    finally:
        subprocess.run(["scancel", job], timeout=30)
    assert "resuming from it (restart 1)" in log, log[-3000:]
    assert log.count("summary: ") == 1  # the first attempt died before its end
    straight = uninterrupted_sft(2)
    resumed = losses(save)
    assert len(resumed) == len(straight) == 4
    for x, y in zip(resumed, straight, strict=True):  # float32 CPU runs repeat up to reduction order
        assert abs(x - y) <= 1e-6 * abs(y), (resumed, straight)


def test_deepspeeds_own_slurm_launcher(tmp_path, uninterrupted_sft):
    """``deepspeed --launcher slurm`` inside a batch job over the two nodes, one slot each: DeepSpeed's runner starts
    ``srun -n 2`` over the hostfile's slots (``--no_ssh_check`` and ``--master_addr``: it would ssh to the first host
    otherwise; ``--force_multi`` where there is one node) and its tasks build the process group from SLURM's variables
    as launch/slurm.sbatch's do; the first two losses equal the DeepSpeed launcher's run."""
    _slurm_up()
    nodes = _nodes()[:2]
    per_node = 2 // len(nodes)  # 2 ranks: one on each of the two nodes, or both on the one
    (tmp_path / "hostfile").write_text("".join(f"{node} slots={per_node}\n" for node in nodes))
    host = nodes[0]
    save = tmp_path / "run"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\nset -euo pipefail\n"
        f"exec deepspeed --hostfile {tmp_path / 'hostfile'} --launcher slurm --force_multi --no_ssh_check "
        f"--master_addr {host} {os.path.join(ROOT, 'examples', 'sft.py')} --ds_config {_config(tmp_path)} "
        f"--seq-len 256 --max-steps 2 --save-dir {save}\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.pop("DS_LONGSEQ_FAULT_INJECT", None)
    job = subprocess.run(["sbatch", "--parsable", "--nodes", str(len(nodes)), "--ntasks-per-node", str(per_node),
                          "--time", "15", "--output", str(tmp_path / "job.out"), str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                         check=True).stdout.strip().split(";")[0]
    try:
        _wait(lambda: _state(job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE"), "the job", timeout=600,
              explain=lambda: _job_report(job))
        log = (tmp_path / "job.out").read_text()
        assert _state(job) in ("COMPLETED", "GONE"), log[-3000:]
    finally:
        subprocess.run(["scancel", job], timeout=30)
    assert "srun -n 2" in log and "summary: 2 steps on 2 rank(s)" in log, log[-3000:]
    for x, y in zip(losses(save), uninterrupted_sft(2)[:2], strict=True):
        assert abs(x - y) <= 1e-6 * abs(y), (losses(save), uninterrupted_sft(2))


def test_scancel_leaves_no_process_behind(tmp_path):
    _slurm_up()
    save = tmp_path / "long"
    job = _submit(tmp_path, "--seq-len", "128", "--max-steps", "500", "--save-dir", str(save))
    try:
        _wait(lambda: len(_tasks(str(save))) == 2 and (save / "metrics.jsonl").is_file()
              and (save / "metrics.jsonl").stat().st_size > 0, "the job to train")
    finally:
        subprocess.run(["scancel", job], check=True, timeout=30)
    _wait(lambda: not _tasks(str(save)), "every task to end", timeout=60)
    _wait(lambda: _state(job) in ("CANCELLED", "GONE"), "the job to be cancelled", timeout=60)
