"""An exactness check of a user's model under a ``long_seq`` config against stock transformers: the engine-free
library of ``ds-longseq verify`` (ds_longseq/cli/verify.py runs it and reports; docs/VERIFY.md).

Holds:
    Tolerance / TOLERANCES / tolerance_for: the verdict's rule per dtype, with its reason.
    truncated_config: a model config cut to its first K decoder layers, with its dropout off.
    layers_that_fit: how many decoder layers the check holds in memory in float64.
    load_checkpoint: a checkpoint's weights for such a config (its first layers only), SDPA or eager attention.
    float64_throughout: norms, eager attention and MoE routers computed in float64 (per instance), for a float64 check.
    random_batch / data_batch: the inputs (two rows; padding and a masked prompt in the random one).
    Result / stock_loss / run_model: one forward and backward: the loss (the stock one computed from the logits in
        their dtype) and every parameter's gradient, in float64, summed over a sequence-parallel group.
    group_errors / relative_errors: the worst relative difference per parameter group, and the loss's.
    judge: the verdict.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ds_longseq.compat import get_attn_implementation
from ds_longseq.families import decoder_adapter
from ds_longseq.toolkit.pretrained import gguf_parts

__all__ = ["Tolerance", "TOLERANCES", "tolerance_for", "truncated_config", "layers_that_fit", "load_checkpoint",
           "float64_throughout", "random_batch", "data_batch", "Result", "stock_loss", "run_model", "group_errors",
           "relative_errors", "judge", "BYTES_PER_PARAM", "FIT_FRACTION", "BATCH_ROWS"]

BYTES_PER_PARAM = 40
"""Bytes per parameter the check holds at its peak, with headroom: a float64 model with its gradients (16), the
float64 reference gradients kept for the comparison (8), the checked run's gradients in float64 (8)."""
FIT_FRACTION = 0.8  # of the free memory: the activations of one step and the allocator's slack need the rest
BATCH_ROWS = 2  # two rows: padding on one, a masked prompt, so the masks and the loss normalisation are checked


@dataclass(frozen=True)
class Tolerance:
    """The verdict's rule for one dtype."""

    dtype: str
    """``float64``, ``float32`` or ``bf16``."""
    absolute: float | None
    """Worst relative difference allowed outright (None: none, only relative to the stock model's own error)."""
    stock_factor: float | None
    """The worst (and mean) difference may be this many times the stock model's own at the dtype (None: unused)."""
    why: str
    """The reason for these numbers, printed with the verdict."""


TOLERANCES = {
    "float64": Tolerance("float64", 1e-10, None, "float64 round-off over a model is ~1e-14; 1e-10 leaves room only "
                         "for summation order, while a wrong mask or a lost chunk is >= 1e-3"),
    "float32": Tolerance("float32", 1e-5, 1.5, "float32 round-off; a deep model's stock float32 run can itself "
                         "differ from float64 by more than 1e-5, so 1.5 x its own difference is allowed too"),
    "bf16": Tolerance("bf16", None, 1.5, "bf16 has 8 mantissa bits: judged as the stock bf16 model's own error "
                      "against float64 (the StreamBP paper's App. B.1 protocol)"),
}


def tolerance_for(dtype: str) -> Tolerance:
    """The rule :func:`judge` applies at ``dtype``."""
    return TOLERANCES[dtype]


def truncated_config(config, num_layers: int | None) -> tuple[object, list[str]]:
    """A copy of ``config`` cut to its first ``num_layers`` decoder layers, per-layer lists included
    (``layer_types``, any list of one entry per layer; indices of layers past the cut dropped from
    ``mlp_only_layers``-style lists), with every dropout probability set to 0. Returns (the copy, what changed).

    Dropout is off rather than seeded: ds_longseq replays each draw from a generator derived from where it happens
    (docs/DROPOUT.md), a stream different from the stock model's, so the same seed gives different masks."""
    # the settings that differ from the class's defaults, as a new config is built from them (the caller's stays as
    # it is); a per-layer list left at its default is derived again from the cut layer count
    values = config.to_diff_dict()
    changed = []
    for key, value in values.items():
        if isinstance(value, float) and value > 0 and ("dropout" in key or "pdrop" in key):
            values[key] = 0.0
            changed.append(f"{key} {value:g} -> 0")
    for key, value in vars(config).items():  # dropout left at a nonzero class default
        if key not in values and isinstance(value, float) and value > 0 and ("dropout" in key or "pdrop" in key):
            values[key] = 0.0
            changed.append(f"{key} {value:g} -> 0")
    total = config.num_hidden_layers
    if num_layers is not None and num_layers < total:
        for key, value in values.items():
            if key == "num_hidden_layers" or not isinstance(value, list):
                continue
            if len(value) == total:
                values[key] = value[:num_layers]
            elif key.endswith("_layers") and all(isinstance(v, int) for v in value):
                values[key] = [v for v in value if v < num_layers]
        values["num_hidden_layers"] = num_layers
    return type(config).from_dict(values), changed


def layers_that_fit(config, requested: int | None, free_bytes: float | None = None,
                    device: str = "cpu") -> tuple[int, int, float]:
    """(layers to check, layers in the model, GiB the check takes): ``requested``, else every layer when they fit
    in :data:`FIT_FRACTION` of this rank's free memory on ``device`` (``free_bytes``: instead of reading it), else as
    many as do (counted on a weightless model).

    Raises:
        UnsupportedModelError: ds_longseq cannot locate the model's decoder layers (``families.decoder_adapter``,
            the refusal ``enable`` would give).
    """
    from transformers import AutoModelForCausalLM

    from ds_longseq.engine import available_memory

    total = config.num_hidden_layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in decoder_adapter(model).layers]
    outside = sum(p.numel() for p in model.parameters()) - sum(per_layer)
    host = available_memory(device)[0] if free_bytes is None else free_bytes
    budget = FIT_FRACTION * host / BYTES_PER_PARAM

    def gib(k):
        return (outside + sum(per_layer[:k])) * BYTES_PER_PARAM / 2**30

    if requested is not None:
        return min(requested, total), total, gib(min(requested, total))
    fit = max((k for k in range(total + 1) if outside + sum(per_layer[:k]) <= budget), default=0)
    if fit == 0:
        raise SystemExit(f"the model's embeddings, head and one decoder layer need {gib(1):.1f} GiB for a float64 "
                         f"check, more than the {FIT_FRACTION * host / 2**30:.1f} GiB it may take here: run verify on "
                         "a machine with more memory")
    return fit, total, gib(fit)


def load_checkpoint(model_path: str, config, dtype: torch.dtype, seed: int, device: torch.device) -> torch.nn.Module:
    """The checkpoint's weights for ``config`` (its first layers only) in ``dtype``, train mode; SDPA attention, or
    eager where the family has no SDPA (Gemma 2); eager experts in float64 (grouped_mm has no float64). Weights the
    checkpoint lacks are drawn from ``seed``, so they are the same in every run."""
    import transformers
    from transformers import AutoModelForCausalLM

    parts = gguf_parts(model_path)
    path, kwargs = (model_path, {}) if parts is None else (parts[0], {"gguf_file": parts[1]})
    if dtype == torch.float64:
        kwargs["experts_implementation"] = "eager"
    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    # the load report lists the layers past the cut as unexpected keys, which is the point here, and a bar per load
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        for attention in ("sdpa", "eager"):
            torch.manual_seed(seed)
            try:
                model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                             attn_implementation=attention, **kwargs)
                break
            except ValueError as err:
                if attention != "sdpa" or "scaled_dot_product_attention" not in str(err):
                    raise
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return model.to(device).train()


FLOAT64_EAGER = "ds_longseq_verify_float64_eager"
"""The name under which transformers' attention registry holds :func:`_float64_eager_attention`."""


def float64_throughout(model: torch.nn.Module) -> list[str]:
    """Make ``model`` compute in float64 where stock transformers rounds to float32 inside a float64 model: RMSNorms,
    eager attention's softmax (families without SDPA), MoE routers' softmax; per instance. Returns what changed.

    Applied to both runs of a float64 check, as the test suite does (tests/helpers.py): a chunked path sums the
    same float32-rounded terms in another order (Gemma's ``1 + weight`` over tokens) or runs a norm's backward twice
    (sequence-parallel StreamBP), ~1e-8 from the stock sums; in float64 both hold 1e-10."""
    import types

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def one_plus_norm(self, x):  # Gemma's norms scale by (1 + weight) and name their epsilon eps
        return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def router(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(torch.softmax(logits, -1), self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
            top = top / top.sum(-1, keepdim=True)
        return logits, top, index

    changed = set()
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
            if name.startswith("Gemma") and hasattr(module, "eps"):
                module.forward = types.MethodType(one_plus_norm, module)
            elif hasattr(module, "variance_epsilon"):
                module.forward = types.MethodType(norm, module)
            else:
                continue
        elif name.endswith("TopKRouter") and all(hasattr(module, a) for a in ("hidden_dim", "top_k", "weight")):
            module.forward = types.MethodType(router, module)
        else:
            continue
        changed.add(name)
    if get_attn_implementation(model.config) == "eager":
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(FLOAT64_EAGER, _float64_eager_attention)
        AttentionMaskInterface.register(FLOAT64_EAGER, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
        model.set_attn_implementation(FLOAT64_EAGER)
        changed.add("eager attention")
    return sorted(changed)


def _float64_eager_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                             **kwargs):
    """transformers' eager attention with its softmax in the inputs' dtype (stock: float32); rows that see no key
    give 0 instead of NaN. (B, H, T, D) query, (B, Hkv, T, D) key and value; returns (B, T, H, D), None."""
    repeat = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
    scores = (query @ k.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[2]]
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return (probs @ v).transpose(1, 2).contiguous(), None


def random_batch(vocab_size: int, seq_len: int, seed: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Two rows of random tokens: row 0 whole, row 1 right-padded by an eighth with its first eighth a prompt
    (labels ignored), so the padding mask and the loss's count of valid tokens are part of the check."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (BATCH_ROWS, seq_len), generator=g)
    mask = torch.ones_like(ids)
    cut = max(seq_len // 8, 1)
    mask[1, seq_len - cut:] = 0
    ids[1, seq_len - cut:] = pad_id
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[1, :cut] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def data_batch(path: str, model_path: str, seq_len: int) -> dict[str, torch.Tensor]:
    """The first two rows of ``path`` (as ``ds-longseq train --data`` reads it), padded to ``seq_len``."""
    from ds_longseq.toolkit.data import JsonlData
    from ds_longseq.toolkit.pretrained import load_tokenizer

    try:
        tokenizer = load_tokenizer(model_path)
    except (OSError, ValueError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise SystemExit(f"--data {path} needs the tokenizer of --model {model_path}, which did not load ({first}): "
                         "save it there (tokenizer.save_pretrained), or leave --data out for random tokens") from None
    try:
        rows = JsonlData(path, tokenizer, seq_len)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    picked = [rows[i] for i in range(BATCH_ROWS)]
    return {k: torch.stack([r[k] for r in picked]) for k in picked[0]}


@dataclass
class Result:
    """One forward and backward."""

    loss: float
    """The loss, as a float64 number."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every parameter's gradient, in float64 (summed over the sequence-parallel group)."""


def stock_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal-LM loss of the stock model, computed here from its logits in the logits' dtype (transformers
    upcasts logits to float32 in its own loss, which would round a float64 reference); plus a mixture of experts'
    load-balancing term when the model returns one."""
    out = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
    logits = out.logits
    targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if getattr(out, "aux_loss", None) is not None:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss.to(loss.dtype)
    return loss


def run_model(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor], group=None) -> Result:
    """``loss_of(model)`` and its backward; gradients in float64, summed over ``group`` when given (what DeepSpeed's
    reduction does for the ranks of a sequence)."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(model)
    loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    if group is not None:
        import torch.distributed as dist

        for g in grads.values():
            dist.all_reduce(g, group=group)
    # kept on the host: the device holds one model at a time
    return Result(float(loss.detach().double()), {n: g.cpu() for n, g in grads.items()})


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def group_errors(result: Result, reference: Result) -> dict[str, tuple[float, str]]:
    """``{group: (worst norm-wise relative difference, the parameter that has it)}``: a group is the parameters
    that differ only by their layer index (``model.layers.*.mlp.down_proj.weight``). A parameter the reference has
    a gradient for and the result has none is an infinite difference."""
    out: dict[str, tuple[float, str]] = {}
    for name, ref in reference.grads.items():
        got = result.grads.get(name)
        err = math.inf if got is None or got.shape != ref.shape else _rel(got, ref)
        group = re.sub(r"\.\d+\.", ".*.", name)
        if group not in out or not err <= out[group][0]:
            out[group] = (err, name)
    for name in result.grads.keys() - reference.grads.keys():
        out[name] = (math.inf, name)  # a gradient the stock model does not have
    return out


def relative_errors(result: Result, reference: Result) -> dict[str, float]:
    """``{"loss": its relative difference, group: the worst of the group's}``: what :func:`judge` reads."""
    errs = {"loss": abs(result.loss - reference.loss) / max(abs(reference.loss), 1e-300)}
    errs.update({g: e for g, (e, _) in group_errors(result, reference).items()})
    return errs


def judge(ours: dict[str, float], stock: dict[str, float] | None, tolerance: Tolerance) -> tuple[bool, str]:
    """(exact, why): ``ours`` and ``stock`` are relative differences against the float64 reference (``stock``: the
    stock model's at the checked dtype; None in float64)."""
    worst, mean = max(ours.values()), sum(ours.values()) / len(ours)
    if tolerance.stock_factor is None:
        return worst <= tolerance.absolute, f"worst {worst:.2e} vs tolerance {tolerance.absolute:g}"
    s_worst, s_mean = max(stock.values()), sum(stock.values()) / len(stock)
    allowed = tolerance.stock_factor * s_worst
    if tolerance.absolute is not None:
        allowed = max(allowed, tolerance.absolute)
        return worst <= allowed, (f"worst {worst:.2e} vs max({tolerance.absolute:g}, {tolerance.stock_factor:g} x "
                                  f"the stock model's {s_worst:.2e})")
    ok = worst <= allowed and mean <= tolerance.stock_factor * s_mean
    return ok, (f"worst {worst:.2e} vs {tolerance.stock_factor:g} x the stock model's {s_worst:.2e}, mean {mean:.2e} "
                f"vs {tolerance.stock_factor:g} x {s_mean:.2e}")
