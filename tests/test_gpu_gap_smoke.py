"""benchmarks/gpu_gap.sh (issue 61 item 5): its CPU smoke mode end to end, and the arithmetic its table rests on.

The smoke run (``bash benchmarks/gpu_gap.sh DIR smoke``: every stage at a tiny size on the smoke_lora suite,
one interpreter per point) is a benchmark run, so it is marked slow as the other benchmark smoke tests are:
``python -m pytest -m slow tests/test_gpu_gap_smoke.py``. The MFU formula against issue 61's own figures, the
report's ratios and targets, the kernel classes and the undoable phase patch run by default.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from benchmarks import gap_report, harness, mfu, phase_profile
from benchmarks.recipes import LLAMA3_8B
from benchmarks.run import SUITES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_POINTS = {("hf_gc", 256), ("streambp_auto", 256), ("streambp_auto_offload", 256),
                ("streambp_auto_offload", 512), ("alst_offload", 512)}


# ---------------------------------------------------------------------------------------------
# MFU: issue 61's figures (Llama-3-8B LoRA on an H200, 989 TFLOP/s dense bf16)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len, tokens_per_s, percent", [
    (32768, 4647, 26.0),  # HF checkpointing at 32K
    (32768, 3808, 22.0),  # StreamBP + offload at 32K
    (131072, 2043, 27.5),  # ALST + offload at 128K
    (131072, 1765, 24.0),  # StreamBP + offload at 128K
])
def test_mfu_reproduces_the_issue_figures(seq_len, tokens_per_s, percent):
    peak, key = mfu.peak_tflops("NVIDIA H200")
    assert (peak, key) == (989.0, "H200")
    got = 100 * mfu.mfu(tokens_per_s, LLAMA3_8B, seq_len, peak)
    # the issue rounds to whole percents (27.5 to a half): within one percentage point, as the brief asks
    assert abs(got - percent) < 1.0, got


def test_mfu_fifty_percent_is_the_issue_tokens_per_second():
    # "50% would be about 8,800 tokens/s at 32K and 3,700 at 128K": the issue's rounding, to 1%
    for seq_len, tokens_per_s in ((32768, 8800), (131072, 3700)):
        at_half = 0.5 * 989e12 / (mfu.step_flops(LLAMA3_8B, seq_len) / seq_len)
        assert abs(at_half / tokens_per_s - 1) < 0.01, at_half


def test_mfu_counts_what_it_says():
    # Llama-3-8B: 32 layers of q/k/v/o (4096 x (4096 + 1024 + 1024 + 4096)) and 3 x 4096 x 14336, plus the head
    assert mfu.matmul_params(LLAMA3_8B) == 32 * (4096 * 10240 + 3 * 4096 * 14336) + 128256 * 4096
    T, P, Lh = 1000, mfu.matmul_params(LLAMA3_8B), 32 * 4096
    assert mfu.step_flops(LLAMA3_8B, T) == pytest.approx(4 * P * T + 6 * T * T * Lh)
    # a trained base adds the weight gradients' pass over the weights
    assert mfu.step_flops(LLAMA3_8B, T, weight_gradients=True) - mfu.step_flops(LLAMA3_8B, T) == 2 * P * T


def test_peak_lookup_by_device_name():
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3 (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)")[0] == 989.0
    assert mfu.peak_tflops("NVIDIA H100 PCIe")[0] == 756.0
    assert mfu.peak_tflops("NVIDIA H200 NVL")[0] == 835.0
    assert mfu.peak_tflops("cpu") is None


# ---------------------------------------------------------------------------------------------
# The report: ratios and targets from rows like the issue's
# ---------------------------------------------------------------------------------------------


def _row(method, seq_len, tokens_per_s, peak_mib, warmup=1, steps=2):
    cmd = (f"python -m benchmarks.run --suite gpu_lora --methods {method} --seq-lens {seq_len} --warmup {warmup} "
           f"--steps {steps} --no-search --out x")
    return harness.new_row(suite="gpu_lora", kind="step", method=method, seq_len=seq_len, status="ok", repeats=1,
                           peak_mib=peak_mib, reserved_mib=peak_mib + 100, tokens_per_s=tokens_per_s,
                           step_s=seq_len / tokens_per_s,
                           device="NVIDIA H200 (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)", command=cmd)


def test_report_ratios_targets_and_mfu(tmp_path, capsys):
    rows = [_row("hf_gc", 32768, 4647.1, 57200.4), _row("streambp_auto", 32768, 4200.0, 20000.0),
            _row("streambp_auto_offload", 32768, 4900.0, 3533.5),
            _row("alst_offload", 131072, 2043.3, 60239.9, warmup=0, steps=1),
            _row("streambp_auto_offload", 131072, 1764.8, 12417.0, steps=1)]
    harness.write_csv(rows, tmp_path / gap_report.AB_CSV)
    gap_report.main([str(tmp_path)])
    text = capsys.readouterr().out
    lines = text.rstrip().splitlines()
    # the faster candidate (offload, 4900) against hf_gc: 1.05x at 0.06x the memory; ALST: 0.86x, short of 1.15x
    assert lines[-2].startswith("- 32768 tokens: streambp_auto_offload (the faster of")
    assert "1.05x hf_gc's tokens/s at 0.06x its peak allocated memory" in lines[-2] and lines[-2].endswith(": met.")
    assert "0.86x alst_offload's tokens/s" in lines[-1] and lines[-1].endswith("NOT met.")
    table = [line for line in lines if line.startswith("| hf_gc | 32768 |")]
    assert table and "| 26.2% |" in table[0] and "| 1 + 2 |" in table[0]  # MFU, and steady state said
    alst = next(line for line in lines if line.startswith("| alst_offload | 131072 |"))
    assert "0 + 1 (NOT steady state)" in alst and "| 27.5% |" in alst
    assert "NVIDIA H200, 989 TFLOP/s" in text
    with open(tmp_path / "gap_report.csv") as f:
        got = {(r["method"], int(r["seq_len"])): r for r in csv.DictReader(f)}
    assert float(got[("hf_gc", 32768)]["mfu"]) == pytest.approx(mfu.mfu(4647.1, LLAMA3_8B, 32768, 989.0))


def test_report_says_what_is_missing(tmp_path, capsys):
    harness.write_csv([_row("hf_gc", 32768, 4647.1, 57200.4)], tmp_path / gap_report.AB_CSV)
    gap_report.main([str(tmp_path)])
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-2].startswith("- 32768 tokens: not measured (streambp_auto has no row")
    assert lines[-1].startswith("- 131072 tokens: not measured (alst_offload has no row")


# ---------------------------------------------------------------------------------------------
# The phase profile's pieces
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, cls", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>", "attention"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
     "elementwise/reduction"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy host<->device"),
    ("Memcpy DtoD (Device -> Device)", "other"),
])
def test_cuda_kernel_classes(name, cls):
    assert phase_profile.kernel_class(name, cuda=True) == cls


def test_cpu_operator_classes():
    assert phase_profile.kernel_class("aten::_scaled_dot_product_flash_attention_for_cpu", cuda=False) == "attention"
    assert phase_profile.kernel_class("aten::mm", cuda=False) == "GEMM"
    assert phase_profile.kernel_class("aten::mul", cuda=False) == "elementwise/reduction"
    assert phase_profile.kernel_class("aten::view", cuda=False) == "other"


def test_cuda_kernel_mix_counts_device_work_only():
    """The CUDA path of kernel_mix on key_averages-like entries: host-side runtime calls and profiler ranges are not
    device work, copies are not in the busy time, and busy + idle is the step."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def avg(key, count, us, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(key=key, count=count, self_device_time_total=us, self_cpu_time_total=10 * us,
                               device_type=device, is_user_annotation=annotation)

    averages = [avg("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTN", 10, 6000.0),
                avg("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 4, 2000.0),
                avg("void at::native::vectorized_elementwise_kernel<4>", 100, 500.0),
                avg("Memcpy DtoH (Device -> Pinned)", 3, 4000.0),
                avg("cudaLaunchKernel", 114, 0.0, device=DeviceType.CPU),
                avg("ds_longseq.streambp.forward", 2, 7000.0, annotation=True)]
    mix = phase_profile.kernel_mix(averages, cuda=True, wall_ms=10.0)
    c = mix["classes"]
    assert (c["GEMM"]["count"], c["GEMM"]["ms"], c["attention"]["ms"]) == (10, 6.0, 2.0)
    assert c["memcpy host<->device"]["ms"] == 4.0 and mix["busy_ms"] == 8.5
    assert c[phase_profile.IDLE]["ms"] == pytest.approx(1.5) and mix["idle_share"] == pytest.approx(0.15)
    assert sum(c[k]["share"] for k in (*phase_profile.BUSY_CLASSES, phase_profile.IDLE)) == pytest.approx(1.0)
    assert not mix["overlap"]


def test_phase_patch_times_every_importer_and_is_undone():
    import ds_longseq.ops.chunk_attention as chunk_attention
    import ds_longseq.ops.streambp_autograd as streambp_autograd
    from ds_longseq.ops import phases

    original = phases.phase
    timer = phase_profile.PhaseTimer(cuda=False)
    with timer.patched():
        assert streambp_autograd.phase is not original and chunk_attention.phase is not original
        with streambp_autograd.phase("streambp.forward"), chunk_attention.phase("attention.forward"):
            pass
        with pytest.raises(ValueError, match="unknown phase"):  # the original's check still runs
            phases.phase("no.such.phase")
    assert streambp_autograd.phase is original and chunk_attention.phase is original and phases.phase is original
    totals = timer.totals()
    assert totals["streambp.forward"]["calls"] == 1 and totals["attention.forward"]["device_ms"] is None


# ---------------------------------------------------------------------------------------------
# The smoke run
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gap")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(REPO, "benchmarks", "gpu_gap.sh"), str(out), "smoke"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


@pytest.mark.slow  # a benchmark run: six interpreters on the smoke suite (about a minute on two idle cores)
def test_smoke_measures_every_point_in_steady_state(smoke):
    out, _ = smoke
    rows = [r for r in harness.read_csv(out / "gap_ab.csv") if r["kind"] == "step"]
    assert {(r["method"], int(r["seq_len"])) for r in rows} == SMOKE_POINTS
    for r in rows:
        assert r["status"] == "ok" and float(r["tokens_per_s"]) > 0, r
        assert "--warmup 1" in r["command"] and r["suite"] == "smoke_lora"
    assert (out / "env_smoke.txt").read_text().count("torch") >= 1


@pytest.mark.slow
def test_smoke_phase_profile_names_the_phases_and_its_mix_sums_to_the_step(smoke):
    out, _ = smoke
    with open(out / "phase_384.csv") as f:
        rows = list(csv.DictReader(f))
    phases = {r["name"]: r for r in rows if r["section"] == "phase"}
    for name in ("streambp.forward", "streambp.replay", "attention.backward"):
        assert float(phases[name]["host_ms"]) > 0 and int(phases[name]["count"]) >= 1, name
        assert phases[name]["device_ms"] == ""  # the CPU has no CUDA events: host times, said so
    assert "time.perf_counter" in (out / "phase_384.md").read_text()
    mix = {r["name"]: r for r in rows if r["section"] == "kernel mix"}
    assert set(phase_profile.KERNEL_CLASSES) | {phase_profile.IDLE, "profiled step"} == set(mix)
    busy_and_idle = sum(float(mix[c]["host_ms"]) for c in (*phase_profile.BUSY_CLASSES, phase_profile.IDLE))
    # the CSV rounds each cell to 1e-4 ms; the classes and idle make up the step unless operators overlapped
    assert busy_and_idle == pytest.approx(float(mix["profiled step"]["host_ms"]), abs=1e-3)
    assert int(mix["GEMM"]["count"]) > 0 and float(mix["attention"]["host_ms"]) > 0
    parts = sum(float(r["host_ms"]) for r in rows if r["section"] == "step part")
    step = next(float(r["host_ms"]) for r in rows if r["section"] == "step")
    assert 0 < parts <= step  # forward + backward + optimizer inside the step's own time


@pytest.mark.slow
def test_smoke_prints_the_combined_table_last(smoke):
    out, stdout = smoke
    lines = stdout.rstrip().splitlines()
    assert lines[-2].startswith("- 256 tokens: ") and "hf_gc's tokens/s" in lines[-2]
    assert lines[-1].startswith("- 512 tokens: streambp_auto_offload ") and "alst_offload's tokens/s" in lines[-1]
    header = max(i for i, line in enumerate(lines) if line.startswith("| method | tokens |"))
    body = [line.split(" | ") for line in lines[header + 2:] if line.startswith("| ")]
    got = {(cells[0].lstrip("| "), int(cells[1])): cells for cells in body}
    assert set(got) == SMOKE_POINTS | {("streambp_auto_offload", 384)}  # (a), (b) and (c)'s phase-timed step
    for cells in got.values():
        assert float(cells[3]) > 0 and cells[2].startswith("1 + ") and "NOT" not in cells[2]
    assert "MFU: none (no dense bf16 peak known for cpu)" in stdout
    with open(out / "gap_report.csv") as f:
        assert tuple(next(csv.reader(f))) == gap_report.COLUMNS
    assert SUITES["smoke_lora"].shape.name in (out / "gap_ab.md").read_text()
