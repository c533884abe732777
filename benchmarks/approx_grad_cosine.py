"""How far Approx-BP's gradients are from exact ones on ``examples/sft.py``'s embedded model and task.

For one copy-task batch (``ds_longseq.toolkit.copy_example``) and a model (the embedded model,
``ds_longseq.toolkit.tiny_llama``, at its initialisation, and optionally a trained one, e.g. an exact
run's ``hf_model/`` export), computes the
exact gradient and the gradient with each ``long_seq.approx_bp`` setting (activation only, norm only,
both), on the stock forward (Approx-BP acts the same on every path), and reports their cosine
similarity and norm ratio over all parameters both have, and the three least similar tensors.

With ``norm`` the q/k/v, gate/up and LM-head weights are re-parameterised (``W~ = W diag(alpha)``), so
their gradients are mapped back before comparing: ``dL/dW = dL/dW~ diag(alpha)``. The folded norm
weights themselves get no gradient (frozen at 1) and are left out of the comparison.

    python -m benchmarks.approx_grad_cosine --trained /tmp/conv/exact/hf_model \
        --out benchmarks/results/approx_grad_cosine
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

SETTINGS = {
    "activation only": {"activation": "resilu2"},
    "norm only": {"norm": "ms_rmsnorm"},
    "both": {"activation": "resilu2", "norm": "ms_rmsnorm"},
}


def fold_scales(model) -> dict:
    """Parameter name -> the norm weight folded into its input columns under ``norm: ms_rmsnorm`` (Llama)."""
    scales = {}
    for i, layer in enumerate(model.model.layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            scales[f"model.layers.{i}.self_attn.{proj}.weight"] = layer.input_layernorm.weight.detach().clone()
        for proj in ("gate_proj", "up_proj"):
            scales[f"model.layers.{i}.mlp.{proj}.weight"] = layer.post_attention_layernorm.weight.detach().clone()
    scales["lm_head.weight"] = model.model.norm.weight.detach().clone()
    return scales


def gradients(model, batch, approx: dict | None):
    """(loss, {name: dL/dW in the unfolded parameterisation}) of one forward + backward on a copy."""
    import ds_longseq

    m = copy.deepcopy(model)
    m.train()
    scales = fold_scales(m) if approx and approx.get("norm") else {}
    if approx:
        ds_longseq.enable(m, {"approx_bp": approx})
    out = m(**batch, use_cache=False)
    out.loss.backward()
    grads = {}
    for name, p in m.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad * scales[name][None, :] if name in scales else p.grad
    return float(out.loss.detach()), grads


def compare(reference: dict, other: dict) -> dict:
    import torch
    import torch.nn.functional as F

    keys = [k for k in reference if k in other]
    a = torch.cat([reference[k].flatten() for k in keys]).double()
    b = torch.cat([other[k].flatten() for k in keys]).double()
    per = {k: F.cosine_similarity(reference[k].flatten().double(), other[k].flatten().double(), dim=0).item()
           for k in keys}
    worst = sorted(per.items(), key=lambda kv: kv[1])[:3]
    return dict(cos=F.cosine_similarity(a, b, dim=0).item(), ratio=(b.norm() / a.norm()).item(), worst=worst,
                left_out=len(reference) - len(keys))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trained", default=None, help="an HF export of a trained embedded model (e.g. <run>/hf_model)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--example", type=int, default=12345, help="copy_example index of the batch")
    p.add_argument("--seed", type=int, default=0, help="init seed of the embedded model and data seed")
    p.add_argument("--out", default=None, help="write <out>.md")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    import torch
    from transformers import LlamaForCausalLM

    from ds_longseq.toolkit import copy_example, tiny_llama

    models = {f"embedded model at init (seed {args.seed})": tiny_llama(args.seq_len, args.seed, torch.float32)}
    if args.trained:
        models[f"trained: {args.trained}"] = LlamaForCausalLM.from_pretrained(
            args.trained, dtype=torch.float32, attn_implementation="sdpa"
        )
    example = copy_example(args.example, args.seq_len, args.seed)
    batch = {k: v[None] if v.dim() == 1 else v for k, v in example.items()}
    lines = [
        "# Approx-BP gradients against exact ones (`benchmarks.approx_grad_cosine`)",
        "",
        f"One copy-task batch (`copy_example({args.example}, {args.seq_len}, {args.seed})`), float32, stock forward. "
        "cos / ratio: over every parameter with a gradient in both (folded norm weights are frozen and left out; "
        "folded weights' gradients mapped back through the fold).",
        "",
        "| model | setting | loss | cos to exact | norm ratio | least similar tensors (cos) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for label, model in models.items():
        loss0, exact = gradients(model, batch, None)
        for name, approx in SETTINGS.items():
            loss, grads = gradients(model, batch, approx)
            c = compare(exact, grads)
            worst = ", ".join(f"{k.replace('model.layers.', 'L')} {v:.3f}" for k, v in c["worst"])
            lines.append(f"| {label} | {name} | {loss:.4f} (exact {loss0:.4f}) | {c['cos']:.4f} | {c['ratio']:.3f} "
                         f"| {worst} |")
            print(lines[-1], flush=True)
    lines += ["", "Command: `python -m benchmarks.approx_grad_cosine " + " ".join(sys.argv[1:] if argv is None
                                                                                else argv) + "`", ""]
    if args.out:
        Path(args.out + ".md").write_text("\n".join(lines))
        print(f"wrote {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
