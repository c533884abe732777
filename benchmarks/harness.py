"""The one benchmark harness: every suite (``benchmarks.run``, ``benchmarks.memory``,
``benchmarks.sp_memory``) measures through it.

Holds:
    Child protocol: ``child_main`` (in the fresh child: run a measure function on a JSON spec, turn an
        out-of-memory exception into a record, print the record as one ``RESULT_PREFIX`` JSON line) and
        ``spawn`` (in the parent: start 1..P fresh children for one point, enforce a per-point timeout,
        kill the survivors of a failed multi-rank point, and always return one record per rank).
    Statuses: ``ok``, ``oom`` (too long: the only failure a max-length search reads as "does not fit"),
        ``timeout``, ``crash`` and ``not_run`` (the time budget was spent, or a shorter length already
        ran out of memory).
    Memory readings: ``maxrss_mib``, ``rss_mib`` and ``reset_peak_rss`` (a step's own peak, free of a
        transient during the build), ``set_address_space_budget`` (CPU budget via RLIMIT_AS),
        ``gpu_memory_above_baseline`` (allocated AND reserved peaks minus their post-build values).
    ``TimeBudget``: stop starting points once a wall-clock budget is spent.
    ``search_max_len``: longest length whose step fits, by explicit lengths or doubling + bisection,
        stopping (not raising) on a timeout or crash.
    One CSV schema (``CSV_COLUMNS``, ``new_row``, ``read_csv`` which maps the older schemas'
        column names, ``write_csv``), ``summarize_repeats``, one plot (``plot``), markdown helpers
        (``grid_table``, ``max_len_table``, ``environment``) and ``write_outputs``, which rewrites the
        CSV, PNG and markdown together (call it after every point: a killed run leaves usable files).

A record is a dict with at least ``status`` and ``error``; measured records add ``peak_mib`` and
friends. Rows are records flattened onto ``CSV_COLUMNS``, all values as CSV text or numbers.
"""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULT_PREFIX = "BENCH_RESULT "
STATUSES = ("ok", "oom", "timeout", "crash", "not_run")
CSV_COLUMNS = (
    "suite",
    "kind",  # step: a measured point; probe: a max-length search probe; max_len: a search result; setup
    "method",
    "seq_len",
    "sp",
    "rank",  # "" for one process; 0..P-1 and "max" (the worst rank) under sequence parallelism
    "status",
    "repeats",  # successful children behind the numbers
    "peak_mib",  # CPU: peak RSS above the post-build RSS; GPU: max_memory_allocated above its post-build value
    "peak_mib_min",
    "peak_mib_max",
    "reserved_mib",  # GPU: max_memory_reserved above the post-build reserved memory
    "host_peak_mib",  # GPU runs: peak RSS above the post-build RSS (what offloading moves to the host)
    "baseline_mib",
    "step_s",
    "tokens_per_s",
    "loss",
    "grad_norm",
    "budget_mib",
    "load1",
    "device",
    "error",
    "command",
    "extra",  # suite-specific numbers as one JSON object (e.g. gradient errors against exact); "" when none
)
# Column names of the schemas before this harness (the committed results/*.csv keep them).
LEGACY_COLUMNS = {"peak_mib_median": "peak_mib", "step_s_median": "step_s"}
NOT_RUN_BUDGET = "not run: time budget"
PEER_FAILED = "killed after another rank failed"
# RuntimeError texts that mean an allocation failed (torch's CPU allocator, C++ new, CUDA).
OOM_MESSAGES = ("out of memory", "can't allocate memory", "DefaultCPUAllocator", "bad_alloc")


# ---------------------------------------------------------------------------------------------
# Rows and CSV
# ---------------------------------------------------------------------------------------------


def new_row(**fields) -> dict:
    """A CSV row with every column present (empty where not given)."""
    unknown = set(fields) - set(CSV_COLUMNS)
    if unknown:
        raise KeyError(f"not CSV columns: {sorted(unknown)}")
    row = dict.fromkeys(CSV_COLUMNS, "")
    row.update({k: "" if v is None else v for k, v in fields.items()})
    return row


def read_csv(path) -> list[dict]:
    """Rows of a results CSV in this schema; older files' column names are mapped, a missing file is []."""
    if not Path(path).exists():
        return []
    with open(path, newline="") as f:
        rows = []
        for raw in csv.DictReader(f):
            row = new_row()
            for key, value in raw.items():
                key = LEGACY_COLUMNS.get(key, key)
                if key in row:
                    row[key] = value
            if not row["kind"]:  # older files held measured points only (benchmarks.run's had a kind)
                row["kind"] = "step"
            if not row["status"]:  # older files had no status: a row with a peak was a success
                row["status"] = "ok" if row["peak_mib"] != "" else ("crash" if row["error"] else "ok")
            rows.append(row)
        return rows


def write_csv(rows: Iterable[dict], path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def write_report(out: str | None, text: str, rows: Iterable[dict]) -> None:
    """Print ``text``; with ``out``, also write it to ``<out>.md`` and the records to ``<out>.jsonl`` (one a line)."""
    print(text)
    if not out:
        return
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(f"{out}.md", "w") as f:
        f.write(text)
    with open(f"{out}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def num(value) -> float | None:
    """A CSV cell as a float, or None when empty."""
    return None if value in ("", None) else float(value)


def summarize_repeats(records: list[dict]) -> dict:
    """Row fields for one point measured by several children: median (and min/max) over the successes.

    The status is ``ok`` when any repeat succeeded (``repeats`` counts them; ``error`` keeps the first
    failure), otherwise the first failure's status.
    """
    ok = [r for r in records if r.get("status") == "ok"]
    failures = [r for r in records if r.get("status") != "ok"]
    out = {
        "status": "ok" if ok else (failures[0]["status"] if failures else "not_run"),
        "repeats": len(ok),
        "error": failures[0].get("error", "") if failures else "",
    }
    if ok:
        peaks = [r["peak_mib"] for r in ok]
        out.update(
            peak_mib=round(statistics.median(peaks), 1),
            peak_mib_min=round(min(peaks), 1),
            peak_mib_max=round(max(peaks), 1),
            step_s=round(statistics.median(r["step_s"] for r in ok), 3),
        )
        for key in ("reserved_mib", "host_peak_mib", "baseline_mib", "tokens_per_s"):
            values = [r[key] for r in ok if r.get(key) is not None]
            if values:
                out[key] = round(statistics.median(values), 1)
        if ok[0].get("loss") is not None:
            out["loss"] = round(ok[0]["loss"], 5)
    return out


def keep_rows(rows: Iterable[dict], drop: Callable[[dict], bool]) -> list[dict]:
    """The rows an ``--append`` run keeps: those the new run will not measure again."""
    return [r for r in rows if not drop(r)]


# ---------------------------------------------------------------------------------------------
# Memory readings
# ---------------------------------------------------------------------------------------------


def maxrss_mib() -> float:
    """Peak RSS of this process so far, in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), None)
    except OSError:
        return None


def rss_mib() -> float:
    """Current RSS of this process in MiB (``VmRSS``); the peak so far where /proc is not available."""
    kib = _proc_status_kib("VmRSS")
    return maxrss_mib() if kib is None else kib / 1024.0


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS to its current RSS (Linux ``/proc/self/clear_refs`` = 5), so that
    ``maxrss_mib`` afterwards reads the peak from now on, not a transient from before (e.g. a weight
    copy while the model was built). Returns whether it was reset (False: the peak stays cumulative)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    hwm, rss = _proc_status_kib("VmHWM"), _proc_status_kib("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + 1024  # within 1 MiB: the reset took


def set_address_space_budget(budget_mib: float) -> None:
    """Cap further address-space growth of this process at ``budget_mib`` MiB (RLIMIT_AS).

    Relative to the current size, so the budget is what the step may add on top of the built model.
    """
    with open("/proc/self/status") as f:
        vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = vm_kib * 1024 + int(budget_mib * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def gpu_memory_above_baseline(base_allocated: int, base_reserved: int, max_allocated: int, max_reserved: int):
    """(peak allocated, peak reserved) in MiB above their post-build values (all arguments in bytes).

    Both are baseline-subtracted: the reserved pool after build (weights, optimizer shards, the
    allocator's cached blocks) is not something the step needed.
    """
    return (max_allocated - base_allocated) / 2**20, (max_reserved - base_reserved) / 2**20


# ---------------------------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------------------------


def is_oom(err: BaseException) -> bool:
    """Whether an exception means "out of memory" (a length that is too long, not a bug)."""
    if isinstance(err, MemoryError):
        return True
    torch = sys.modules.get("torch")  # no torch import here: fake children in the tests do not need it
    if torch is not None and isinstance(err, getattr(torch, "OutOfMemoryError", ())):
        return True
    # CPU allocator failures under RLIMIT_AS and some CUDA paths surface as plain RuntimeErrors
    text = str(err)
    return isinstance(err, RuntimeError) and any(m in text for m in OOM_MESSAGES)


def identity(spec: dict) -> dict:
    """The fields of a spec that name its point; every record carries them."""
    return {k: spec[k] for k in ("method", "seq_len", "sp", "rank") if k in spec}


def child_main(measure: Callable[[dict], dict], spec_json: str) -> int:
    """Run ``measure(spec)`` in this fresh child and print its record as one result line.

    An out-of-memory exception becomes ``status: oom``; any other exception propagates (the
    parent records a crash with the last line of stderr), after the traceback is printed.
    """
    spec = json.loads(spec_json)
    try:
        record = {**identity(spec), "status": "ok", "error": "", **measure(spec)}
    except Exception as err:  # noqa: BLE001 - classified, not swallowed: non-OOM errors re-raise below
        if not is_oom(err):
            raise
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        record = {**identity(spec), "status": "oom", "error": f"{type(err).__name__}: {first}".rstrip(": ")}
        traceback.print_exc()
    print(RESULT_PREFIX + json.dumps(record), flush=True)
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------


def last_result(stdout: str) -> dict | None:
    """The last result line of a child's stdout, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                return json.loads(line[len(RESULT_PREFIX) :])
            except json.JSONDecodeError:
                return None
    return None


def failure_record(returncode: int | None, stderr: str) -> dict:
    """A record for a child that printed no result: killed by a signal, or exited with an error."""
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig == signal.SIGKILL:  # nobody else sends SIGKILL here: the kernel's OOM killer
            return {"status": "oom", "error": "killed by SIGKILL (the OOM killer?)"}
        return {"status": "crash", "error": f"killed by signal {sig} ({signal.Signals(sig).name})"}
    tail = [line for line in stderr.strip().splitlines() if line.strip() and "[WARNING]" not in line]
    return {"status": "crash", "error": tail[-1][:240] if tail else f"exit code {returncode}"}


def spawn(
    module: str,
    spec: dict,
    *,
    timeout_s: float,
    nprocs: int = 1,
    env: dict | None = None,
    rank_env: Callable[[int], dict] | None = None,
    grace_s: float = 20.0,
    poll_s: float = 0.2,
) -> list[dict]:
    """Run ``python -m module --_child SPEC`` in ``nprocs`` fresh processes; one record per process.

    With ``nprocs > 1`` each process gets ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``; ``env`` is added
    for all of them and ``rank_env(rank)`` for one.

    Each process is its own session, so a timeout kills it with everything it started (compilers,
    DataLoader workers). A rank that fails leaves its peers blocked in a collective: once one exits
    non-zero the others get ``grace_s`` seconds, then they are killed. Nothing raises: a timeout,
    crash or kill comes back as a record with ``status`` and ``error``.
    """
    cmd = [sys.executable, "-m", module, "--_child", json.dumps(spec)]
    procs, files = [], []
    try:
        for rank in range(nprocs):
            child_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
            if nprocs > 1:
                child_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs))
            child_env.update(rank_env(rank) if rank_env else {})
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            files.append((out, err))
            procs.append(
                subprocess.Popen(
                    cmd, cwd=REPO_ROOT, env=child_env, stdout=out, stderr=err, text=True, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout_s
        first_failure, killed = None, {}
        while any([p.poll() is None for p in procs]):  # a list: poll EVERY process, so exits are seen
            now = time.monotonic()
            if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                first_failure = now
            timed_out = now > deadline
            if timed_out or (first_failure is not None and now - first_failure > grace_s):
                why = (
                    {"status": "timeout", "error": f"timeout after {timeout_s:.0f}s"}
                    if timed_out
                    else {"status": "crash", "error": PEER_FAILED}
                )
                for rank, p in enumerate(procs):
                    if p.poll() is None:
                        _kill_group(p)
                        killed[rank] = why
                break
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:  # the parent is being interrupted: leave no child behind
                _kill_group(p)
            p.wait()
    records = []
    for rank, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
        rec = last_result(stdout)
        if rec is None:
            rec = {**identity(spec), **(killed.get(rank) or failure_record(p.returncode, stderr))}
            if nprocs > 1:
                rec["rank"] = rank
        records.append(rec)
    return records


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session (start_new_session), nothing else
    except ProcessLookupError:
        pass


@dataclass
class TimeBudget:
    """A wall-clock budget for starting points. ``minutes=None`` never runs out."""

    minutes: float | None
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=None)

    def __post_init__(self):
        if self.start is None:
            self.start = self.clock()

    def remaining_s(self) -> float:
        return math.inf if self.minutes is None else self.minutes * 60 - (self.clock() - self.start)

    def spent(self) -> bool:
        return self.remaining_s() <= 0

    def timeout(self, child_timeout_s: float) -> float:
        """A child's timeout, cut to what is left: a point started late ends with the budget."""
        return max(1.0, min(child_timeout_s, self.remaining_s()))


# ---------------------------------------------------------------------------------------------
# Max-length search
# ---------------------------------------------------------------------------------------------


@dataclass
class SearchResult:
    """``best``: longest length that fit (None: none did); ``fails_at``: shortest that ran out of
    memory (None: none did); ``stop``: why the search ended; ``probes``: the records it ran."""

    best: int | None
    fails_at: int | None
    stop: str
    probes: list = field(default_factory=list)


def search_max_len(
    probe: Callable[[int], dict | None],
    *,
    lo: int = 1024,
    hi: int = 1 << 20,
    granularity: int | None = None,
    lengths: Iterable[int] | None = None,
    known: Iterable[dict] = (),
) -> SearchResult:
    """Longest sequence length whose step fits.

    ``probe(n)`` runs length ``n`` and returns a record (``status`` ok / oom / timeout / crash), or None
    when it was not run (time budget). Only ``oom`` means "too long"; a timeout, crash or missing
    budget stops the search, which then reports the last length that fit and why it stopped.

    With ``lengths``: probe them in ascending order, stopping at the first that does not fit (few,
    chosen probes: the GPU suites' default). Otherwise double from ``lo`` until a probe fails or ``hi``
    passes, then bisect to ``granularity`` tokens (lengths stay multiples of it).
    ``known``: records already measured under the same conditions (a suite's timed points); they
    are used instead of probing, and bound the search (memory grows with length).
    """
    probes: list[dict] = []
    known = {int(r["seq_len"]): r for r in known if r.get("status") in ("ok", "oom")}
    ooms = [n for n, r in known.items() if r["status"] == "oom"]
    bad = min(ooms) if ooms else None
    fits_known = [n for n, r in known.items() if r["status"] == "ok" and (bad is None or n < bad)]
    good = max(fits_known) if fits_known else None

    def test(n: int) -> str:
        """'ok', 'oom', or the reason to stop."""
        r = known.get(n)
        if r is None:
            r = probe(n)
            if r is None:
                return "time budget"
            probes.append(r)
        if r["status"] in ("ok", "oom"):
            return r["status"]
        return f"{r['status']} at {n}: {r.get('error', '')}".rstrip(": ")

    def done(stop: str) -> SearchResult:
        return SearchResult(good, bad, stop, probes)

    if lengths is not None:
        for n in sorted(set(lengths)):
            if (good is not None and n <= good) or (bad is not None and n >= bad):
                continue
            outcome = test(n)
            if outcome == "ok":
                good = n
            elif outcome == "oom":
                bad = n
                break
            else:
                return done(outcome)
        if bad is not None:
            return done(f"oom at {bad}")
        return done("every length probed fits")

    step = granularity or 1
    if good is None:
        if bad is not None and bad <= lo:
            return done(f"oom at {bad}")
        outcome = test(lo)
        if outcome != "ok":
            if outcome == "oom":
                bad = lo
                return done(f"oom at {lo}: the low end does not fit")
            return done(outcome)
        good = lo
    while bad is None and good < hi:
        n = min(good * 2, hi)
        outcome = test(n)
        if outcome == "ok":
            good = n
        elif outcome == "oom":
            bad = n
        else:
            return done(outcome)
    if bad is None:
        return done(f"the range's top ({hi}) fits")
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if mid <= good:
            break
        outcome = test(mid)
        if outcome == "ok":
            good = mid
        elif outcome == "oom":
            bad = mid
        else:
            return done(outcome)
    return done(f"oom at {bad}" + (f" (bisected to {granularity} tokens)" if granularity else ""))


# ---------------------------------------------------------------------------------------------
# Reports: plot, markdown, outputs
# ---------------------------------------------------------------------------------------------


def _select(rows, kind="step", rank=""):
    return [r for r in rows if r["kind"] == kind and str(r["rank"]) == str(rank)]


def plot(rows: list[dict], path, title: str, *, peak_label: str, x_label: str = "sequence length (tokens, batch 1)",
         rank="") -> None:
    """Peak memory and step time vs length (one line per method, log scales), and max length per method.

    Panels without data are left out; failed points are omitted from the lines.
    """
    import matplotlib

    matplotlib.use("Agg")  # headless; set here so importing this module has no side effects
    import matplotlib.pyplot as plt

    points = [r for r in _select(rows, "step", rank) if r["status"] == "ok"]
    searched = _select(rows, "max_len", rank)
    methods = list(dict.fromkeys(r["method"] for r in _select(rows, "step", rank) + searched))
    seq_lens = sorted({int(r["seq_len"]) for r in points})
    panels = [("peak_mib", peak_label + " (MiB, log)")]
    if any(num(r["step_s"]) for r in points):
        panels.append(("step_s", "step time (s, log)"))
    n = len(panels) + bool(searched)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4.2), squeeze=False)
    axes = axes[0]
    for ax, (key, label) in zip(axes, panels, strict=False):
        for m in methods:
            pts = [(int(r["seq_len"]), num(r[key])) for r in points if r["method"] == m and num(r[key])]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # methods differ by over 10x: a linear axis hides the chunked ones
        if seq_lens:
            ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no successful point", ha="center", transform=ax.transAxes)
    if searched:
        ax = axes[-1]
        names = [r["method"] for r in searched]
        vals = [int(r["seq_len"]) if r["seq_len"] != "" else 0 for r in searched]
        ax.bar(names, vals, color="tab:green")
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:,}", ha="center", va="bottom", fontsize=8)
        budget = searched[0]["budget_mib"]
        ax.set_title("max length, one training step" + (f" within {budget} MiB" if budget else ""), fontsize=9)
        ax.set_ylabel("tokens")
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cell_text(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def failure_cell(row: dict, width: int = 60) -> str:
    """What a table shows for a point without a number."""
    status, error = row["status"], _cell_text(row["error"])
    if status == "not_run":
        return error or "not run"
    if status == "oom":
        return "OOM"
    return f"{status}: {error[:width]}" if error else status


def grid_table(rows, methods, seq_lens, key, fmt, *, rank="", seq_label=str, strong_rank=None,
               header="seq_len") -> list[str]:
    """A markdown table of ``key`` for every (length, method) point; failures say why.

    ``strong_rank``: under SP, the number of ranks: show the ``max`` row in bold and the per-rank
    values after it.
    """
    by = {(r["method"], int(r["seq_len"]), str(r["rank"])): r for r in rows if r["kind"] == "step"}
    lines = [f"| {header} | " + " | ".join(methods) + " |", "|---:|" + "---:|" * len(methods)]
    for s in seq_lens:
        cells = []
        for m in methods:
            r = by.get((m, s, str(rank)))
            if r is None:
                cells.append("")
            elif r["status"] != "ok" or num(r[key]) is None:
                cells.append(failure_cell(r) if r["status"] != "ok" else "")
            elif strong_rank:
                per = [by.get((m, s, str(k))) for k in range(strong_rank)]
                per_text = " / ".join(fmt(num(p[key])) if p and num(p[key]) is not None else "-" for p in per)
                cells.append(f"**{fmt(num(r[key]))}** ({per_text})")
            else:
                cells.append(fmt(num(r[key])))
        lines.append(f"| {seq_label(s)} | " + " | ".join(cells) + " |")
    return lines


def max_len_table(rows, methods) -> list[str]:
    """| method | fits | stopped because |, from the ``max_len`` rows."""
    by = {r["method"]: r for r in rows if r["kind"] == "max_len"}
    lines = ["| method | longest that fit | search stopped because |", "|---|---:|---|"]
    for m in methods:
        r = by.get(m)
        if r is None:
            continue
        fits = f"{int(r['seq_len']):,}" if r["seq_len"] != "" else "none"
        lines.append(f"| {m} | {fits} | {_cell_text(r['error'])} |")
    return lines


def probes_table(rows) -> list[str]:
    """Every search probe, in order: | method | seq_len | status | peak | error |."""
    probes = [r for r in rows if r["kind"] == "probe"]
    if not probes:
        return []
    lines = ["| method | seq_len | status | peak MiB | reserved MiB | error |", "|---|---:|---|---:|---:|---|"]
    for r in probes:
        lines.append(
            f"| {r['method']} | {r['seq_len']} | {r['status']} | {r['peak_mib']} | {r['reserved_mib']} | "
            f"{_cell_text(r['error'])[:80]} |"
        )
    return lines


def version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def mem_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) / 2**20
    except (OSError, StopIteration):
        return float("nan")


def environment(commands: Iterable[str], device: str | None = None) -> list[str]:
    """Markdown lines: the command(s) that made the file and the software and machine.

    ``device``: what the children ran on, as they reported it (the parent never touches CUDA: a
    context there would take device memory from every child).
    """
    commands = list(dict.fromkeys(c for c in commands if c))
    out = ["Command" + ("s:" if len(commands) > 1 else ":")]
    out += [f"- `{c}`" for c in commands] if len(commands) > 1 else [f"`{commands[0]}`" if commands else ""]
    out += [
        "",
        f"Versions: torch {version('torch')}, transformers {version('transformers')}, deepspeed "
        f"{version('deepspeed')}, peft {version('peft')}, python {platform.python_version()}; device: "
        f"{device or 'cpu'}; machine: {platform.processor() or platform.machine()}, {num_cpus()} CPU cores, "
        f"{mem_gib():.0f} GiB RAM.",
    ]
    return out


def write_outputs(rows: list[dict], out: str, markdown: str, plot_fn: Callable[[str], None] | None,
                  csv: bool = True) -> None:
    """Rewrite ``out``.csv, .md and .png from all rows so far (the PNG last: it is the slowest).

    ``csv=False`` leaves the CSV as it is (re-rendering a committed file keeps its original schema).
    """
    if csv:
        write_csv(rows, out + ".csv")
    Path(out + ".md").write_text(markdown)
    if plot_fn is not None:
        plot_fn(out + ".png")
