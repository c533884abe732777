"""Gradient error of truncated adjoint sharding vs T-bar, on a partly trained SSM LM with a long-range task.

Paper 002 Sec. 4.3 proposes truncating the adjoint (each output reaches back through its last T-bar
state transitions only) and leaves its effect on the gradient to future work. This measures it.

1. Train (a fresh child): ``recall-h32-L2`` (``benchmarks.recipes.SSM_SHAPES``) with plain autograd and
   AdamW on ``recall_batch``, a task with long-range structure: each row is ``num_keys`` random key
   tokens, a filler that follows a local rule (the next filler token is the previous + 1 with
   probability 3/4), a separator, and the keys again. The final keys can only be predicted by
   remembering the first ones, ``seq_len - num_keys - 1`` tokens back; the filler by looking one back.
   The checkpoint goes to a temporary directory.
2. Evaluate (a fresh child each): on one held-out batch, the reference gradient by plain autograd,
   then exact adjoint sharding and truncated adjoint sharding for T-bar = 1, 2, 4, ..., T (the real
   training path, ``long_seq.adjoint.truncation``). Each child reports the step's peak RSS above its
   post-build RSS and time, and against the reference: the relative error ||g - g_ref|| / ||g_ref|| and
   cosine over all parameters, the relative error per parameter group, and the error of the loss
   gradient on the embedded input dL/dy_0 (B, T, P), overall and on the key positions the answer depends
   on. dL/dy_0 is read exactly by giving the model a per-position embedding table (row b*T + t holds
   the embedding of ids[b, t]; the table's gradient is then dL/dy_0); the vocabulary embedding's
   gradient is its index_add over the ids. The same comparisons are made (after the measured step,
   not measured) for the gradient of the ANSWER loss alone, the mean cross entropy of the final keys:
   the long-range learning signal, which the LM loss's local terms would otherwise hide.

Holds: ``recall_batch``, ``PARAM_GROUPS`` / ``group_of``, ``train`` and ``evaluate`` (the children's
measure functions), ``gradient_errors``, ``report_markdown``, ``plot`` and the CLI.

    python -m benchmarks.adjoint_truncation --out benchmarks/results/adjoint_truncation_cpu
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.adjoint_flops import chunked_adjoint_flops, truncated_flops
from benchmarks.recipes import SSM_SHAPES, build_ssm, enable_ssm_method

MODULE = "benchmarks.adjoint_truncation"
SUITE = "adjoint_truncation"
SEP, FIRST_KEY, NUM_KEY_SYMBOLS, NUM_FILLER_SYMBOLS = 0, 1, 16, 16
FIRST_FILLER = FIRST_KEY + NUM_KEY_SYMBOLS
VOCAB = FIRST_FILLER + NUM_FILLER_SYMBOLS  # 33: recall-h32-L2's vocab
FILLER_STAY_ON_RULE = 0.75
EVAL_SEED = 10**6  # the held-out batch; training batches use seeds 0, 1, 2, ...
CHUNK_SIZE = 256
# (group, parameter-name test): the first match wins; every parameter falls in one group.
PARAM_GROUPS = (
    ("embeddings", lambda n: n.startswith("embed.")),
    ("A_log/dt", lambda n: n.endswith(".A_log") or ".dt_proj." in n),
    ("B/C proj", lambda n: ".bc_proj." in n),
    ("in/out proj, D_skip", lambda n: any(k in n for k in (".in_proj.", ".out_proj.", ".conv.", ".D_skip"))),
    ("norms", lambda n: n.startswith("layers.") and ".norm." in n),
    ("head", lambda n: n.startswith(("lm_head.", "norm_f."))),
)


def group_of(name: str) -> str:
    for group, test in PARAM_GROUPS:
        if test(name):
            return group
    raise KeyError(f"parameter {name!r} is in no group of PARAM_GROUPS: add it")


def recall_batch(batch: int, seq_len: int, num_keys: int, seed: int):
    """(ids, labels) of the recall task, (batch, seq_len) each; labels of the first keys are -100 (random).

    Layout per row: keys k_1..k_m (ids 1..16), filler (ids 17..32), SEP (0), k_1..k_m again.
    """
    import torch

    filler_len = seq_len - 2 * num_keys - 1
    if filler_len < 1:
        raise ValueError(f"seq_len {seq_len} is too short for {num_keys} keys: need > {2 * num_keys + 1}")
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(FIRST_KEY, FIRST_KEY + NUM_KEY_SYMBOLS, (batch, num_keys), generator=g)
    filler = torch.empty(batch, filler_len, dtype=torch.long)
    filler[:, 0] = torch.randint(0, NUM_FILLER_SYMBOLS, (batch,), generator=g)
    on_rule = torch.rand(batch, filler_len, generator=g) < FILLER_STAY_ON_RULE
    jumps = torch.randint(0, NUM_FILLER_SYMBOLS, (batch, filler_len), generator=g)
    for j in range(1, filler_len):
        filler[:, j] = torch.where(on_rule[:, j], (filler[:, j - 1] + 1) % NUM_FILLER_SYMBOLS, jumps[:, j])
    ids = torch.cat([keys, filler + FIRST_FILLER, torch.full((batch, 1), SEP), keys], dim=1)
    labels = ids.clone()
    labels[:, :num_keys] = -100
    return ids, labels


def segment_losses(logits, labels, num_keys: int) -> dict:
    """Mean cross entropy on the answer (the final keys) and on the filler, from (B, T, V) logits."""
    import torch.nn.functional as F

    targets = labels[:, 1:]
    ce = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="none",
                         ignore_index=-100).view_as(targets)
    answer = ce[:, -num_keys:].mean().item()
    filler = ce[:, num_keys:-num_keys - 1].mean().item()
    return {"answer_loss": answer, "filler_loss": filler}


def train(spec: dict) -> dict:
    """Child: train with plain autograd, save the checkpoint to ``spec['checkpoint']``."""
    import torch

    torch.set_num_threads(spec.get("threads", 2))
    shape = SSM_SHAPES[spec["shape"]]
    model = build_ssm(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    harness.reset_peak_rss()
    baseline = harness.maxrss_mib()
    log, start = [], time.perf_counter()
    for step in range(spec["train_steps"]):
        ids, labels = recall_batch(spec["batch"], spec["seq_len"], spec["num_keys"], seed=step)
        out = model(ids, labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % max(1, spec["train_steps"] // 10) == 0 or step == spec["train_steps"] - 1:
            with torch.no_grad():
                log.append({"step": step, "loss": out.loss.item(), **segment_losses(out.logits, labels,
                                                                                  spec["num_keys"])})
            print(json.dumps(log[-1]), file=sys.stderr, flush=True)
    train_s = time.perf_counter() - start
    peak = harness.maxrss_mib() - baseline
    model.eval()
    with torch.no_grad():
        ids, labels = recall_batch(spec["eval_batch"], spec["seq_len"], spec["num_keys"], seed=EVAL_SEED)
        out = model(ids, labels=labels)
        held_out = {"loss": out.loss.item(), **segment_losses(out.logits, labels, spec["num_keys"])}
    torch.save({"shape": spec["shape"], "state_dict": model.state_dict()}, spec["checkpoint"])
    return {"baseline_mib": baseline, "peak_mib": peak, "step_s": train_s / max(spec["train_steps"], 1),
            "tokens_per_s": spec["batch"] * spec["seq_len"] * spec["train_steps"] / train_s,
            "loss": held_out["loss"], "device": "cpu",
            "extra": {"log": log, "held_out": held_out, "chance_answer_loss": math.log(NUM_KEY_SYMBOLS)}}


def _per_position_embedding(model, ids):
    """Swap in an embedding table with one row per (b, t): its gradient is dL/dy_0. Returns the new ids."""
    import torch

    rows = model.embed.weight.detach()[ids.reshape(-1)].clone()
    model.embed = torch.nn.Embedding.from_pretrained(rows, freeze=False)
    return torch.arange(ids.numel()).view_as(ids)


def gradients(model, ids, vocab_size: int) -> dict:
    """Named gradients after one backward, with the vocabulary embedding's gradient and ``input`` = dL/dy_0
    (the model carries the per-position table of ``_per_position_embedding``)."""
    import torch

    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    per_position = grads.pop("embed.weight")
    vocab = torch.zeros(vocab_size, per_position.shape[1], dtype=per_position.dtype)
    grads["embed.weight"] = vocab.index_add_(0, ids.reshape(-1), per_position)
    grads["input"] = per_position.view(*ids.shape, -1)
    return grads


def gradient_errors(grads: dict, ref: dict, num_keys: int) -> dict:
    """Relative errors and cosine of ``grads`` against ``ref`` (float64 reductions)."""
    import torch

    def rel(a, b):
        d = b.double().norm()
        return ((a.double() - b.double()).norm() / d).item() if d > 0 else float("nan")

    names = [n for n in ref if n != "input"]
    flat = torch.cat([grads[n].double().flatten() for n in names])
    flat_ref = torch.cat([ref[n].double().flatten() for n in names])
    out = {"rel_err": rel(flat, flat_ref),
           "cosine": torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0).item(),
           "norm_ratio": (flat.norm() / flat_ref.norm()).item(), "groups": {}}
    for group, _ in PARAM_GROUPS:
        members = [n for n in names if group_of(n) == group]
        if members:
            out["groups"][group] = rel(torch.cat([grads[n].flatten() for n in members]),
                                       torch.cat([ref[n].flatten() for n in members]))
    g, r = grads["input"], ref["input"]
    out["input_rel_err"] = rel(g, r)
    out["input_keys_rel_err"] = rel(g[:, :num_keys], r[:, :num_keys])
    out["input_rest_rel_err"] = rel(g[:, num_keys:], r[:, num_keys:])
    return out


def evaluate(spec: dict) -> dict:
    """Child: one forward + backward of ``spec['method']`` on the held-out batch; errors against the reference."""
    import torch
    import torch.fx.experimental.symbolic_shapes  # noqa: F401  (sympy: imported by autograd.grad, before the baseline)

    torch.set_num_threads(spec.get("threads", 2))
    shape = SSM_SHAPES[spec["shape"]]
    checkpoint = torch.load(spec["checkpoint"], weights_only=True)
    model = build_ssm(shape)
    model.load_state_dict(checkpoint["state_dict"])
    ids, labels = recall_batch(spec["eval_batch"], spec["seq_len"], spec["num_keys"], seed=EVAL_SEED)
    position_ids = _per_position_embedding(model, ids)
    enable_ssm_method(model, spec["method"], spec.get("chunk_size", CHUNK_SIZE))
    ref = None if spec["method"] == "autograd" else torch.load(spec["reference"], weights_only=True)
    harness.reset_peak_rss()
    baseline = harness.maxrss_mib()
    start = time.perf_counter()
    loss = model(position_ids, labels=labels).loss
    loss.backward()
    step_s = time.perf_counter() - start
    peak = harness.maxrss_mib() - baseline
    grads = gradients(model, ids, shape.vocab_size)
    grad_norm = torch.cat([g.flatten() for n, g in grads.items() if n != "input"]).norm().item()
    # not measured: the answer loss alone (the final keys, predictable only from the first ones)
    model.zero_grad(set_to_none=True)
    answer_labels = labels.clone()
    answer_labels[:, : -spec["num_keys"]] = -100
    model(position_ids, labels=answer_labels).loss.backward()
    answer_grads = gradients(model, ids, shape.vocab_size)
    if ref is None:
        torch.save({"lm": grads, "answer": answer_grads}, spec["reference"])
        extra = {"reference": True}
    else:
        extra = {**gradient_errors(grads, ref["lm"], spec["num_keys"]),
                 "answer": gradient_errors(answer_grads, ref["answer"], spec["num_keys"])}
    return {"baseline_mib": baseline, "peak_mib": peak, "step_s": step_s,
            "tokens_per_s": ids.numel() / step_s, "loss": loss.item(), "grad_norm": grad_norm, "device": "cpu",
            "extra": extra}


def measure(spec: dict) -> dict:
    return train(spec) if spec["method"] == "train" else evaluate(spec)


# ---- report ------------------------------------------------------------------------------------


def _extra(row) -> dict:
    return json.loads(row["extra"]) if row.get("extra") else {}


def _truncation(method: str) -> int | None:
    return int(method[len("adjoint_t"):]) if method.startswith("adjoint_t") else None


def _error_table(evals, seq_len: int, part: str | None, measured: bool) -> list[str]:
    """Rows of gradient errors per method; ``part``: None for the LM loss, "answer" for the answer loss."""
    groups = [g for g, _ in PARAM_GROUPS]
    extra_cols = ["peak MiB", "step s", "adjoint count"] if measured else []
    lines = ["| method | T-bar | rel. error | cosine | norm ratio | " + " | ".join(groups)
             + " | dL/dy_0 | dL/dy_0 keys | " + "".join(c + " | " for c in extra_cols),
             "|---|---:|---:|---:|---:|" + "---:|" * (len(groups) + 2 + len(extra_cols))]
    for r in evals:
        t_bar = _truncation(r["method"])
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {t_bar or ''} | {harness.failure_cell(r)} |")
            continue
        ex = _extra(r)
        tail = ""
        if measured:
            exact = not t_bar or t_bar >= seq_len  # T-bar >= T runs the exact (streamed) path
            count = chunked_adjoint_flops(seq_len, CHUNK_SIZE) if exact else truncated_flops(seq_len, t_bar)
            tail = (f" {float(r['peak_mib']):.1f} | {float(r['step_s']):.2f} | "
                    f"{f'{count:,}' if r['method'] != 'autograd' else ''} |")
        head = f"| {r['method']} | {t_bar or ''} | "
        if ex.get("reference"):
            lines.append(head + "reference | 1 | 1 | " + " | ".join("" for _ in groups) + " | | |" + tail)
            continue
        ex = ex if part is None else ex[part]
        cells = [f"{ex['rel_err']:.3g}", f"{ex['cosine']:.6f}", f"{ex['norm_ratio']:.4f}"]
        cells += [f"{ex['groups'].get(g, float('nan')):.3g}" for g in groups]
        cells += [f"{ex['input_rel_err']:.3g}", f"{ex['input_keys_rel_err']:.3g}"]
        lines.append(head + " | ".join(cells) + " |" + tail)
    return lines


def report_markdown(rows: list[dict], args) -> str:
    shape = SSM_SHAPES[args.shape]
    out = ["# Truncated adjoint sharding: gradient error vs T-bar (`benchmarks.adjoint_truncation`)", "",
           f"Model {shape.describe()}, float32; recall task (`recall_batch`): {args.num_keys} key tokens, a filler "
           f"with a local rule, a separator, the keys again; T = {args.seq_len}, so the answer depends on tokens "
           f"{args.seq_len - args.num_keys - 1} positions back.", ""]
    setup = [r for r in rows if r["kind"] == "setup"]
    if setup:
        r = setup[-1]
        if r["status"] != "ok":
            out += [f"Training failed: {r['status']} {r['error']}", ""]
        else:
            ex = _extra(r)
            hp = ex.get("train", {"lr": args.lr, "batch": args.batch, "train_steps": args.train_steps})
            out += [f"**Training** (plain autograd, AdamW lr {hp['lr']:g}, batch {hp['batch']}, {hp['train_steps']} "
                    f"steps, {float(r['step_s']):.2f} s/step; chance answer loss ln {NUM_KEY_SYMBOLS} = "
                    f"{ex['chance_answer_loss']:.3f}):", "",
                    "| step | loss | answer loss | filler loss |", "|---:|---:|---:|---:|"]
            out += [f"| {e['step']} | {e['loss']:.3f} | {e['answer_loss']:.3f} | {e['filler_loss']:.3f} |"
                    for e in ex["log"]]
            h = ex["held_out"]
            out += ["", f"Held-out batch ({args.eval_batch} rows, the one the gradients below are taken on): loss "
                    f"{h['loss']:.3f}, answer loss {h['answer_loss']:.3f}, filler loss {h['filler_loss']:.3f}.", ""]
    evals = [r for r in rows if r["kind"] == "step"]
    reference = next((r for r in evals if r["method"] == "autograd" and r["status"] == "ok"), None)
    if setup and setup[-1]["status"] == "ok" and reference:
        trained, evaluated = _extra(setup[-1])["held_out"]["loss"], float(reference["loss"])
        same = abs(trained - evaluated) <= 1e-5 * abs(trained)
        out += [f"Checkpoint check: the held-out loss at the end of training ({trained:.6f}) "
                f"{'equals' if same else 'DIFFERS FROM'} the reference child's ({evaluated:.6f}).", ""]
    out += ["**Gradient of the LM loss (every token) against plain autograd's** (relative error = ||g - g_ref|| / "
            "||g_ref||; dL/dy_0: the gradient on the embedded input, all positions and the key positions alone; "
            "peak MiB and step s: this step, measured; adjoint count: FLOPs of the adjoint state per state element, "
            "`benchmarks.adjoint_flops`):", ""]
    out += _error_table(evals, args.seq_len, None, measured=True)
    out += ["", f"**Gradient of the answer loss alone** (the {args.num_keys} final keys: the long-range signal; "
            "computed after the measured step in the same child). With K layers a truncated gradient reaches at most "
            "K (T-bar - 1) tokens back, so it gives the key positions nothing below that reach:", ""]
    out += _error_table(evals, args.seq_len, "answer", measured=False)
    out += ["", "Reading: `head` (LM head and final norm) depends on the forward only and must match to float32 "
            "rounding at every T-bar; the exact `adjoint` row is the float32 floor of the comparison. Peak MiB: RSS "
            "above the post-build RSS of a fresh process (noise: a few MiB); step s: one sample on a shared 2-core "
            "machine.", ""]
    out += harness.environment([r["command"] for r in rows], device="cpu") + [""]
    return "\n".join(out)


def plot(rows: list[dict], path: str, seq_len: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(_truncation(r["method"]), _extra(r), r) for r in rows
           if r["kind"] == "step" and r["status"] == "ok" and _truncation(r["method"])]
    pts.sort(key=lambda p: p[0])
    exact = next((r for r in rows if r["kind"] == "step" and r["method"] == "adjoint" and r["status"] == "ok"), None)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    xs = [p[0] for p in pts]
    ax = axes[0]
    if pts:
        ax.plot(xs, [max(p[1]["rel_err"], 1e-12) for p in pts], marker="o", color="k", label="all parameters")
        ax.plot(xs, [max(p[1]["input_rel_err"], 1e-12) for p in pts], marker="s", ls="--", label="dL/dy_0")
        ax.plot(xs, [max(p[1]["input_keys_rel_err"], 1e-12) for p in pts], marker="s", ls=":", label="dL/dy_0 keys")
        if all("answer" in p[1] for p in pts):
            ax.plot(xs, [max(p[1]["answer"]["rel_err"], 1e-12) for p in pts], marker="^", color="r",
                    label="answer loss: all parameters")
            ax.plot(xs, [max(p[1]["answer"]["input_keys_rel_err"], 1e-12) for p in pts], marker="^", ls=":",
                    color="r", label="answer loss: dL/dy_0 keys")
        for g, _ in PARAM_GROUPS:
            if g != "head":
                ax.plot(xs, [max(p[1]["groups"].get(g, float("nan")), 1e-12) for p in pts], marker=".", lw=0.8,
                        label=g)
    if exact:
        ax.axhline(_extra(exact)["rel_err"], color="gray", lw=0.8, label="exact adjoint (float32 floor)")
    ax.set_yscale("log")
    ax.set_ylabel("relative error vs autograd")
    ax = axes[1]
    if pts:
        ax.plot(xs, [p[1]["cosine"] for p in pts], marker="o", color="k", label="LM loss")
        if all("answer" in p[1] for p in pts):
            ax.plot(xs, [p[1]["answer"]["cosine"] for p in pts], marker="^", color="r", label="answer loss")
    ax.set_ylabel("cosine similarity to the exact gradient")
    ax = axes[2]
    if pts:
        ax.plot(xs, [float(p[2]["peak_mib"]) for p in pts], marker="o", label="peak MiB")
        ax.plot(xs, [float(p[2]["step_s"]) for p in pts], marker="s", label="step s")
    if exact:
        ax.axhline(float(exact["peak_mib"]), color="C0", ls=":", lw=0.8, label="exact adjoint peak")
        ax.axhline(float(exact["step_s"]), color="C1", ls=":", lw=0.8, label="exact adjoint step")
    ax.set_yscale("log")
    ax.set_ylabel("peak RSS above post-build (MiB) / step time (s)")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"T-bar (T = {seq_len})")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("Truncated adjoint sharding on a partly trained SSM (recall task)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sha256(path) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main(argv=None, spawn=harness.spawn) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SSM_SHAPES), default="recall-h32-L2")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--num-keys", type=int, default=4)
    p.add_argument("--train-steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=4, help="training rows per step")
    p.add_argument("--eval-batch", type=int, default=8, help="rows of the held-out batch the gradients are taken on")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--truncations", type=int, nargs="+", default=None,
                   help="T-bar values; default 1, 2, 4, ..., T")
    p.add_argument("--checkpoint", default=None,
                   help="use this checkpoint instead of training one; the training row of an existing <out>.csv "
                        "is kept when it recorded this file's sha256 (or none: then the report checks its held-out "
                        "loss against the reference child's)")
    p.add_argument("--keep-checkpoint", default=None, help="copy the trained checkpoint here")
    p.add_argument("--out", default="benchmarks/results/adjoint_truncation_cpu",
                   help="output prefix; writes <out>.csv, <out>.png, <out>.md")
    p.add_argument("--threads", type=int, default=2, help="torch threads per child")
    p.add_argument("--child-timeout", type=float, default=1800.0, help="seconds per child")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        return harness.child_main(measure, args._child)
    truncations = args.truncations or [2**k for k in range(int(math.log2(args.seq_len)) + 1)]
    if args.seq_len not in truncations and args.truncations is None:
        truncations.append(args.seq_len)
    command = "python -m benchmarks.adjoint_truncation " + " ".join(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    env = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
    tmp = tempfile.mkdtemp(prefix="adjoint_truncation_")
    common = {"shape": args.shape, "seq_len": args.seq_len, "num_keys": args.num_keys, "eval_batch": args.eval_batch,
              "threads": args.threads,
              "checkpoint": args.checkpoint or os.path.join(tmp, "checkpoint.pt"),
              "reference": os.path.join(tmp, "reference_grads.pt")}
    rows: list[dict] = []
    if args.checkpoint:
        digest = _sha256(args.checkpoint)
        rows = [r for r in harness.read_csv(args.out + ".csv") if r["kind"] == "setup" and r["status"] == "ok"
                and _extra(r).get("checkpoint_sha256", digest) == digest][-1:]

    def record(kind, spec, records, **more):
        fields = harness.summarize_repeats(records)
        ok = [r for r in records if r.get("status") == "ok"]
        if ok:
            fields.update(loss=round(ok[0]["loss"], 6), extra=json.dumps({**ok[0]["extra"], **more}))
            if ok[0].get("grad_norm") is not None:
                fields["grad_norm"] = f"{ok[0]['grad_norm']:.8g}"
        row = harness.new_row(suite=SUITE, kind=kind, method=spec["method"], seq_len=args.seq_len,
                              load1=round(os.getloadavg()[0], 2), device="cpu", command=command, **fields)
        rows.append(row)
        print(f"{spec['method']:>14} {row['status']:>6} peak {row['peak_mib']!s:>7} MiB  step {row['step_s']!s:>7} s"
              f"  {row['error']}", flush=True)
        harness.write_outputs(rows, args.out, report_markdown(rows, args),
                              lambda path: plot(rows, path, args.seq_len))
        return row

    try:
        if args.checkpoint is None:
            hp = {"train_steps": args.train_steps, "batch": args.batch, "lr": args.lr}
            spec = {**common, "method": "train", **hp}
            records = spawn(MODULE, spec, timeout_s=args.child_timeout, env=env)
            ok = os.path.exists(common["checkpoint"]) and any(r.get("status") == "ok" for r in records)
            more = {"train": hp, "checkpoint_sha256": _sha256(common["checkpoint"])} if ok else {}
            row = record("setup", spec, records, **more)
            if row["status"] != "ok":
                return 1
            if args.keep_checkpoint:
                shutil.copy(common["checkpoint"], args.keep_checkpoint)
        for method in ["autograd", "adjoint", *(f"adjoint_t{t}" for t in truncations)]:
            spec = {**common, "method": method}
            row = record("step", spec, spawn(MODULE, spec, timeout_s=args.child_timeout, env=env))
            if method == "autograd" and row["status"] != "ok":
                return 1  # no reference gradient
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.out}.csv, {args.out}.png, {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
