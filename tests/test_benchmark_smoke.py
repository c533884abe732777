"""Smoke tests for the benchmarks (slow: they spawn one interpreter per point) and the max-length search."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run_module(out, module, *args):
    """``python -m module *args --out out`` from the repo root; returns the rows of ``out``.csv."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(f"{out}.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_memory_benchmark_quick(tmp_path):
    """``--quick`` on the methods that need no ds_longseq writes 6 positive points and a plot."""
    out = tmp_path / "m"
    rows = _run_module(out, "benchmarks.memory", "--quick", "--methods", "stock", "hf_gc", "alst")
    assert len(rows) == 6  # 3 methods x seq lens (512, 1024)
    for row in rows:
        assert not row["error"], row
        assert float(row["peak_mib_median"]) > 0, row
    assert Path(f"{out}.png").stat().st_size > 0
    assert Path(f"{out}.md").exists()


def test_max_length_search_doubles_then_bisects_to_the_granularity(monkeypatch):
    """The search logic alone, with a fake child that fits up to 5000 tokens (smoke suite: 128..1024
    doubling, granularity 128), and one whose low end does not fit."""
    from benchmarks import run

    monkeypatch.setitem(run.SUITES, "fake", run.Suite(run.TINY, "float32", "torch", (), (), (128, 65536), 128, 1.0))
    calls = []

    def fake_spawn(suite, method, n, budget, warmup, steps, timeout):
        calls.append(n)
        return {"method": method, "seq_len": n, "ok": n <= 5000, "error": "" if n <= 5000 else "oom: MemoryError"}

    monkeypatch.setattr(run, "spawn", fake_spawn)
    best, probes = run.search_max_len("fake", "streambp", 1.0, 10, lambda msg: None)
    assert best == 4992 and best % 128 == 0 and len(probes) == len(calls)
    assert calls[:7] == [128, 256, 512, 1024, 2048, 4096, 8192]  # doubling, then bisection between 4096 and 8192
    monkeypatch.setattr(run, "spawn", lambda *a: {"method": "x", "seq_len": a[2], "ok": False, "error": "oom: x"})
    assert run.search_max_len("fake", "streambp", 1.0, 10, lambda msg: None)[0] is None
    monkeypatch.setattr(
        run, "spawn", lambda *a: {"method": "x", "seq_len": a[2], "ok": False, "error": "ImportError: y"}
    )
    with pytest.raises(RuntimeError, match="ImportError"):
        run.search_max_len("fake", "streambp", 1.0, 10, lambda msg: None)


@pytest.mark.slow
def test_benchmark_runner_smoke_suite(tmp_path):
    """``benchmarks.run --suite smoke``: the DeepSpeed ZeRO-3 + optimizer-offload path of the GPU suite,
    on CPU with a tiny model; every method trains the same loss; CSV, plot and report are written."""
    out = tmp_path / "s"
    rows = _run_module(
        out, "benchmarks.run", "--suite", "smoke", "--seq-lens", "256", "--methods", "alst", "streambp", "--no-search"
    )
    assert [r["method"] for r in rows] == ["alst", "streambp"]
    assert all(not r["error"] and float(r["peak_mib"]) > 0 and float(r["tokens_per_s"]) > 0 for r in rows), rows
    assert abs(float(rows[0]["loss"]) - float(rows[1]["loss"])) < 1e-4  # same model, same data
    assert Path(f"{out}.png").stat().st_size > 0 and "Tokens per second" in Path(f"{out}.md").read_text()


@pytest.mark.slow
def test_sp_memory_benchmark_smoke(tmp_path):
    """``benchmarks.sp_memory --smoke``: 2 gloo ranks per point; every method trains the same loss."""
    rows = _run_module(tmp_path / "sp", "benchmarks.sp_memory", "--smoke", "--sp", "2")
    assert rows and all(not r["error"] and float(r["peak_mib_median"]) > 0 for r in rows), rows
    by_len = {}
    for r in rows:
        by_len.setdefault(r["seq_len"], set()).add(round(float(r["loss"]), 4))
    assert all(len(losses) == 1 for losses in by_len.values()), by_len  # alst_sp, mst_sp, streambp_sp agree
    assert {r["method"] for r in rows} == {"alst_sp", "mst_sp", "streambp_sp"}
