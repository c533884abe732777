"""Bytes one decoder layer saves for backward, per token, with and without ``long_seq.approx_bp``.

Counts what autograd keeps between forward and backward (``torch.autograd.graph.saved_tensors_hooks``)
for one forward of one decoder layer with gradients on (full fine-tuning), each storage once (the MS
norm's output and the q/k/v inputs are one tensor) and parameters excluded. Broken down by module:
attention (incl. RoPE and the projections), MLP, the two norms. This is what an un-chunked layer holds
(stock training); a StreamBP chunk replay or an MsT chunk holds the same per token of the chunk.

Measured on CPU at the real shape (the counts do not depend on the device, except that SDPA's CPU
kernel saves what the flash kernel would: output and logsumexp).

    python -m benchmarks.saved_bytes --out benchmarks/results/saved_bytes
"""

from __future__ import annotations

import argparse
import collections
import json

import torch

VARIANTS = {
    "stock": {},
    "resilu2": {"activation": "resilu2"},
    "ms_rmsnorm": {"norm": "ms_rmsnorm"},
    "resilu2 + ms_rmsnorm": {"activation": "resilu2", "norm": "ms_rmsnorm"},
}
SHAPES = {
    # name: (hidden, intermediate, heads, kv heads)
    "llama3-8b": (4096, 14336, 32, 8),
    "llama-small": (512, 1376, 8, 8),
}


def measure(shape: str, variant: str, tokens: int, dtype: torch.dtype) -> dict[str, int]:
    """Saved bytes by module for one forward of layer 0 of a 1-layer Llama of ``shape``."""
    import transformers

    import ds_longseq

    hidden, inter, heads, kv = SHAPES[shape]
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=1,
        vocab_size=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    if VARIANTS[variant]:
        ds_longseq.enable(model, {"approx_bp": VARIANTS[variant]})
    layer = model.model.layers[0]
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    position_ids = torch.arange(tokens)[None]
    pos = model.model.rotary_emb(x, position_ids)
    seen: dict[int, int] = {}
    by_module: dict[str, int] = collections.Counter()
    current = ["other"]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
            by_module[current[0]] += seen[ptr]
        return t

    hooks = []
    for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
        module = layer.get_submodule(name)
        hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: current.__setitem__(0, n)))
        hooks.append(module.register_forward_hook(lambda m, a, o: current.__setitem__(0, "residual adds")))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=pos)
    for h in hooks:
        h.remove()
    out = {k: v // tokens for k, v in by_module.items()}
    out["total"] = sum(seen.values()) // tokens
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--out", default=None, help="prefix for .json and .md")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = {v: measure(args.shape, v, args.tokens, dtype) for v in VARIANTS}
    cols = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp", "residual adds", "total"]
    lines = [
        f"# Saved bytes per token, one decoder layer ({args.shape}, {args.dtype}, {args.tokens} tokens, "
        "full fine-tuning)",
        "",
        f"    python -m benchmarks.saved_bytes --shape {args.shape} --tokens {args.tokens} --dtype {args.dtype}"
        + (f" --out {args.out}" if args.out else ""),
        "",
        "| variant | " + " | ".join(cols) + " | vs stock |",
        "|---|" + "---:|" * (len(cols) + 1),
    ]
    stock = rows["stock"]["total"]
    for v, r in rows.items():
        cells = [f"{r.get(c, 0):,}" for c in cols]
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {100 * (r['total'] - stock) / stock:+.1f}% |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".json", "w") as f:
            json.dump({"shape": args.shape, "dtype": args.dtype, "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
