"""Shared test helpers: tiny models of every supported family, batches with padding, gradient diffs."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import transformers

# name -> (config class, model class, extra config kwargs). Shapes are tiny but keep every
# structural feature: GQA (4 query heads on 2 KV heads), qkv bias (Qwen2), q/k norm and an
# explicit head_dim (Qwen3), a sliding-window config longer than the test sequence (Mistral).
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
}
# Families tested in tests/test_families.py (kept out of ARCHS, whose tests assume the Llama-like
# parameter layout): Gemma 2 with both softcaps small enough to bite and a window shorter than the
# test sequences (eager attention in the stock model: SDPA has no softcap).
EXTRA_ARCHS = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 6,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "attn_implementation": "eager",
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention"],
            "final_logit_softcapping": 3.0,
            "attn_implementation": "eager",
        },
    ),
    # 2 layers: a sparse MoE block and a dense MLP (mlp_only_layers); a load-balancing loss large
    # enough to matter; the eager experts (grouped_mm has no float64)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
            "experts_implementation": "eager",
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 6,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.5,
            "experts_implementation": "eager",
        },
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"partial_rotary_factor": 0.5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
}
VOCAB = 101


def make_model(
    arch: str = "llama", dtype=torch.float64, tie: bool = False, seed: int = 0, num_layers: int = 2, **overrides
):
    """A randomly initialised tiny ``*ForCausalLM`` with weights large enough for peaked attention."""
    config_name, model_name, extra = {**ARCHS, **EXTRA_ARCHS}[arch]
    kwargs = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    # HF's std=0.02 init makes attention nearly uniform, which would hide masking bugs.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.15)
    return model.to(dtype)


def make_batch(batch: int = 2, seq_len: int = 37, seed: int = 1, pad: bool = True):
    """input_ids, attention_mask and labels: row 0 left-padded, row 1 right-padded with a masked prompt."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=g)
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    labels = ids.clone()
    if pad:
        mask[0, :5] = 0
        if batch > 1:
            mask[1, seq_len - 4 :] = 0
            labels[1, :7] = -100
        labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reference_loss(model, batch, dtype=None):
    """Plain-autograd causal-LM loss from the stock model's logits, in ``dtype`` (default: logits dtype).

    transformers upcasts logits to float32 even for float64 models; float64 exactness tests need
    the loss in float64 too, so the reference computes it here.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    logits = out.logits.to(dtype or out.logits.dtype)
    targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    if getattr(out, "aux_loss", None) is not None:  # a mixture of experts: + its load-balancing loss
        loss = loss + model.router_aux_loss_coef * out.aux_loss.to(loss.dtype)
    return loss


def loss_and_grads(model, batch, use_reference=False, ref_dtype=None):
    """(loss, {name: grad}, embedding-output grad) after one backward."""
    if use_reference:
        return grads_of(model, lambda: reference_loss(model, batch, ref_dtype))
    return grads_of(model, lambda: model(**batch).loss)


def grads_of(model, loss_fn):
    """(loss, {name: grad}, input-embedding-output grad) of ``loss_fn()`` after one backward.

    The embedding-output gradient is the last forward's (``loss_fn`` may run the model more than once).
    """
    model.zero_grad(set_to_none=True)
    captured = {}

    def hook(module, inputs, output):
        output.retain_grad()
        captured["embeds"] = output

    h = model.get_input_embeddings().register_forward_hook(hook)
    try:
        loss = loss_fn()
        loss.backward()
    finally:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, captured["embeds"].grad.detach().clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against reference ``b`` (in float64)."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def compare(result, reference) -> dict[str, float]:
    """Relative errors of loss, input-embedding gradient and every parameter gradient."""
    loss, grads, gin = result
    rloss, rgrads, rgin = reference
    assert set(grads) == set(rgrads), f"parameters with gradients differ: {set(grads) ^ set(rgrads)}"
    errs = {"loss": rel_err(loss, rloss), "input_grad": rel_err(gin, rgin)}
    errs.update({f"grad:{n}": rel_err(grads[n], rgrads[n]) for n in rgrads})
    return errs


def clone(model):
    return copy.deepcopy(model)


def full_precision_norms(model):
    """Make the model's RMSNorms compute in the input dtype instead of float32; returns the model.

    Stock Hugging Face RMSNorms cast to float32 even in a float64 model. A path that runs the
    norm's backward twice over the same tokens (sequence-parallel StreamBP: queries in one pass,
    keys/values in another) then rounds each at float32, ~1e-8 apart from one backward over the sum.
    With the norm in float64 both are exact, so float64 tests can hold 1e-10.
    """
    import types

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    def gemma_forward(self, x):  # Gemma's norms scale by (1 + weight) and name their epsilon eps
        return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(gemma_forward if name.startswith("Gemma") else forward, module)
    return model


def float64_eager_attention(model):
    """Give ``model`` an eager attention whose softmax runs in the inputs' dtype; returns the model.

    transformers' eager attention (the only stock one with logit softcapping: SDPA has none) takes
    its softmax in float32 even in a float64 model; a float64 reference needs it in float64. Masks are
    the eager ones (additive); rows that see no key give 0 instead of NaN.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
        R = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(R, 1), value.repeat_interleave(R, 1)
        scores = (query @ k.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores + attention_mask[..., : k.shape[2]]
        probs = torch.softmax(scores, -1).nan_to_num(0.0)
        probs = F.dropout(probs, p=dropout, training=module.training)  # as stock eager attention, after the softmax
        return (probs @ v).transpose(1, 2).contiguous(), None

    AttentionInterface.register("float64_eager", attention)
    AttentionMaskInterface.register("float64_eager", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.config._attn_implementation = "float64_eager"
    return model


def float64_routers(model):
    """Make the model's MoE routers keep the input dtype (stock ones take their softmax in float32
    even in a float64 model, so routing weights carry float32 rounding); returns the model."""
    import types

    def forward(self, hidden_states):
        logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(torch.softmax(logits, -1), self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral always renormalises
            top = top / top.sum(-1, keepdim=True)
        return logits, top, index

    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.forward = types.MethodType(forward, module)
    return model


def float64_load_balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """transformers' MoE load-balancing loss (Switch Transformer eqs. 4-6) in the logits' dtype:
    the stock one accumulates in float32. A test reference, monkeypatched into the modeling module
    (where both the stock forward and ds_longseq's look it up)."""
    if gate_logits is None or not isinstance(gate_logits, tuple):
        return 0
    probs = [torch.softmax(g, -1) for g in gate_logits]
    rows = probs[0].shape[0]
    mask = torch.ones(rows, dtype=probs[0].dtype) if attention_mask is None else attention_mask.reshape(-1)
    mask = mask.to(probs[0])
    counts, prob_sum = 0, 0
    for p in probs:
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.zeros(num_experts, dtype=p.dtype).scatter_add_(0, chosen, mask.repeat_interleave(top_k))
        prob_sum = prob_sum + (p * mask[:, None]).sum(0)
    total = len(probs) * mask.sum()
    return (counts / total * (prob_sum / total)).sum() * num_experts


def layer_input_offload(model):
    """The model's ``forwards.layer_input_offload.LayerInputOffload``: the object one of the base model's forward
    pre-hooks belongs to (StreamBP's automatic choices register theirs beside it)."""
    from ds_longseq.forwards.layer_input_offload import LayerInputOffload

    (offload,) = [h.__self__ for h in model.model._forward_pre_hooks.values()
                  if isinstance(getattr(h, "__self__", None), LayerInputOffload)]
    return offload


def lora_with_dropout(model, dropout: float, targets):
    """``model`` wrapped by PEFT with LoRA (rank 4, alpha 8) on ``targets`` and ``lora_dropout`` on each adapter, its
    ``lora_B`` drawn nonzero (seeded) so that every adapter's gradient reaches its input."""
    import peft

    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout,
                                                       target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.15)
    return model
