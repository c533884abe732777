"""benchmarks.profile (where a step's time and FLOPs go) and benchmarks.batch (the largest micro-batch per method).

The profile runs real children on the tiny smoke_lora suite; the batch search's logic runs on a fake spawn."""

from __future__ import annotations

import pytest
import torch

from benchmarks import batch as batch_bench
from benchmarks import profile as profile_bench
from ds_longseq.ops import chunked_lm_head_loss, shift_causal_labels


@pytest.mark.slow  # a benchmark run (CI time); tests/test_benchmark_harness.py checks the harness by default
def test_profile_names_streambp_phases_and_checkpointing_recompute(tmp_path):
    out = str(tmp_path / "prof")
    points = profile_bench.main(["--suite", "smoke_lora", "--methods", "hf_gc", "streambp", "--seq-lens", "256",
                                 "--warmup", "0", "--out", out])
    by = {p["method"]: p for p in points}
    stages = {m: {k.split("|")[0] for k in p["cells_ms"]} for m, p in by.items()}
    # smoke_lora's 128-token chunks: two chunks, so one capture pass (of the first chunk) and two re-forwards
    assert {"forward", "K/V capture", "chunk re-forward", "chunk backward", "optimizer"} <= stages["streambp"]
    assert {"forward", "recompute", "backward", "optimizer"} <= stages["hf_gc"]
    assert "recompute" not in stages["streambp"] and "K/V capture" not in stages["hf_gc"]
    components = {k.split("|")[1] for k in by["streambp"]["cells_ms"]}
    assert {"attention kernel", "attention", "MLP", "LM head + loss"} <= components
    for p in points:  # matmuls and the attention kernels counted
        assert p["gflop"]["mm"] > 0 and any("flash_attention" in op for op in p["gflop"])
    text = open(out + ".md").read()
    assert "### streambp, 256 tokens" in text and "| K/V capture |" in text


def test_attention_flops_count_the_causal_half():
    assert profile_bench._attention_pairs(4, 4, causal=True) == 10  # 4 + 3 + 2 + 1
    assert profile_bench._attention_pairs(2, 6, causal=True) == 5 + 6  # bottom-right: rows see 5 and 6 keys
    assert profile_bench._attention_pairs(3, 5, causal=False) == 15


def test_the_loss_head_computes_its_logits_once_per_step():
    """Forward + backward of the chunked loss head: 3 GEMMs of N x V x d (logits, input gradient, weight gradient:
    what an unchunked head costs), not 4 (the logits recomputed in backward), by torch's FLOP count."""
    V, d, T = 97, 16, 200
    hidden = torch.randn(1, T, d, requires_grad=True)
    weight = torch.randn(V, d, requires_grad=True)
    targets = shift_causal_labels(torch.randint(0, V, (1, T)))

    def step():
        loss, _ = chunked_lm_head_loss(hidden, weight, targets, chunk_size=64)
        loss.backward()

    gflop = profile_bench.count_flops(step)
    assert sum(gflop.values()) * 1e9 == 3 * 2 * (T - 1) * V * d


def test_batch_search_finds_the_largest_batch_and_compares_per_sample():
    calls = []

    def spawn(module, spec, timeout_s):
        calls.append((spec["method"], spec["batch_size"], spec["steps"]))
        limit = {"hf_gc": 3, "streambp": 13}[spec["method"]]
        if spec["batch_size"] > limit:
            return [{"status": "oom"}]
        return [{"status": "ok", "step_s": 1.0 + 0.5 * spec["batch_size"], "tokens_per_s": 1.0, "peak_mib": 1.0}]

    rows = batch_bench.main(["--methods", "hf_gc", "streambp", "--seq-len", "64", "--max-batch", "64"], spawn=spawn)
    assert [r["batch_size"] for r in rows] == [3, 13]
    probed = [b for m, b, steps in calls if m == "streambp" and steps == 1]
    assert probed == [1, 2, 4, 8, 16, 12, 14, 13]  # doubling, then bisection between 8 and 16
    text = batch_bench.report_markdown(rows, "hf_gc", "cmd", 64, 1024)
    per_gc, per_sbp = 2.5 / 3, 7.5 / 13
    assert f"{per_sbp / per_gc:.2f}x" in text
