"""Smoke tests for the benchmarks: real children on tiny models (slow: one interpreter per point).

The harness logic itself (search, failures, time budget, files) is tested fast in test_benchmark_harness.py.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
        assert row["status"] == "ok" and float(row["peak_mib"]) > 0, row
    assert Path(f"{out}.png").stat().st_size > 0
    assert Path(f"{out}.md").exists()


def _offload_methods():
    """streambp_offload needs ds_longseq's ``long_seq.offload`` section (OffloadConfig): skipped without it."""
    from benchmarks.recipes import offload_supported

    return ["streambp_offload"] if offload_supported() else []


@pytest.mark.slow
def test_benchmark_runner_smoke_suite(tmp_path):
    """``benchmarks.run --suite smoke``: the gpu_full path (DeepSpeed ZeRO-3 + optimizer offload, tied
    embeddings) on CPU with a tiny model; every method trains the same loss; CSV, plot and report."""
    out = tmp_path / "s"
    methods = ["alst", "alst_offload", "streambp", *_offload_methods()]
    rows = _run_module(out, "benchmarks.run", "--suite", "smoke", "--seq-lens", "256", "--methods", *methods,
                       "--no-search")
    assert [r["method"] for r in rows] == methods
    assert all(r["status"] == "ok" and float(r["peak_mib"]) > 0 and float(r["tokens_per_s"]) > 0 for r in rows), rows
    losses = [float(r["loss"]) for r in rows]
    assert max(losses) - min(losses) < 1e-4, losses  # same model, same data
    assert Path(f"{out}.png").stat().st_size > 0 and "Tokens per second" in Path(f"{out}.md").read_text()


@pytest.mark.slow
def test_benchmark_runner_smoke_lora_suite_with_search(tmp_path):
    """``benchmarks.run --suite smoke_lora``: the gpu_lora path (PEFT LoRA on the inner model, torch AdamW
    on the adapters) with a tiny model; the same loss for every method; one search probe each."""
    pytest.importorskip("peft")
    out = tmp_path / "l"
    methods = ["hf_gc", "alst_offload", "streambp"]
    rows = _run_module(out, "benchmarks.run", "--suite", "smoke_lora", "--seq-lens", "256", "--methods", *methods,
                       "--steps", "2", "--search-lengths", "512")
    points = [r for r in rows if r["kind"] == "step"]
    assert [r["method"] for r in points] == methods and all(r["status"] == "ok" for r in points), rows
    losses = [float(r["loss"]) for r in points]  # after one optimizer step: the adapters trained identically
    assert max(losses) - min(losses) < 1e-4, losses
    maxlen = {r["method"]: r for r in rows if r["kind"] == "max_len"}
    assert all(maxlen[m]["seq_len"] == "512" and maxlen[m]["error"] == "every length probed fits" for m in methods)
    assert "Maximum sequence length" in Path(f"{out}.md").read_text()


@pytest.mark.slow
def test_benchmark_runner_smoke_qlora_suite(tmp_path):
    """``benchmarks.run --suite smoke_qlora``: the gpu_qlora path (LoRA on a base whose decoder linears are
    bitsandbytes 4-bit, quantized in place) on CPU; every decoder linear quantized, the same loss for every method."""
    pytest.importorskip("peft")
    bnb = pytest.importorskip("bitsandbytes")
    from benchmarks.recipes import LLAMA_TINY, build_model, quantize_4bit

    model = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=256)
    assert quantize_4bit(model) == 7 * LLAMA_TINY.num_hidden_layers
    assert all(isinstance(m, bnb.nn.Linear4bit) for m in model.model.layers[0].mlp.children()
               if isinstance(m, torch.nn.Linear))
    out = tmp_path / "q"
    methods = ["hf_gc", "streambp_auto_offload"]
    rows = _run_module(out, "benchmarks.run", "--suite", "smoke_qlora", "--seq-lens", "256", "--methods", *methods,
                       "--no-search")
    assert [r["method"] for r in rows] == methods and all(r["status"] == "ok" for r in rows), rows
    losses = [float(r["loss"]) for r in rows]
    assert max(losses) - min(losses) < 1e-4, losses


@pytest.mark.slow
def test_gpu_qlora_script_smoke(tmp_path):
    """``bash benchmarks/gpu_qlora.sh DIR smoke``: the GPU script's points (LoRA and QLoRA at one length, QLoRA's
    longest-length probes) with the tiny smoke suites on CPU; the 'bnb' stage refuses without a carried wheel."""
    pytest.importorskip("bitsandbytes")
    script = str(REPO_ROOT / "benchmarks" / "gpu_qlora.sh")
    run = subprocess.run(["bash", script, str(tmp_path), "smoke"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = []
    for suite in ("smoke_lora", "smoke_qlora"):
        with open(tmp_path / f"{suite}_at_len.csv") as f:
            rows += list(csv.DictReader(f))
    assert [r["suite"] for r in rows] == ["smoke_lora", "smoke_qlora"] and all(r["status"] == "ok" for r in rows)
    with open(tmp_path / "qlora_maxlen.csv") as f:
        longest = [r for r in csv.DictReader(f) if r["kind"] == "max_len"]
    assert [(r["suite"], r["seq_len"]) for r in longest] == [("smoke_qlora", "512")]
    if not (REPO_ROOT / ".whl_bnb").exists():
        refused = subprocess.run(["bash", script, str(tmp_path / "b"), "bnb"], capture_output=True, text=True)
        assert refused.returncode == 2 and "no .whl_bnb/bitsandbytes-*.whl carried" in refused.stderr


@pytest.mark.slow
def test_sp_memory_benchmark_smoke(tmp_path):
    """``benchmarks.sp_memory --smoke``: 2 gloo ranks per point; every method trains the same loss."""
    rows = _run_module(tmp_path / "sp", "benchmarks.sp_memory", "--smoke", "--sp", "2")
    assert rows and all(r["status"] == "ok" and float(r["peak_mib"]) > 0 for r in rows), rows
    by_len = {}
    for r in rows:
        by_len.setdefault(r["seq_len"], set()).add(round(float(r["loss"]), 4))
    assert all(len(losses) == 1 for losses in by_len.values()), by_len  # alst_sp, mst_sp, streambp_sp agree
    assert {r["method"] for r in rows} == {"alst_sp", "mst_sp", "streambp_sp"}


@pytest.mark.slow
def test_objectives_benchmark_smoke(tmp_path):
    """``benchmarks.objectives`` on a tiny model (vocab 8192 >> hidden 64, so logits dominate): one row per
    (objective, method), the same loss from full logits and from ds_longseq's chunked log-probs, and for the
    GRPO group (4 rows x 512 tokens: ~64 MiB per copy of the full logits) less memory than full logits."""
    out = tmp_path / "o"
    rows = _run_module(out, "benchmarks.objectives", "--shape", "tiny", "--seq-lens", "512",
                       "--methods", "naive", "chunked_head")
    by = {r["method"]: r for r in rows}
    assert sorted(by) == ["dpo:chunked_head", "dpo:naive", "grpo:chunked_head", "grpo:naive"], rows
    assert all(r["status"] == "ok" and float(r["peak_mib"]) > 0 for r in rows), rows
    for objective in ("dpo", "grpo"):  # same model, same data: the chunked path computes the same objective
        assert abs(float(by[f"{objective}:naive"]["loss"]) - float(by[f"{objective}:chunked_head"]["loss"])) < 1e-3
    # Measured 229 vs 99 MiB; RSS noise is tens of MiB, so only this point's gap is large enough to assert.
    assert float(by["grpo:chunked_head"]["peak_mib"]) < float(by["grpo:naive"]["peak_mib"]), rows
    assert Path(f"{out}.png").stat().st_size > 0 and "GRPO: peak memory" in Path(f"{out}.md").read_text()


@pytest.mark.slow  # CI time
def test_paired_runs_a_method_from_another_checkout(tmp_path):
    """``benchmarks.paired --tree before=DIR``: ``method@before`` imports ds_longseq and benchmarks.run from DIR,
    interleaved with the current tree's method (how a refactor's step time is compared with the code before it)."""
    import shutil

    from benchmarks import paired

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = tmp_path / "before"
    for part in ("ds_longseq", "benchmarks"):
        shutil.copytree(os.path.join(root, part), tree / part, ignore=shutil.ignore_patterns("__pycache__", "results"))
    lines = []
    times = paired.paired("smoke", ["streambp@before", "streambp"], 256, 0, 1, log=lines.append,
                          trees={"before": str(tree)})
    assert set(times) == {"streambp@before", "streambp"} and all(len(t) == 1 for t in times.values())
    assert f"  streambp@before: ds_longseq from {tree}" in lines
    assert f"  streambp: ds_longseq from {root}" in lines
