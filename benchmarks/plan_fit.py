"""Fit the memory planner's constants on half of the measured points and check them on the other half.

    python -m benchmarks.plan_fit            # report: benchmarks/results/plan_validation.md
    python -m benchmarks.plan_fit --write    # also rewrite ds_longseq/plan_memory.py's fitted block

Every measured peak in the committed results that the planner models (``SOURCES``: the cpu, memory and
sp_memory suites on CPU, the gpu_lora rows on an H100 and an H200) becomes a point: model shape, setup, length,
measured bytes above the built model. For each (regime, method) the planner's structural part (gradients,
optimizer state, layer inputs kept on the device) is subtracted and a line ``fixed + per_token x T_local`` is
fitted by least squares to the FIT half: in each series (one source and method), every other length in
increasing order starting with the shortest. The other half is HELD OUT: the report gives the planner's error
on those points, per component and regime. A method with fewer than two fit points after the split is fitted
on all its points and flagged (no held-out check). Then the targets of issue 30 for the 8B-LoRA shape.
"""

from __future__ import annotations

import argparse
import csv
import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.recipes import LLAMA3_8B, LLAMA_SMALL, ModelShape
from ds_longseq import plan_memory as P

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIB = 1024**2
GIB = 1024**3
H100_BYTES = 79.18 * GIB  # what torch reported as the H100's total capacity in the OOM of RESULTS section 5
HOST_BYTES = 125 * GIB  # the GPU node's host memory as `free -g` showed it (128 GiB nominal)


@functools.lru_cache(maxsize=None)
def dims(shape: ModelShape) -> P.ModelDims:
    """The planner's sizes of a benchmark shape, read from the transformers config the benchmarks build it from."""
    return P.ModelDims.from_config(shape.config(max_position_embeddings=4096))


# torch AdamW on float32 parameters (cpu suite): 2 fp32 moments; on the LoRA adapters in bf16: 2 bf16 moments
CPU_STEP = P.Setup(device="cpu", dtype_bytes=4, zero_stage=0, optimizer_bytes_per_param=8)
GPU_LORA = P.Setup(device="cuda", dtype_bytes=2, zero_stage=0, lora_rank=16, optimizer_bytes_per_param=4)
# method name in the results -> (planner method, offload layer inputs)
METHODS = {
    "stock": ("stock", False), "hf_gc": ("hf_gc", False), "alst": ("alst", False), "mst": ("mst", False),
    "streambp": ("streambp", False), "streambp_offload": ("streambp", True),
    "alst_offload": ("alst_offload", True), "alst_offload_sync": ("alst_offload_sync", True),
    "alst_sp": ("alst", False), "mst_sp": ("mst", False), "streambp_sp": ("streambp", False),
}


@dataclass(frozen=True)
class Source:
    file: str
    series: str  # points of one series share a measurement; the fit/held-out split alternates within it
    shape: ModelShape
    setup: P.Setup
    optimizer_step: bool
    peak_column: str
    rename: dict | None = None  # method names of an older run -> today's
    where: dict | None = None  # column -> required value


SOURCES = (
    Source("cpu_suite.csv", "cpu_suite", LLAMA_SMALL, CPU_STEP, True, "peak_mib"),
    Source("memory_cpu.csv", "memory_cpu", LLAMA_SMALL, CPU_STEP, False, "peak_mib_median"),
    Source("memory_cpu_32k.csv", "memory_cpu", LLAMA_SMALL, CPU_STEP, False, "peak_mib_median"),
    Source("sp_memory_cpu.csv", "sp_memory_cpu", LLAMA_SMALL, replace(CPU_STEP, gpus=2, sequence_parallel=2), False,
           "peak_mib_median", where={"rank": "max"}),
    # the H100 run of 2026-11-22 called the save_on_cpu imitation alst_offload
    Source("gpu_lora_h100.csv", "gpu_lora_h100", LLAMA3_8B, GPU_LORA, True, "peak_mib",
           rename={"alst_offload": "alst_offload_sync"}),
    Source("gpu_lora_real_alst_h200.csv", "gpu_lora_h200", LLAMA3_8B, GPU_LORA, True, "peak_mib"),
)


@dataclass
class Point:
    source: Source
    method: str
    seq_len: int
    measured: float  # bytes above the built model
    role: str = ""  # fit / held-out / fit-all (too few points to hold any out)

    @property
    def setup(self) -> P.Setup:
        planner_method, offload = METHODS[self.method]
        return replace(self.source.setup, method=planner_method, offload_layer_inputs=offload)

    @property
    def key(self) -> tuple[str, str]:
        return ("cpu" if self.setup.device == "cpu" else "gpu", P._key(self.setup))

    def structural(self) -> float:
        zero = P.Coefficient(0.0, 0.0)
        return P.estimate(dims(self.source.shape), self.setup, self.seq_len, optimizer_step=self.source.optimizer_step,
                          coef=zero).above_build

    def unit_tokens(self, coef_unit: str) -> float:
        """Bytes of one unit times local tokens (the regressor of per_token)."""
        d = dims(self.source.shape)
        unit = d.hidden_size * self.setup.dtype_bytes if coef_unit == "hidden" else d.vocab_size * 4
        return unit * -(-self.seq_len // self.setup.sequence_parallel) * self.setup.batch_size

    def predicted(self, coefficients) -> float:
        return P.estimate(dims(self.source.shape), self.setup, self.seq_len, optimizer_step=self.source.optimizer_step,
                          coef=coefficients[self.key]).above_build


def load_points() -> list[Point]:
    points = []
    for src in SOURCES:
        with open(RESULTS / src.file) as f:
            for row in csv.DictReader(f):
                if src.where and any(row.get(k) != v for k, v in src.where.items()):
                    continue
                if row.get("status", "ok") != "ok" or not row.get(src.peak_column) or row.get("kind") == "max_len":
                    continue
                method = (src.rename or {}).get(row["method"], row["method"])
                if method not in METHODS:
                    continue
                points.append(Point(src, method, int(row["seq_len"]), float(row[src.peak_column]) * MIB))
    # one point per (series, method, length): a step row and a probe of the same length measure the same thing
    seen, unique = set(), []
    for p in points:
        k = (p.source.series, p.method, p.seq_len)
        if k not in seen:
            seen.add(k)
            unique.append(p)
    return unique


def unit_of(method: str) -> str:
    # stock and HF checkpointing keep the whole sequence's fp32 logits: their per-token cost scales with the vocab
    return "vocab" if method in ("stock", "hf_gc") else "hidden"


def fit(points: list[Point]) -> dict[tuple[str, str], P.Coefficient]:
    """Split each series in two (alternating lengths), then least squares per (regime, key) on the fit half."""
    by_series: dict = {}
    for p in points:
        by_series.setdefault((p.source.series, p.method), []).append(p)
    for series in by_series.values():
        for i, p in enumerate(sorted(series, key=lambda q: q.seq_len)):
            p.role = "fit" if i % 2 == 0 else "held-out"
    by_key: dict = {}
    for p in points:
        by_key.setdefault(p.key, []).append(p)
    coefficients = {}
    for key, pts in sorted(by_key.items()):
        fit_pts = [p for p in pts if p.role == "fit"]
        if len({p.seq_len // p.setup.sequence_parallel for p in fit_pts}) < 2:
            for p in pts:
                p.role = "fit-all"
            fit_pts = pts
        unit = unit_of(key[1].removesuffix("_sp").removesuffix("_offload"))
        xs = [p.unit_tokens(unit) for p in fit_pts]
        ys = [p.measured - p.structural() for p in fit_pts]
        n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        fixed = my - slope * mx
        series = sorted({p.source.file for p in fit_pts})
        coefficients[key] = P.Coefficient(round(slope, 4), round(fixed / MIB, 1), unit,
                                          f"{n} points of {', '.join(series)}")
    return coefficients


def held_out_error(points: list[Point], coefficients) -> dict[str, float]:
    worst = {}
    for p in points:
        if p.role == "held-out":
            err = abs(p.predicted(coefficients) / p.measured - 1)
            worst[p.key[0]] = max(worst.get(p.key[0], 0.0), err)
    return worst


def targets(coefficients) -> list[tuple[str, bool, str]]:
    """Issue 30's 8B-LoRA checks on one 80 GB GPU + 128 GiB host, with the fitted coefficients."""
    saved, new = dict(P.COEFFICIENTS), dict(coefficients)
    P.COEFFICIENTS.clear()
    P.COEFFICIENTS.update(new)
    try:
        d8 = dims(LLAMA3_8B)
        sbp = replace(GPU_LORA, method="streambp", offload_layer_inputs=True)
        out = []
        e = P.estimate(d8, sbp, 393216)
        out.append(("StreamBP + offload fits 384K on an 80 GB GPU + 125 GiB host",
                    e.device_total <= H100_BYTES and e.host_total <= HOST_BYTES,
                    f"{e.device_total / GIB:.1f} GiB per GPU, {e.host_total / GIB:.1f} GiB host; longest that fits "
                    f"{P.longest_fit(d8, sbp, H100_BYTES, HOST_BYTES):,} tokens"))
        for method, label in (("alst_offload", "ALST's real recipe"), ("alst_offload_sync", "the imitation")):
            setup = replace(GPU_LORA, method=method, offload_layer_inputs=True)  # both offload the checkpoints
            e = P.estimate(d8, setup, 262144)
            longest = P.longest_fit(d8, setup, H100_BYTES, HOST_BYTES)
            out.append((f"{label} ({method}) runs out of GPU memory at 256K", e.device_total > H100_BYTES,
                        f"{e.device_total / GIB:.1f} GiB per GPU; longest that fits {longest:,} tokens"))
        g = coefficients[("gpu", "streambp_offload")]
        slope_kib = g.per_token * LLAMA3_8B.hidden_size * 2 / 1024
        out.append(("GPU slope of StreamBP + offload within 10% of 96.5 KiB/token (128K-384K, H100)",
                    abs(slope_kib / 96.5 - 1) <= 0.10, f"{slope_kib:.1f} KiB/token"))
        host_kib = LLAMA3_8B.num_hidden_layers * LLAMA3_8B.hidden_size * 2 / 1024
        out.append(("host slope within 10% of the measured 256.8 KiB/token (256K-384K, H100)",
                    abs(host_kib / 256.8 - 1) <= 0.10, f"{host_kib:.1f} KiB/token (L x d x 2 B)"))
        return out
    finally:
        P.COEFFICIENTS.clear()
        P.COEFFICIENTS.update(saved)


def report(points, coefficients) -> str:
    worst = held_out_error(points, coefficients)
    lines = ["# Memory planner: fitted on half of the measurements, checked on the other half", "",
             "`python -m benchmarks.plan_fit` (constants written into `ds_longseq/plan_memory.py` by `--write`). Bytes "
             "above the built model, MiB. Fit / held-out alternate by length within each series (source and "
             "method); `fit-all`: too few points to hold one out (not validated).", "",
             "## Fitted constants", "", "| regime | method | per token | unit | fixed MiB | fitted on |",
             "|---|---|---:|---|---:|---|"]
    for (regime, key), c in sorted(coefficients.items()):
        lines.append(f"| {regime} | {key} | {c.per_token} | {c.unit} | {c.fixed_mib} | {c.fitted_on} |")
    lines += ["", "## Every point", "",
              "| source | method | tokens | role | measured | structural | fitted | predicted | error |",
              "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for p in sorted(points, key=lambda q: (q.key, q.source.file, q.seq_len)):
        pred, struct = p.predicted(coefficients), p.structural()
        lines.append(f"| {p.source.file} | {p.method} | {p.seq_len} | {p.role} | {p.measured / MIB:.0f} | "
                     f"{struct / MIB:.0f} | {(pred - struct) / MIB:.0f} | {pred / MIB:.0f} | "
                     f"{(pred / p.measured - 1) * 100:+.1f}% |")
    lines += ["", "## Held-out error (largest absolute, per regime)", ""]
    lines += [f"- {regime}: {err:.1%} over {sum(1 for p in points if p.role == 'held-out' and p.key[0] == regime)} "
              f"points" for regime, err in sorted(worst.items())]
    lines += ["", "## Targets (8B LoRA, one 80 GB GPU = 79.18 GiB usable, 125 GiB host)", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {what}: {detail}" for what, ok, detail in targets(coefficients)]
    lines += ["", "Notes:", "",
              "- ALST's real recipe has two measured points (H200, 32K and 128K), both used to fit: its OOM "
              "prediction at 256K (and its longest length on an 80 GB GPU) is the fitted line's, an estimate not "
              "validated on a held-out point.",
              "- The imitation (alst_offload_sync, H100, default allocator) ran 224K and ran out of memory at 256K. "
              "Its line is right where it was measured (held-out 196K: 0.0%) but predicts 256K fits (73 GiB of "
              "79): the OOM came from the allocator, which held 10 GB reserved above the allocated peak at 224K "
              "without expandable segments. The planner models allocated memory; the benchmarks and the examples "
              "now run with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (unless set), where reserved stayed "
              "within 6-23% of allocated on the H200.",
              "- Fixed costs are fitted per regime at one shape each (Llama h512 on CPU, Llama-3-8B on GPU); for "
              "another model the per-token term is scaled with its hidden size (vocabulary for stock and HF "
              "checkpointing): an estimate until a run checks it.", ""]
    return "\n".join(lines)


def write_constants(coefficients, worst) -> None:
    path = ROOT / "ds_longseq" / "plan_memory.py"
    text = path.read_text()
    body = ["COEFFICIENTS: dict[tuple[str, str], Coefficient] = {"]
    for (regime, key), c in sorted(coefficients.items()):
        body.append(f"    ({regime!r}, {key!r}): Coefficient({c.per_token!r}, {c.fixed_mib!r}, {c.unit!r},")
        body.append(f"                                  {c.fitted_on!r}),")
    body.append("}")
    errs = ", ".join(f"{r!r}: {max(0.05, round(e + 0.005, 2))!r}" for r, e in sorted(worst.items()))
    body.append(f"HELD_OUT_ERROR: dict[str, float] = {{{errs}}}  # largest held-out error, rounded up, at least 5%")
    new = re.sub(r"(# BEGIN FITTED\n).*?(\n# END FITTED)", lambda m: m.group(1) + "\n".join(body) + m.group(2),
                 text, flags=re.S)
    path.write_text(new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite ds_longseq/plan_memory.py's fitted block")
    ap.add_argument("--out", default=str(RESULTS / "plan_validation.md"))
    args = ap.parse_args(argv)
    points = load_points()
    coefficients = fit(points)
    text = report(points, coefficients)
    Path(args.out).write_text(text)
    print(text)
    if args.write:
        write_constants(coefficients, held_out_error(points, coefficients))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
