"""Where one training step's time and FLOPs go, per method, by phase and by component.

    python -m benchmarks.profile --suite cpu --seq-lens 4096 16384 --out benchmarks/results/profile_cpu

For each method and length, in a fresh child process (``benchmarks.harness.spawn``): the suite's model and
recipe (``benchmarks.run.SUITES``, ``benchmarks.recipes``), ``--warmup`` untimed steps, one step under
``torch.profiler`` (CPU, and CUDA when the model is there), and one more under ``torch.utils.flop_counter``.

Time. Every operator's self time (CPU: on the host thread that ran it; CUDA: its kernels' device time) is put
in one cell of (stage, component):
    stage      forward; "K/V capture", "chunk re-forward", "chunk backward" (StreamBP's backward passes, from
               ds_longseq's own ranges, ``ds_longseq.ops.phases``); "recompute" (a module's forward run inside
               the backward: activation checkpointing's); backward; optimizer; "offload wait"; "collectives".
    component  "attention kernel" (the fused attention ops, ds_longseq's tiles), "attention merge" (the
               log-sum-exp merge of a chunk's tiles: what one kernel call per chunk would save), "attention"
               (the attention module's other work: projections, norms of q/k, RoPE), "MLP", "norms",
               "LM head + loss", "embedding", "other" (glue outside any module: the loss, optimizer, copies).
The component of a backward operator is its forward operator's (matched by autograd's sequence number), and
a forward operator's is the innermost module of the model it ran in (forward hooks open a profiler range per
module). The profiled step is slower than an unprofiled one (the profiler's overhead per operator): the
table reports both and the shares are of the profiled total.

FLOPs. ``torch.utils.flop_counter.FlopCounterMode`` over one step counts every matmul by torch's own formulas
(in-place and batched ones included). Attention kernels are counted analytically as the score and value
products they must compute: a causal square block of L queries counts L (L + 1) / 2 query-key pairs (the
fused kernels skip the masked half), a bottom-right causal block of L queries against K keys
K L - L (L - 1) / 2, backward 2.5x forward (FlashAttention-2's five products against two). Each method's
total is set against ``--baseline`` (HF gradient checkpointing by default) at the same length.

Outputs: ``<out>.md`` (a table per point and the FLOP comparison), ``<out>.json`` (every cell), ``<out>.png``
(stacked bars of time by stage per method and length), rewritten after every point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

from benchmarks import harness

MODULE = "benchmarks.profile"
STAGES = ("forward", "K/V capture", "chunk re-forward", "chunk backward", "recompute", "backward", "optimizer",
          "offload wait", "collectives")
COMPONENTS = ("attention kernel", "attention merge", "attention", "MLP", "norms", "LM head + loss", "embedding",
              "other")
_PHASE_STAGE = {"streambp.capture": "K/V capture", "streambp.replay": "chunk re-forward",
                "streambp.grad": "chunk backward", "offload.wait": "offload wait", "sp.exchange": "collectives"}
_PHASE_COMPONENT = {"attention.forward": "attention kernel", "attention.backward": "attention kernel",
                    "attention.merge": "attention merge",
                    "lm_head.forward": "LM head + loss", "lm_head.backward": "LM head + loss"}
_ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_MODULE_PREFIX = "module:"
_STEP_PREFIX = "step."
_BACKWARD_NODE = "autograd::engine::evaluate_function:"


def module_component(name: str) -> str | None:
    """The component a model submodule's qualified name belongs to, or None for containers (the layer)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("self_attn", "attn", "attention", "self_attention"):
        return "attention"
    if leaf in ("mlp", "feed_forward", "block_sparse_moe"):
        return "MLP"
    if "norm" in leaf:
        return "norms"
    if leaf in ("embed_tokens", "wte", "embed_in"):
        return "embedding"
    if leaf in ("lm_head", "embed_out"):
        return "LM head + loss"
    return None


def module_ranges(model) -> list:
    """Forward hooks that open a profiler range ``module:<component>`` around each classified submodule (closed
    even when its forward raises: StreamBP's capture stops a layer at its cache update). Returns the handles."""
    import torch

    handles = []
    for name, module in model.named_modules():
        component = module_component(name)
        if component is None or not name:
            continue
        stack = []

        def pre(mod, args, _stack=stack, _label=_MODULE_PREFIX + component):
            rf = torch.profiler.record_function(_label)
            rf.__enter__()
            _stack.append(rf)

        def post(mod, args, output, _stack=stack):
            if _stack:
                _stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    return handles


def _chain(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def classify(events, device_time: bool) -> dict[tuple[str, str], float]:
    """{(stage, component): milliseconds} over the profiled operators (see the module docstring)."""
    from ds_longseq.ops.phases import PREFIX

    forward_component: dict[tuple[int, int], str] = {}
    cells: dict[tuple[str, str], float] = defaultdict(float)
    for e in sorted(events, key=lambda e: e.time_range.start):
        stage = component = None
        in_backward = in_module_forward = False
        backward_node = None
        for a in _chain(e):
            name = a.name
            if name.startswith(PREFIX):
                key = name[len(PREFIX):]
                stage = stage or _PHASE_STAGE.get(key)
                component = component or _PHASE_COMPONENT.get(key)
            elif name.startswith(_MODULE_PREFIX):
                component = component or name[len(_MODULE_PREFIX):]
                in_module_forward = in_module_forward or not in_backward
            elif name.startswith(_BACKWARD_NODE):
                in_backward = True
                backward_node = backward_node or a
            elif name == _STEP_PREFIX + "optimizer":
                stage = stage or "optimizer"
            elif component is None and any(op in name for op in _ATTENTION_OPS):
                component = "attention kernel"
        if e.sequence_nr >= 0 and not e.name.startswith(_BACKWARD_NODE) and component is not None:
            forward_component.setdefault((e.thread, e.sequence_nr), component)
        if component is None and backward_node is not None:
            component = forward_component.get((backward_node.fwd_thread, backward_node.sequence_nr))
        if stage is None:
            if in_module_forward and in_backward:
                stage = "recompute"
            elif in_backward:
                stage = "backward"
            else:
                stage = "forward"
        ms = (e.self_device_time_total if device_time else e.self_cpu_time_total) / 1e3
        if ms > 0:
            cells[(stage, component or "other")] += ms
    return dict(cells)


def _attention_pairs(q_len: int, k_len: int, causal: bool) -> int:
    if not causal:
        return q_len * k_len
    if q_len == k_len:
        return q_len * (q_len + 1) // 2
    return k_len * q_len - q_len * (q_len - 1) // 2  # bottom-right: the last q_len of k_len positions


def _attention_formulas():
    """flop_counter formulas for the fused attention ops, causal-aware (see the module docstring)."""
    import torch

    aten = torch.ops.aten

    def fwd(q, k, v, *args, out_shape=None, **kwargs):
        causal = bool(args[1]) if len(args) > 1 else bool(kwargs.get("is_causal", False))
        B, H, L, D = q
        return 4 * B * H * D * _attention_pairs(L, k[2], causal)

    def bwd(grad_out, q, k, v, out, lse, *args, out_shape=None, **kwargs):
        causal = bool(args[1]) if len(args) > 1 else bool(kwargs.get("is_causal", False))
        B, H, L, D = q
        return 10 * B * H * D * _attention_pairs(L, k[2], causal)

    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: fwd,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd}
    return mapping


def count_flops(step) -> dict[str, float]:
    """{op name: GFLOP} of one call of ``step`` (matmuls by torch's formulas, attention by ours).

    A dispatch mode over torch's ``flop_registry`` rather than ``FlopCounterMode`` itself, whose module tracking
    asserts on the no-grad chunk loops inside StreamBP's autograd Functions."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    aten = torch.ops.aten
    registry = {**flop_registry, **{op: shape_wrapper(f) for op, f in _attention_formulas().items()}}
    counts: dict[str, float] = defaultdict(float)

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = str(func._overloadpacket).removeprefix("aten.")
            # in-place forms (addmm_, baddbmm_) count as their out-of-place op does
            formula = registry.get(func._overloadpacket) or registry.get(getattr(aten, name.rstrip("_"), None))
            if formula is not None:
                counts[name.rstrip("_")] += formula(*args, **kwargs, out_val=out) / 1e9
            return out

    with Count():
        step()
    return dict(counts)


def measure(spec: dict) -> dict:
    """One point in this fresh process: ``spec`` = suite, method, seq_len, warmup."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.run import SUITES, build_step, resolve_device

    suite = SUITES[spec["suite"]]
    device = resolve_device(suite)
    step = build_step(suite, spec["method"], spec["seq_len"], device)
    model = step.model
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(spec["warmup"]):
        step()
    sync()
    plain_s = None
    if spec.get("plain", True):
        start = time.perf_counter()
        step()
        sync()
        plain_s = time.perf_counter() - start
    handles = module_ranges(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step(lambda name: record_function(_STEP_PREFIX + name))
        sync()
    for h in handles:
        h.remove()
    cells = classify(prof.events(), device_time=device == "cuda")
    flops = count_flops(step) if spec.get("flops", True) else {}
    if plain_s is None:  # the profiled step's own wall time (the profiler's overhead included)
        plain_s = sum(cells.values()) / 1e3
    return {"device": device, "plain_step_s": plain_s, "cells_ms": {f"{s}|{c}": v for (s, c), v in cells.items()},
            "gflop": flops}


def _table(point: dict) -> list[str]:
    cells = {tuple(k.split("|")): v for k, v in point["cells_ms"].items()}
    total = sum(cells.values()) or 1.0
    stages = [s for s in STAGES if any(k[0] == s for k in cells)]
    components = [c for c in COMPONENTS if any(k[1] == c for k in cells)]
    lines = ["| stage | " + " | ".join(components) + " | total | share |",
             "|---|" + "---:|" * (len(components) + 2)]
    for s in stages:
        row = [cells.get((s, c), 0.0) for c in components]
        values = " | ".join(f"{v:.0f}" for v in row)
        lines.append(f"| {s} | {values} | {sum(row):.0f} | {sum(row) / total:.1%} |")
    col = [sum(cells.get((s, c), 0.0) for s in stages) for c in components]
    lines.append("| **all** | " + " | ".join(f"{v:.0f}" for v in col) + f" | {total:.0f} | 100% |")
    lines.append("| share | " + " | ".join(f"{v / total:.1%}" for v in col) + " | | |")
    return lines


def _flop_groups(gflop: dict[str, float]) -> dict[str, float]:
    out = defaultdict(float)
    for op, n in gflop.items():
        attention = any(a in op for a in _ATTENTION_OPS)
        out["attention" if attention else "matmul"] += n
    return out


def report_markdown(points: list[dict], baseline: str, command: str) -> str:
    lines = ["# One training step, by phase and component (torch.profiler) and by FLOPs (flop_counter)", "",
             f"Command: `{command}`", "",
             "Milliseconds of operator self time in one profiled step (see `benchmarks/profile.py` for how each "
             "operator is attributed). `plain step` is the same step unprofiled.", ""]
    by_len = defaultdict(dict)
    for p in points:
        by_len[p["seq_len"]][p["method"]] = p
    for seq_len in sorted(by_len):
        lines += [f"## {seq_len} tokens", ""]
        base = by_len[seq_len].get(baseline)
        lines += ["| method | plain step (s) | vs " + baseline + " | matmul GFLOP | vs " + baseline
                  + " | attention GFLOP | vs " + baseline + " |", "|---|---:|---:|---:|---:|---:|---:|"]
        for method, p in by_len[seq_len].items():
            g = _flop_groups(p["gflop"])
            row = f"| {method} | {p['plain_step_s']:.2f} | "
            if base and g["matmul"] and _flop_groups(base["gflop"])["matmul"]:
                bg = _flop_groups(base["gflop"])
                row += f"{p['plain_step_s'] / base['plain_step_s']:.2f}x | {g['matmul']:.1f} | "
                row += f"{g['matmul'] / bg['matmul']:.3f}x | {g['attention']:.1f} | "
                row += f"{g['attention'] / bg['attention']:.2f}x |" if bg["attention"] else "- |"
            else:
                row += f"- | {g['matmul']:.1f} | - | {g['attention']:.1f} | - |"
            lines.append(row)
        lines.append("")
        for method, p in by_len[seq_len].items():
            lines += [f"### {method}, {seq_len} tokens ({p['device']}; plain step {p['plain_step_s']:.2f} s)", ""]
            lines += _table(p)
            ops = sorted(p["gflop"].items(), key=lambda kv: -kv[1])
            lines += ["", "GFLOP by op: " + ", ".join(f"{op} {n:.1f}" for op, n in ops), ""]
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = sorted({p["seq_len"] for p in points})
    fig, axes = plt.subplots(1, len(lens), figsize=(5.5 * len(lens), 4.5), squeeze=False)
    for ax, seq_len in zip(axes[0], lens, strict=True):
        pts = [p for p in points if p["seq_len"] == seq_len]
        bottoms = [0.0] * len(pts)
        for stage in STAGES:
            values = [sum(v for k, v in p["cells_ms"].items() if k.split("|")[0] == stage) / 1e3 for p in pts]
            if any(values):
                ax.bar([p["method"] for p in pts], values, bottom=bottoms, label=stage)
                bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        ax.set_title(f"{seq_len} tokens")
        ax.set_ylabel("profiled step time (s)")
        ax.tick_params(axis="x", rotation=30)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", default="cpu", help="a suite of benchmarks.run (model, dtype, chunk sizes)")
    p.add_argument("--methods", nargs="+", default=["hf_gc", "alst", "streambp", "streambp_auto"])
    p.add_argument("--seq-lens", nargs="+", type=int, default=[4096])
    p.add_argument("--baseline", default="hf_gc")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=3600.0)
    p.add_argument("--no-plain", action="store_true",
                   help="no unprofiled step (long GPU points: 'plain step' is then the profiled total)")
    p.add_argument("--no-flops", action="store_true", help="no FLOP-counting step")
    p.add_argument("--out", default=None, help="output prefix (.md, .json, .png); default: print only")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None, spawn=harness.spawn):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args._child:
        return harness.child_main(measure, args._child)
    command = "python -m benchmarks.profile " + " ".join(argv)
    points = []
    for seq_len in args.seq_lens:
        for method in args.methods:
            spec = {"suite": args.suite, "method": method, "seq_len": seq_len, "warmup": args.warmup,
                    "plain": not args.no_plain, "flops": not args.no_flops}
            result = spawn(MODULE, spec, timeout_s=args.timeout_s)[0]
            if result.get("status") != "ok" or "cells_ms" not in result:
                print(f"{method} @ {seq_len}: failed: {result.get('error', result)}", flush=True)
                continue
            points.append({"method": method, "seq_len": seq_len, **result})
            print(f"{method} @ {seq_len}: plain step {result['plain_step_s']:.2f} s", flush=True)
            if args.out:
                os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
                with open(args.out + ".json", "w") as f:
                    json.dump(points, f, indent=1)
                with open(args.out + ".md", "w") as f:
                    f.write(report_markdown(points, args.baseline, command))
                plot(points, args.out + ".png")
    if not args.out:
        print(report_markdown(points, args.baseline, command))
    return points


if __name__ == "__main__":
    main()
