"""Communication-volume model: bytes each rank contributes to collectives per optimizer step.

Pure Python (no torch, no DeepSpeed): closed-form formulas over the model shape, so it evaluates
instantly for any world size (no loop over ranks; the only loop is over the handful of parameter
tensors of ONE decoder layer). ``tests/test_comm_model.py`` checks every byte it predicts against
collectives counted on real gloo CPU ranks running DeepSpeed 0.19.8 through
``ds_longseq.engine.initialize``; ``benchmarks/COMM_MODEL.md`` has the derivation, the validation
and a worked Llama-3-8B example.

Accounting (the unit of every ``bytes`` number)
------------------------------------------------
``bytes`` = the bytes of the INPUT tensor this rank passes to each collective call, summed over
the calls of one optimizer step (``gas`` micro-steps + the optimizer step). That is exactly what a
wrapper around ``deepspeed.comm`` / ``torch.distributed`` functions sees, counting only the
outermost call (``deepspeed.comm.allgather_fn`` calls ``all_gather_into_tensor`` itself; that is
one call) and only the input argument (not the output buffer):

=================  =========================================  ============================================
collective         input tensor                               estimated wire bytes sent per rank (``wire``)
=================  =========================================  ============================================
all_gather         this rank's shard (1/g of the result)      (g - 1) x input         (ring)
reduce_scatter     the whole tensor (g x this rank's result)  (g - 1) / g x input     (ring)
all_reduce         the whole tensor                           2 (g - 1) / g x input   (ring: RS + AG)
all_to_all         the whole local tensor (g blocks)          (g - 1) / g x input     (its own block stays)
=================  =========================================  ============================================

g is the group size: the world W for ZeRO (DeepSpeed partitions over the whole world, also under
sequence parallelism), the Ulysses degree u for the all-to-all, the ring degree r for the ring, P for the SP
metadata. ``send_recv`` (ring attention's ``batch_isend_irecv``): input = the tensors this rank sends, which is
its wire estimate too. ``bytes`` is what is tested;
``wire`` is an estimate for bandwidth reasoning (NCCL may choose trees, NVLS or hierarchical
algorithms) and is not tested.

What is modelled (DeepSpeed 0.19.8 semantics, one parameter group, no offload / quantization / hpZ)
---------------------------------------------------------------------------------------------------
N = number of unique parameter elements, n_i = elements of parameter tensor i, ceil(x) rounds up.

ZeRO-2, per micro-step (backward): every gradient is all-reduced once, in buckets
    (``use_multi_rank_bucket_allreduce``, the default): N x grad_bytes, exact (no padding).
ZeRO-2, per optimizer step: one all_gather of the updated flat parameter partition:
    ceil(N / 2W) x 2 x param_bytes (the flat group is padded to a multiple of 2W elements).
ZeRO-3, per micro-step: each parameter is all-gathered by the module that uses it, from its own
    partition of ceil(n_i / W) elements: sum_i m_i x ceil(n_i / W) x param_bytes, where m_i is the
    number of gathers of tensor i per micro-step (below); gradients are reduce-scattered once:
    W x sum_i ceil(n_i / W) x grad_bytes (each tensor padded to a multiple of W).
    Gathers per micro-step (with ``stage3_max_reuse_distance=0``, ``stage3_prefetch_bucket_size=0``,
    as the tests set; see COMM_MODEL.md for the default settings):
      - forward 1, backward 1 for every parameter of the embedding, the final norm, the LM head
        (a tied embedding/LM-head weight is gathered by both modules: 2 + 2) and, for ``streambp``
        and ``stock``, every decoder-layer parameter (StreamBP: decoder layers are ZeRO-3 leaf
        modules, gathered once for the whole chunk loop, whatever the number of chunks);
      - ``gc`` / ``mst_gc`` (HF activation checkpointing): a decoder-layer parameter is gathered a
        third time for the recompute, EXCEPT the layer's last-called module (``gc``: mlp.down_proj;
        ``mst_gc``: the whole MLP, which ds_longseq makes a ZeRO-3 leaf): DeepSpeed's pre-backward
        hook gathers it before the recompute reaches it, and the recompute reuses it.
    Parameters with n_i <= ``stage3_param_persistence_threshold`` (``persistence_threshold``) are
    not gathered in forward / backward; they are all-gathered once per optimizer step instead
    (steady state: in DeepSpeed's first two forward passes, which record its module trace, they
    are gathered like the others).
Sequence parallelism P = u x r (``ds_longseq.ops.sp_layout``): Ulysses over u ranks, ring attention over r; u the
    largest divisor of P dividing H unless ``ring`` forces r. T_l = ceil(T / P) (2 ceil(T / 2P) when r > 1).
Ulysses (u > 1), per micro-step and decoder layer, one exchange "round" moves
    (2 H + 2 H_kv_eff) x B x T_l x D x act_bytes (q, attention output, k, v; H_kv_eff =
    max(H_kv, u): kv heads are replicated when fewer than u). Rounds: ``stock`` 2 (forward,
    gradients); ``gc`` / ``mst_gc`` 3 (+ recompute); ``streambp`` 3 (K/V once per pass, queries and
    outputs per chunk, K/V gradients once). Calls per layer: ``stock`` 4 + 4, ``gc`` / ``mst_gc``
    4 + 8, ``streambp`` (2 + 2c) forward and (2 + 2c) + (2c + 2) backward, c = StreamBP chunks of
    the local shard.
Ring (r > 1), per micro-step and decoder layer, with K = B x H_kv_eff x T_l x D elements (one rank's K or V after
    the Ulysses exchange, (B, H_kv_eff / u, u T_l, D)):
    ``stock`` / ``gc`` / ``mst_gc`` (whole-shard ring attention, ``batch_isend_irecv``): forward r - 1 calls of
    2 K x act_bytes (K and V); backward the same again (twice for ``gc`` / ``mst_gc``: their recompute runs the
    ring forward) plus r calls of 2 K x cb (dK, dV in the compute dtype: cb = 4 for act_bytes 2, else act_bytes).
    ``streambp`` (``all_gather_single`` / ``reduce_scatter_single`` over the ring group): forward 2 gathers of
    K x act_bytes; backward 2 more (the capture pass) and 2 reduce-scatters of r K x act_bytes.
    Plus ds_longseq's per-forward metadata over the SP group (``torch.distributed``): all_gather of
    the shard shape (16 bytes) and of the padding mask + positions (16 x B x ceil(T / P) bytes), and
    one all_reduce of the loss statistics (16 bytes).

Chunking changes message COUNTS only, never bytes: StreamBP's c sets the all-to-all call count; the
ZeRO gathers and reductions do not depend on any chunk count (ds_longseq reduces each gradient once
and gathers each layer once per pass), and MsT / LM-head chunks run no collective at all.

Not modelled: DeepSpeed's scalar bookkeeping (one 4- or 8-byte all_reduce in each optimizer step;
the tests allow only calls of <= 8 bytes outside the model) and ZeRO-3's trace-check broadcasts in
the first two forward passes of a run (8 bytes per module, once per run; the tests count the steady
state after them).

Bounds: the ZeRO numbers above are exact for DeepSpeed's padding. Against the unpadded N / W
figures the padding adds less than 2 elements per rank to the ZeRO-2 all_gather, less than one
element per parameter tensor per gather to the ZeRO-3 all_gathers, and less than W elements per
parameter tensor to the ZeRO-3 reduce_scatter input.

Example:
    python -m benchmarks.comm_model --preset llama3-8b --seq-len 1048576 --world 1024 --sp 8 \
        --zero 3 --method streambp --chunk-size 4096
    python -m benchmarks.comm_model --preset llama3-8b --seq-len 1048576 --sp 8 --zero 3 \
        --method streambp --chunk-size 4096 --sweep
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

__all__ = [
    "ModelShape",
    "PRESETS",
    "METHODS",
    "KINDS",
    "Flow",
    "CommVolume",
    "predict",
    "sp_degrees",
    "wire_factor",
    "sweep",
    "main",
]

METHODS = ("streambp", "mst_gc", "gc", "stock")
"""``streambp``: StreamBP layers (+ chunked LM head), no checkpointing; ``mst_gc``: MsT MLP + HF
gradient checkpointing; ``gc``: plain HF gradient checkpointing; ``stock``: neither."""

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
PHASES = ("forward", "backward", "step")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _local_len(seq_len: int, sp: int, ring: int) -> int:
    return _ceil_div(seq_len, sp) if ring == 1 else 2 * _ceil_div(seq_len, 2 * sp)


def sp_degrees(size: int, num_heads: int, ring: int | None = None, num_kv_heads: int | None = None
               ) -> tuple[int, int]:
    """(u, r), u r = ``size``: ``ds_longseq.ops.sp_layout.sp_degrees`` without torch (a test checks they agree).
    u is the largest divisor of ``size`` dividing ``num_heads`` and dividing or a multiple of ``num_kv_heads``
    (None: as many as the query heads), r the rest; ``ring`` forces r.

    Raises:
        ValueError: a forced ``ring`` that does not divide ``size`` or leaves a u the heads do not fit.
    """
    kv = num_heads if num_kv_heads is None else num_kv_heads

    def fits(u: int) -> bool:
        return num_heads % u == 0 and (kv % u == 0 or u % kv == 0)

    if ring is None:
        u = max(d for d in range(1, size + 1) if size % d == 0 and fits(d))
        return u, size // u
    if ring < 1 or size % ring:
        raise ValueError(f"ring {ring} does not divide the sequence-parallel size {size}")
    if not fits(size // ring):
        raise ValueError(f"ring {ring} leaves a Ulysses degree of {size // ring}, which cannot shard {num_heads} query "
                         f"and {kv} key/value heads: raise ring or leave it unset (chosen from the heads)")
    return size // ring, ring


@dataclass(frozen=True)
class ModelShape:
    """A Llama / Mistral / Qwen2 / Qwen3-style decoder-only causal LM (dense, no MoE).

    Attributes:
        num_layers, hidden, intermediate, heads, kv_heads, head_dim, vocab: the HF config values.
        tied: tie_word_embeddings (the LM head reuses the embedding weight).
        qkv_bias: q/k/v projections have biases (Qwen2, or ``attention_bias=True``).
        o_bias: the output projection has a bias (``attention_bias=True`` on Llama).
        qk_norm: per-head RMSNorm on q and k (Qwen3): two ``head_dim`` weights per layer.
        mlp_bias: the MLP projections have biases (``mlp_bias=True`` on Llama).
    """

    name: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_config(cls, config, name: str | None = None) -> ModelShape:
        """Read a ``transformers`` config object (or anything with the same attributes)."""
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        model_type = getattr(config, "model_type", "")
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            name=name or model_type or "custom",
            num_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def layer_params(self) -> list[tuple[str, int, str]]:
        """One decoder layer's parameter tensors: (HF name inside the layer, elements, role).

        Role: ``attn`` (attention projections and q/k norms), ``norm`` (the two layer norms),
        ``mlp`` (gate / up projections), ``mlp_last`` (down projection: the last module a layer
        calls, which matters for ZeRO-3 with checkpointing).
        """
        h, d, inter = self.hidden, self.head_dim, self.intermediate
        q, kv = self.heads * d, self.kv_heads * d
        out = [("self_attn.q_proj.weight", h * q, "attn")]
        if self.qkv_bias:
            out.append(("self_attn.q_proj.bias", q, "attn"))
        out.append(("self_attn.k_proj.weight", h * kv, "attn"))
        if self.qkv_bias:
            out.append(("self_attn.k_proj.bias", kv, "attn"))
        out.append(("self_attn.v_proj.weight", h * kv, "attn"))
        if self.qkv_bias:
            out.append(("self_attn.v_proj.bias", kv, "attn"))
        out.append(("self_attn.o_proj.weight", q * h, "attn"))
        if self.o_bias:
            out.append(("self_attn.o_proj.bias", h, "attn"))
        if self.qk_norm:
            out += [("self_attn.q_norm.weight", d, "attn"), ("self_attn.k_norm.weight", d, "attn")]
        out += [("input_layernorm.weight", h, "norm"), ("post_attention_layernorm.weight", h, "norm")]
        for proj, role in (("gate_proj", "mlp"), ("up_proj", "mlp"), ("down_proj", "mlp_last")):
            out.append((f"mlp.{proj}.weight", h * inter, role))
            if self.mlp_bias:
                out.append((f"mlp.{proj}.bias", h if proj == "down_proj" else inter, role))
        return out

    def outer_params(self) -> list[tuple[str, int, str]]:
        """The parameters outside the decoder layers: (HF name, elements, using module).

        A tied weight is listed once per module that uses (and, under ZeRO-3, gathers) it.
        """
        emb = self.vocab * self.hidden
        return [
            ("model.embed_tokens.weight", emb, "embed"),
            ("model.norm.weight", self.hidden, "final_norm"),
            ("model.embed_tokens.weight" if self.tied else "lm_head.weight", emb, "lm_head"),
        ]

    def param_numels(self) -> dict[str, int]:
        """Every unique parameter tensor by its HF name (loops over layers; for tests and display)."""
        out = {name: n for name, n, _ in self.outer_params()}
        for i in range(self.num_layers):
            out.update({f"model.layers.{i}.{name}": n for name, n, _ in self.layer_params()})
        return out

    @property
    def num_params(self) -> int:
        """N: unique parameter elements (closed form)."""
        outer = sum(n for _, n, module in self.outer_params() if not (self.tied and module == "lm_head"))
        return outer + self.num_layers * sum(n for _, n, _ in self.layer_params())


PRESETS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B config.json: 8.03 B parameters
    "llama3-8b": ModelShape("Llama-3-8B", 32, 4096, 14336, 32, 8, 128, 128256),
    # meta-llama/Meta-Llama-3-70B config.json: 70.6 B parameters
    "llama3-70b": ModelShape("Llama-3-70B", 80, 8192, 28672, 64, 8, 128, 128256),
    # Qwen/Qwen3-8B config.json (head_dim 128, q/k norm, untied): 8.19 B parameters
    "qwen3-8b": ModelShape("Qwen3-8B", 36, 4096, 12288, 32, 8, 128, 151936, qk_norm=True),
    # tests/helpers.make_model("llama"): the tiny model the tests count collectives on
    "tiny": ModelShape("tiny-llama (tests)", 2, 64, 96, 4, 2, 16, 101),
}


def wire_factor(kind: str, group_size: int) -> float:
    """Estimated bytes a rank puts on the wire per input byte (ring all_gather / reduce_scatter /
    all_reduce, pairwise all_to_all; a send_recv's input is what it sends) in a group of ``group_size`` ranks."""
    g = group_size
    if g <= 1:
        return 0.0
    return {"all_gather": g - 1, "reduce_scatter": (g - 1) / g, "all_reduce": 2 * (g - 1) / g,
            "all_to_all": (g - 1) / g, "send_recv": 1.0}[kind]


@dataclass(frozen=True)
class Flow:
    """One stream of collectives of one optimizer step, as seen by one rank.

    Attributes:
        source: ``zero_params`` (ZeRO parameter gathers), ``zero_grads`` (gradient reduction),
            ``ulysses`` (activation all-to-all), ``ring`` (ring attention's K/V traffic: point-to-point
            exchanges of whole shards, or StreamBP's gathers / reduce-scatters over the ring group),
            ``sp_metadata`` (ds_longseq's per-forward shape and mask/position gather), ``sp_loss`` (the
            group's loss statistics).
        kind: one of :data:`KINDS` (``send_recv``: one ``batch_isend_irecv`` call; bytes = what it sends).
        phase: ``forward``, ``backward`` (``engine.backward``) or ``step`` (``engine.step``).
        group_size: ranks in the collective's group (W for ZeRO, P for the SP metadata, u for Ulysses, r for
            the ring).
        bytes: input bytes per rank, summed over the step (see the module docstring).
        calls: number of calls per rank, or None where DeepSpeed's bucketing / coalescing decides.
    """

    source: str
    kind: str
    phase: str
    group_size: int
    bytes: int
    calls: int | None

    @property
    def wire_bytes(self) -> float:
        return self.bytes * wire_factor(self.kind, self.group_size)


@dataclass(frozen=True)
class CommVolume:
    """The prediction for one configuration: inputs, derived sizes and the flows."""

    shape: ModelShape
    seq_len: int
    micro_batch: int
    world: int
    sp: int
    zero: int
    method: str
    num_chunks: int
    gas: int
    param_bytes: int
    grad_bytes: int
    act_bytes: int
    persistence_threshold: int
    ulysses: int = 1
    ring: int = 1
    flows: tuple[Flow, ...] = field(default=())

    @property
    def dp_replicas(self) -> int:
        return self.world // self.sp

    @property
    def local_len(self) -> int:
        """Tokens per rank of each sequence: ceil(T / P); under a ring 2 ceil(T / 2P) (``shard_batch(pad=True)``
        pads to a multiple of 2P: the ring's 2r zigzag blocks, each cut u ways)."""
        return _local_len(self.seq_len, self.sp, self.ring)

    @property
    def tokens_per_step(self) -> int:
        return self.dp_replicas * self.micro_batch * self.seq_len * self.gas

    def bytes_by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for f in self.flows:
            out[f.kind] += f.bytes
        return out

    def wire_bytes_by_kind(self) -> dict[str, float]:
        out = dict.fromkeys(KINDS, 0.0)
        for f in self.flows:
            out[f.kind] += f.wire_bytes
        return out

    def calls_by_kind(self) -> dict[str, int | None]:
        """Calls per kind; None where any contributing flow's count is not deterministic."""
        out: dict[str, int | None] = dict.fromkeys(KINDS, 0)
        for f in self.flows:
            if f.calls is None or out[f.kind] is None:
                out[f.kind] = None
            else:
                out[f.kind] += f.calls
        return out

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.flows)

    @property
    def total_wire_bytes(self) -> float:
        return sum(f.wire_bytes for f in self.flows)

    def by_source_phase_kind(self) -> dict[tuple[str, str, str], Flow]:
        return {(f.source, f.phase, f.kind): f for f in self.flows}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["flows"] = [{**asdict(f), "wire_bytes": f.wire_bytes} for f in self.flows]
        d.update(
            dp_replicas=self.dp_replicas,
            local_len=self.local_len,
            tokens_per_step=self.tokens_per_step,
            num_params=self.shape.num_params,
            bytes_by_kind=self.bytes_by_kind(),
            calls_by_kind=self.calls_by_kind(),
            wire_bytes_by_kind=self.wire_bytes_by_kind(),
            total_bytes=self.total_bytes,
            total_wire_bytes=self.total_wire_bytes,
        )
        return d


def _zero3_gathers_per_micro_step(role: str, method: str) -> tuple[int, int]:
    """(forward, backward) gathers per micro-step of one decoder-layer parameter of ``role``."""
    if method in ("streambp", "stock"):
        return 1, 1
    last = {"gc": ("mlp_last",), "mst_gc": ("mlp", "mlp_last")}[method]
    return 1, (1 if role in last else 2)


def predict(
    shape: ModelShape | str,
    seq_len: int,
    *,
    world: int,
    sp: int = 1,
    zero: int = 3,
    method: str = "streambp",
    micro_batch: int = 1,
    gas: int = 1,
    chunk_size: int | None = None,
    num_chunks: int | None = None,
    param_bytes: int = 2,
    grad_bytes: int | None = None,
    act_bytes: int | None = None,
    persistence_threshold: int = 0,
    ring: int | None = None,
) -> CommVolume:
    """Predict the per-rank collective traffic of one optimizer step.

    Args:
        shape: a :class:`ModelShape` or a :data:`PRESETS` key.
        seq_len: T, tokens per sequence (the global length under sequence parallelism).
        world: W, total ranks; must be a multiple of ``sp``.
        sp: P, sequence-parallel size (1: none).
        zero: ZeRO stage, 2 or 3.
        method: one of :data:`METHODS`.
        micro_batch: B, sequences per SP group (per rank without SP) per micro-step.
        gas: gradient-accumulation micro-steps per optimizer step.
        chunk_size, num_chunks: StreamBP query chunks of the local shard (give one; ``chunk_size``
            is what ds_longseq is configured with: c = ceil(ceil(T / P) / chunk_size)). They only
            change ``streambp``'s all-to-all call counts; other methods ignore them.
        param_bytes: bytes per element of parameters as gathered (2 for bf16, 4 for fp32).
        grad_bytes: bytes per element of gradients as reduced (default ``param_bytes``).
        act_bytes: bytes per element of activations in the all-to-all (default ``param_bytes``).
        persistence_threshold: ZeRO-3 ``stage3_param_persistence_threshold`` (DeepSpeed's default
            is 100000; the counted tests use 0).
        ring: the ring degree r of P = u x r (``long_seq.sequence_parallel.ring``); None: chosen from the heads as
            ds_longseq does (:func:`sp_degrees`: u the largest divisor of P dividing H).
    """
    if isinstance(shape, str):
        if shape not in PRESETS:
            raise ValueError(f"unknown preset {shape!r}: one of {sorted(PRESETS)}")
        shape = PRESETS[shape]
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    act_bytes = param_bytes if act_bytes is None else act_bytes
    problems = []
    if method not in METHODS:
        problems.append(f"method {method!r} is not one of {METHODS}")
    if zero not in (2, 3):
        problems.append(f"zero stage {zero} is not modelled: use 2 or 3")
    for name, value in (("seq_len", seq_len), ("world", world), ("sp", sp), ("micro_batch", micro_batch),
                        ("gas", gas), ("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("act_bytes", act_bytes)):
        if not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be a positive integer, got {value!r}")
    if problems:
        raise ValueError("; ".join(problems))
    if world % sp:
        problems.append(f"world {world} is not a multiple of the sequence-parallel size {sp}")
    u = r = 1
    try:
        u, r = sp_degrees(sp, shape.heads, ring, shape.kv_heads)
    except ValueError as err:
        problems.append(str(err))
    if chunk_size is not None and num_chunks is not None:
        problems.append("give chunk_size or num_chunks, not both")
    if problems:
        raise ValueError("; ".join(problems))

    W, P, B = world, sp, micro_batch
    T_l = _local_len(seq_len, P, r)
    if method != "streambp":
        c = 1
    elif num_chunks is not None:
        c = num_chunks
    elif chunk_size is not None:
        c = _ceil_div(T_l, chunk_size)
    else:
        c = _ceil_div(T_l, 1024)  # ds_longseq's default streambp.chunk_size
    flows: list[Flow] = []

    def add(source, kind, phase, group, nbytes, calls):
        if nbytes or calls:
            flows.append(Flow(source, kind, phase, group, int(nbytes), calls))

    # ---- ZeRO ----------------------------------------------------------------------------------
    layer = shape.layer_params()
    outer = shape.outer_params()
    unique_outer = [(n, k, m) for n, k, m in outer if not (shape.tied and m == "lm_head")]
    N = shape.num_params
    if zero == 2:
        add("zero_grads", "all_reduce", "backward", W, gas * N * grad_bytes, None)
        if W > 1:
            add("zero_params", "all_gather", "step", W, _ceil_div(N, 2 * W) * 2 * param_bytes, 1)
    else:
        t = persistence_threshold

        def shard(n):
            return _ceil_div(n, W)

        fwd = bwd = 0  # elements gathered per micro-step, per pass
        for _, n, _ in outer:  # tied weight: listed twice, gathered by both modules
            if n > t:
                fwd += shard(n)
                bwd += shard(n)
        for _, n, role in layer:
            if n > t:
                f, b = _zero3_gathers_per_micro_step(role, method)
                fwd += shape.num_layers * f * shard(n)
                bwd += shape.num_layers * b * shard(n)
        persistent = sum(shard(n) for _, n, _ in unique_outer if n <= t)
        persistent += shape.num_layers * sum(shard(n) for _, n, _ in layer if n <= t)
        if W > 1:
            add("zero_params", "all_gather", "forward", W, gas * fwd * param_bytes, None)
            add("zero_params", "all_gather", "backward", W, gas * bwd * param_bytes, None)
            add("zero_params", "all_gather", "step", W, persistent * param_bytes, None)
        padded = sum(shard(n) for _, n, _ in unique_outer) + shape.num_layers * sum(shard(n) for _, n, _ in layer)
        add("zero_grads", "reduce_scatter", "backward", W, gas * W * padded * grad_bytes, None)

    # ---- sequence parallelism: Ulysses over u ranks x ring over r ---------------------------------
    L = shape.num_layers
    kv_eff = max(shape.kv_heads, u)  # kv heads replicated up to u before the all-to-all (none when u = 1)
    if u > 1:
        round_bytes = L * (2 * shape.heads + 2 * kv_eff) * B * T_l * shape.head_dim * act_bytes
        fwd_calls, bwd_calls = {
            "stock": (4, 4),
            "gc": (4, 8),
            "mst_gc": (4, 8),
            "streambp": (2 + 2 * c, (2 + 2 * c) + (2 * c + 2)),
        }[method]
        bwd_rounds = 1 if method == "stock" else 2
        add("ulysses", "all_to_all", "forward", u, gas * round_bytes, gas * L * fwd_calls)
        add("ulysses", "all_to_all", "backward", u, gas * bwd_rounds * round_bytes, gas * L * bwd_calls)
    if r > 1:
        # one rank's K (or V) after the Ulysses exchange: (B, H_kv_eff / u, u T_l, D)
        block = B * kv_eff * T_l * shape.head_dim
        if method == "streambp":  # ops.ulysses.UlyssesRingExchange: per layer and pass, K and V gathered
            add("ring", "all_gather", "forward", r, gas * L * 2 * block * act_bytes, gas * L * 2)
            add("ring", "all_gather", "backward", r, gas * L * 2 * block * act_bytes, gas * L * 2)
            # dK / dV of the whole sequence (B, H_kv_eff / u, T, D), model dtype, summed home
            add("ring", "reduce_scatter", "backward", r, gas * L * 2 * r * block * act_bytes, gas * L * 2)
        else:  # ops.ring._RingAttention: K and V passed r - 1 times per forward, again in backward, dK / dV r times
            grad_bytes_ring = 4 if act_bytes == 2 else act_bytes  # the compute dtype: float32 for half precision
            forwards_in_backward = 0 if method == "stock" else 1  # gc / mst_gc recompute the attention forward
            kv_pass = 2 * block * act_bytes
            add("ring", "send_recv", "forward", r, gas * L * (r - 1) * kv_pass, gas * L * (r - 1))
            add("ring", "send_recv", "backward", r,
                gas * L * ((1 + forwards_in_backward) * (r - 1) * kv_pass + r * 2 * block * grad_bytes_ring),
                gas * L * ((1 + forwards_in_backward) * (r - 1) + r))
    if P > 1:
        add("sp_metadata", "all_gather", "forward", P, gas * (16 + 2 * 8 * B * T_l), 2 * gas)
        add("sp_loss", "all_reduce", "forward", P, gas * 16, gas)

    return CommVolume(
        shape=shape,
        seq_len=seq_len,
        micro_batch=B,
        world=W,
        sp=P,
        zero=zero,
        method=method,
        num_chunks=c,
        gas=gas,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        act_bytes=act_bytes,
        persistence_threshold=persistence_threshold,
        ulysses=u,
        ring=r,
        flows=tuple(flows),
    )


def sweep(worlds=None, **kwargs) -> list[CommVolume]:
    """:func:`predict` for each world size (default: powers of two from 8 to 4096, multiples of sp)."""
    sp = kwargs.get("sp", 1)
    if worlds is None:
        worlds = [2**k for k in range(3, 13)]
    return [predict(world=w, **kwargs) for w in worlds if w % sp == 0 and w >= sp]


# ---- CLI ----------------------------------------------------------------------------------------


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def _header(v: CommVolume) -> str:
    s = v.shape
    tied = "tied" if s.tied else "untied"
    chunks = f", {v.num_chunks} StreamBP chunks of the local shard" if v.method == "streambp" else ""
    return (
        f"{s.name}: {_fmt_count(s.num_params)} params ({tied}), {s.num_layers} layers, H {s.heads}, "
        f"H_kv {s.kv_heads}, D {s.head_dim}\n"
        f"T = {v.seq_len:,} tokens, micro-batch {v.micro_batch}, GAS {v.gas}; world {v.world} = "
        f"{v.dp_replicas} data-parallel replicas x SP {v.sp}{_split(v)} (local shard {v.local_len:,} tokens); "
        f"ZeRO-{v.zero}; method {v.method}{chunks}\n"
        f"bytes/element: params {v.param_bytes}, grads {v.grad_bytes}, activations {v.act_bytes}; "
        f"persistence threshold {v.persistence_threshold}; tokens per optimizer step {v.tokens_per_step:,}"
    )


def _split(v: CommVolume) -> str:
    return f" = Ulysses {v.ulysses} x ring {v.ring}" if v.sp > 1 else ""


def format_table(v: CommVolume) -> str:
    """Per-flow and per-kind table for one configuration."""
    lines = [_header(v), "", "per rank, per optimizer step (input bytes = what the tests count; wire = ring estimate):"]
    row = "{:<12} {:<15} {:<9} {:>6} {:>9} {:>18} {:>11} {:>11}"
    lines.append(row.format("source", "kind", "phase", "group", "calls", "input bytes", "input", "est. wire"))
    for f in v.flows:
        calls = "-" if f.calls is None else f"{f.calls:,}"
        lines.append(row.format(f.source, f.kind, f.phase, f.group_size, calls, f"{f.bytes:,}",
                                _fmt_bytes(f.bytes), _fmt_bytes(f.wire_bytes)))
    lines.append("")
    lines.append(row.format("total", "by kind", "", "", "", "", "", ""))
    wire = v.wire_bytes_by_kind()
    for kind, nbytes in v.bytes_by_kind().items():
        if nbytes:
            calls = v.calls_by_kind()[kind]
            lines.append(row.format("", kind, "", "", "-" if calls is None else f"{calls:,}", f"{nbytes:,}",
                                    _fmt_bytes(nbytes), _fmt_bytes(wire[kind])))
    lines.append(row.format("", "all", "", "", "", f"{v.total_bytes:,}", _fmt_bytes(v.total_bytes),
                            _fmt_bytes(v.total_wire_bytes)))
    return "\n".join(lines)


SWEEP_COLUMNS = (("zero_params", "ZeRO param gathers"), ("zero_grads", "ZeRO grad reduction"),
                 ("ulysses", "Ulysses all-to-all"), ("ring", "ring K/V traffic"), ("sp", "SP metadata + loss"))


def bytes_by_source(v: CommVolume) -> dict[str, tuple[int, float]]:
    """(input bytes, estimated wire bytes) per source; ``sp`` = ``sp_metadata`` + ``sp_loss``."""
    out = {key: (0, 0.0) for key, _ in SWEEP_COLUMNS}
    for f in v.flows:
        key = "sp" if f.source.startswith("sp_") else f.source
        b, w = out[key]
        out[key] = (b + f.bytes, w + f.wire_bytes)
    return out


def format_sweep(volumes: list[CommVolume]) -> str:
    """One line per world size: per-rank input and estimated wire bytes by source."""
    if not volumes:
        return "(no world size is a multiple of the sequence-parallel size)"
    v0 = volumes[0]
    header = _header(v0).split("\n")
    chunks = f" ({v0.num_chunks} chunks)" if v0.method == "streambp" else ""
    lines = [
        header[0],
        f"T = {v0.seq_len:,}, micro-batch {v0.micro_batch}, GAS {v0.gas}, SP {v0.sp}{_split(v0)}, ZeRO-{v0.zero}, "
        f"method {v0.method}{chunks}",
        header[2].split("; tokens per")[0],
        "per rank, per optimizer step: input bytes (counted unit) / estimated wire bytes (ring)",
    ]
    columns = [(k, t) for k, t in SWEEP_COLUMNS if k != "ring" or v0.ring > 1]
    row = "{:>6} {:>5} {:>14} " + " ".join("{:>25}" for _ in columns) + " {:>11} {:>11}"
    lines.append(row.format("world", "DP", "tokens/step", *(title for _, title in columns),
                            "total wire", "wire/token"))
    for v in volumes:
        src = bytes_by_source(v)
        cells = [f"{_fmt_bytes(src[k][0])} / {_fmt_bytes(src[k][1])}" for k, _ in columns]
        per_rank_tokens = v.micro_batch * v.local_len * v.gas
        lines.append(row.format(v.world, v.dp_replicas, f"{v.tokens_per_step:,}", *cells,
                                _fmt_bytes(v.total_wire_bytes), _fmt_bytes(v.total_wire_bytes / per_rank_tokens)))
    lines.append("(wire/token: estimated wire bytes per rank per token that rank holds, B x ceil(T/P) x GAS)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.comm_model",
        description="Per-rank collective bytes of one optimizer step (ZeRO-2/3 + Ulysses x ring SP + chunking).",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    parser.add_argument("--seq-len", type=int, default=1048576)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--gas", type=int, default=1)
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--sp", type=int, default=1)
    parser.add_argument("--ring", type=int, help="ring degree r of SP = u x r (default: chosen from the heads)")
    parser.add_argument("--zero", type=int, choices=(2, 3), default=3)
    parser.add_argument("--method", choices=METHODS, default="streambp")
    chunks = parser.add_mutually_exclusive_group()
    chunks.add_argument("--chunk-size", type=int, help="StreamBP chunk_size (tokens of the local shard)")
    chunks.add_argument("--num-chunks", type=int, help="StreamBP chunks of the local shard")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per parameter element (2: bf16)")
    parser.add_argument("--grad-bytes", type=int, help="bytes per gradient element (default: --dtype-bytes)")
    parser.add_argument("--act-bytes", type=int, help="bytes per activation element (default: --dtype-bytes)")
    parser.add_argument("--persistence-threshold", type=int, default=0,
                        help="ZeRO-3 stage3_param_persistence_threshold (DeepSpeed default 100000)")
    parser.add_argument("--sweep", action="store_true", help="worlds 8..4096 (multiples of --sp)")
    parser.add_argument("--json", action="store_true", help="print the full prediction(s) as JSON")
    args = parser.parse_args(argv)
    kwargs = dict(
        shape=args.preset, seq_len=args.seq_len, sp=args.sp, zero=args.zero, method=args.method,
        micro_batch=args.micro_batch, gas=args.gas, chunk_size=args.chunk_size, num_chunks=args.num_chunks,
        param_bytes=args.dtype_bytes, grad_bytes=args.grad_bytes, act_bytes=args.act_bytes,
        persistence_threshold=args.persistence_threshold, ring=args.ring,
    )
    try:
        volumes = sweep(**kwargs) if args.sweep else [predict(world=args.world, **kwargs)]
    except ValueError as err:
        parser.error(str(err))
    if args.json:
        print(json.dumps([v.to_dict() for v in volumes] if args.sweep else volumes[0].to_dict(), indent=1))
    elif args.sweep:
        print(format_sweep(volumes))
    else:
        print(format_table(volumes[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
