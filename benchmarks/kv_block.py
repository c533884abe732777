"""How the chunk attention's key-tile size (``long_seq.attention.kv_block_size``) trades time for transient memory.

    python -m benchmarks.kv_block --seq-len 16384 --chunk-size 1024 --blocks 1024 4096 16384 --repeats 5 \
        --out benchmarks/results/kv_block_cpu

One layer's attention as StreamBP runs it: for every chunk (last first, as the backward replays them) the
chunk's queries against the prefix and its own keys, forward and backward, the prefix's key/value gradients added
into whole-sequence buffers (``prefix_grad_sink``). Each tile is one fused kernel call, and every tile after the
first costs a log-sum-exp merge over the chunk's (H, C, D) output: fewer, larger tiles mean fewer calls and merges,
but the backward of a tile returns its keys' gradients as one (B, Hkv, n, D) tensor before they are added to the
buffers, so a tile of n keys holds that much more memory for a moment. The block sizes are timed interleaved
(round-robin, ``--repeats`` rounds), and each reports its median and its worst round.

Shapes default to the cpu suite's model (8 heads of 64, 8 key/value heads), float32, on this machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def layer_attention(q, k, v, chunk_size: int, block: int) -> float:
    """Seconds for one layer's chunk attention, forward and backward, every chunk."""
    import torch

    from ds_longseq.ops.chunk_attention import chunk_causal_attention

    T = q.shape[2]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    start = time.perf_counter()
    for s in reversed(range(0, T, chunk_size)):
        e = min(s + chunk_size, T)
        q_c = q[:, :, s:e].detach().requires_grad_()
        k_c, v_c = (t[:, :, s:e].detach().requires_grad_() for t in (k, v))
        out = chunk_causal_attention(q_c, k_c, v_c, scale=q.shape[-1] ** -0.5, k_prefix=k[:, :, :s] if s else None,
                                     v_prefix=v[:, :, :s] if s else None, kv_block_size=block,
                                     prefix_grad_sink=(dk, dv))
        out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--blocks", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="output prefix (.md, .jsonl)")
    args = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    T, H, Hkv, D = args.seq_len, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, H, T, D)
    k, v = torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    times = {b: [] for b in args.blocks}
    layer_attention(q, k, v, args.chunk_size, args.blocks[0])  # warm-up
    for _ in range(args.repeats):
        for b in args.blocks:
            times[b].append(layer_attention(q, k, v, args.chunk_size, b))
    base = args.blocks[0]
    rows = []
    for b in args.blocks:
        ratios = [t / t0 for t, t0 in zip(times[b], times[base], strict=True)]
        rows.append({"seq_len": T, "chunk_size": args.chunk_size, "kv_block_size": b, "median_s": statistics.median(
            times[b]), "times_s": times[b], "median_ratio": statistics.median(ratios), "worst_ratio": max(ratios),
            "transient_grad_mib": 2 * Hkv * min(b, T) * D * 4 / 2**20})
    command = "python -m benchmarks.kv_block " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"# Chunk attention time by key-tile size ({T} tokens, chunks of {args.chunk_size}, H={H}, Hkv={Hkv}, "
             f"D={D}, float32, CPU)", "", f"Command: `{command}`", "",
             f"| kv_block_size | median (s) | vs {base} (median of paired rounds) | worst round | transient dK/dV "
             "per tile (MiB) |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['kv_block_size']} | {r['median_s']:.3f} | {r['median_ratio']:.3f}x | "
                     f"{r['worst_ratio']:.3f}x | {r['transient_grad_mib']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return rows


if __name__ == "__main__":
    main()
