"""``benchmarks.harness`` and the suites' drivers, with fake children: fast (no model is built).

The search and the drivers get fake ``probe`` / ``spawn`` functions; ``spawn`` itself runs
``tests.fake_bench_child``, a real child process that imports nothing heavy.
"""

import csv
import math
from pathlib import Path

import pytest

from benchmarks import harness

FAKE_CHILD = "tests.fake_bench_child"


def _probe(limit, fail=None):
    """A fake probe: fits up to ``limit`` tokens, then OOM; ``fail``: {length: (status, error)}."""
    calls = []

    def probe(n):
        calls.append(n)
        if fail and n in fail:
            status, error = fail[n]
            return {"seq_len": n, "status": status, "error": error}
        ok = n <= limit
        return {"seq_len": n, "status": "ok" if ok else "oom", "error": "" if ok else "MemoryError"}

    return probe, calls


# ---------------------------------------------------------------------------------------------
# Max-length search
# ---------------------------------------------------------------------------------------------


def test_search_doubles_then_bisects_to_the_granularity():
    probe, calls = _probe(5000)
    result = harness.search_max_len(probe, lo=128, hi=65536, granularity=128)
    assert result.best == 4992 and result.fails_at == 5120 and len(result.probes) == len(calls)
    assert calls[:7] == [128, 256, 512, 1024, 2048, 4096, 8192]  # doubling, then bisection in (4096, 8192)
    assert all(n % 128 == 0 for n in calls) and len(calls) == len(set(calls))
    assert result.stop.startswith("oom at 5120")


def test_search_reports_the_top_of_the_range_and_a_low_end_that_does_not_fit():
    probe, _ = _probe(10**9)
    assert harness.search_max_len(probe, lo=128, hi=1000, granularity=128).best == 1000
    probe, calls = _probe(0)
    result = harness.search_max_len(probe, lo=128, hi=1024, granularity=128)
    assert result.best is None and calls == [128] and "low end" in result.stop


@pytest.mark.parametrize("status", ["timeout", "crash"])
def test_search_stops_on_a_timeout_or_crash_without_raising(status):
    """Only OOM means "too long"; a timeout or crash ends the search with the last fit and the reason."""
    probe, calls = _probe(10**9, fail={2048: (status, "boom")})
    result = harness.search_max_len(probe, lo=256, hi=65536, granularity=256)
    assert calls == [256, 512, 1024, 2048]
    assert result.best == 1024 and result.fails_at is None
    assert result.stop == f"{status} at 2048: boom"
    assert result.probes[-1]["status"] == status


def test_search_explicit_lengths_stop_at_the_first_that_does_not_fit():
    probe, calls = _probe(100_000)
    result = harness.search_max_len(probe, lengths=[262144, 65536, 131072, 98304])
    assert calls == [65536, 98304, 131072]  # ascending, nothing after the first OOM
    assert (result.best, result.fails_at, result.stop) == (98304, 131072, "oom at 131072")
    probe, calls = _probe(10**9)
    assert harness.search_max_len(probe, lengths=[1, 2]).stop == "every length probed fits"


def test_search_uses_and_is_bounded_by_known_points():
    """Timed points of the same run count: a known OOM bounds the search, known fits are not re-probed."""
    probe, calls = _probe(10**9)
    known = [{"seq_len": 8192, "status": "ok"}, {"seq_len": 16384, "status": "ok"},
             {"seq_len": 32768, "status": "oom"}, {"seq_len": 4096, "status": "timeout"}]
    result = harness.search_max_len(probe, lengths=[16384, 65536, 131072], known=known)
    assert calls == [] and (result.best, result.fails_at) == (16384, 32768)
    known = [{"seq_len": 8192, "status": "ok"}]
    result = harness.search_max_len(probe, lo=8192, hi=65536, granularity=8192, known=known)
    assert calls == [16384, 32768, 65536] and result.best == 65536  # 8192 came from the known point


def test_search_stops_when_the_time_budget_is_spent():
    calls = []

    def probe(n):
        calls.append(n)
        return {"seq_len": n, "status": "ok"} if n < 1024 else None  # None: not run (budget spent)

    result = harness.search_max_len(probe, lo=256, hi=65536, granularity=256)
    assert (result.best, result.stop) == (512, "time budget") and len(result.probes) == 2


# ---------------------------------------------------------------------------------------------
# Memory arithmetic, time budget, rows
# ---------------------------------------------------------------------------------------------


def test_gpu_memory_subtracts_the_post_build_allocation_and_reservation():
    mib = 2**20
    peak, reserved = harness.gpu_memory_above_baseline(
        base_allocated=16_000 * mib, base_reserved=18_000 * mib, max_allocated=40_000 * mib, max_reserved=50_000 * mib
    )
    assert (peak, reserved) == (24_000.0, 32_000.0)


def test_record_row_keeps_gpu_fields_and_drops_numbers_of_failures():
    from benchmarks.run import record_row

    ok = {"method": "streambp", "seq_len": 65536, "status": "ok", "error": "", "peak_mib": 24000.04,
          "reserved_mib": 32000.06, "host_peak_mib": 512.0, "step_s": 12.3456, "tokens_per_s": 5308.5,
          "loss": 11.9, "device": "NVIDIA H100 80GB HBM3"}
    row = record_row("gpu_lora", "step", ok, command="c")
    assert (row["peak_mib"], row["reserved_mib"], row["step_s"], row["status"]) == (24000.0, 32000.1, 12.346, "ok")
    assert set(row) == set(harness.CSV_COLUMNS)
    failed = record_row("gpu_lora", "probe", {"method": "m", "seq_len": 1, "status": "oom", "error": "x",
                                               "peak_mib": 5.0})
    assert failed["peak_mib"] == "" and failed["status"] == "oom" and failed["repeats"] == 0


def test_time_budget_cuts_child_timeouts():
    now = [0.0]
    budget = harness.TimeBudget(2, clock=lambda: now[0])
    assert budget.timeout(540) == 120 and not budget.spent()
    now[0] = 100
    assert budget.timeout(540) == 20
    now[0] = 130
    assert budget.spent()
    assert harness.TimeBudget(None).timeout(540) == 540 and harness.TimeBudget(None).remaining_s() == math.inf


def test_summarize_repeats_medians_and_first_failure():
    recs = [{"status": "ok", "peak_mib": p, "step_s": s, "loss": 1.0} for p, s in ((10, 1), (30, 3), (20, 2))]
    recs.append({"status": "oom", "error": "MemoryError"})
    out = harness.summarize_repeats(recs)
    assert (out["peak_mib"], out["peak_mib_min"], out["peak_mib_max"], out["step_s"]) == (20, 10, 30, 2)
    assert out["repeats"] == 3 and out["status"] == "ok" and out["error"] == "MemoryError"
    assert harness.summarize_repeats([{"status": "timeout", "error": "t"}])["status"] == "timeout"


@pytest.mark.parametrize("name", ["memory_cpu.csv", "sp_memory_cpu.csv", "cpu_suite.csv", "cpu_suite_maxlen.csv"])
def test_committed_results_read_in_the_one_schema(name):
    rows = harness.read_csv(harness.REPO_ROOT / "benchmarks" / "results" / name)
    assert rows and all(set(r) == set(harness.CSV_COLUMNS) for r in rows)
    assert all(r["kind"] in ("step", "max_len") and r["status"] in harness.STATUSES for r in rows)
    if name != "cpu_suite_maxlen.csv":
        assert all(harness.num(r["peak_mib"]) > 0 for r in rows if r["status"] == "ok" and r["kind"] == "step")


# ---------------------------------------------------------------------------------------------
# spawn: real fresh children (tests.fake_bench_child)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "behavior, status, error",
    [
        ("ok", "ok", ""),
        ("oom", "oom", "MemoryError: fake allocation failure"),
        ("crash", "crash", "ValueError: fake bug"),
        ("segv", "crash", "killed by signal 11 (SIGSEGV)"),
        ("sigkill", "oom", "killed by SIGKILL (the OOM killer?)"),
        ("exit3", "crash", "exit code 3"),
    ],
)
def test_spawn_classifies_every_outcome(behavior, status, error):
    (rec,) = harness.spawn(FAKE_CHILD, {"behavior": behavior, "method": "m", "seq_len": 7}, timeout_s=60)
    assert (rec["status"], rec["error"], rec["method"], rec["seq_len"]) == (status, error, "m", 7)


def test_spawn_timeout_kills_the_child():
    (rec,) = harness.spawn(FAKE_CHILD, {"behavior": "hang", "method": "m", "seq_len": 7}, timeout_s=1)
    assert rec["status"] == "timeout" and rec["error"] == "timeout after 1s"


def test_spawn_kills_the_peers_of_a_failed_rank_after_the_grace_period():
    recs = harness.spawn(FAKE_CHILD, {"behavior": ["hang", "crash"], "method": "m", "seq_len": 7},
                         timeout_s=60, nprocs=2, grace_s=0.5)
    assert [(r["rank"], r["status"], r["error"]) for r in recs] == [
        (0, "crash", harness.PEER_FAILED), (1, "crash", "ValueError: fake bug")]
    recs = harness.spawn(FAKE_CHILD, {"behavior": ["ok", "ok"], "method": "m", "seq_len": 7}, timeout_s=60, nprocs=2)
    assert [r["rank"] for r in recs] == [0, 1] and all(r["status"] == "ok" for r in recs)


# ---------------------------------------------------------------------------------------------
# benchmarks.run driver: the suite goes on, files after every point, time budget, append
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_plot(monkeypatch):
    """matplotlib takes most of a second per rewrite; the plot itself is checked by the slow smoke runs."""
    monkeypatch.setattr(harness, "plot", lambda rows, path, *a, **k: Path(path).write_bytes(b"plot"))


@pytest.fixture
def fake_gpu_suite(monkeypatch, no_plot):
    """A GPU-like suite (the device is the memory budget) whose children never start."""
    from benchmarks import run

    suite = run.Suite("fake", run.LLAMA_TINY, "float32", "auto", "torch", (1024, 2048, 4096), ("hf_gc", "streambp"),
                      search_lengths=(8192, 16384), timeout_s=540.0)
    monkeypatch.setitem(run.SUITES, "fake_gpu", suite)
    return run


def _fake_spawn(outcomes, out=None, seen_rows=None, timeouts=None, clock=None):
    """spawn() stand-in: ``outcomes(method, seq_len)`` -> (status, error); records what it saw."""

    def spawn(module, spec, *, timeout_s, env=None, **_):
        if timeouts is not None:
            timeouts.append(timeout_s)
        if seen_rows is not None:  # how many rows the CSV held when this child started
            path = Path(f"{out}.csv")
            seen_rows.append(len(list(csv.DictReader(path.open()))) if path.exists() else 0)
        if clock is not None:
            clock[0] += 60
        status, error = outcomes(spec["method"], spec["seq_len"])
        rec = {"method": spec["method"], "seq_len": spec["seq_len"], "status": status, "error": error}
        if status == "ok":
            rec.update(peak_mib=float(spec["seq_len"]), reserved_mib=2.0 * spec["seq_len"], host_peak_mib=1.0,
                       step_s=1.0, tokens_per_s=float(spec["seq_len"]), loss=10.0, device="fake GPU")
        return [rec]

    return spawn


def _rows(out):
    return list(csv.DictReader(open(f"{out}.csv")))


def test_run_records_timeouts_and_ooms_and_goes_on(fake_gpu_suite, tmp_path):
    run = fake_gpu_suite
    out = tmp_path / "r"

    def outcomes(method, n):
        if method == "hf_gc":
            return ("ok", "") if n < 4096 else ("oom", "OutOfMemoryError: CUDA out of memory")
        return ("ok", "") if n <= 8192 else ("timeout", "timeout after 540s")

    seen = []
    run.main(["--suite", "fake_gpu", "--out", str(out)], spawn=_fake_spawn(outcomes, out, seen))
    rows = _rows(out)
    points = {(r["method"], int(r["seq_len"])): r for r in rows if r["kind"] == "step"}
    assert points[("hf_gc", 4096)]["status"] == "oom" and points[("streambp", 4096)]["status"] == "ok"
    maxlen = {r["method"]: r for r in rows if r["kind"] == "max_len"}
    # hf_gc: the timed points already bound it (fits 2048, OOM at 4096): no probe at all
    assert (maxlen["hf_gc"]["seq_len"], maxlen["hf_gc"]["error"]) == ("2048", "oom at 4096")
    # streambp: 8192 fits, the 16384 probe times out: recorded, and the search (not the suite) stops
    probes = [(r["method"], r["seq_len"], r["status"]) for r in rows if r["kind"] == "probe"]
    assert probes == [("streambp", "8192", "ok"), ("streambp", "16384", "timeout")]
    assert maxlen["streambp"]["seq_len"] == "8192"
    assert maxlen["streambp"]["error"] == "timeout at 16384: timeout after 540s"
    # every point's row was on disk before the next child started (the search adds rows without children)
    assert seen[:6] == list(range(6)) and seen == sorted(set(seen)) and len(seen) == 8
    md = Path(f"{out}.md").read_text()
    assert "Peak reserved GPU memory" in md and "timeout at 16384" in md and Path(f"{out}.png").stat().st_size


def test_run_skips_longer_points_after_an_oom(fake_gpu_suite, tmp_path):
    run = fake_gpu_suite
    out = tmp_path / "r"
    run.main(["--suite", "fake_gpu", "--methods", "hf_gc", "--no-search", "--out", str(out)],
             spawn=_fake_spawn(lambda m, n: ("oom", "CUDA out of memory") if n >= 2048 else ("ok", "")))
    assert [(r["seq_len"], r["status"], r["error"]) for r in _rows(out)] == [
        ("1024", "ok", ""), ("2048", "oom", "CUDA out of memory"), ("4096", "not_run", "not run: oom at 2048")]


def test_run_time_budget_marks_the_rest_not_run(fake_gpu_suite, tmp_path):
    run = fake_gpu_suite
    out = tmp_path / "r"
    clock, timeouts = [0.0], []
    run.main(["--suite", "fake_gpu", "--time-budget-min", "2.5", "--out", str(out)],
             spawn=_fake_spawn(lambda m, n: ("ok", ""), timeouts=timeouts, clock=clock), clock=lambda: clock[0])
    rows = _rows(out)
    ran = [r for r in rows if r["status"] == "ok" and r["kind"] == "step"]
    assert len(ran) == 3 and timeouts == [150, 90, 30]  # each child's timeout is cut to the budget left
    not_run = [r for r in rows if r["status"] == "not_run"]
    assert [r["error"] for r in not_run] == [harness.NOT_RUN_BUDGET] * 3 and all(r["kind"] == "step" for r in not_run)
    # the searches start no child: each reports what the timed points showed and why it stopped
    maxlen = [(r["method"], r["seq_len"], r["error"]) for r in rows if r["kind"] == "max_len"]
    assert maxlen == [("hf_gc", "2048", "time budget"), ("streambp", "1024", "time budget")]
    assert "Not run:" in Path(f"{out}.md").read_text()


def test_run_append_merges_methods_run_separately(fake_gpu_suite, tmp_path):
    run = fake_gpu_suite
    out = tmp_path / "r"
    spawn = _fake_spawn(lambda m, n: ("ok", ""))
    run.main(["--suite", "fake_gpu", "--methods", "hf_gc", "--seq-lens", "1024", "--no-search", "--out", str(out)],
             spawn=spawn)
    run.main(["--suite", "fake_gpu", "--methods", "streambp", "--seq-lens", "1024", "--no-search", "--append",
              "--out", str(out)], spawn=spawn)
    assert [r["method"] for r in _rows(out)] == ["hf_gc", "streambp"]
    assert len(set(r["command"] for r in _rows(out))) == 2 and "Commands:" in Path(f"{out}.md").read_text()


def test_memory_driver_records_failed_repeats(tmp_path, no_plot):
    from benchmarks import memory

    out = tmp_path / "m"
    calls = iter([("ok", ""), ("oom", "MemoryError"), ("timeout", "timeout after 5s"), ("timeout", "t")])

    def spawn(module, spec, *, timeout_s, env=None, **_):
        status, error = next(calls)
        rec = {"method": spec["method"], "seq_len": spec["seq_len"], "status": status, "error": error}
        if status == "ok":
            rec.update(peak_mib=100.0, step_s=1.0, loss=10.0, baseline_mib=500.0)
        return [rec]

    memory.main(["--seq-lens", "512", "1024", "--methods", "stock", "--repeats", "2", "--out", str(out)], spawn=spawn)
    rows = _rows(out)
    assert [(r["status"], r["repeats"], r["error"]) for r in rows] == [
        ("ok", "1", "MemoryError"), ("timeout", "0", "timeout after 5s")]
    assert "timeout: timeout after 5s" in Path(f"{out}.md").read_text()
