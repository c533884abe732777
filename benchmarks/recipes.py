"""Model builders and method recipes, defined once for every benchmark suite.

Holds:
    ModelShape and the shapes: LLAMA_SMALL (the CPU suites' h512 / 4 layers / vocab 32000),
        LLAMA_TINY and QWEN3_TINY (CPU smoke runs in seconds), SP_SMOKE (the SP smoke run),
        LLAMA3_8B and QWEN3_4B (the GPU suites; random weights, no download).
    build_model: a ``*ForCausalLM`` with the shape's config, built directly on its device in its
        dtype (never initialised on CPU and moved: an 8B model would take minutes), same seed ->
        same weights.
    quantize_4bit: a model's decoder linears replaced by bitsandbytes 4-bit ones (the QLoRA suites' base).
    apply_lora: PEFT LoRA (rank 16, alpha 32, all seven projections) on a model; returns the PEFT
        wrapper and the inner ``*ForCausalLM`` that recipes are applied to.
    Recipe and METHODS: what each method does to a model (stock, hf_gc, alst, alst_offload,
        alst_offload_sync, mst, streambp, streambp_offload, streambp_2x, the sequence-parallel alst_sp,
        mst_sp, streambp_sp, and
        the Approx-BP stock_approx, hf_gc_approx, mst_approx, streambp_approx, streambp_approx_2x);
        ``prepare`` applies one, ``long_seq_config`` is its ds_longseq section, ``step_context`` is the
        context a training step (forward AND backward) runs in (DeepSpeed's checkpoint offload for
        alst_offload), ``compute_loss`` runs its forward (inside save_on_cpu for alst_offload_sync).
    ALLOC_CONF: the CUDA allocator setting of ALST's published recipe, which every GPU method runs with.
    ALST pieces (DeepSpeed's own ops): alst_mlp_forward (TiledMLP), tiled_fused_loss and alst_loss
        (TiledFusedLogitsLoss).
    Residual SSM models (``ds_longseq.adjoint``, the adjoint-sharding suites): SSMShape and SSM_SHAPES,
        build_ssm, and the methods autograd / adjoint / adjoint_t<T-bar> (ssm_truncation, enable_ssm_method).

Methods:
    stock:            plain Hugging Face model, SDPA attention.
    hf_gc:            HF gradient checkpointing (non-reentrant).
    alst:             hf_gc + DeepSpeed's TiledMLP + TiledFusedLogitsLoss (the ALST recipe on one rank).
    alst_offload:     alst with ALST's own checkpoint offload as DeepSpeed 0.19.8 ships it:
                      ``deepspeed.runtime.activation_checkpointing.offload_activations.
                      get_checkpoint_hidden_states_offloading_ctx_manager`` around the forward and the
                      backward, which marks each HF checkpointed layer's hidden_states input and copies it
                      to pinned host memory on a side stream (asynchronous, buffer pool, the last layer's
                      kept on the device), with HF non-reentrant checkpointing, the checkpointing it is
                      written for. On a CPU accelerator DeepSpeed's engine skips every tensor (nothing to
                      offload to), so on CPU this recipe is alst plus the marking: its wiring only.
    alst_offload_sync: the IMITATION the 2026-11-22 H100 rows called alst_offload, kept to compare with
                      them: REENTRANT checkpointing (CheckpointFunction saves each layer's input with
                      save_for_backward) and a synchronous ``torch.autograd.graph.save_on_cpu`` around the
                      forward only, so exactly those checkpoints go to host memory, blocking the stream.
    mst:              hf_gc + ds_longseq mini-sequence MLP (as many chunks as ALST's tiles) + chunked LM head.
    streambp:         ds_longseq StreamBP layers + chunked LM head (no checkpointing).
    streambp_offload: streambp with ds_longseq's ``long_seq.offload.layer_inputs = "cpu"``.
    streambp_2x:      streambp with a chunk twice the suite's ``chunk_size`` (exact): the bigger chunk's own effect;
                      streambp_4x the same at four times.
    streambp_auto, streambp_offload_auto: streambp / streambp_offload with ``streambp.chunk_size = "auto"``: the
                      whole sequence as one chunk when its work fits 80% of free memory, else the largest power of two.
                      Like every StreamBP method they keep the attention outputs where memory allows
                      (``streambp.keep_attention_output`` "auto", the default); streambp_auto_offload is another name
                      of streambp_offload_auto (issue 61's GPU suite).
    streambp_auto_recompute: streambp_auto with ``keep_attention_output: false``: the backward's replay recomputes
                      the attention forward (StreamBP before issue 61).
    streambp_offload_1call: streambp_offload with ``attention.single_call = true``: one attention kernel call per
                      chunk and direction (FlashAttention-2's bottom-right causal mask) instead of cuDNN's tiles.
    streambp_keep<k>, streambp_offload_keep<k> (k = 2, 4): streambp / streambp_offload keeping every k-th layer
                      input only (``long_seq.offload.keep_every``), the others rebuilt in backward.
    <m>_approx:       stock, hf_gc, mst, streambp with ds_longseq's Approx-BP on top (``APPROX_BP``: ReSiLU2
                      activations, which backpropagate an approximate derivative, and MS-RMSNorm, an exact
                      re-parameterisation); for stock / hf_gc the ds_longseq section is then only ``approx_bp``,
                      so the HF forward and loss are unchanged.
    streambp_approx_2x: streambp_approx with the chunk doubled (what the smaller saved activations could buy).
"""

from __future__ import annotations

import contextlib
import math
import types
from dataclasses import dataclass, replace
from typing import Literal

SEED = 0
# Loss tile: 1024 tokens (125 MiB of fp32 logits at vocab 32000) for ALST's shards and for our
# lm_head chunk_size (its default), so the two loss paths are compared like for like.
LOSS_TOKENS_PER_CHUNK = 1024
# ALST's published recipe runs with PyTorch's expandable segments (less fragmentation at long
# lengths); benchmarks.run gives every method on CUDA this setting, so no method wins by allocator.
ALLOC_CONF = "expandable_segments:True"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The Approx-BP section of the *_approx methods: both replacements on (the models here are SiLU / RMSNorm).
APPROX_BP = {"activation": "resilu2", "norm": "ms_rmsnorm"}


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only model's dimensions; ``family`` picks the transformers config and model classes."""

    name: str
    family: Literal["llama", "qwen3", "gpt_oss", "deepseek_v3", "qwen3_5"]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rope_theta: float | None = None  # None: the config's default
    tie_word_embeddings: bool = False
    extra: tuple[tuple[str, object], ...] = ()
    """Further config fields of the family (experts, latent ranks, windows), as (name, value) pairs."""

    def config(self, max_position_embeddings: int):
        import transformers

        cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
               "gpt_oss": transformers.GptOssConfig, "deepseek_v3": transformers.DeepseekV3Config,
               "qwen3_5": transformers.Qwen3_5TextConfig}[self.family]
        kwargs = dict(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=max_position_embeddings,
            attn_implementation="sdpa",
        )
        if self.head_dim is not None:
            kwargs["head_dim"] = self.head_dim
        if self.rope_theta is not None:
            kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        kwargs.update(self.extra)
        return cls(**kwargs)

    def describe(self) -> str:
        head = f" head_dim={self.head_dim}" if self.head_dim else ""
        return (
            f"{self.name} ({self.family} h={self.hidden_size} ffn={self.intermediate_size} "
            f"L={self.num_hidden_layers} heads={self.num_attention_heads}/{self.num_key_value_heads}{head} "
            f"vocab={self.vocab_size}{', tied embeddings' if self.tie_word_embeddings else ''})"
        )


LLAMA_SMALL = ModelShape("llama-small", "llama", 512, 1376, 4, 8, 8, 32000)
# Issue 27's memory check: gpt-oss's and DeepSeek-V3's layouts at LLAMA_SMALL's width, depth and vocabulary
# (attention sinks, alternating 1024-token windows, 8 experts of which 2 per token; multi-head latent attention
# with its latent cache, shared expert and grouped routing, the first layer dense)
GPT_OSS_SMALL = ModelShape(
    "gpt-oss-small", "gpt_oss", 512, 688, 4, 8, 8, 32000, head_dim=64,
    extra=(("num_local_experts", 8), ("num_experts_per_tok", 2), ("sliding_window", 1024),
           ("layer_types", ["sliding_attention", "full_attention"] * 2),
           ("attn_implementation", "eager")),  # gpt-oss has no sdpa path in transformers (its sinks)
)
DEEPSEEK_V3_SMALL = ModelShape(
    "deepseek-v3-small", "deepseek_v3", 512, 1376, 4, 8, 8, 32000,
    extra=(("kv_lora_rank", 128), ("q_lora_rank", 192), ("qk_nope_head_dim", 64), ("qk_rope_head_dim", 32),
           ("v_head_dim", 64), ("n_routed_experts", 8), ("num_experts_per_tok", 2), ("moe_intermediate_size", 344),
           ("first_k_dense_replace", 1), ("n_shared_experts", 1), ("n_group", 1), ("topk_group", 1)),
)
# Issue 28's memory check: Qwen3.5's hybrid layout at LLAMA_SMALL's width, depth and vocabulary (three Gated
# DeltaNet layers with a 4-wide short convolution, then one gated full-attention layer, as Qwen3.5 repeats them)
QWEN3_5_SMALL = ModelShape(
    "qwen3.5-small", "qwen3_5", 512, 1376, 4, 8, 2, 32000, head_dim=64,
    extra=(("layer_types", ["linear_attention"] * 3 + ["full_attention"]), ("linear_num_key_heads", 4),
           ("linear_num_value_heads", 8), ("linear_key_head_dim", 64), ("linear_value_head_dim", 64),
           ("linear_conv_kernel_dim", 4)),
)
SHAPES = {s.name: s for s in (LLAMA_SMALL, GPT_OSS_SMALL, DEEPSEEK_V3_SMALL, QWEN3_5_SMALL)}
"""The shapes the CPU memory benchmark takes by name (``--shape``)."""
LLAMA_TINY = ModelShape("llama-tiny", "llama", 64, 160, 2, 4, 2, 512)
QWEN3_TINY = ModelShape("qwen3-tiny", "qwen3", 64, 160, 2, 4, 2, 512, head_dim=16, tie_word_embeddings=True)
SP_SMOKE = ModelShape("llama-sp-smoke", "llama", 64, 96, 2, 4, 4, 1000)
LLAMA3_8B = ModelShape("llama3-8b", "llama", 4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0)
QWEN3_4B = ModelShape(
    "qwen3-4b", "qwen3", 2560, 9728, 36, 32, 8, 151936, head_dim=128, rope_theta=1e6, tie_word_embeddings=True
)


@contextlib.contextmanager
def _default_dtype(dtype):
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(shape: ModelShape, *, dtype: str, device: str, seq_len: int, seed: int = SEED):
    """A randomly initialised ``*ForCausalLM`` of ``shape``, in training mode.

    Built under ``torch.device(device)`` with the default dtype set, so parameters are created and
    initialised (HF's normal(0, 0.02)) where they live, in their final dtype. The same seed gives
    the same weights (on CPU in float32 exactly those of ``LlamaForCausalLM(config)`` under the seed,
    as the committed CPU results were built).
    """
    import torch
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
           "gpt_oss": transformers.GptOssForCausalLM, "deepseek_v3": transformers.DeepseekV3ForCausalLM,
           "qwen3_5": transformers.Qwen3_5ForCausalLM}[shape.family]
    config = shape.config(max_position_embeddings=max(seq_len, 4096))
    torch.manual_seed(seed)
    with _default_dtype(getattr(torch, dtype)), torch.device(device):
        model = cls(config)
    model.train()
    return model


def random_tokens(shape: ModelShape, seq_len: int, device="cpu", seed: int = SEED + 1, batch_size: int = 1):
    """(batch_size, seq_len) token ids, the same for every method (drawn on CPU, then moved; the first row is the
    batch-1 draw)."""
    import torch

    ids = torch.randint(0, shape.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
    return ids.to(device)


def quantize_4bit(model, quant_type: str = "nf4", double_quant: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model``'s decoder layers by a bitsandbytes 4-bit linear (QLoRA's base:
    ``quant_type`` nf4 or fp4, double quantization of the scales on by default), in place, layer by layer, on the
    device the weights are on; the embedding and the LM head stay in the model's dtype, as transformers'
    ``load_in_4bit`` leaves them. The packed weights are stored as the model's dtype
    (``bnb_4bit_quant_storage``) and computed in it. Returns how many linears were quantized."""
    import torch

    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise ImportError("the QLoRA suites need bitsandbytes: pip install 'bitsandbytes>=0.50.2'") from err
    from ds_longseq.compat import keep_4bit_weights_unpacked

    count = 0
    for layer in model.model.layers:
        for name, module in list(layer.named_modules()):
            if type(module) is not torch.nn.Linear:
                continue
            weight = module.weight
            quantized = bnb.nn.Linear4bit(
                module.in_features, module.out_features, bias=module.bias is not None, compute_dtype=weight.dtype,
                compress_statistics=double_quant, quant_type=quant_type, quant_storage=weight.dtype,
                device="meta")
            quantized.weight = bnb.nn.Params4bit(weight.data, requires_grad=False, compress_statistics=double_quant,
                                                 quant_type=quant_type, quant_storage=weight.dtype)
            if module.bias is not None:
                quantized.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child,
                    quantized.to(weight.device))  # .to() quantizes (on the device the weight is on)
            del weight, module
            count += 1
    keep_4bit_weights_unpacked(model)  # no CPU inference repacking (the smoke suite runs on CPU)
    return count


def apply_lora(model, rank: int = 16, alpha: int = 32):
    """Freeze ``model`` and add PEFT LoRA adapters on the attention and MLP projections.

    Returns (peft_model, inner): ``inner`` is ``peft_model.base_model.model``, the ``*ForCausalLM``
    whose projections now carry the adapters; recipes (checkpointing, ALST tiles, ``ds_longseq.enable``)
    are applied to it and the benchmark calls it directly.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        raise ImportError("the LoRA suites need PEFT: pip install peft (or pip install -e '.[bench]')") from err
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(model, config)
    return peft_model, peft_model.base_model.model


# ---------------------------------------------------------------------------------------------
# ALST: DeepSpeed's TiledMLP and TiledFusedLogitsLoss
# ---------------------------------------------------------------------------------------------


def alst_mlp_forward(self, x):
    """``*MLP.forward`` replacement that tiles the sequence with DeepSpeed's TiledMLP."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_compute(mlp, x_shard):
        return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x_shard)) * mlp.up_proj(x_shard))

    # Shard count as DeepSpeed's TiledMLP docstring suggests: ceil(seqlen / hidden).
    num_shards = math.ceil(x.shape[-2] / x.shape[-1])
    # ``.weight`` of a LoRA-wrapped projection is its frozen base weight; TiledMLP drops frozen ones
    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(mlp_compute, self, x, num_shards, params)


def tiled_fused_loss(model, hidden, shift_labels, n_valid, tokens_per_tile):
    """sum(cross entropy of ``model.lm_head(hidden)`` vs ``shift_labels``) / ``n_valid``, computed by
    DeepSpeed's TiledFusedLogitsLoss in tiles of ``tokens_per_tile`` tokens (no full logits)."""
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    def loss_fn(lm_head, x, y):
        # Divide inside the tile rather than after TiledFusedLogitsLoss: it runs the
        # lm_head backward during its forward with an incoming grad of 1, so scaling
        # the returned sum afterwards would leave lm_head.weight.grad n_valid times too big.
        logits = lm_head(x).float()
        return F.cross_entropy(logits, y, ignore_index=-100, reduction="sum") / n_valid

    shards = max(1, math.ceil(hidden.shape[1] / tokens_per_tile))
    weight = model.lm_head.weight
    tied = weight is model.get_input_embeddings().weight
    if not tied:
        return TiledFusedLogitsLoss.apply(loss_fn, model.lm_head, hidden, shift_labels, None, shards, [weight], "sum")
    # Tied embeddings (Qwen3-4B): TiledFusedLogitsLoss runs the lm_head backward inside its forward and
    # marks the weight ready for ZeRO's reduction on its last tile; the embedding backward then marks
    # the same weight ready again, and DeepSpeed 0.19.8's ZeRO-3 asserts on the duplicate. Hold the
    # weight "not ready" through the loss (its gradient accumulates, as between tiles) and let the
    # embedding backward reduce both contributions once.
    weight.ds_grad_is_ready = False
    try:
        return TiledFusedLogitsLoss.apply(loss_fn, model.lm_head, hidden, shift_labels, None, shards, [], "sum")
    finally:
        weight.ds_grad_is_ready = True


def alst_loss(model, input_ids, labels, tokens_per_tile: int = LOSS_TOKENS_PER_CHUNK):
    """Mean causal-LM loss via TiledFusedLogitsLoss, never materialising full logits."""
    import torch.nn.functional as F

    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    # Shift once, HF style: pad with -100 so targets keep the hidden states' length.
    shift_labels = F.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    n_valid = (shift_labels != -100).sum().clamp(min=1)
    return tiled_fused_loss(model, hidden, shift_labels, n_valid, tokens_per_tile)


# ---------------------------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """What one method does to a model. See the module docstring for each method."""

    name: str
    checkpointing: Literal["none", "non_reentrant", "reentrant"] = "none"
    alst: bool = False  # DeepSpeed TiledMLP on every MLP and TiledFusedLogitsLoss for the loss
    # How checkpointed layer inputs go to the host: "deepspeed" = ALST's own offload context around the
    # forward and backward; "save_on_cpu" = the synchronous imitation around the forward only (with
    # reentrant checkpointing, whose CheckpointFunction saves each layer's input with save_for_backward).
    offload_checkpoints: Literal["none", "deepspeed", "save_on_cpu"] = "none"
    long_seq: Literal["none", "mst", "streambp"] = "none"
    offload_layer_inputs: bool = False  # ds_longseq long_seq.offload.layer_inputs = "cpu" (StreamBP)
    sequence_parallel: bool = False
    approx_bp: bool = False  # ds_longseq long_seq.approx_bp = APPROX_BP, on top of whatever else the recipe does
    chunk_scale: int = 1  # StreamBP chunk = chunk_scale x the suite's chunk_size
    keep_every: int = 1  # ds_longseq long_seq.offload.keep_every (StreamBP keeps every k-th layer input only)
    auto_chunk: bool = False  # ds_longseq long_seq.streambp.chunk_size = "auto" (the whole sequence when it fits)
    single_call: bool | None = None  # ds_longseq long_seq.attention.single_call (None: left to the default)
    # ds_longseq long_seq.streambp.keep_attention_output (None: left to the default, "auto")
    keep_attention_output: bool | str | None = None


_BASE = (
    Recipe("stock"),
    Recipe("hf_gc", checkpointing="non_reentrant"),
    Recipe("alst", checkpointing="non_reentrant", alst=True),
    Recipe("alst_offload", checkpointing="non_reentrant", alst=True, offload_checkpoints="deepspeed"),
    Recipe("alst_offload_sync", checkpointing="reentrant", alst=True, offload_checkpoints="save_on_cpu"),
    Recipe("mst", checkpointing="non_reentrant", long_seq="mst"),
    Recipe("streambp", long_seq="streambp"),
    Recipe("streambp_offload", long_seq="streambp", offload_layer_inputs=True),
)
METHODS: dict[str, Recipe] = {r.name: r for r in _BASE}
for _name in ("alst", "mst", "streambp"):
    METHODS[f"{_name}_sp"] = replace(METHODS[_name], name=f"{_name}_sp", sequence_parallel=True)
METHODS["streambp_2x"] = replace(METHODS["streambp"], name="streambp_2x", chunk_scale=2)
METHODS["streambp_4x"] = replace(METHODS["streambp"], name="streambp_4x", chunk_scale=4)
METHODS["streambp_auto"] = replace(METHODS["streambp"], name="streambp_auto", auto_chunk=True)
METHODS["streambp_offload_auto"] = replace(METHODS["streambp_offload"], name="streambp_offload_auto", auto_chunk=True)
METHODS["streambp_auto_offload"] = replace(METHODS["streambp_offload_auto"], name="streambp_auto_offload")
METHODS["streambp_auto_recompute"] = replace(METHODS["streambp_auto"], name="streambp_auto_recompute",
                                             keep_attention_output=False)
METHODS["streambp_offload_1call"] = replace(METHODS["streambp_offload"], name="streambp_offload_1call",
                                            single_call=True)
for _k in (2, 4):  # sparse layer-input storage, on the device and offloaded
    METHODS[f"streambp_keep{_k}"] = replace(METHODS["streambp"], name=f"streambp_keep{_k}", keep_every=_k)
    METHODS[f"streambp_offload_keep{_k}"] = replace(METHODS["streambp_offload"], name=f"streambp_offload_keep{_k}",
                                                    keep_every=_k)
for _name in ("stock", "hf_gc", "mst", "streambp", "streambp_2x"):
    _approx = _name.replace("_2x", "") + "_approx" + ("_2x" if _name.endswith("_2x") else "")
    METHODS[_approx] = replace(METHODS[_name], name=_approx, approx_bp=True)


def exact_counterpart(name: str) -> str | None:
    """The method that differs from ``name`` only in having no Approx-BP (``streambp_approx_2x`` ->
    ``streambp_2x``), or None for a method without Approx-BP."""
    recipe = get_recipe(name)
    if not recipe.approx_bp:
        return None
    exact = replace(recipe, approx_bp=False)
    return next((m for m, r in METHODS.items() if replace(r, name=exact.name) == exact), None)


def get_recipe(name: str) -> Recipe:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}: choose from {sorted(METHODS)}") from None


def offload_supported() -> bool:
    """Whether this ds_longseq has the ``long_seq.offload`` section that ``streambp_offload`` uses."""
    import ds_longseq.config

    return hasattr(ds_longseq.config, "OffloadConfig")


def long_seq_config(recipe: Recipe, shape: ModelShape, seq_len: int, *, chunk_size: int, loss_chunk_size: int,
                    sp: int = 1, auto_budget_gib: float | None = None) -> dict:
    """The recipe's ``long_seq`` section ({} for methods that do not use ds_longseq).

    With ``approx_bp`` the section gets ``APPROX_BP``; for a recipe that uses no other ds_longseq
    technique (stock, hf_gc) it is then ``{"approx_bp": APPROX_BP}`` alone, which installs no model
    forward: the HF forward computes the loss as for the plain recipe.
    """
    lm_head = {"enabled": True, "chunk_size": loss_chunk_size}
    if recipe.long_seq == "mst":
        # as many MLP chunks as ALST's TiledMLP tiles on this rank's tokens: ceil(T_local / hidden)
        num_chunks = max(1, math.ceil((seq_len // sp) / shape.hidden_size))
        cfg = {"mini_seq": {"enabled": True, "mlp_num_chunks": num_chunks}, "lm_head": lm_head}
    elif recipe.long_seq == "streambp":
        # kv_block_size left to the device default: the whole prefix per tile on CUDA, 1024 keys on CPU
        chunk = "auto" if recipe.auto_chunk else chunk_size * recipe.chunk_scale
        cfg = {"streambp": {"enabled": True, "chunk_size": chunk}, "lm_head": lm_head}
        if recipe.auto_chunk and auto_budget_gib is not None:
            cfg["streambp"]["auto_budget_gib"] = auto_budget_gib
        if recipe.offload_layer_inputs:
            cfg["offload"] = {"layer_inputs": "cpu"}
        if recipe.keep_every > 1:
            cfg.setdefault("offload", {})["keep_every"] = recipe.keep_every
        if recipe.single_call is not None:
            cfg["attention"] = {"single_call": recipe.single_call}
        if recipe.keep_attention_output is not None:
            cfg["streambp"]["keep_attention_output"] = recipe.keep_attention_output
    else:
        cfg = {}
    if recipe.approx_bp:
        cfg["approx_bp"] = dict(APPROX_BP)
    if not cfg:
        return {}
    if recipe.sequence_parallel:
        cfg["sequence_parallel"] = {"size": sp}
    return cfg


def enable_checkpointing(model, reentrant: bool) -> None:
    """HF activation checkpointing on every decoder layer (under transformers 5.23's name or the older one)."""
    from ds_longseq.compat import set_activation_checkpointing

    set_activation_checkpointing(model, True, {"use_reentrant": reentrant})


def prepare(model, recipe: Recipe, *, frozen_inputs: bool = False) -> None:
    """Apply the recipe's model changes that are not ds_longseq's (checkpointing, ALST tiles).

    ds_longseq's part (``long_seq_config``) is applied by the caller: ``ds_longseq.enable`` in a
    single process, or the DeepSpeed config's ``long_seq`` section under ``ds_longseq.engine``.
    ``frozen_inputs``: the embeddings are frozen (LoRA); reentrant checkpointing then needs the
    embedding output to require grad, or no gradient reaches the checkpointed layers (what HF and
    PEFT do for reentrant checkpointing with adapters).
    """
    if recipe.checkpointing != "none":
        enable_checkpointing(model, reentrant=recipe.checkpointing == "reentrant")
        if recipe.checkpointing == "reentrant" and frozen_inputs:
            model.enable_input_require_grads()
    if recipe.alst:
        import deepspeed.runtime.sequence_parallel.ulysses_sp  # noqa: F401  (import cost before any baseline)

        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(alst_mlp_forward, layer.mlp)


def checkpoint_offload(recipe: Recipe, pin_memory: bool):
    """The context around a recipe's FORWARD: ``save_on_cpu`` for alst_offload_sync, else nothing.

    Only the forward: the backward's recomputations save their own tensors, which must stay on the
    device (offloading them would copy each layer's activations to the host and straight back).
    """
    import torch

    if recipe.offload_checkpoints == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)
    return contextlib.nullcontext()


def step_context(recipe: Recipe, pin_memory: bool = True):
    """The context a training step of ``recipe`` runs in: forward AND backward (its exit drops what the
    backward has not restored, so the backward must run inside).

    alst_offload: DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager`` with its
    defaults (ALST's recipe), pinned host buffers on CUDA. Every other recipe: nothing.
    """
    if recipe.offload_checkpoints != "deepspeed":
        return contextlib.nullcontext()
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    return get_checkpoint_hidden_states_offloading_ctx_manager(use_pin_memory=pin_memory)


def compute_loss(recipe: Recipe, model, input_ids, *, call=None, loss_chunk_size: int = LOSS_TOKENS_PER_CHUNK,
                 pin_memory: bool = False):
    """The recipe's forward and mean causal-LM loss (labels = inputs), ready for ``backward``.

    ``call``: what to call for the HF forward (a DeepSpeed engine), default ``model``; ALST runs the
    base model and its tiled loss on ``model`` directly.
    """
    with checkpoint_offload(recipe, pin_memory):
        if recipe.alst:
            return alst_loss(model, input_ids, input_ids, loss_chunk_size)
        return (call or model)(input_ids=input_ids, labels=input_ids, use_cache=False).loss


# ---------------------------------------------------------------------------------------------
# Residual SSM models (paper 002, adjoint sharding): shapes and the three gradient methods
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SSMShape:
    """Sizes of a ``ds_longseq.adjoint.ResidualSSMForCausalLM`` (inner size 2 x hidden, no convolution)."""

    name: str
    hidden_size: int
    num_layers: int
    state_size: int = 16
    vocab_size: int = 256

    def config(self):
        from ds_longseq.adjoint import SSMConfig

        return SSMConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
                         state_size=self.state_size)

    @property
    def inner_size(self) -> int:
        return 2 * self.hidden_size

    def describe(self) -> str:
        return (f"{self.name} (P={self.hidden_size} D={self.inner_size} N={self.state_size} K={self.num_layers} "
                f"V={self.vocab_size})")


# The adjoint benchmarks' sizes: the state is (D, N) = (2P, 16) floats per token and layer, so h32 and
# h64 differ 2x in state, L4 and L16 4x in layers (autograd keeps every layer's state, adjoint one).
SSM_SHAPES = {
    s.name: s
    for s in (
        SSMShape("h32-L4", 32, 4),
        SSMShape("h64-L4", 64, 4),
        SSMShape("h32-L16", 32, 16),
        SSMShape("recall-h32-L2", 32, 2, state_size=8, vocab_size=33),  # benchmarks.adjoint_truncation's task
        SSMShape("ssm-tiny", 8, 2, state_size=4, vocab_size=33),  # smoke tests
    )
}
SSM_METHODS = ("autograd", "adjoint", "adjoint_t<T-bar>")
"""autograd: plain autograd (the scan saves a and h per layer); adjoint: exact adjoint sharding;
adjoint_t<T-bar>, e.g. adjoint_t64: truncated adjoint sharding (an approximate gradient)."""


def build_ssm(shape: SSMShape, seed: int = SEED):
    """The float32 ``ResidualSSMForCausalLM`` of ``shape``: same seed -> same weights."""
    import torch

    from ds_longseq.adjoint import ResidualSSMForCausalLM

    torch.manual_seed(seed)
    return ResidualSSMForCausalLM(shape.config())


def ssm_truncation(method: str) -> int | None:
    """T-bar of an SSM method name (None for ``autograd`` and exact ``adjoint``); unknown names raise."""
    if method in ("autograd", "adjoint"):
        return None
    prefix = "adjoint_t"
    if method.startswith(prefix) and method[len(prefix):].isdigit() and int(method[len(prefix):]) >= 1:
        return int(method[len(prefix):])
    raise ValueError(f"unknown SSM method {method!r}: use autograd, adjoint or adjoint_t<T-bar> (e.g. adjoint_t64)")


def enable_ssm_method(model, method: str, chunk_size: int) -> None:
    """Switch ``model``'s training forward to ``method``'s gradients (nothing to do for ``autograd``)."""
    truncation = ssm_truncation(method)
    if method == "autograd":
        return
    import ds_longseq

    ds_longseq.enable(model, {"adjoint": {"enabled": True, "chunk_size": chunk_size, "truncation": truncation}})
