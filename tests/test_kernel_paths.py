"""The tests marked ``kernel_paths`` (bitwise comparisons that hold by construction: the same kernels on the same
operands) run again under two other MKL code paths, so an equality that rests on two different computations
rounding alike fails on the developers' machine too, not only on the CPU where the default path happens to differ.

MKL picks its kernels by CPU (an AMD EPYC and this project's Intel Xeon take different paths by default);
``MKL_CBWR`` forces one path for the whole process and must be set before MKL starts, so each path runs the marked
tests in a child process. ``COMPATIBLE`` (the SSE2-era kernels) and ``AVX2`` (the path an AMD CPU takes, and the one
where the hand-written linear backward of issue 53 rounded unlike autograd's on this machine) are the two requested.
MKL does not take every request on every CPU (issue 60: ``MKL_CBWR=AVX2`` on an AMD EPYC without AVX-512 reports its
automatic branch), so each run asks MKL which branch it took; where the requested one was not, the first other path
MKL does take runs instead (``choose_path``), and where it takes none the test skips with MKL's answers.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

TESTS = Path(__file__).parent
REPO = TESTS.parent
MARKER = re.compile(r"pytest\.mark\.kernel_paths\b")
# mkl_serv_cbwr_get(MKL_CBWR_BRANCH)'s answer for each MKL_CBWR value (MKL's MKL_CBWR_* constants); 2 is its
# automatic branch, what it reports when it did not take the requested one
BRANCH_CODES = {"COMPATIBLE": 3, "SSE4_2": 8, "AVX": 9, "AVX2": 10}
AUTO_BRANCH = 2
# Paths other than the default on any x86 CPU, tried in this order when the requested one is not taken. MKL does not
# honour every request on every CPU (MKL_CBWR=AVX2 on an AMD EPYC without AVX-512 reports branch 2 and runs its
# default path), so the test asks MKL which path it took instead of assuming it from the CPU's flags.
PATH_ORDER = ("AVX2", "AVX", "SSE4_2", "COMPATIBLE")


def _mkl_branch_script() -> str:
    return (
        "import ctypes, os, torch\n"
        "lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so'))\n"
        "torch.randn(8, 8) @ torch.randn(8, 8)\n"
        "print(lib.mkl_serv_cbwr_get(1))\n"
    )


def mkl_branch(path: str) -> int | None:
    """The branch MKL reports in a fresh process started with ``MKL_CBWR=path``, or None if the probe failed."""
    proc = subprocess.run([sys.executable, "-c", _mkl_branch_script()], env={**os.environ, "MKL_CBWR": path},
                          capture_output=True, text=True)
    words = proc.stdout.split()
    return int(words[-1]) if proc.returncode == 0 and words and words[-1].lstrip("-").isdigit() else None


def choose_path(requested: str, branch_of: Callable[[str], int | None]) -> tuple[str | None, str]:
    """The MKL path to run the marked tests under: ``requested`` if MKL takes it here, else the first path of
    ``PATH_ORDER`` it does take (checked, not assumed). Returns ``(path, note)``, or ``(None, reason)`` when MKL
    takes none of them on this CPU (the caller skips with the reason; nothing ran, so nothing can have failed).

    ``branch_of(path)`` is MKL's answer for ``MKL_CBWR=path`` (``mkl_branch``; a fake in the unit test).
    """
    answers: dict[str, int | None] = {}
    for path in (requested, *(p for p in PATH_ORDER if p != requested)):
        answers[path] = branch_of(path)
        if answers[path] == BRANCH_CODES[path]:
            if path == requested:
                return path, f"MKL_CBWR={path} taken"
            return path, (f"MKL_CBWR={requested} not taken on this CPU (MKL reports branch {answers[requested]}); "
                          f"MKL_CBWR={path} is, and runs instead")
    reported = ", ".join(f"{p} -> {b}" for p, b in answers.items())
    return None, f"MKL takes none of the requested code paths on this CPU (MKL_CBWR value -> branch: {reported})"


def _mkl_path_switchable() -> str | None:
    """Why MKL_CBWR cannot select a path here, or None. Whether the CPU honours a given path is asked of MKL
    itself (``choose_path``), not read from the CPU's flags."""
    if not torch.backends.mkl.is_available():
        return "torch is not built with MKL (MKL_CBWR selects nothing)"
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        if not hasattr(lib, "mkl_serv_cbwr_get"):
            raise AttributeError("mkl_serv_cbwr_get")
    except (OSError, AttributeError):
        return "this torch build does not expose MKL's mkl_serv_cbwr_get (the path taken cannot be checked)"
    return None


def marked_files() -> list[Path]:
    """The test files holding at least one ``kernel_paths`` test (read as text: no import, no collection)."""
    return sorted(p for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name and MARKER.search(p.read_text()))


def test_the_marked_files_are_found():
    """The runner below finds the marked tests (an empty selection would pass checking nothing)."""
    names = {p.name for p in marked_files()}
    assert "test_unread_outputs.py" in names


def _faked(answers: dict[str, int]) -> Callable[[str], int | None]:
    asked = []

    def branch_of(path: str) -> int | None:
        asked.append(path)
        return answers.get(path, AUTO_BRANCH)
    branch_of.asked = asked
    return branch_of


def test_choose_path_runs_the_requested_path_when_mkl_takes_it():
    branch_of = _faked({"AVX2": 10, "AVX": 9})
    assert choose_path("AVX2", branch_of)[0] == "AVX2"
    assert branch_of.asked == ["AVX2"]  # nothing else asked once the request is taken


def test_choose_path_falls_back_to_a_path_mkl_takes():
    """The AMD EPYC without AVX-512 of issue 60: MKL answers MKL_CBWR=AVX2 with its automatic branch."""
    path, note = choose_path("AVX2", _faked({"AVX2": AUTO_BRANCH, "AVX": AUTO_BRANCH, "SSE4_2": 8}))
    assert path == "SSE4_2"
    assert "MKL_CBWR=AVX2 not taken" in note and "branch 2" in note
    assert choose_path("COMPATIBLE", _faked({"AVX2": 10}))[0] == "AVX2"
    # a failed probe (None) is a path not taken, never a pass
    assert choose_path("AVX2", lambda p: None if p == "AVX2" else BRANCH_CODES[p])[0] == "AVX"


def test_choose_path_skips_when_mkl_takes_no_path():
    path, reason = choose_path("AVX2", _faked({}))
    assert path is None
    assert "takes none" in reason and "AVX2 -> 2" in reason and "COMPATIBLE -> 2" in reason


def run_marked_tests(path: str) -> subprocess.CompletedProcess:
    files = [str(p.relative_to(REPO)) for p in marked_files()]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "kernel_paths and not slow", *files],
        cwd=REPO, env={**os.environ, "MKL_CBWR": path}, capture_output=True, text=True, timeout=900,
    )


# AVX2 (what an AMD CPU takes) by default; the SSE2-era path in the slow run (CI time)
@pytest.mark.parametrize("path", [pytest.param("COMPATIBLE", marks=pytest.mark.slow), "AVX2"])
def test_marked_tests_pass_under_another_mkl_path(path):
    reason = _mkl_path_switchable()
    if reason:
        pytest.skip(reason)
    taken, note = choose_path(path, mkl_branch)
    if taken is None:
        pytest.skip(note)
    proc = run_marked_tests(taken)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    # a path that was taken and breaks a marked test fails here, whichever path it is
    assert proc.returncode == 0, f"{note}; under MKL_CBWR={taken}:\n{tail}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= len(marked_files()), tail
