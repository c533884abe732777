"""Per-rank peak CPU memory of one training step under DeepSpeed-Ulysses sequence parallelism.

P CPU ranks (gloo) share one sequence of GLOBAL length T, each holding T/P consecutive tokens.
For each method and global length, P fresh rank processes build the same model (same seed, same
weights and data for every method; float32, batch 1; the Llama shape of ``benchmarks.memory``),
record their peak resident set size (``ru_maxrss``) as the baseline, run exactly one forward +
backward step (no optimizer step) and report the peak RSS minus that baseline in MiB, the step
time and the loss. Fresh processes per point matter: ``ru_maxrss`` is a high-water mark.

As in ``benchmarks.memory``, the number counts everything a step allocates on top of the built
model: activations, logits, autograd buffers, communication buffers and the (local, not yet
reduced) parameter gradients (about 173 MiB per rank here, identical for every method).

Methods (all with ``sequence_parallel`` over the P ranks):
    alst_sp:     DeepSpeed's ALST recipe: ``UlyssesSPAttentionHF.register_with_transformers``
                 (SDPA core attention), ``TiledMLP`` on every MLP, ``TiledFusedLogitsLoss`` for the
                 loss, HF gradient checkpointing (non-reentrant).
    mst_sp:      ds_longseq mini-sequence MLP (as many chunks as ALST's TiledMLP tiles) and chunked
                 LM-head loss, HF gradient checkpointing.
    streambp_sp: ds_longseq StreamBP + chunked LM-head loss (no checkpointing).

After the measurement (outside the measured peak and time) every rank sums the parameter gradients
over the group and reports their global norm, so methods can be checked to agree on gradients too.

Example:
    python -m benchmarks.sp_memory --sp 2 --seq-lens 8192 16384 32768 --repeats 1 \
        --out benchmarks/results/sp_memory_cpu
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

from benchmarks.memory import (
    LOSS_TOKENS_PER_CHUNK,
    MODEL_SHAPE,
    REPO_ROOT,
    SEED,
    _alst_mlp_forward,
    _maxrss_mib,
    _version,
    tiled_fused_loss,
)

METHODS = ("alst_sp", "mst_sp", "streambp_sp")
DEFAULT_SEQ_LENS = (8192, 16384, 32768)
# --smoke: a tiny model and short sequences, so a test runs every method in seconds.
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
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
CSV_COLUMNS = ("method", "seq_len", "sp", "rank", "peak_mib_median", "peak_mib_min", "peak_mib_max",
               "baseline_mib", "step_s_median", "repeats", "loss", "grad_norm", "load1", "error",
               "command")


def _shape(smoke):
    return SMOKE_SHAPE if smoke else MODEL_SHAPE


def _chunk(smoke):
    return SMOKE_CHUNK if smoke else LOSS_TOKENS_PER_CHUNK


def _shape_str(shape):
    return (f"Llama h={shape['hidden_size']} ffn={shape['intermediate_size']} "
            f"L={shape['num_hidden_layers']} heads={shape['num_attention_heads']} "
            f"kv={shape['num_key_value_heads']} vocab={shape['vocab_size']}")


def mlp_tiles(seq_len, sp, shape):
    """TiledMLP's shard count on one rank's T/P tokens (``_alst_mlp_forward``: ceil(T_l / hidden))."""
    return math.ceil((seq_len // sp) / shape["hidden_size"])


def check_sizes(seq_len, sp, shape):
    if seq_len % sp:
        raise ValueError(f"global length {seq_len} is not divisible by --sp {sp}")
    for key in ("num_attention_heads", "num_key_value_heads"):
        if shape[key] % sp:
            raise ValueError(f"{key}={shape[key]} is not divisible by --sp {sp}")


# ---------------------------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------------------------

def _alst_sp_loss(model, input_ids, position_ids, shift_labels, n_valid_global, tokens_per_tile):
    """This rank's share of the group's mean loss: (local loss sum) / (global valid-token count).

    Summing the ranks' gradients then gives the gradient of the group mean. The division sits
    inside the tile (see ``benchmarks.memory.tiled_fused_loss``): TiledFusedLogitsLoss runs the
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


def run_rank(method, seq_len, sp, smoke):
    """Runs one measured step on this rank (env: RANK, WORLD_SIZE, MASTER_ADDR/PORT) and returns a dict."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    shape, chunk = _shape(smoke), _chunk(smoke)
    check_sizes(seq_len, sp, shape)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    rank = dist.get_rank()

    torch.manual_seed(SEED)  # same construction as benchmarks.memory._prepare: same weights
    config = LlamaConfig(**shape, max_position_embeddings=seq_len, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.train()
    input_ids = torch.randint(0, shape["vocab_size"], (1, seq_len),
                              generator=torch.Generator().manual_seed(SEED + 1))
    if method in ("alst_sp", "mst_sp"):  # streambp replaces checkpointing, so not on it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})

    if method == "alst_sp":
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=1,
            seq_length=seq_len, seq_length_is_variable=False)
        group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        # the model must really run DeepSpeed's all-to-all attention, not SDPA on the local shard only
        assert ALL_ATTENTION_FUNCTIONS["sdpa"].__name__ == "uattn_wrapper", ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert model.config._attn_implementation == "sdpa"
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(_alst_mlp_forward, layer.mlp)
        ids, pos, shift_labels = _alst_shard(input_ids, sp_rank, sp)

        def step():
            n_valid = (shift_labels != -100).sum().to(torch.float32)
            dist.all_reduce(n_valid, group=group)
            loss = _alst_sp_loss(model, ids, pos, shift_labels, n_valid.clamp(min=1), chunk)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)  # report the group's mean, like ds_longseq's loss
            return float(total)

    elif method in ("mst_sp", "streambp_sp"):
        import ds_longseq
        from ds_longseq.engine import sequence_parallel_groups, shard_batch

        mpu = sequence_parallel_groups(sp)
        group, sp_rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        if method == "mst_sp":
            cfg = {"mini_seq": {"enabled": True, "mlp_num_chunks": mlp_tiles(seq_len, sp, shape)},
                   "lm_head": {"enabled": True, "chunk_size": chunk}}
        else:
            cfg = {"streambp": {"enabled": True, "chunk_size": chunk, "kv_block_size": chunk},
                   "lm_head": {"enabled": True, "chunk_size": chunk}}
        cfg["sequence_parallel"] = {"size": sp}
        ds_longseq.enable(model, cfg, sp_group=group)
        local = shard_batch({"input_ids": input_ids, "labels": input_ids}, sp_rank, sp)

        def step():
            loss = model(**local).loss
            loss.backward()
            return float(loss.detach())
    else:
        raise ValueError(f"unknown method {method!r}")

    dist.barrier()
    baseline = _maxrss_mib()
    dist.barrier(group=group)
    start = time.perf_counter()
    loss = step()
    step_s = time.perf_counter() - start
    peak = _maxrss_mib() - baseline

    # Outside the measurement: the group's summed gradients, as DeepSpeed's reduction would form them.
    sq = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            sq += p.grad.double().pow(2).sum()
    dist.barrier()
    dist.destroy_process_group()
    return {"ok": True, "method": method, "seq_len": seq_len, "sp": sp, "rank": rank,
            "baseline_mib": baseline, "peak_mib": peak, "step_s": step_s, "loss": loss,
            "grad_norm": float(sq.sqrt()), "threads": threads}


# ---------------------------------------------------------------------------------------------
# Launching P ranks
# ---------------------------------------------------------------------------------------------

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_json(text):
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                pass
    return None


def _rank_error(returncode, stderr):
    if returncode is not None and returncode < 0:  # SIGKILL here is almost always the OOM killer
        return f"killed by signal {-returncode} (OOM?)"
    tail = [line for line in stderr.strip().splitlines() if line.strip() and "[WARNING]" not in line]
    return tail[-1] if tail else f"exit code {returncode}"


def spawn_point(method, seq_len, sp, smoke, timeout_s, threads, mmap_threshold=None, grace_s=20.0):
    """Runs the P ranks of one point in fresh interpreters; returns one record per rank.

    A rank that fails leaves its peers blocked in a collective: once any rank exits non-zero the
    others get ``grace_s`` seconds, then every survivor is killed; the whole point is killed at
    ``timeout_s``. Failures come back as ``ok: False`` records.
    """
    port = _free_port()
    cmd = [sys.executable, "-m", "benchmarks.sp_memory", "--_rank", method, str(seq_len), "--sp", str(sp)]
    if smoke:
        cmd.append("--smoke")
    procs, files = [], []
    for r in range(sp):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   LOCAL_RANK=str(r), WORLD_SIZE=str(sp), LOCAL_WORLD_SIZE=str(sp),
                   OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        if mmap_threshold:
            # As in benchmarks.memory: a fixed threshold stops glibc from raising it after frees.
            env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        files.append((out, err))
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=err, text=True))
    deadline = time.monotonic() + timeout_s
    first_failure, reason = None, {}
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed and first_failure is None:
                first_failure = now
            if now > deadline or (first_failure is not None and now - first_failure > grace_s):
                why = (f"timeout after {timeout_s:.0f}s" if now > deadline
                       else "killed: another rank failed and this one did not exit")
                for r, p in enumerate(procs):
                    if p.poll() is None:
                        p.kill()
                        reason[r] = why
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    records = []
    for r, (p, (out, err)) in enumerate(zip(procs, files, strict=True)):
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
        rec = _last_json(stdout)
        if rec is None:
            rec = {"ok": False, "method": method, "seq_len": seq_len, "sp": sp, "rank": r,
                   "error": reason.get(r) or _rank_error(p.returncode, stderr)}
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------
# Summaries and reports
# ---------------------------------------------------------------------------------------------

def summarize(method, seq_len, sp, runs, command):
    """``runs``: one list of P rank records per repeat. Returns P per-rank rows and a ``max`` row.

    The ``max`` row holds, per repeat, the largest peak / step time over the ranks (what bounds
    a machine with P ranks), then the median over repeats.
    """
    rows = []
    errors = [rec["error"] for run in runs for rec in run if not rec["ok"]]
    good = [run for run in runs if all(rec["ok"] for rec in run)]

    def row(rank, peaks, steps, baseline, loss, grad):
        r = dict.fromkeys(CSV_COLUMNS, "")
        r.update(method=method, seq_len=seq_len, sp=sp, rank=rank, repeats=len(peaks),
                 error=errors[0] if errors else "", command=command)
        if peaks:
            r.update(peak_mib_median=round(statistics.median(peaks), 1),
                     peak_mib_min=round(min(peaks), 1), peak_mib_max=round(max(peaks), 1),
                     step_s_median=round(statistics.median(steps), 2),
                     baseline_mib=round(baseline, 1) if baseline != "" else "",
                     loss=f"{loss:.8f}", grad_norm=f"{grad:.9g}")
        return r

    for rank in range(sp):
        recs = [run[rank] for run in good]
        rows.append(row(rank, [x["peak_mib"] for x in recs], [x["step_s"] for x in recs],
                        recs[0]["baseline_mib"] if recs else "",
                        recs[0]["loss"] if recs else 0.0, recs[0]["grad_norm"] if recs else 0.0))
    rows.append(row("max", [max(x["peak_mib"] for x in run) for run in good],
                    [max(x["step_s"] for x in run) for run in good],
                    max(x["baseline_mib"] for x in good[0]) if good else "",
                    good[0][0]["loss"] if good else 0.0, good[0][0]["grad_norm"] if good else 0.0))
    return rows


def read_csv(path):
    if not Path(path).exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _num(x):
    return float(x) if x not in ("", None) else None


def _index(rows):
    return {(r["method"], int(r["seq_len"]), str(r["rank"])): r for r in rows}


def write_png(rows, methods, seq_lens, sp, shape, path):
    """Peak MiB (max over ranks) vs global length, one line per method (failed points omitted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = _index(rows)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in methods:
        pts = [(s, _num(by[(method, s, "max")]["peak_mib_median"])) for s in seq_lens
               if (method, s, "max") in by and _num(by[(method, s, "max")]["peak_mib_median"]) is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
    ax.set_xlabel(f"GLOBAL sequence length (tokens, batch 1; {sp} ranks x T/{sp})")
    ax.set_ylabel("per-rank peak RSS above baseline (MiB, max over ranks)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Ulysses SP={sp} (gloo CPU ranks), one fwd+bwd step\n{_shape_str(shape)}, fp32",
                 fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_lines():
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no successful point", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        return _num(r[key]) if r else None

    for m in ours:
        mem_lose, mem_win, time_lose, time_win = [], [], [], []
        mem_same, time_same = [], []
        for s in seq_lens:
            a, b = val("alst_sp", s, "peak_mib_median"), val(m, s, "peak_mib_median")
            if a and b:
                txt = f"{s}: {b:.0f} vs {a:.0f} MiB ({(b / a - 1) * 100:+.0f}%)"
                if abs(b - a) <= max(MEM_NOISE_MIB, MEM_NOISE_REL * a):
                    mem_same.append(txt)
                else:
                    (mem_lose if b > a else mem_win).append(txt)
            a, b = val("alst_sp", s, "step_s_median"), val(m, s, "step_s_median")
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
            peaks = [val(m, s, "peak_mib_median", str(r)) for r in range(sp)]
            if all(p is not None for p in peaks) and min(peaks) > 0 and max(peaks) / min(peaks) > 1.25:
                lines.append(f"- `{m}` at {s}: ranks are imbalanced, peaks "
                             + "/".join(f"{p:.0f}" for p in peaks) + " MiB.")
    failed = [f"{m}@{s}: {by[(m, s, 'max')]['error']}" for m in methods for s in seq_lens
              if (m, s, "max") in by and by[(m, s, "max")]["peak_mib_median"] == ""]
    if failed:
        lines.append("- Failed points: " + "; ".join(failed) + ".")
    return lines


def write_md(rows, methods, seq_lens, sp, shape, threads, path, smoke):
    by = _index(rows)

    def table(key, fmt, note_err):
        lines = ["| global seq_len (T/P per rank) | " + " | ".join(methods) + " |",
                 "|---|" + "---:|" * len(methods)]
        for s in seq_lens:
            cells = []
            for m in methods:
                mx = by.get((m, s, "max"))
                if mx is None:
                    cells.append("")
                elif mx[key] == "":
                    cells.append("failed" + (": " + mx["error"].replace("|", "\\|")[:80] if note_err else ""))
                else:
                    per = [by[(m, s, str(r))][key] for r in range(sp)]
                    cells.append(f"**{fmt(_num(mx[key]))}** ({' / '.join(fmt(_num(p)) for p in per)})")
            lines.append(f"| {s} ({s // sp}) | " + " | ".join(cells) + " |")
        return lines

    chunk = _chunk(smoke)
    tiles = ", ".join(f"{mlp_tiles(s, sp, shape)} at {s}" for s in seq_lens)
    out = [f"# Per-rank peak memory under Ulysses sequence parallelism, SP={sp} "
           f"({_shape_str(shape)}, fp32, batch 1)", "",
           f"{sp} CPU ranks (gloo) on one machine share each sequence; the length is GLOBAL, "
           f"each rank holds T/{sp} tokens. One forward + backward step, no optimizer step.", "",
           "Per-rank peak RSS minus that rank's post-build baseline, MiB: **max over ranks** "
           f"({' / '.join(f'rank {r}' for r in range(sp))}); includes each rank's ~173 MiB of unreduced parameter "
           "gradients, the same for every method." if not smoke else
           "Per-rank peak RSS minus that rank's post-build baseline, MiB: **max over ranks** (per rank).", ""]
    out += table("peak_mib_median", lambda v: f"{v:.0f}", True)
    out += ["", "Step wall time, s: **slowest rank** (per rank). Noisy: the ranks share a 2-core "
            "machine with each other (and, during these runs, with other jobs), "
            f"{threads} thread(s) per rank; one sample per point unless the CSV says otherwise.", ""]
    out += table("step_s_median", lambda v: f"{v:.1f}", False)
    maxrows = [r for r in rows if str(r["rank"]) == "max"]
    loads = [float(r["load1"]) for r in maxrows if r.get("load1") not in ("", None)]
    if loads:
        out += ["", f"1-minute load average when each point ended (CSV `load1`, {len(loads)} of "
                f"{len(maxrows)} points): {min(loads):.1f} to {max(loads):.1f} on {_ncpu()} cores "
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
            "and gloo's communication buffers; numbers are whole-process, not live tensors.", "",
            "Command(s):", ""]
    commands = list(dict.fromkeys(r["command"] for r in rows if r.get("command")))
    out += [f"- `{c}`" for c in commands]
    out += ["", f"Versions: torch {_version('torch')}, transformers {_version('transformers')}, "
            f"deepspeed {_version('deepspeed')}, python {platform.python_version()}; machine: "
            f"{platform.processor() or platform.machine()}, {_ncpu()} CPU cores available, "
            f"{_mem_gib():.0f} GiB RAM; {sp} ranks x {threads} thread(s).", ""]
    Path(path).write_text("\n".join(out))


def _single_process_losses():
    """{seq_len: [losses]} from benchmarks.memory's result CSVs (same model shape, seed and tokens)."""
    found = {}
    for path in sorted((REPO_ROOT / "benchmarks" / "results").glob("memory_cpu*.csv")):
        for r in read_csv(path):
            if r.get("loss"):
                found.setdefault(int(r["seq_len"]), []).append(float(r["loss"]))
    return found


def _ncpu():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _mem_gib():
    try:
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) / 2**20
    except (OSError, StopIteration):
        return float("nan")


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sp", type=int, default=2, help="ranks per sequence (P)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None,
                   help=f"GLOBAL sequence lengths (default {' '.join(map(str, DEFAULT_SEQ_LENS))})")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
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
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: rewrite <out>.png and <out>.md from <out>.csv")
    p.add_argument("--_rank", nargs=2, metavar=("METHOD", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._rank:
        print(json.dumps(run_rank(args._rank[0], int(args._rank[1]), args.sp, args.smoke)), flush=True)
        return

    shape = _shape(args.smoke)
    seq_lens = args.seq_lens or list(SMOKE_SEQ_LENS if args.smoke else DEFAULT_SEQ_LENS)
    for s in seq_lens:
        check_sizes(s, args.sp, shape)
    threads = args.threads_per_rank or max(1, _ncpu() // args.sp)
    command = "python -m benchmarks.sp_memory " + " ".join(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    csv_path = args.out + ".csv"
    measured = {(m, s) for s in seq_lens for m in args.methods}
    if args.report_only:
        measured, args.append, seq_lens = set(), True, []
    kept = [r for r in read_csv(csv_path)
            if args.append and (r["method"], int(r["seq_len"])) not in measured and int(r["sp"]) == args.sp]
    rows = list(kept)
    print(f"{'method':>12} {'seq_len':>7} {'peak MiB max (per rank)':>28} {'step s':>8} {'loss':>10}  error",
          flush=True)
    if not rows and not seq_lens:
        raise SystemExit(f"--report-only: no rows for --sp {args.sp} in {csv_path}")
    for seq_len in seq_lens:
        for method in args.methods:
            runs = [spawn_point(method, seq_len, args.sp, args.smoke, args.point_timeout, threads,
                                args.mmap_threshold) for _ in range(args.repeats)]
            new = summarize(method, seq_len, args.sp, runs, command)
            for r in new:  # machine load (1-min average) when the point ended: step times are shared-CPU times
                r["load1"] = round(os.getloadavg()[0], 2)
            rows.extend(new)
            mx = new[-1]
            per = "/".join(str(r["peak_mib_median"]) for r in new[:-1])
            peaks = f"{mx['peak_mib_median']} ({per})" if mx["repeats"] else "-"
            print(f"{method:>12} {seq_len:>7} {peaks:>28} {str(mx['step_s_median']):>8} "
                  f"{str(mx['loss']):>10}  {mx['error']}", flush=True)
            write_csv(rows, csv_path)  # after each point, so a partial sweep survives
    all_lens = sorted({int(r["seq_len"]) for r in rows})
    all_methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    write_png(rows, all_methods, all_lens, args.sp, shape, args.out + ".png")
    write_md(rows, all_methods, all_lens, args.sp, shape, threads, args.out + ".md", args.smoke)
    for a in agreement(rows, all_methods, all_lens):
        print(f"seq_len {a['seq_len']}: loss " + ", ".join(f"{m}={v[0]:.6f}" for m, v in a["values"].items())
              + f" (spread {a['loss_rel']:.1e}); grad norm spread {a['grad_rel']:.1e}"
              + ("  MISMATCH" if a["mismatch"] else ""))
    print(f"wrote {csv_path}, {args.out}.png, {args.out}.md")


if __name__ == "__main__":
    main()
