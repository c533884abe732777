"""Peak CPU memory of one DPO pair and one GRPO group (forward + backward) versus row length.

For each objective, method and row length, a fresh child (``benchmarks.harness.spawn``) builds
the small Llama-shaped model (``benchmarks.recipes.LLAMA_SMALL``: h512, 4 layers, vocab 32000,
random weights, float32), records its peak RSS as the baseline, runs exactly one forward + backward
of the objective and reports the peak RSS above that baseline, in MiB (as ``benchmarks.memory``).

Objectives (rows share one prompt, the first quarter of the row; labels only on the completion):
    dpo:  one pair, chosen row then rejected row (batch 2), ``ds_longseq.ops.dpo_loss`` with
          precomputed reference log-probs (constants: the reference forward is not measured).
    grpo: one group of ``--group-size`` completions (batch G), ``ds_longseq.ops.grpo_loss``
          (loss_type "dapo", beta 0, old policy = the current one detached: TRL's defaults).

Methods:
    naive:                 stock model -> full (B, T, V) logits -> log_softmax -> gather -> objective.
    chunked_head:          ds_longseq with the chunked LM head only: ``return_token_logprobs=True``.
    chunked_head_streambp: the same plus StreamBP layers.
    liger:                 stock decoder -> Liger's LigerFusedLinearDPOLoss / LigerFusedLinearGRPOLoss
                           on the hidden states and ``lm_head.weight`` (no reference model). Liger
                           chunks over the BATCH (``chunk_size`` pairs / rows per chunk, default 1),
                           so one long pair still forms its full-length logits.

Holds: ``build_batch``, ``token_logprobs`` and ``objective_loss`` (the objectives per method),
``measure`` (the child), ``report_markdown`` and the CLI (``main``); the harness does the rest.

Example:
    python -m benchmarks.objectives --seq-lens 1024 2048 4096 8192 \
        --out benchmarks/results/objectives_cpu
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.recipes import LLAMA_SMALL, LOSS_TOKENS_PER_CHUNK, ModelShape, build_model

MODULE = "benchmarks.objectives"
OBJECTIVES = ("dpo", "grpo")
METHODS = ("naive", "chunked_head", "chunked_head_streambp", "liger")
DEFAULT_SEQ_LENS = (1024, 2048, 4096, 8192)
CHUNK_SIZE = 1024  # StreamBP chunk tokens, as benchmarks.memory
GROUP_SIZE = 4
SHAPES = {"llama_small": LLAMA_SMALL,
          # smoke runs: still a vocabulary much larger than the hidden size, so logits dominate
          "tiny": ModelShape("llama-tiny-v8k", "llama", 64, 160, 2, 4, 2, 8192)}


def long_seq_config(method: str) -> dict:
    """The ds_longseq section of a method ({} for the stock model)."""
    lm_head = {"enabled": True, "chunk_size": LOSS_TOKENS_PER_CHUNK}
    if method == "chunked_head":
        return {"lm_head": lm_head}
    if method == "chunked_head_streambp":
        return {"streambp": {"enabled": True, "chunk_size": CHUNK_SIZE}, "lm_head": lm_head}
    return {}


def build_batch(shape: ModelShape, seq_len: int, num_rows: int, seed: int = 1) -> dict:
    """(num_rows, seq_len) rows that share their first seq_len // 4 tokens (the prompt); labels on the rest."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt_len = seq_len // 4
    ids = torch.randint(0, shape.vocab_size, (num_rows, seq_len), generator=g)
    ids[:, :prompt_len] = ids[0, :prompt_len]
    labels = ids.clone()
    labels[:, :prompt_len] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _shifted_targets(labels):
    """Targets aligned with the hidden states: label t + 1 at position t, -100 at the end."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def token_logprobs(method: str, model, batch):
    """The policy's ``TokenLogprobs`` of the completion tokens."""
    import torch

    from ds_longseq.ops import TokenLogprobs

    if method == "naive":
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        targets = _shifted_targets(batch["labels"])
        mask = targets != -100
        logps = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        return TokenLogprobs(logps * mask, mask)
    return model(**batch, use_cache=False, return_token_logprobs=True)


def objective_loss(objective: str, method: str, model, batch):
    """The scalar loss of ``objective`` computed by ``method``, ready for ``backward``."""
    import torch

    from ds_longseq.ops import dpo_loss, group_advantages, grpo_loss

    num_rows = batch["input_ids"].shape[0]
    completion = (batch["labels"] != -100).sum(-1).double()
    vocab = model.config.vocab_size
    # Reference log-probs are precomputed inputs (TRL's precompute_ref_log_probs); any constants give
    # the same memory. A uniform model's log-prob keeps the loss in a plausible range.
    ref_seq = (-completion * math.log(vocab)).float()
    rewards = torch.arange(num_rows, dtype=torch.float32)
    if method == "liger":
        return _liger_loss(objective, model, batch, rewards)
    lp = token_logprobs(method, model, batch)
    if objective == "dpo":
        seq = lp.sequence_logprobs()
        half = num_rows // 2
        return dpo_loss(seq[:half], seq[half:], ref_seq[:half], ref_seq[half:], beta=0.1)[0]
    return grpo_loss(lp, group_advantages(rewards, num_rows), beta=0.0, loss_type="dapo")[0]


def _liger_loss(objective, model, batch, rewards):
    """Liger's fused linear + objective on the stock decoder's hidden states (its own chunking)."""
    from ds_longseq.ops import group_advantages

    try:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss, LigerFusedLinearGRPOLoss
    except ImportError as err:
        raise ImportError("the liger method needs liger-kernel: pip install liger-kernel") from err
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         use_cache=False).last_hidden_state
    targets = _shifted_targets(batch["labels"])
    weight = model.lm_head.weight
    if objective == "dpo":
        # use_ref_model=False: no reference forward inside the loss (ours gets precomputed constants)
        loss_fn = LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=False)
        return loss_fn(weight, hidden, targets)[0]
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo")
    mask = targets != -100
    advantages = group_advantages(rewards, rewards.shape[0])
    return loss_fn(hidden, weight, targets.clamp_min(0), mask.long(), advantages)[0]


def measure(spec: dict) -> dict:
    """One fwd + bwd of ``spec['objective']`` by ``spec['method']`` at ``spec['seq_len']`` tokens per row."""
    import torch

    import ds_longseq

    torch.set_num_threads(2)
    shape, seq_len = SHAPES[spec["shape"]], spec["seq_len"]
    objective, method = spec["objective"], spec["method"].split(":", 1)[1]
    model = build_model(shape, dtype="float32", device="cpu", seq_len=seq_len)
    if long_seq_config(method):
        ds_longseq.enable(model, long_seq_config(method))
    if method == "liger":
        import liger_kernel.chunked_loss  # noqa: F401  (import cost before the baseline)
    num_rows = 2 if objective == "dpo" else spec["group_size"]
    batch = build_batch(shape, seq_len, num_rows)
    baseline = harness.maxrss_mib()
    if spec.get("budget_mib"):
        harness.set_address_space_budget(spec["budget_mib"])
    start = time.perf_counter()
    loss = objective_loss(objective, method, model, batch)
    loss.backward()
    step_s = time.perf_counter() - start
    return {"baseline_mib": baseline, "peak_mib": harness.maxrss_mib() - baseline, "step_s": step_s,
            "tokens_per_s": num_rows * seq_len / step_s, "loss": float(loss.detach()), "device": "cpu"}


def report_markdown(rows, objectives, methods, seq_lens, shape: ModelShape, group_size, budget_mib) -> str:
    """Per objective: peak MiB and step-time tables; then notes, command and environment."""
    out = [f"# Peak memory of one DPO pair / GRPO group, forward + backward ({shape.describe()}, fp32)", "",
           "Peak RSS of a fresh process minus its post-build baseline, MiB (includes the parameter "
           "gradients every method allocates). Rows share a prompt (first quarter); seq_len is tokens "
           f"per row. DPO: 2 rows (chosen, rejected). GRPO: {group_size} rows (one group).", ""]
    for objective in objectives:
        names = [f"{objective}:{m}" for m in methods]
        out += [f"## {objective.upper()}: peak memory (MiB)", ""]
        out += harness.grid_table(rows, names, seq_lens, "peak_mib", lambda x: f"{x:.0f}")
        out += ["", f"## {objective.upper()}: step wall time (s; indicative only, shared 2-core machine)", ""]
        out += harness.grid_table(rows, names, seq_lens, "step_s", lambda x: f"{x:.1f}")
        out += [""]
    out += [f"Each child may grow its address space by at most {budget_mib:.0f} MiB after the baseline "
            "(RLIMIT_AS): `OOM` means an allocation failed under that cap, and a method's longer lengths "
            "are then not run (`not run: oom at N`).", ""] if budget_mib else []
    out += harness.environment([r["command"] for r in rows], device="cpu") + [
        f"liger-kernel {harness.version('liger-kernel')}.", ""]
    return "\n".join(out)


def main(argv=None, spawn=harness.spawn):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(DEFAULT_SEQ_LENS), help="tokens per row")
    p.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--group-size", type=int, default=GROUP_SIZE, help="GRPO completions per group")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama_small")
    p.add_argument("--repeats", type=int, default=1)
    # No cap by default: RLIMIT_AS counts reserved virtual address space (thread stacks, allocator
    # arenas, mmapped libraries), so a cap near the real peak reported points as OOM that fit.
    p.add_argument("--budget-mib", type=float, default=0.0,
                   help="cap each child's address-space growth after the baseline (RLIMIT_AS, virtual memory: "
                        "set it well above the expected peak RSS); 0: no cap")
    p.add_argument("--child-timeout", type=float, default=1800.0, help="seconds per child")
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="start no child after this many minutes; the rest are recorded as not run")
    p.add_argument("--out", default="benchmarks/results/objectives_cpu",
                   help="output prefix; writes <out>.csv, <out>.png, <out>.md")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        return harness.child_main(measure, args._child)

    from tqdm import tqdm

    shape = SHAPES[args.shape]
    command = "python -m benchmarks.objectives " + " ".join(argv)
    # as benchmarks.run: a fixed mmap threshold keeps freed big tensors from staying in RSS
    env = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
    budget = harness.TimeBudget(args.time_budget_min)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    rows, oom_at = [], {}
    points = [(o, s, m) for o in args.objectives for s in args.seq_lens for m in args.methods]
    bar = tqdm(points, desc="points", unit="pt")
    for objective, seq_len, method in bar:
        name = f"{objective}:{method}"
        bar.set_postfix_str(f"{name}@{seq_len}")
        spec = {"objective": objective, "method": name, "seq_len": seq_len, "shape": args.shape,
                "group_size": args.group_size, "budget_mib": args.budget_mib or None}
        records = []
        if name in oom_at:  # memory grows with length: a longer point would run out too
            fields = {"status": "not_run", "error": f"not run: oom at {oom_at[name]}"}
        else:
            for _ in range(args.repeats):
                if budget.spent():
                    break
                records += spawn(MODULE, spec, timeout_s=budget.timeout(args.child_timeout), env=env)
            fields = harness.summarize_repeats(records) if records else {"status": "not_run",
                                                                          "error": harness.NOT_RUN_BUDGET}
            if fields["status"] == "oom":
                oom_at[name] = seq_len
        row = harness.new_row(suite="objectives", kind="step", method=name, seq_len=seq_len,
                              budget_mib=args.budget_mib or None, device="cpu", command=command, **fields)
        rows.append(row)
        tqdm.write(f"{name:>28} {seq_len:>6} {row['status']:>7} peak {row['peak_mib']} MiB, "
                   f"{row['step_s']} s, loss {row['loss']} {row['error']}")
        harness.write_outputs(  # after each point, so a partial run survives
            rows, args.out,
            report_markdown(rows, args.objectives, args.methods, args.seq_lens, shape, args.group_size,
                            args.budget_mib),
            lambda path: harness.plot(rows, path, f"one DPO pair (2 rows) / GRPO group ({args.group_size} rows), "
                                      f"fwd+bwd, {shape.describe()}, fp32", peak_label="peak RSS above post-build",
                                      x_label="tokens per row"),
        )
    print(f"wrote {args.out}.csv, {args.out}.png, {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
