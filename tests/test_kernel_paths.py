"""The tests marked ``kernel_paths`` (bitwise comparisons that hold by construction: the same kernels on the same
operands) run again under two other MKL code paths, so an equality that rests on two different computations
rounding alike fails on the developers' machine too, not only on the CPU where the default path happens to differ.

MKL picks its kernels by CPU (an AMD EPYC and this project's Intel Xeon take different paths by default);
``MKL_CBWR`` forces one path for the whole process and must be set before MKL starts, so each path runs the marked
tests in a child process. ``COMPATIBLE`` (the SSE2-era kernels) and ``AVX2`` (the path an AMD CPU takes, and the one
where the hand-written linear backward of issue 53 rounded unlike autograd's on this machine) are two paths other
than the default on any x86 CPU with AVX2.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
REPO = TESTS.parent
MARKER = re.compile(r"pytest\.mark\.kernel_paths\b")
# mkl_serv_cbwr_get(MKL_CBWR_BRANCH)'s answer for each MKL_CBWR value (MKL's MKL_CBWR_* constants)
BRANCH_CODES = {"COMPATIBLE": 3, "AVX2": 10}


def _mkl_branch_script() -> str:
    return (
        "import ctypes, os, torch\n"
        "lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so'))\n"
        "torch.randn(8, 8) @ torch.randn(8, 8)\n"
        "print(lib.mkl_serv_cbwr_get(1))\n"
    )


def _mkl_path_switchable() -> str | None:
    """Why MKL_CBWR cannot select a path here, or None."""
    if not torch.backends.mkl.is_available():
        return "torch is not built with MKL (MKL_CBWR selects nothing)"
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        if not hasattr(lib, "mkl_serv_cbwr_get"):
            raise AttributeError("mkl_serv_cbwr_get")
    except (OSError, AttributeError):
        return "this torch build does not expose MKL's mkl_serv_cbwr_get (the path taken cannot be checked)"
    if "avx2" not in Path("/proc/cpuinfo").read_text():
        return "the CPU has no AVX2"
    return None


def marked_files() -> list[Path]:
    """The test files holding at least one ``kernel_paths`` test (read as text: no import, no collection)."""
    return sorted(p for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name and MARKER.search(p.read_text()))


def test_the_marked_files_are_found():
    """The runner below finds the marked tests (an empty selection would pass checking nothing)."""
    names = {p.name for p in marked_files()}
    assert "test_unread_outputs.py" in names


# AVX2 (what an AMD CPU takes) by default; the SSE2-era path in the slow run (CI time)
@pytest.mark.parametrize("path", [pytest.param("COMPATIBLE", marks=pytest.mark.slow), "AVX2"])
def test_marked_tests_pass_under_another_mkl_path(path):
    reason = _mkl_path_switchable()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "MKL_CBWR": path}
    branch = subprocess.run([sys.executable, "-c", _mkl_branch_script()], env=env, capture_output=True, text=True,
                            check=True).stdout.split()[-1]
    assert int(branch) == BRANCH_CODES[path], f"MKL_CBWR={path} did not take effect (MKL reports branch {branch})"
    files = [str(p.relative_to(REPO)) for p in marked_files()]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "kernel_paths and not slow", *files],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"under MKL_CBWR={path}:\n{tail}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= len(files), tail
