"""Attention cost of StreamBP's chunked pattern on CUDA, against torch's SDPA on the whole sequence.

Holds: ``main`` (CLI), ``measure`` (one point). Single process, attention only (no projections):
what the kernels cost per training step of one layer, at the Llama-3-8B attention shape by default
(32 query heads, 8 kv heads, head dim 128, bf16, batch 1).

Methods, each one layer's attention work in a training step with recomputation (the same FLOPs):
    sdpa_gc:  ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` forward under
              no_grad, then forward + backward with grad: what HF gradient checkpointing / ALST do
              per layer (torch's flash kernel).
    streambp: ``chunk_causal_attention`` over chunks of ``--chunk`` queries: forward in order under
              no_grad, then last chunk first, forward + backward with the prefix gradients added
              into float32 sinks: what a StreamBP layer does (kernel "auto": cuda_flash here).
    streambp_math: the same with the pure-PyTorch math tile (what CUDA ran before the fused
              kernels), at lengths up to ``--math-max-len``.
    sdpa_gc_flash / sdpa_gc_cudnn / streambp_flash: the same with one backend forced
              (FlashAttention-2 or cuDNN), to show which kernel the speed comes from.
Reported: median milliseconds of ``--repeats`` runs after a warm-up, attention TFLOP/s (the causal
FLOPs of two forwards and one backward, ``_flops``; the same count for every method) and peak
memory above the inputs.

Example:
    python -m benchmarks.attention_gpu --seq-lens 16384 32768 65536 --out benchmarks/results/attention_h100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ds_longseq.ops.chunk_attention import chunk_causal_attention


def _flops(T: int, H: int, D: int) -> float:
    # causal: half of the T x T scores; QK^T and PV are 2 GEMMs of 2*T*T*D/2 FLOPs each per head
    fwd = 2 * 2 * T * T * D * H / 2
    return 2 * fwd + 2.5 * fwd  # two forwards (no-grad + recompute) and one backward (2.5x forward)


def _inputs(T, H, Hkv, D, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, H, T, D, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, Hkv, T, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, Hkv, T, D, device=device, dtype=dtype, generator=g)
    go = torch.randn(1, H, T, D, device=device, dtype=dtype, generator=g)
    return q, k, v, go


def _sdpa_gc(q, k, v, go, chunk):
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
    return torch.autograd.grad(out, (qg, kg, vg), go)


def _streambp(q, k, v, go, chunk, kernel="auto"):
    T = q.shape[2]
    bounds = [(s, min(s + chunk, T)) for s in range(0, T, chunk)]
    scale = q.shape[-1] ** -0.5
    with torch.no_grad():
        for s, e in bounds:
            chunk_causal_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], scale=scale, k_prefix=k[:, :, :s],
                                   v_prefix=v[:, :, :s], kernel=kernel)
    dk = torch.zeros(k.shape, device=k.device)
    dv = torch.zeros(v.shape, device=v.device)
    dq = torch.empty_like(q)
    for s, e in reversed(bounds):
        qc = q[:, :, s:e].detach().requires_grad_()
        kc, vc = k[:, :, s:e].detach().requires_grad_(), v[:, :, s:e].detach().requires_grad_()
        out = chunk_causal_attention(qc, kc, vc, scale=scale, k_prefix=k[:, :, :s], v_prefix=v[:, :, :s],
                                     prefix_grad_sink=(dk, dv), kernel=kernel)
        gq, gk, gv = torch.autograd.grad(out, (qc, kc, vc), go[:, :, s:e])
        dq[:, :, s:e] = gq
        dk[:, :, s:e] += gk
        dv[:, :, s:e] += gv
    return dq, dk, dv


def _sdpa_backend(backend):
    def run(*args):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend)):
            return _sdpa_gc(*args)

    return run


METHODS = {
    "sdpa_gc": _sdpa_gc,  # torch's own choice of backend
    "sdpa_gc_flash": _sdpa_backend("FLASH_ATTENTION"),
    "sdpa_gc_cudnn": _sdpa_backend("CUDNN_ATTENTION"),
    "streambp": _streambp,  # kernel "auto"
    "streambp_flash": lambda *a: _streambp(*a, kernel="cuda_flash"),
    "streambp_math": lambda *a: _streambp(*a, kernel="math"),
}


def measure(method, T, H, Hkv, D, chunk, repeats, dtype=torch.bfloat16) -> dict:
    """One point: median ms, TFLOP/s and peak MiB above the inputs, or the error."""
    device = torch.device("cuda")
    q, k, v, go = _inputs(T, H, Hkv, D, dtype, device)
    fn = METHODS[method]
    record = {"method": method, "seq_len": T, "chunk": chunk, "heads": H, "kv_heads": Hkv, "head_dim": D}
    try:
        fn(q, k, v, go, chunk)  # warm-up (kernel selection, allocator)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(q, k, v, go, chunk)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    except torch.OutOfMemoryError as err:
        return {**record, "error": "oom: " + str(err).splitlines()[0][:100]}
    except RuntimeError as err:  # a backend that cannot take this shape on this GPU
        return {**record, "error": str(err).splitlines()[0][:100]}
    ms = statistics.median(times)
    return {**record, "ms": ms, "tflops": _flops(T, H, D) / (ms / 1e3) / 1e12,
            "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--math-max-len", type=int, default=16384)
    p.add_argument("--out", default=None, help="write <out>.jsonl and <out>.md")
    args = p.parse_args(argv)
    rows = []
    for T in args.seq_lens:
        for method in METHODS:
            if method == "streambp_math" and T > args.math_max_len:
                continue
            r = measure(method, T, args.heads, args.kv_heads, args.head_dim, args.chunk, args.repeats)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        lines = [f"# Attention cost per layer step on {torch.cuda.get_device_name(0)} (torch {torch.__version__})", "",
                 f"Shape: {args.heads} heads / {args.kv_heads} kv heads, head dim {args.head_dim}, bf16, batch 1, "
                 f"StreamBP chunk {args.chunk}. Median of {args.repeats} after one warm-up.", "",
                 "| seq_len | method | ms | attention TFLOP/s | peak MiB above inputs |", "|---:|---|---:|---:|---:|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['seq_len']} | {r['method']} | {r['error']} | | |")
            else:
                lines.append(f"| {r['seq_len']} | {r['method']} | {r['ms']:.1f} | {r['tflops']:.0f} | "
                             f"{r['peak_mib']:.0f} |")
        cmd = " ".join(sys.argv[1:] if argv is None else argv)
        lines += ["", f"Command: `python -m benchmarks.attention_gpu {cmd}`", ""]
        Path(args.out + ".md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
