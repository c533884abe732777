"""The adjoint-sharding benchmarks (``benchmarks.adjoint_memory``, ``adjoint_flops``, ``adjoint_truncation``).

Fast: the memory suite runs two real fresh children at a tiny size, the truncation suite runs in this
process (its children's measure functions called directly), and the FLOPs count is checked against
brute force: the (t, i) pairs enumerated, the elementwise ops the scans actually dispatch, and the
matmul FLOPs of whole training steps under torch's own FLOP formulas.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from benchmarks import adjoint_flops, adjoint_memory, adjoint_truncation, harness
from benchmarks.recipes import SSM_SHAPES, SSMShape, build_ssm, enable_ssm_method, ssm_truncation
from ds_longseq.ops.linear_scan import adjoint_scan, linear_scan, truncated_adjoint

RESULTS = harness.REPO_ROOT / "benchmarks" / "results"


def _inprocess_spawn(module, spec, **kwargs):
    """``harness.spawn`` without the fresh process: the child's measure function, called here."""
    threads = torch.get_num_threads()
    try:
        measure = importlib.import_module(module).measure
        return [{**harness.identity(spec), "status": "ok", "error": "", **measure(spec)}]
    finally:
        torch.set_num_threads(threads)  # the measure functions set 2


# ---- adjoint_memory -----------------------------------------------------------------------------


def test_adjoint_memory_tiny_run_in_a_fresh_child(tmp_path):
    """The real path: one fresh child (its own loss check against the plain forward), CSV, markdown, plot."""
    out = tmp_path / "m"
    adjoint_memory.main(["--sizes", "ssm-tiny", "--seq-lens", "96", "--methods", "adjoint", "--chunk-size", "32",
                         "--out", str(out)])
    (row,) = harness.read_csv(f"{out}.csv")
    assert set(row) == set(harness.CSV_COLUMNS) and row["method"] == "ssm-tiny:adjoint"
    # a tiny step may allocate nothing above the post-build RSS: >= 0, not > 0
    assert row["status"] == "ok" and float(row["peak_mib"]) >= 0 and float(row["tokens_per_s"]) > 0, row
    assert json.loads(row["extra"])["plain_loss"] == pytest.approx(float(row["loss"]), rel=1e-5)
    assert Path(f"{out}.png").stat().st_size > 0 and "Memory ratio autograd" in Path(f"{out}.md").read_text()


def test_adjoint_memory_methods_agree_in_process(tmp_path, monkeypatch):
    """Every method at one tiny point (measure functions called here): same loss, the exact adjoint's
    gradient norm passes the parent's check against autograd's, the truncated one is reported."""
    monkeypatch.setattr(harness, "plot", lambda *a, **k: None)  # rendered by the fresh-child test
    out = tmp_path / "m"
    adjoint_memory.main(["--sizes", "ssm-tiny", "--seq-lens", "80", "--methods", "autograd", "adjoint", "adjoint_t4",
                         "--chunk-size", "32", "--threads", "1", "--out", str(out)], spawn=_inprocess_spawn)
    rows = harness.read_csv(f"{out}.csv")
    assert [r["status"] for r in rows] == ["ok"] * 3, rows
    assert max(float(r["loss"]) for r in rows) - min(float(r["loss"]) for r in rows) < 1e-5
    norms = {r["method"].split(":")[1]: float(r["grad_norm"]) for r in rows}
    assert norms["adjoint"] == pytest.approx(norms["autograd"], rel=1e-4)
    assert "/ autograd's" in Path(f"{out}.md").read_text()


def test_adjoint_memory_fails_a_point_whose_gradient_differs(tmp_path, monkeypatch):
    """The parent's check: an exact-adjoint point whose gradient norm is not autograd's is a failure."""
    monkeypatch.setattr(harness, "plot", lambda *a, **k: None)

    def spawn(module, spec, **kwargs):
        rec = {**harness.identity(spec), "status": "ok", "error": "", "peak_mib": 10.0, "step_s": 1.0,
               "tokens_per_s": 64.0, "loss": 3.0, "extra": {}, "baseline_mib": 1.0}
        rec["grad_norm"] = 2.0 if spec["method"].endswith(":adjoint") else 1.0
        return [rec]

    out = tmp_path / "m"
    adjoint_memory.main(["--sizes", "ssm-tiny", "--seq-lens", "64", "--methods", "autograd", "adjoint", "adjoint_t4",
                         "--out", str(out)], spawn=spawn)
    by = {r["method"]: r for r in harness.read_csv(f"{out}.csv")}
    assert by["ssm-tiny:adjoint"]["status"] == "crash" and "gradient check failed" in by["ssm-tiny:adjoint"]["error"]
    assert by["ssm-tiny:autograd"]["status"] == "ok" and by["ssm-tiny:adjoint_t4"]["status"] == "ok"  # not checked


def test_adjoint_memory_child_refuses_a_loss_that_is_not_the_plain_forwards(monkeypatch):
    """The child's check: the adjoint training loss must be the plain forward's (here a plan that adds 1)."""
    from ds_longseq.adjoint import sharding

    original = sharding.AdjointPlan.loss
    monkeypatch.setattr(sharding.AdjointPlan, "loss", lambda self, *a: original(self, *a) + 1.0)
    with pytest.raises(RuntimeError, match="loss check failed"):
        _inprocess_spawn(adjoint_memory.MODULE, {"method": "ssm-tiny:adjoint", "seq_len": 32, "chunk_size": 16})


def test_ssm_method_names():
    assert ssm_truncation("adjoint_t64") == 64 and ssm_truncation("adjoint") is None
    for bad in ("adjoint_t0", "adjoint_tx", "streambp"):
        with pytest.raises(ValueError, match="unknown SSM method"):
            ssm_truncation(bad)


# ---- adjoint_flops ------------------------------------------------------------------------------


class _Counter(TorchDispatchMode):
    """Counts dispatched FLOPs: matmuls by torch's own formulas, multiplies (1) and addcmuls (2) by elements."""

    def __init__(self):
        super().__init__()
        self.matmul = 0
        self.elementwise = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in flop_registry:
            self.matmul += flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet in (torch.ops.aten.mul, torch.ops.aten.mul_):
            self.elementwise += out.numel()
        elif packet in (torch.ops.aten.add, torch.ops.aten.add_):
            self.elementwise += out.numel()
        elif packet in (torch.ops.aten.addcmul, torch.ops.aten.addcmul_):
            self.elementwise += 2 * out.numel()
        return out


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 7, 8, 9, 33, 64])
def test_scan_counts_equal_the_dispatched_elementwise_ops(num_tokens):
    """One state element (B = D = N = 1): the counts are the FLOPs the scans really dispatch."""
    a, b = torch.rand(1, num_tokens, 1), torch.rand(1, num_tokens, 1)
    for fn, want in ((linear_scan, adjoint_flops.scan_flops(num_tokens)),
                     (adjoint_scan, adjoint_flops.scan_flops(num_tokens))):
        with _Counter() as c:
            fn(a, b)
        assert c.elementwise == want, (fn.__name__, num_tokens)
    for window in (1, 2, 3, 5, num_tokens, num_tokens + 3):
        with _Counter() as c:
            truncated_adjoint(a, b, window)
        assert c.elementwise == adjoint_flops.truncated_flops(num_tokens, window), (num_tokens, window)


@pytest.mark.parametrize("num_tokens, chunk_size", [(1, 4), (8, 4), (9, 4), (33, 8), (20, 64)])
def test_chunked_scan_counts_equal_the_dispatched_ops_of_a_streamed_sweep(num_tokens, chunk_size):
    """The streamed exact path's scans: chunks in order with the state carried, then the adjoint last chunk
    first with the carry a_s * mu_s (the calls ``ds_longseq.adjoint.sharding`` makes)."""
    a, b = torch.rand(1, num_tokens, 1), torch.rand(1, num_tokens, 1)
    bounds = [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]
    with _Counter() as c:
        carry = None
        for s, e in bounds:
            carry = linear_scan(a[:, s:e], b[:, s:e], carry)[:, -1].clone()
    assert c.elementwise == adjoint_flops.chunked_scan_flops(num_tokens, chunk_size)
    with _Counter() as c:
        carry = None
        for s, e in reversed(bounds):
            mu = adjoint_scan(a[:, s:e], b[:, s:e], carry)
            carry = a[:, s] * mu[:, 0]
    assert c.elementwise == adjoint_flops.chunked_adjoint_flops(num_tokens, chunk_size)


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 12, 31])
def test_vjp_counts_equal_the_enumerated_pairs(num_tokens):
    for window in (None, 1, 2, 4, num_tokens, num_tokens + 2):
        brute = sum(1 for t in range(num_tokens) for i in range(t + 1) if window is None or t - i < window)
        assert adjoint_flops.pairs(num_tokens, window) == brute
        assert adjoint_flops.paper_vjps(num_tokens, window) == {"A": brute, "B": brute, "C": num_tokens,
                                                                "total": 2 * brute + num_tokens}
    # the paper's own example (Sec. 4.3): T = 10K, T-bar = 2000 removes 64% of the VJPs
    assert 1 - adjoint_flops.pairs(10_000, 2000) / adjoint_flops.pairs(10_000) == pytest.approx(0.64, abs=0.005)


@pytest.mark.parametrize("method", ["autograd", "adjoint", "adjoint_t4"])
@pytest.mark.parametrize("num_tokens, chunk_size", [(20, 8), (16, 64)])
def test_step_matmul_flops_equal_torch_formulas(method, num_tokens, chunk_size):
    """A whole forward + backward (2 layers, uneven last chunk): the counted matmul FLOPs are torch's."""
    shape = SSMShape("count", 8, 2, state_size=4, vocab_size=33)
    model = build_ssm(shape)
    enable_ssm_method(model, method, chunk_size)
    ids = torch.randint(0, shape.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    with _Counter() as c:
        model(ids, labels=ids).loss.backward()
    assert c.matmul == adjoint_flops.step_flops(shape, num_tokens, method)["matmul"]


def test_flops_report_and_validation(tmp_path):
    rows = [harness.new_row(suite="adjoint_memory", kind="step", method=f"h32-L4:{m}", seq_len=t, status="ok",
                            step_s=s * t / 1024)
            for m, s in (("autograd", 1.0), ("adjoint", 1.5)) for t in (1024, 2048)]
    harness.write_csv(rows, tmp_path / "m.csv")
    val = {v["method"]: v for v in adjoint_flops.validation_rows(harness.read_csv(tmp_path / "m.csv"))}
    assert val["adjoint"]["time_slope"] == pytest.approx(1.0) and val["adjoint"]["time_ratio"] == pytest.approx(1.5)
    assert 1 < val["adjoint"]["count_ratio"] < 2 and val["autograd"]["count_ratio"] == pytest.approx(1.0)
    out = tmp_path / "f"
    threads = torch.get_num_threads()
    try:
        adjoint_flops.main(["--sizes", "h32-L4", "--seq-lens", "1024", "2048", "--measured", str(tmp_path / "m.csv"),
                            "--time-scans", "--scan-lens", "16", "32", "--scan-windows", "1", "2", "--window-len", "32",
                            "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    text = Path(f"{out}.md").read_text()
    assert "a count, not a measurement" in text and "time slope" in text and Path(f"{out}.png").stat().st_size > 0
    assert "| `truncated_adjoint`, T = 32, T-bar |" in text and "| 32 |" in text


# ---- adjoint_truncation -------------------------------------------------------------------------


# bitwise by construction: integer token ids
def test_recall_batch_layout():
    ids, labels = adjoint_truncation.recall_batch(3, 20, 2, seed=0)
    assert ids.shape == labels.shape == (3, 20)
    assert torch.equal(ids[:, :2], ids[:, -2:]) and (ids[:, -3] == adjoint_truncation.SEP).all()
    assert (labels[:, :2] == -100).all() and torch.equal(labels[:, 2:], ids[:, 2:])
    assert (ids[:, 2:-3] >= adjoint_truncation.FIRST_FILLER).all() and ids.max() < adjoint_truncation.VOCAB
    assert {adjoint_truncation.group_of(n) for n, _ in build_ssm(SSM_SHAPES["ssm-tiny"]).named_parameters()} == {
        g for g, _ in adjoint_truncation.PARAM_GROUPS}


# bitwise by construction: the kept row is a copy (same sha256)
def test_adjoint_truncation_tiny_run(tmp_path, monkeypatch):
    """Train, reference, exact and truncated gradients (in this process): schema, and errors that make sense."""
    render = adjoint_truncation.plot
    monkeypatch.setattr(adjoint_truncation, "plot", lambda *a, **k: None)  # after every point: once is enough here
    out = tmp_path / "t"
    ckpt = tmp_path / "ckpt.pt"
    seq_len = 24
    adjoint_truncation.main(["--shape", "ssm-tiny", "--seq-len", str(seq_len), "--num-keys", "2", "--train-steps", "3",
                             "--batch", "2", "--eval-batch", "2", "--truncations", "1", "4", str(seq_len),
                             "--keep-checkpoint", str(ckpt), "--threads", "1", "--out", str(out)],
                            spawn=_inprocess_spawn)
    rows = harness.read_csv(f"{out}.csv")
    assert all(set(r) == set(harness.CSV_COLUMNS) for r in rows)
    want = [("setup", "train"), ("step", "autograd"), ("step", "adjoint")]
    assert [(r["kind"], r["method"]) for r in rows] == want + [("step", f"adjoint_t{t}") for t in (1, 4, seq_len)]
    assert all(r["status"] == "ok" for r in rows), rows
    err = {r["method"]: json.loads(r["extra"]) for r in rows[2:]}
    # float32: exact adjoint vs autograd differ by re-association only (~1e-7)
    assert err["adjoint"]["rel_err"] < 1e-5 and err[f"adjoint_t{seq_len}"]["rel_err"] < 1e-5
    assert all(e["groups"]["head"] < 1e-5 for e in err.values())  # the head never sees the truncation
    assert err["adjoint_t1"]["rel_err"] > 100 * err["adjoint"]["rel_err"]
    # the answer loss (final keys) reaches the first keys only through K (T-bar - 1) = 6 < 19 tokens here: nothing
    assert err["adjoint_t4"]["answer"]["input_keys_rel_err"] == 1.0 and err["adjoint"]["answer"]["rel_err"] < 1e-5
    render(rows, str(tmp_path / "t.png"), seq_len)
    assert ckpt.exists() and (tmp_path / "t.png").stat().st_size > 0 and "T-bar" in Path(f"{out}.md").read_text()
    # a second run on the kept checkpoint keeps the training row (same sha256) and checks the checkpoint
    adjoint_truncation.main(["--shape", "ssm-tiny", "--seq-len", str(seq_len), "--num-keys", "2", "--eval-batch", "2",
                             "--truncations", "2", "--checkpoint", str(ckpt), "--threads", "1", "--out", str(out)],
                            spawn=_inprocess_spawn)
    again = harness.read_csv(f"{out}.csv")
    assert [r["method"] for r in again] == ["train", "autograd", "adjoint", "adjoint_t2"]
    assert again[0]["extra"] == rows[0]["extra"] and "Checkpoint check:" in Path(f"{out}.md").read_text()
    assert "DIFFERS" not in Path(f"{out}.md").read_text()


# ---- committed results --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["adjoint_memory_cpu.csv", "adjoint_truncation_cpu.csv"])
def test_committed_adjoint_results_read_in_the_one_schema(name):
    rows = harness.read_csv(RESULTS / name)
    assert rows and all(set(r) == set(harness.CSV_COLUMNS) for r in rows)
    assert all(r["status"] in harness.STATUSES for r in rows)
    assert all(harness.num(r["peak_mib"]) > 0 for r in rows if r["status"] == "ok")
    if name == "adjoint_memory_cpu.csv":  # every measured adjoint point trained autograd's loss
        ref = {(r["method"].split(":")[0], r["seq_len"]): float(r["loss"]) for r in rows
               if r["status"] == "ok" and r["method"].endswith(":autograd")}
        for r in rows:
            key = (r["method"].split(":")[0], r["seq_len"])
            if r["status"] == "ok" and key in ref:
                assert abs(float(r["loss"]) - ref[key]) < 1e-5 * ref[key], r
