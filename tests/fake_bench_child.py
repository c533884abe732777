"""A stand-in benchmark child for the harness tests: ``python -m tests.fake_bench_child --_child SPEC``.

``spec["behavior"]`` (per rank, from ``RANK``) picks what it does: ``ok`` (a record), ``oom`` (raises
MemoryError), ``crash`` (raises ValueError), ``hang`` (sleeps past any test timeout), ``segv`` /
``sigkill`` (kills itself with that signal), ``exit3`` (exits with status 3 and no record). Imports
nothing heavy, so a spawn costs tens of milliseconds.
"""

import os
import signal
import sys
import time

from benchmarks import harness


def measure(spec):
    behaviors = spec["behavior"]
    rank = int(os.environ.get("RANK", "0"))
    behavior = behaviors[rank] if isinstance(behaviors, list) else behaviors
    if behavior == "ok":
        return {"peak_mib": 100.0 + spec.get("seq_len", 0) / 1024, "step_s": 0.5, "rank": rank}
    if behavior == "oom":
        raise MemoryError("fake allocation failure")
    if behavior == "crash":
        raise ValueError("fake bug")
    if behavior == "hang":
        time.sleep(600)
    if behavior == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if behavior == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if behavior == "exit3":
        sys.exit(3)
    raise AssertionError(f"unknown behavior {behavior!r}")


if __name__ == "__main__":
    sys.exit(harness.child_main(measure, sys.argv[sys.argv.index("--_child") + 1]))
