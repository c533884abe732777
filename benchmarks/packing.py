"""Packed documents: step time of one packed row against the same documents padded one per row.

One training step (forward + backward, no optimizer) of a small Llama with StreamBP and the
chunked LM head, on the same documents in three layouts:

- ``packed``: one row of all documents, restarting ``position_ids`` (what TRL's padding_free and
  ``DataCollatorWithFlattening`` send); ds_longseq keeps every document separate.
- ``padded``: one document per row, right-padded to the longest, with an attention mask.
- ``one_document``: the packed tokens as ONE document (``arange`` positions): the cost of full causal
  attention over the row, which is what attending across documents would cost (a wrong model).

Per layout: step time (median of ``--repeats`` after a warm-up), tokens per second counting real
tokens only, and the attention work: query-key pairs of the tiles the op visits (from its tile plan)
against the dense causal triangle. Results go to ``<out>.jsonl`` and ``<out>.md``.

    python -m benchmarks.packing --seq-len 16384 --out benchmarks/results/packing_cpu
    python -m benchmarks.packing --seq-len 131072 --doc-len 256 32768 --hidden 4096 --layers 2 --heads 32 \
        --kv-heads 8 --vocab 32000 --chunk 4096 --device cuda --dtype bf16 --out benchmarks/results/packing_cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ds_longseq.ops.chunk_attention import _plan, default_kv_block_size

LAYOUTS = ("packed", "padded", "one_document")
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def document_lengths(total: int, seed: int, low: int, high: int) -> list[int]:
    """Log-uniform document lengths in [low, high] that sum to ``total`` (the last one cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        u = torch.rand((), generator=g).item()
        n = int(round(low * (high / low) ** u))
        n = min(n, left)
        lengths.append(n)
        left -= n
    return lengths


def build_model(args):
    import transformers

    import ds_longseq

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.seq_len, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(args.device, DTYPES[args.dtype])
    return ds_longseq.enable(model, {
        "streambp": {"enabled": True, "chunk_size": args.chunk},
        "attention": {"kv_block_size": args.kv_block},
        "lm_head": {"enabled": True, "chunk_size": args.chunk},
    })


def batch_for(layout: str, lengths: list[int], vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    if layout == "padded":
        L = max(lengths)
        ids = torch.zeros(len(docs), L, dtype=torch.long)
        mask = torch.zeros(len(docs), L, dtype=torch.long)
        for i, d in enumerate(docs):
            ids[i, : len(d)] = d
            mask[i, : len(d)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ids = torch.cat(docs).unsqueeze(0)
    labels = ids.clone()
    if layout == "packed":
        pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        return {"input_ids": ids, "position_ids": pos, "labels": labels}
    return {"input_ids": ids, "labels": labels}


def attention_pairs(layout: str, lengths: list[int], chunk: int, block: int | None, device: str = "cpu"
                    ) -> tuple[int, int, int, int]:
    """Per head and layer pass: (query-key pairs in the tiles the op visits, pairs of the dense
    causal triangle, tiles the op runs, tiles it would run without document bounds). ``block``
    None: the op's default key tile on ``device`` (CUDA: the whole prefix; else 1024 keys)."""
    rows = [[n] for n in lengths] if layout == "padded" else [lengths if layout == "packed" else [sum(lengths)]]
    visited = dense = tiles = unbounded = 0
    for docs in rows:
        T = max(lengths) if layout == "padded" else sum(docs)
        offsets = torch.tensor([0, *docs]).cumsum(0)[:-1].tolist()
        starts = torch.cat([torch.full((n,), s) for n, s in zip(docs, offsets, strict=True)])
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            lo = starts[s:e].view(1, -1) if layout == "packed" else None
            b = block or default_kv_block_size(e, device)  # keys the chunk sees: s prefix + e - s own
            plan = _plan(s, e - s, e - s, b, lo)
            visited += sum(t.rows * (t.b - t.a) for t in plan)
            tiles += len(plan)
            unbounded += len(_plan(s, e - s, e - s, b, None))
        dense += T * (T + 1) // 2
    return visited, dense, tiles, unbounded


def measure(layout: str, args, lengths: list[int]) -> dict:
    model = build_model(args)
    batch = {k: v.to(args.device) for k, v in batch_for(layout, lengths, args.vocab, args.seed).items()}
    cuda = torch.device(args.device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times, loss = [], None
    for i in range(args.repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = model(**batch)
        out.loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
        loss = out.loss.item()
    step = statistics.median(times)
    visited, dense, tiles, unbounded = attention_pairs(layout, lengths, args.chunk, args.kv_block, args.device)
    real = sum(lengths)
    row = {"layout": layout, "rows": batch["input_ids"].shape[0], "row_len": batch["input_ids"].shape[1],
           "real_tokens": real, "step_s": step, "tokens_per_s": real / step, "loss": loss,
           "attention_pairs": visited, "dense_causal_pairs": dense, "tiles": tiles, "tiles_without_bounds": unbounded}
    if cuda:
        row["peak_gpu_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192, help="real tokens in all documents together")
    p.add_argument("--doc-len", type=int, nargs=2, default=[64, 4096], help="min and max document length")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=1024, help="StreamBP and LM-head chunk_size")
    p.add_argument("--kv-block", type=int, default=None,
                   help="keys per tile; default: the op's (1024 on CPU, the whole prefix on CUDA)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--out", default=None, help="write <out>.jsonl and <out>.md")
    args = p.parse_args(argv)
    lengths = document_lengths(args.seq_len, args.seed, *args.doc_len)
    rows = []
    for layout in args.layouts:
        r = measure(layout, args, lengths)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cmd = " ".join(sys.argv[1:] if argv is None else argv)
        cuda = torch.device(args.device).type == "cuda"
        where = torch.cuda.get_device_name(args.device) if cuda else f"{torch.get_num_threads()} threads"
        block = args.kv_block or ("the whole prefix" if cuda else default_kv_block_size(0, args.device))
        lines = [
            f"# Packed documents vs padded rows (torch {torch.__version__}, {where})", "",
            f"{len(lengths)} documents, {sum(lengths)} tokens (lengths {min(lengths)}-{max(lengths)}, log-uniform); "
            f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, vocab "
            f"{args.vocab}, {args.dtype} on {args.device}; StreamBP + chunked LM head, chunk {args.chunk}, key tile "
            f"{block}. One forward + backward, median of {args.repeats} after a warm-up.", "",
            "| layout | rows x length | step s | real tokens/s | loss | attention pairs visited | vs dense causal "
            "| tiles run (without bounds) |" + (" peak GPU MiB |" if cuda else ""),
            "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if cuda else ""),
        ]
        for r in rows:
            lines.append(f"| {r['layout']} | {r['rows']} x {r['row_len']} | {r['step_s']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['loss']:.4f} | {r['attention_pairs']:,} | "
                         f"{r['attention_pairs'] / r['dense_causal_pairs']:.2f} | "
                         f"{r['tiles']} ({r['tiles_without_bounds']}) |"
                         + (f" {r['peak_gpu_mib']:.0f} |" if cuda else ""))
        lines += ["", "`attention pairs visited`: query-key pairs in the tiles the attention op runs (per head and "
                  "layer pass), from its tile plan; `vs dense causal`: over the causal triangle of the rows as laid "
                  "out; `tiles run`: tiles in the attention op's plans for every row's chunks (each is one kernel "
                  "call per layer pass), against the same chunks planned without document bounds: key tiles "
                  "outside a query's document are skipped, and a chunk's causal diagonal becomes one tile per "
                  "document starting in it. `loss`: the last step's; packed and padded train the same targets "
                  "(no token predicts across a document boundary), so theirs agree. "
                  "`one_document` attends across documents: its numbers are the cost of ignoring the "
                  "boundaries, not a correct model.", "", f"Command: `python -m benchmarks.packing {cmd}`", ""]
        Path(args.out + ".md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
