"""Host memory of offloaded layer inputs with ``long_seq.offload.keep_every``: what the pinned pool holds.

    python -m benchmarks.sparse_host --seq-len 8192 --out benchmarks/results/sparse_host_cpu

For k in 1, 2, 4 (StreamBP + ``layer_inputs: "cpu"`` on the cpu suites' Llama h512 / 4 layers, float32, one
training step), the bytes the offload pool allocated for the kept inputs (exact: its slabs), against
L x T x d x 4 bytes, and the step time. On a CPU model the rebuilt block lives in the same memory, so this counts
the host side only (what a GPU run keeps in host memory); the whole-process peak is benchmarks.memory's.
"""

from __future__ import annotations

import argparse
import time

import torch

import ds_longseq
from benchmarks import harness
from benchmarks.recipes import LLAMA_SMALL, build_model, random_tokens

MIB = 1024**2


def measure(seq_len: int, keep_every: int) -> dict:
    model = build_model(LLAMA_SMALL, dtype="float32", device="cpu", seq_len=seq_len)
    # the layer inputs alone (the attention outputs StreamBP can keep beside them would add their own slabs)
    cfg = {"streambp": {"enabled": True, "chunk_size": 1024, "keep_attention_output": False},
           "lm_head": {"enabled": True, "chunk_size": 1024},
           "offload": {"layer_inputs": "cpu", "keep_every": keep_every}}
    ds_longseq.enable(model, cfg)
    from ds_longseq.forwards.layer_input_offload import LayerInputOffload

    (pool,) = [h.__self__.pool for h in model.model._forward_pre_hooks.values()
               if isinstance(getattr(h, "__self__", None), LayerInputOffload)]
    ids = random_tokens(LLAMA_SMALL, seq_len)
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return {"k": keep_every, "pool_mib": pool.num_bytes / MIB, "step_s": time.perf_counter() - start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    every = LLAMA_SMALL.num_hidden_layers * args.seq_len * LLAMA_SMALL.hidden_size * 4 / MIB
    rows = [measure(args.seq_len, k) for k in (1, 2, 4)]
    lines = [f"# Offloaded layer inputs with keep_every: host pool, {LLAMA_SMALL.describe()}, T={args.seq_len}, fp32",
             "", f"L x T x d x 4 B = {every:.0f} MiB", "", "| keep_every | host pool MiB | ratio to k=1 | step s |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['k']} | {r['pool_mib']:.0f} | {rows[0]['pool_mib'] / r['pool_mib']:.2f} | {r['step_s']:.2f} |"
              for r in rows]
    lines += ["", *harness.environment([f"python -m benchmarks.sparse_host --seq-len {args.seq_len}"]), ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(f"{args.out}.md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
