"""Peak CPU memory of one training step versus sequence length.

For each method and sequence length, a fresh child process builds a small
Llama-shaped model (random weights, float32, batch 1), records the process's
peak resident set size (``ru_maxrss``) as the baseline, runs exactly one
forward + backward step (no optimizer step) and reports the peak RSS minus
that baseline, in MiB. Fresh processes matter: ``ru_maxrss`` is a high-water
mark and the allocator keeps freed pages, so points must not share a process.

The number therefore counts everything a step allocates on top of the built
model: activations, logits, autograd buffers and the parameter gradients
(about 173 MiB here, identical for every method, so differences between
methods are differences in activation memory).

Methods:
    stock:    plain Hugging Face model, SDPA attention.
    hf_gc:    HF gradient checkpointing (non-reentrant).
    alst:     hf_gc + DeepSpeed ALST tiles (``TiledMLP``, ``TiledFusedLogitsLoss``).
    mst:      hf_gc + ds_longseq mini-sequence MLP and chunked LM-head loss.
    streambp: ds_longseq StreamBP (chunked layer backprop) + chunked LM-head loss.

Example:
    python -m benchmarks.memory --seq-lens 2048 4096 --repeats 3 \
        --out benchmarks/results/memory_cpu
"""

import argparse
import csv
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import types
from importlib import metadata
from pathlib import Path

METHODS = ("stock", "hf_gc", "alst", "mst", "streambp")
DEFAULT_SEQ_LENS = (2048, 4096, 8192, 16384)
MODEL_SHAPE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
SEED = 0
# Loss tile: 1024 tokens (125 MiB of fp32 logits at this vocab) for ALST's shards and for our
# lm_head chunk_size (its default), so the two loss paths are compared like for like.
LOSS_TOKENS_PER_CHUNK = 1024
REPO_ROOT = Path(__file__).resolve().parent.parent
CSV_COLUMNS = ("method", "seq_len", "peak_mib_median", "peak_mib_min", "peak_mib_max",
               "step_s_median", "repeats", "loss", "error")


def _maxrss_mib():
    """Peak RSS of this process so far, in MiB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _alst_mlp_forward(self, x):
    """LlamaMLP.forward replacement that tiles the sequence with DeepSpeed's TiledMLP."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_compute(mlp, x_shard):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x_shard)) * mlp.up_proj(x_shard))

    # Shard count as DeepSpeed's TiledMLP docstring suggests: ceil(seqlen / hidden).
    num_shards = math.ceil(x.shape[-2] / x.shape[-1])
    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(mlp_compute, self, x, num_shards, params)


def _alst_loss(model, input_ids, labels):
    """Mean causal-LM loss via TiledFusedLogitsLoss, never materialising full logits."""
    import torch.nn.functional as F

    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    # Shift once, HF style: pad with -100 so targets keep the hidden states' length.
    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    n_valid = (shift_labels != -100).sum().clamp(min=1)
    return tiled_fused_loss(model, hidden, shift_labels, n_valid, LOSS_TOKENS_PER_CHUNK)


def tiled_fused_loss(model, hidden, shift_labels, n_valid, tokens_per_tile):
    """sum(cross entropy of ``model.lm_head(hidden)`` vs ``shift_labels``) / ``n_valid``, computed by
    DeepSpeed's TiledFusedLogitsLoss in tiles of ``tokens_per_tile`` tokens (no full logits)."""
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    def loss_fn(lm_head, x, y):
        # Divide inside the tile rather than after TiledFusedLogitsLoss: it runs the
        # lm_head backward during its forward with an incoming grad of 1, so scaling
        # the returned sum afterwards would leave lm_head.weight.grad n_valid times too big.
        logits = lm_head(x).float()
        return F.cross_entropy(logits, y, ignore_index=-100, reduction="sum") / n_valid

    shards = max(1, math.ceil(hidden.shape[1] / tokens_per_tile))
    return TiledFusedLogitsLoss.apply(loss_fn, model.lm_head, hidden, shift_labels, None,
                                      shards, [model.lm_head.weight], "sum")


def _prepare(method, seq_len):
    """Builds the model and inputs for ``method`` and returns a one-step closure."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if method == "alst":
        import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401  (import cost before baseline)
    torch.manual_seed(SEED)
    config = LlamaConfig(**MODEL_SHAPE, max_position_embeddings=seq_len, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.train()
    if method in ("hf_gc", "alst", "mst"):  # streambp replaces checkpointing, so not on it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if method == "alst":
        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(_alst_mlp_forward, layer.mlp)
    elif method in ("mst", "streambp"):
        import ds_longseq

        if method == "mst":
            cfg = {"mini_seq": {"enabled": True, "mlp_num_chunks": 8},
                   "lm_head": {"enabled": True, "chunk_size": LOSS_TOKENS_PER_CHUNK}}
        else:
            cfg = {"streambp": {"enabled": True, "chunk_size": 1024},
                   "lm_head": {"enabled": True, "chunk_size": LOSS_TOKENS_PER_CHUNK}}
        ds_longseq.enable(model, cfg)
    elif method not in ("stock", "hf_gc"):
        raise ValueError(f"unknown method {method!r}")

    input_ids = torch.randint(0, MODEL_SHAPE["vocab_size"], (1, seq_len),
                              generator=torch.Generator().manual_seed(SEED + 1))
    labels = input_ids.clone()

    def step():
        if method == "alst":
            loss = _alst_loss(model, input_ids, labels)
        else:
            loss = model(input_ids=input_ids, labels=labels, use_cache=False).loss
        loss.backward()
        return float(loss.detach())

    return step


def _set_budget(budget_mib):
    """Caps further address-space growth of this process at ``budget_mib`` MiB."""
    with open("/proc/self/status") as f:
        vm_kib = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = vm_kib * 1024 + int(budget_mib * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def run_child(method, seq_len, budget_mib=None):
    """Runs one measured step in this process and returns the result dict."""
    import torch

    torch.set_num_threads(2)
    step = _prepare(method, seq_len)
    baseline = _maxrss_mib()
    if budget_mib:
        _set_budget(budget_mib)
    start = time.perf_counter()
    loss = step()
    step_s = time.perf_counter() - start
    return {"ok": True, "method": method, "seq_len": seq_len, "baseline_mib": baseline,
            "peak_mib": _maxrss_mib() - baseline, "step_s": step_s, "loss": loss}


def _spawn(method, seq_len, budget_mib, timeout_s, mmap_threshold=None):
    """Runs ``run_child`` in a fresh interpreter; failures become ``ok: False`` records."""
    cmd = [sys.executable, "-m", "benchmarks.memory", "--_child", method, str(seq_len)]
    if budget_mib:
        cmd += ["--budget-mib", str(budget_mib)]
    env = dict(os.environ)
    if mmap_threshold:
        # A fixed threshold stops glibc from raising it (up to 32 MiB) after frees, which
        # otherwise serves mid-sized tensors from the heap where freed pages stay in RSS.
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    fail = {"ok": False, "method": method, "seq_len": seq_len}
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {**fail, "error": f"timeout after {timeout_s}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    if proc.returncode < 0:  # killed by a signal: SIGKILL here is almost always the OOM killer
        return {**fail, "error": f"killed by signal {-proc.returncode} (OOM?)"}
    tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return {**fail, "error": tail[-1] if tail else f"exit code {proc.returncode}"}


def summarize(method, seq_len, runs):
    """Reduces the repeat records of one (method, seq_len) point to one CSV row."""
    ok = [r for r in runs if r["ok"]]
    errors = [r["error"] for r in runs if not r["ok"]]
    peaks = [r["peak_mib"] for r in ok]
    row = dict.fromkeys(CSV_COLUMNS, "")
    row.update(method=method, seq_len=seq_len, repeats=len(ok), error=errors[0] if errors else "")
    if ok:
        row.update(peak_mib_median=round(statistics.median(peaks), 1),
                   peak_mib_min=round(min(peaks), 1), peak_mib_max=round(max(peaks), 1),
                   step_s_median=round(statistics.median(r["step_s"] for r in ok), 2),
                   loss=round(ok[0]["loss"], 5))
    return row


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def write_png(rows, methods, seq_lens, path):
    """Peak MiB vs sequence length, one line per method (failed points omitted)."""
    import matplotlib

    matplotlib.use("Agg")  # headless; set here so importing this module has no side effects
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in methods:
        pts = [(r["seq_len"], r["peak_mib_median"]) for r in rows
               if r["method"] == method and r["peak_mib_median"] != ""]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
    ax.set_yscale("log")  # stock and chunked methods differ by over 10x: linear hides the latter
    ax.set_xlabel("sequence length (tokens, batch 1)")
    ax.set_ylabel("peak RSS above post-build baseline (MiB, log scale)")
    ax.set_title(_shape_str() + ", fp32, one fwd+bwd step", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _shape_str():
    s = MODEL_SHAPE
    return (f"Llama h={s['hidden_size']} ffn={s['intermediate_size']} L={s['num_hidden_layers']} "
            f"heads={s['num_attention_heads']} vocab={s['vocab_size']}")


def _version(pkg):
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def write_md(rows, methods, seq_lens, path, argv, repeats_note):
    """Markdown report: peak MiB table, step-time table, command and environment."""
    by = {(r["method"], r["seq_len"]): r for r in rows}

    def table(key, fmt):
        lines = ["| seq_len | " + " | ".join(methods) + " |",
                 "|---:|" + "---:|" * len(methods)]
        for s in seq_lens:
            cells = []
            for m in methods:
                r = by.get((m, s))
                if r is None:
                    cells.append("")
                elif r[key] == "":
                    cells.append("failed" + (": " + r["error"].replace("|", "\\|")[:80]
                                             if key == "peak_mib_median" else ""))
                else:
                    cells.append(fmt(r))
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        return lines

    out = [f"# Peak memory of one training step ({_shape_str()}, fp32, batch 1)", "",
           "Peak RSS minus the post-build baseline, median over repeats, MiB "
           "(includes the ~173 MiB of parameter gradients every method allocates).", ""]
    out += table("peak_mib_median", lambda r: f"{r['peak_mib_median']:.0f}")
    out += ["", "Step wall time (s, median; noisy: shared 2-core machine):", ""]
    out += table("step_s_median", lambda r: f"{r['step_s_median']:.1f}")
    out += ["", repeats_note + " The CSV has min/max and the successful repeat count per point.",
            "", "Caveat: RSS also counts pages glibc keeps after frees, so a point can sit a few "
            "hundred MiB above the live-tensor peak and curves need not be monotonic "
            "(`--mmap-threshold 1048576` reduces this).",
            "", "Command: `python -m benchmarks.memory " + " ".join(argv) + "`", "",
            f"Versions: torch {_version('torch')}, transformers {_version('transformers')}, "
            f"deepspeed {_version('deepspeed')}; processor: "
            f"{platform.processor() or platform.machine()}, cpu_count {os.cpu_count()}, "
            f"children use torch.set_num_threads(2).", ""]
    Path(path).write_text("\n".join(out))


def _parse_overrides(items):
    """Parses ``SEQ:REPEATS`` pairs, e.g. ``16384:1``."""
    return {int(s): int(n) for s, n in (item.split(":") for item in items)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--repeats-at", nargs="+", default=[], metavar="SEQ:N",
                   help="per-length repeat overrides, e.g. 16384:1 to save time")
    p.add_argument("--out", default="benchmarks/results/memory_cpu",
                   help="output prefix; writes <out>.csv, <out>.png, <out>.md")
    p.add_argument("--quick", action="store_true", help="smoke test: seq lens 512 1024, 1 repeat")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="cap each child's address-space growth after the baseline (RLIMIT_AS)")
    p.add_argument("--mmap-threshold", type=int, default=None, metavar="BYTES",
                   help="set MALLOC_MMAP_THRESHOLD_ in children (less allocator retention in RSS)")
    p.add_argument("--child-timeout", type=float, default=3600.0, help="seconds per child")
    p.add_argument("--_child", nargs=2, metavar=("METHOD", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._child:
        method, seq_len = args._child[0], int(args._child[1])
        print(json.dumps(run_child(method, seq_len, args.budget_mib)), flush=True)
        return

    from tqdm import tqdm

    if args.quick:
        args.seq_lens, args.repeats = [512, 1024], 1
    overrides = _parse_overrides(args.repeats_at)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    points = [(s, m) for s in args.seq_lens for m in args.methods]
    rows = []
    bar = tqdm(points, desc="points", unit="pt")
    tqdm.write(f"{'method':>9} {'seq_len':>7} {'peak MiB (med/min/max)':>24} {'step s':>8}  error")
    for seq_len, method in bar:
        bar.set_postfix_str(f"{method}@{seq_len}")
        runs = [_spawn(method, seq_len, args.budget_mib, args.child_timeout, args.mmap_threshold)
                for _ in range(overrides.get(seq_len, args.repeats))]
        row = summarize(method, seq_len, runs)
        rows.append(row)
        peaks = (f"{row['peak_mib_median']}/{row['peak_mib_min']}/{row['peak_mib_max']}"
                 if row["repeats"] else "-")
        tqdm.write(f"{method:>9} {seq_len:>7} {peaks:>24} {str(row['step_s_median']):>8}  {row['error']}")
        write_csv(rows, args.out + ".csv")  # rewrite after each point so partial runs survive
    write_png(rows, args.methods, args.seq_lens, args.out + ".png")
    note = f"Repeats per point: {args.repeats}" + "".join(
        f"; {n} at seq_len {s} (to bound run time)" for s, n in sorted(overrides.items())) + "."
    write_md(rows, args.methods, args.seq_lens, args.out + ".md", argv, note)
    print(f"wrote {args.out}.csv, {args.out}.png, {args.out}.md")


if __name__ == "__main__":
    main()
