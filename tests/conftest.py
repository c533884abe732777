"""Test-session housekeeping.

DeepSpeed's CPU communication backend (``deepspeed_shm_comm_op``) backs its all-reduce with files
``/dev/shm/deepspeed_allreduce_buffer_*`` that it never removes. Every multi-rank test leaves some
behind, and /dev/shm is memory: one full suite left 20 GiB there, enough for the OOM killer to hit
later tests and benchmarks on a 24 GiB machine. Each test removes the buffers that appeared while it
ran and that no live process has mapped: its own ranks have exited by then, while the ranks of a
pytest run going on beside it (a second checkout, a helper) still map theirs, so concurrent runs do
not pull buffers from under each other. Files that existed before the test are left alone.
"""

import glob
import os

import pytest

_SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def _mapped_shm_buffers() -> set[str]:
    """The DeepSpeed buffers some live process has mapped (read from every readable /proc/<pid>/maps)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                for line in f:
                    if "deepspeed_allreduce_buffer_" in line:
                        mapped.add(line.split(None, 5)[-1].strip().removesuffix(" (deleted)"))
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return mapped


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    before = set(glob.glob(_SHM_BUFFERS))
    yield
    new = set(glob.glob(_SHM_BUFFERS)) - before
    if not new:
        return
    for path in new - _mapped_shm_buffers():
        try:
            os.remove(path)
        except OSError:  # already gone, or not ours to remove
            pass


@pytest.fixture(scope="session")
def uninterrupted_sft(tmp_path_factory):
    """``get(num_ranks)``: the losses of an uninterrupted examples/sft.py run through the DeepSpeed launcher
    (tests.test_sft's config, 256 tokens, 4 steps), run once per world size for the whole session: the reference of
    the fault, resume and multi-node tests. Its checkpoints come from the time rule alone (--save-every-minutes
    at a microsecond: due after every step, which the ranks agree on each step) and the default
    --save-total-limit (2) leaves the newest two."""
    from tests.test_sft import _config, losses, run_sft

    runs, dirs = {}, {}

    def get(num_ranks: int, save_dir: bool = False) -> list[float]:
        """The run's losses, or with ``save_dir`` its save directory (its step3/ and step4/ checkpoints)."""
        if num_ranks not in runs:
            tmp = tmp_path_factory.mktemp(f"uninterrupted{num_ranks}")
            dirs[num_ranks] = tmp / "run"
            run_sft(_config(tmp), tmp / "run", "--max-steps", "4", "--save-every-minutes", "1e-8", num_ranks=num_ranks)
            runs[num_ranks] = losses(tmp / "run")
            assert sorted(p.name for p in (tmp / "run").glob("step*")) == ["step3", "step4"]
        return dirs[num_ranks] if save_dir else runs[num_ranks]

    return get
