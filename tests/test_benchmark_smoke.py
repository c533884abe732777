"""Smoke test for the memory benchmark (slow: spawns one interpreter per point)."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_memory_benchmark_quick(tmp_path):
    """``--quick`` on the methods that need no ds_longseq writes 6 positive points and a plot."""
    out = tmp_path / "m"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--quick",
         "--methods", "stock", "hf_gc", "alst", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(f"{out}.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6  # 3 methods x seq lens (512, 1024)
    for row in rows:
        assert not row["error"], row
        assert float(row["peak_mib_median"]) > 0, row
    assert Path(f"{out}.png").stat().st_size > 0
    assert Path(f"{out}.md").exists()
