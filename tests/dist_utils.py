"""Run a test body on N CPU ranks (gloo), each in a fresh spawned process, with a timeout.

Modelled on DeepSpeed's ``DistributedTest``: the body is a top-level function ``fn(rank, *args)``
whose picklable return value comes back per rank; an exception on any rank fails the test with
that rank's traceback. The process group is destroyed before a rank exits.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        result = fn(rank, *args)
        # Bytes, not tensors: a tensor sent through a queue is a shared-memory handle that dies
        # with this process.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int = 2, args: tuple = (), timeout: float = 600.0) -> list:
    """Run ``fn(rank, *args)`` on ``world_size`` gloo ranks; return the results ordered by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def run_job(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in its own process group, which is killed whole on
    timeout: a launcher's ranks (a frozen or spinning one included) do not outlive the test that started them."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kwargs)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
