"""Per-rank peak CPU memory of one training step under DeepSpeed-Ulysses sequence parallelism.

P CPU ranks (gloo) share one sequence of GLOBAL length T, each holding T/P consecutive tokens.
For each method and global length, P fresh rank processes (``benchmarks.harness.spawn`` with
``nprocs=P``) build the same model (same seed, same weights and data for every method; float32,
batch 1; ``benchmarks.recipes.LLAMA_SMALL``), record their peak resident set size (``ru_maxrss``)
as the baseline, run exactly one forward + backward step (no optimizer step) and report the peak
RSS minus that baseline in MiB, the step time and the loss. Fresh processes per point matter:
``ru_maxrss`` is a high-water mark.

As in ``benchmarks.memory``, the number counts everything a step allocates on top of the built
model: activations, logits, autograd buffers, communication buffers and the (local, not yet
reduced) parameter gradients (about 173 MiB per rank here, identical for every method).

Methods (``benchmarks.recipes``, all with ``sequence_parallel`` over the P ranks):
    alst_sp:     DeepSpeed's ALST recipe: ``UlyssesSPAttentionHF.register_with_transformers``
                 (SDPA core attention), ``TiledMLP`` on every MLP, ``TiledFusedLogitsLoss`` for the
                 loss, HF gradient checkpointing (non-reentrant).
    mst_sp:      ds_longseq mini-sequence MLP (as many chunks as ALST's TiledMLP tiles) and chunked
                 LM-head loss, HF gradient checkpointing.
    streambp_sp: ds_longseq StreamBP + chunked LM-head loss (no checkpointing).
    mst_sp_ring, streambp_sp_ring: the same with the group run as a ring (``sequence_parallel.ring`` = P: Ulysses
                 x ring 1 x P, zigzag shards, ring attention on whole shards / StreamBP's K/V gathered over the
                 ring); not in the default set.

After the measurement (outside the measured peak and time) every rank sums the parameter gradients
over the group and reports their global norm, so methods can be checked to agree on gradients too.

Holds: ``run_rank`` (one rank, the child), ``summarize`` (P rank records per repeat -> per-rank and
``max`` rows), ``agreement`` and ``where_we_lose`` (plain-sentence comparisons), ``write_md`` and the
CLI (``main``).

Example:
    python -m benchmarks.sp_memory --sp 2 --seq-lens 8192 16384 32768 --repeats 1 \
        --out benchmarks/results/sp_memory_cpu
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import REPO_ROOT, num_cpus, read_csv
from benchmarks.recipes import (
    LLAMA_SMALL,
    LOSS_TOKENS_PER_CHUNK,
    SP_SMOKE,
    build_model,
    get_recipe,
    long_seq_config,
    prepare,
    random_tokens,
    tiled_fused_loss,
)

MODULE = "benchmarks.sp_memory"
METHODS = ("alst_sp", "mst_sp", "streambp_sp", "mst_sp_ring", "streambp_sp_ring")
DEFAULT_METHODS = ("alst_sp", "mst_sp", "streambp_sp")
DEFAULT_SEQ_LENS = (8192, 16384, 32768)
# --smoke: a tiny model and short sequences, so a test runs every method in seconds.
SMOKE_SEQ_LENS = (256, 512)
SMOKE_CHUNK = 64  # lm_head / StreamBP / kv-block / loss-tile tokens under --smoke (several per shard)
# Relative disagreement between methods above which the report flags a mismatch (float32 noise
# from different summation orders is ~1e-6 on the loss and ~1e-5 on the gradient norm).
LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-3
# "Where we lose" calls a difference noise below these: RSS carries allocator retention of a few
# tens of MiB, and step times on a shared machine vary by ~10% run to run.
MEM_NOISE_MIB = 25.0
MEM_NOISE_REL = 0.05
TIME_NOISE_REL = 0.10


def _shape(smoke):
    return SP_SMOKE if smoke else LLAMA_SMALL


def _chunk(smoke):
    return SMOKE_CHUNK if smoke else LOSS_TOKENS_PER_CHUNK


def mlp_tiles(seq_len, sp, shape):
    """TiledMLP's shard count on one rank's T/P tokens (``alst_mlp_forward``: ceil(T_l / hidden))."""
    return math.ceil((seq_len // sp) / shape.hidden_size)


def check_sizes(seq_len, sp, shape):
    if seq_len % sp:
        raise ValueError(f"global length {seq_len} is not divisible by --sp {sp}")
    for key in ("num_attention_heads", "num_key_value_heads"):
        if getattr(shape, key) % sp:
            raise ValueError(f"{key}={getattr(shape, key)} is not divisible by --sp {sp}")


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------

def _alst_sp_loss(model, input_ids, position_ids, shift_labels, n_valid_global, tokens_per_tile):
    """This rank's share of the group's mean loss: (local loss sum) / (global valid-token count).

    Summing the ranks' gradients then gives the gradient of the group mean. The division sits
    inside the tile (see ``benchmarks.recipes.tiled_fused_loss``): TiledFusedLogitsLoss runs the
    lm_head backward during its forward with an incoming gradient of 1.
    """
    hidden = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    return tiled_fused_loss(model, hidden, shift_labels, n_valid_global, tokens_per_tile)


def _alst_shard(input_ids, rank, sp):
    """DeepSpeed-style sharding, independent of ds_longseq: global shift first, then cut."""
    import torch
    import torch.nn.functional as F

    T = input_ids.shape[1]
    local = T // sp
    shift_labels = F.pad(input_ids, (0, 1), value=-100)[:, 1:]
    position_ids = torch.arange(T).unsqueeze(0)
    cut = slice(rank * local, (rank + 1) * local)
    return (input_ids[:, cut].contiguous(), position_ids[:, cut].contiguous(),
            shift_labels[:, cut].contiguous())


def run_rank(spec):
    """One measured step on this rank (env: RANK, WORLD_SIZE, MASTER_ADDR/PORT); returns its record."""
    import deepspeed
    import torch
    import torch.distributed as dist

    method, seq_len, sp, smoke = spec["method"], spec["seq_len"], spec["sp"], spec["smoke"]
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    shape, chunk = _shape(smoke), _chunk(smoke)
    check_sizes(seq_len, sp, shape)
    recipe = get_recipe(method.removesuffix("_ring"))
    if not recipe.sequence_parallel:
        raise ValueError(f"{method} is not a sequence-parallel method: choose from {METHODS}")
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    rank = dist.get_rank()

    model = build_model(shape, dtype="float32", device="cpu", seq_len=seq_len)  # same weights as benchmarks.memory
    input_ids = random_tokens(shape, seq_len)
    prepare(model, recipe)

    if recipe.alst:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=1,
            seq_length=seq_len, seq_length_is_variable=False)
        group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        # the model must really run DeepSpeed's all-to-all attention, not SDPA on the local shard only
        if ALL_ATTENTION_FUNCTIONS["sdpa"].__name__ != "uattn_wrapper" or model.config._attn_implementation != "sdpa":
            raise RuntimeError(f"UlyssesSPAttentionHF is not in place: {ALL_ATTENTION_FUNCTIONS['sdpa']}")
        ids, pos, shift_labels = _alst_shard(input_ids, sp_rank, sp)

        def step():
            n_valid = (shift_labels != -100).sum().to(torch.float32)
            dist.all_reduce(n_valid, group=group)
            loss = _alst_sp_loss(model, ids, pos, shift_labels, n_valid.clamp(min=1), chunk)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)  # report the group's mean, like ds_longseq's loss
            return float(total)

    else:
        import ds_longseq
        from ds_longseq.engine import sequence_parallel_groups, shard_batch

        mpu = sequence_parallel_groups(sp)
        group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        cfg = long_seq_config(recipe, shape, seq_len, chunk_size=chunk, loss_chunk_size=chunk, sp=sp)
        if method.endswith("_ring"):
            cfg["sequence_parallel"]["ring"] = sp
        ds_longseq.enable(model, cfg, sp_group=group)
        # cut by the enabled model's layout (zigzag under a ring)
        local = shard_batch({"input_ids": input_ids, "labels": input_ids}, sp_rank, sp, layout=model)

        def step():
            loss = model(**local).loss
            loss.backward()
            return float(loss.detach())

    dist.barrier()
    baseline = harness.maxrss_mib()
    dist.barrier(group=group)
    start = time.perf_counter()
    loss = step()
    step_s = time.perf_counter() - start
    peak = harness.maxrss_mib() - baseline

    # Outside the measurement: the group's summed gradients, as DeepSpeed's reduction would form them.
    sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            sq += p.grad.double().pow(2).sum()
    dist.barrier()
    dist.destroy_process_group()
    return {"method": method, "seq_len": seq_len, "sp": sp, "rank": rank, "baseline_mib": baseline,
            "peak_mib": peak, "step_s": step_s, "loss": loss, "grad_norm": float(sq.sqrt()), "threads": threads}


def spawn_point(method, seq_len, sp, smoke, timeout_s, threads, mmap_threshold=None, spawn=harness.spawn):
    """The P ranks of one point in fresh interpreters (gloo on a free port); one record per rank."""
    port = harness.free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_WORLD_SIZE": str(sp),
           "OMP_NUM_THREADS": str(threads)}
    if mmap_threshold:
        # As in benchmarks.memory: a fixed threshold stops glibc from raising it after frees.
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    spec = {"method": method, "seq_len": seq_len, "sp": sp, "smoke": smoke}
    return spawn(MODULE, spec, timeout_s=timeout_s, nprocs=sp, env=env)


# ---------------------------------------------------------------------------------------------
# Summaries and reports
# ---------------------------------------------------------------------------------------------

def summarize(method, seq_len, sp, runs, command):
    """``runs``: one list of P rank records per repeat. Returns P per-rank rows and a ``max`` row.

    Only repeats where every rank succeeded count. The ``max`` row holds, per repeat, the largest
    peak / step time over the ranks (what bounds a machine with P ranks), then the median over
    repeats. ``error`` keeps the first failure of any rank in any repeat.
    """
    failures = [rec for run in runs for rec in run if rec.get("status") != "ok"]
    # the root cause first: a rank killed because a peer failed says nothing about the point
    failures.sort(key=lambda rec: rec.get("error") == harness.PEER_FAILED)
    good = [run for run in runs if all(rec.get("status") == "ok" for rec in run)]

    def row(rank, recs):
        if recs:
            fields = harness.summarize_repeats(recs)
            fields.update(loss=f"{recs[0]['loss']:.8f}", grad_norm=f"{recs[0]['grad_norm']:.9g}",
                          step_s=round(statistics.median(r["step_s"] for r in recs), 2))
        else:
            fields = {"status": failures[0]["status"] if failures else "not_run", "repeats": 0}
        fields["error"] = failures[0].get("error", "") if failures else ""
        return harness.new_row(suite="sp_memory", kind="step", method=method, seq_len=seq_len, sp=sp, rank=rank,
                               device="cpu", command=command, **fields)

    rows = [row(rank, [run[rank] for run in good]) for rank in range(sp)]
    worst = [{"status": "ok", "peak_mib": max(r["peak_mib"] for r in run), "step_s": max(r["step_s"] for r in run),
              "baseline_mib": max(r["baseline_mib"] for r in run), "loss": run[0]["loss"],
              "grad_norm": run[0]["grad_norm"]} for run in good]
    rows.append(row("max", worst))
    return rows


def _index(rows):
    return {(r["method"], int(r["seq_len"]), str(r["rank"])): r for r in rows}


def agreement(rows, methods, seq_lens):
    """Per length: the loss and gradient-norm spread over methods, and any flagged mismatch."""
    by = _index(rows)
    out = []
    for s in seq_lens:
        vals = {m: (float(by[(m, s, "max")]["loss"]), float(by[(m, s, "max")]["grad_norm"]))
                for m in methods if (m, s, "max") in by and by[(m, s, "max")]["loss"] != ""}
        if not vals:
            continue
        ranks_disagree = [m for m in vals if len({by[(m, s, str(r))]["loss"]
                                                   for r in range(int(by[(m, s, 'max')]['sp']))}) > 1]
        losses = [v[0] for v in vals.values()]
        grads = [v[1] for v in vals.values()]
        dl = (max(losses) - min(losses)) / abs(statistics.mean(losses))
        dg = (max(grads) - min(grads)) / abs(statistics.mean(grads))
        out.append({"seq_len": s, "values": vals, "loss_rel": dl, "grad_rel": dg,
                    "mismatch": dl > LOSS_RTOL or dg > GRAD_RTOL, "ranks_disagree": ranks_disagree})
    return out


def where_we_lose(rows, methods, seq_lens, sp, threads=1):
    """Plain sentences comparing ds_longseq's methods with alst_sp, derived from the max-rank rows.

    A time comparison is marked confounded when either point ended with the machine's 1-minute
    load well above what the ranks themselves make (other work was sharing the cores).
    """
    by = _index(rows)
    lines = []
    busy_load = sp * threads + 0.75
    ours = [m for m in methods if m != "alst_sp"]
    if "alst_sp" not in methods or not ours:
        return ["(needs alst_sp and at least one ds_longseq method to compare)"]

    def val(m, s, key, rank="max"):
        r = by.get((m, s, rank))
        return harness.num(r[key]) if r else None

    for m in ours:
        mem_lose, mem_win, time_lose, time_win = [], [], [], []
        mem_same, time_same = [], []
        for s in seq_lens:
            a, b = val("alst_sp", s, "peak_mib"), val(m, s, "peak_mib")
            if a and b:
                txt = f"{s}: {b:.0f} vs {a:.0f} MiB ({(b / a - 1) * 100:+.0f}%)"
                if abs(b - a) <= max(MEM_NOISE_MIB, MEM_NOISE_REL * a):
                    mem_same.append(txt)
                else:
                    (mem_lose if b > a else mem_win).append(txt)
            a, b = val("alst_sp", s, "step_s"), val(m, s, "step_s")
            if a and b:
                txt = f"{s}: {b:.1f} vs {a:.1f} s ({(b / a - 1) * 100:+.0f}%)"
                la, lb = val("alst_sp", s, "load1"), val(m, s, "load1")
                if la is not None and lb is not None and max(la, lb) > busy_load:
                    txt += f" [CONFOUNDED: machine load {lb:.1f} vs {la:.1f}]"
                if abs(b - a) <= TIME_NOISE_REL * a:
                    time_same.append(txt)
                else:
                    (time_lose if b > a else time_win).append(txt)
        if mem_lose:
            lines.append(f"- `{m}` uses MORE per-rank memory than `alst_sp` at " + "; ".join(mem_lose) + ".")
        if mem_win:
            lines.append(f"- `{m}` uses less per-rank memory than `alst_sp` at " + "; ".join(mem_win) + ".")
        if mem_same:
            lines.append(f"- `{m}` per-rank memory is within noise of `alst_sp` at " + "; ".join(mem_same) + ".")
        if time_lose:
            lines.append(f"- `{m}` is SLOWER than `alst_sp` at " + "; ".join(time_lose) + ".")
        if time_win:
            lines.append(f"- `{m}` is faster than `alst_sp` at " + "; ".join(time_win) + ".")
        if time_same:
            lines.append(f"- `{m}` step time is within noise of `alst_sp` at " + "; ".join(time_same) + ".")
    # Rank imbalance: the max row hides how different the ranks are.
    for m in methods:
        for s in seq_lens:
            peaks = [val(m, s, "peak_mib", str(r)) for r in range(sp)]
            if all(p is not None for p in peaks) and min(peaks) > 0 and max(peaks) / min(peaks) > 1.25:
                lines.append(f"- `{m}` at {s}: ranks are imbalanced, peaks "
                             + "/".join(f"{p:.0f}" for p in peaks) + " MiB.")
    failed = [f"{m}@{s}: {by[(m, s, 'max')]['error']}" for m in methods for s in seq_lens
              if (m, s, "max") in by and by[(m, s, "max")]["peak_mib"] == ""]
    if failed:
        lines.append("- Failed points: " + "; ".join(failed) + ".")
    return lines


def write_md(rows, methods, seq_lens, sp, shape, threads, smoke) -> str:
    """The report: per-rank tables (max over ranks in bold), agreement, where we lose, setup."""

    def table(key, fmt):
        return harness.grid_table(rows, methods, seq_lens, key, fmt, rank="max", strong_rank=sp,
                                  seq_label=lambda s: f"{s} ({s // sp})",
                                  header="global seq_len (T/P per rank)")

    chunk = _chunk(smoke)
    tiles = ", ".join(f"{mlp_tiles(s, sp, shape)} at {s}" for s in seq_lens)
    out = [f"# Per-rank peak memory under Ulysses sequence parallelism, SP={sp} "
           f"({shape.describe()}, fp32, batch 1)", "",
           f"{sp} CPU ranks (gloo) on one machine share each sequence; the length is GLOBAL, "
           f"each rank holds T/{sp} tokens. One forward + backward step, no optimizer step.", "",
           "Per-rank peak RSS minus that rank's post-build baseline, MiB: **max over ranks** "
           f"({' / '.join(f'rank {r}' for r in range(sp))}); includes each rank's ~173 MiB of unreduced parameter "
           "gradients, the same for every method." if not smoke else
           "Per-rank peak RSS minus that rank's post-build baseline, MiB: **max over ranks** (per rank).", ""]
    out += table("peak_mib", lambda v: f"{v:.0f}")
    out += ["", "Step wall time, s: **slowest rank** (per rank). Noisy: the ranks share a 2-core "
            "machine with each other (and, during these runs, with other jobs), "
            f"{threads} thread(s) per rank; one sample per point unless the CSV says otherwise.", ""]
    out += table("step_s", lambda v: f"{v:.1f}")
    maxrows = [r for r in rows if str(r["rank"]) == "max"]
    loads = [float(r["load1"]) for r in maxrows if r.get("load1") not in ("", None)]
    if loads:
        out += ["", f"1-minute load average when each point ended (CSV `load1`, {len(loads)} of "
                f"{len(maxrows)} points): {min(loads):.1f} to {max(loads):.1f} on {num_cpus()} cores "
                f"({sp} ranks x {threads} thread(s) alone make {sp * threads}); anything above that is "
                "other work slowing the step."]
    out += ["", "## Do the methods agree?", "",
            "Loss = the group's token-mean loss (ALST: its per-rank shares summed over the group). "
            "Gradient norm = norm of the parameter gradients summed over the group (computed after "
            f"the measurement). A mismatch is flagged above {LOSS_RTOL:g} (loss) / {GRAD_RTOL:g} "
            "(grad norm) relative spread.", "",
            "| global seq_len | " + " | ".join(f"{m} loss / grad norm" for m in methods)
            + " | loss spread | grad spread | |", "|---:|" + "---:|" * (len(methods) + 3)]
    for a in agreement(rows, methods, seq_lens):
        cells = [f"{a['values'][m][0]:.6f} / {a['values'][m][1]:.6g}" if m in a["values"] else ""
                 for m in methods]
        flag = "MISMATCH" if a["mismatch"] else "ok"
        if a["ranks_disagree"]:
            flag += "; ranks disagree: " + ", ".join(a["ranks_disagree"])
        out.append(f"| {a['seq_len']} | " + " | ".join(cells)
                   + f" | {a['loss_rel']:.1e} | {a['grad_rel']:.1e} | {flag} |")
    single = {} if smoke else _single_process_losses()
    hits = [(a["seq_len"], single[a["seq_len"]], a["values"]) for a in agreement(rows, methods, seq_lens)
            if a["seq_len"] in single]
    if hits:
        out += ["", "Cross-check against one process on the whole sequence (same weights and tokens; "
                "`benchmarks/results/memory_cpu*.csv` from `benchmarks.memory`): "
                + "; ".join(f"{s}: {'/'.join(f'{x:.5f}' for x in sorted(set(ref)))} vs SP "
                            f"{min(v[0] for v in vals.values()):.5f}"
                            for s, ref, vals in hits) + "."]
    out += ["", "## Where we lose", ""]
    out += where_we_lose(rows, methods, seq_lens, sp, threads)
    out += ["", "Step times are single samples on a shared machine; a difference of tens of percent "
            "can be load alone (compare the CSV's `load1`). Memory repeats to within ~10 MiB."]
    out += ["", "## Setup", "",
            f"- alst_sp: `UlyssesSPAttentionHF.register_with_transformers(core_attn_implementation='sdpa', "
            f"sequence_parallel_size={sp}, micro_batch_size=1, seq_length=T, seq_length_is_variable=False)`, "
            f"TiledMLP with ceil(T_l / hidden) tiles ({tiles}), TiledFusedLogitsLoss on {chunk}-token tiles "
            "(per-rank loss = local loss sum / global valid-token count), HF gradient checkpointing.",
            f"- mst_sp: ds_longseq `mini_seq` with `mlp_num_chunks` = ALST's tile count, `lm_head` "
            f"chunk_size {chunk}, `sequence_parallel` size {sp}, HF gradient checkpointing.",
            f"- streambp_sp: ds_longseq `streambp` chunk_size {chunk}, kv_block_size {chunk}, `lm_head` "
            f"chunk_size {chunk}, `sequence_parallel` size {sp}; no checkpointing.",
            "- Same weights (seed) and the same random tokens for every method; fresh processes per "
            "point (`ru_maxrss` is a high-water mark).",
            "- Caveat: RSS also counts pages glibc keeps after frees (see `benchmarks/memory.py`), "
            "and gloo's communication buffers; numbers are whole-process, not live tensors.", ""]
    out += harness.environment([r["command"] for r in rows], device="cpu")
    out += [f"{sp} ranks x {threads} thread(s).", ""]
    return "\n".join(out)


def _single_process_losses():
    """{seq_len: [losses]} from benchmarks.memory's result CSVs (same model shape, seed and tokens)."""
    found = {}
    for path in sorted((REPO_ROOT / "benchmarks" / "results").glob("memory_cpu*.csv")):
        for r in read_csv(path):
            if r.get("loss"):
                found.setdefault(int(r["seq_len"]), []).append(float(r["loss"]))
    return found


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def main(argv=None, spawn=harness.spawn):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sp", type=int, default=2, help="ranks per sequence (P)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help=f"GLOBAL sequence lengths (default {' '.join(map(str, DEFAULT_SEQ_LENS))})")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/sp_memory_cpu",
                   help="output prefix; writes <out>.csv, <out>.png, <out>.md")
    p.add_argument("--append", action="store_true",
                   help="keep the other points already in <out>.csv (a long sweep in several runs); "
                        "points measured now replace theirs")
    p.add_argument("--smoke", action="store_true",
                   help=f"tiny model, lengths {' '.join(map(str, SMOKE_SEQ_LENS))} unless --seq-lens: seconds")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="torch / OpenMP threads per rank (default: available cores // P, at least 1)")
    p.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="set MALLOC_MMAP_THRESHOLD_ in the ranks (less allocator retention in RSS)")
    p.add_argument("--point-timeout", type=float, default=1800.0,
                   help="seconds per point (all P ranks); a hung point is killed and recorded as failed")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="start no point after this many minutes; the rest are recorded as not run")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rewrite <out>.png and <out>.md from <out>.csv")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._child:
        return harness.child_main(run_rank, args._child)

    shape = _shape(args.smoke)
    seq_lens = args.seq_lens or list(SMOKE_SEQ_LENS if args.smoke else DEFAULT_SEQ_LENS)
    for s in seq_lens:
        check_sizes(s, args.sp, shape)
    threads = args.threads_per_rank or max(1, num_cpus() // args.sp)
    command = "python -m benchmarks.sp_memory " + " ".join(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    csv_path = args.out + ".csv"
    measured = {(m, s) for s in seq_lens for m in args.methods}
    if args.report_only:
        measured, args.append, seq_lens = set(), True, []
    kept = harness.keep_rows(
        read_csv(csv_path),
        lambda r: not args.append or (r["method"], int(r["seq_len"])) in measured or int(r["sp"]) != args.sp,
    )
    rows = list(kept)
    if not rows and not seq_lens:
        raise SystemExit(f"--report-only: no rows for --sp {args.sp} in {csv_path}")
    budget = harness.TimeBudget(args.time_budget_min)

    def write():
        all_lens = sorted({int(r["seq_len"]) for r in rows})
        all_methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
        harness.write_outputs(
            rows, args.out, write_md(rows, all_methods, all_lens, args.sp, shape, threads, args.smoke),
            lambda path: harness.plot(
                rows, path, f"Ulysses SP={args.sp} (gloo CPU ranks), one fwd+bwd step; {shape.describe()}, fp32",
                peak_label="per-rank peak RSS above baseline, max over ranks",
                x_label=f"GLOBAL sequence length (tokens, batch 1; {args.sp} ranks x T/{args.sp})", rank="max"),
            csv=not args.report_only,
        )

    print(f"{'method':>12} {'seq_len':>7} {'peak MiB max (per rank)':>28} {'step s':>8} {'loss':>10}  error",
          flush=True)
    for seq_len in seq_lens:
        for method in args.methods:
            runs = []
            for _ in range(args.repeats):
                if budget.spent():
                    break
                runs.append(spawn_point(method, seq_len, args.sp, args.smoke, budget.timeout(args.point_timeout),
                                        threads, args.mmap_threshold, spawn=spawn))
            if runs:
                new = summarize(method, seq_len, args.sp, runs, command)
            else:
                new = [harness.new_row(suite="sp_memory", kind="step", method=method, seq_len=seq_len, sp=args.sp,
                                       rank=rank, status="not_run", error=harness.NOT_RUN_BUDGET, command=command)
                       for rank in [*range(args.sp), "max"]]
            for r in new:  # machine load (1-min average) when the point ended: step times are shared-CPU times
                r["load1"] = round(os.getloadavg()[0], 2)
            rows.extend(new)
            mx = new[-1]
            per = "/".join(str(r["peak_mib"]) for r in new[:-1])
            peaks = f"{mx['peak_mib']} ({per})" if mx["repeats"] else "-"
            print(f"{method:>12} {seq_len:>7} {peaks:>28} {str(mx['step_s']):>8} "
                  f"{str(mx['loss']):>10}  {mx['error']}", flush=True)
            write()  # after each point, so a partial sweep survives
    write()
    all_lens = sorted({int(r["seq_len"]) for r in rows})
    all_methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    for a in agreement(rows, all_methods, all_lens):
        print(f"seq_len {a['seq_len']}: loss " + ", ".join(f"{m}={v[0]:.6f}" for m, v in a["values"].items())
              + f" (spread {a['loss_rel']:.1e}); grad norm spread {a['grad_rel']:.1e}"
              + ("  MISMATCH" if a["mismatch"] else ""))
    print(f"wrote {csv_path}, {args.out}.png, {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
