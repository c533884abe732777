"""The planner's memory model: what one training step needs per GPU and per host, and the longest sequence that fits.

Torch-free, as the whole planner (``ds_longseq.plan``: the command line and the public names; ``plan_search``: the
search behind ``--write-config``, built on this module).

Holds:
    ModelDims: a decoder's sizes, read from a Hugging Face config (``from_config``) and its parameter counts.
    Method / METHOD_OF_TECHNIQUE: the training methods the planner knows, and which of them a ``long_seq``
        technique means (the one place a method's name is written).
    Setup: how it trains (method from the ``long_seq`` section, offload, SP degree, ZeRO stage, LoRA, dtype,
        GPUs and nodes); ``Setup.from_configs`` reads a DeepSpeed config and the typed ``LongSeqConfig`` of its
        ``long_seq`` section (parsed there only when the caller has not parsed it).
    Coefficient / COEFFICIENTS: the fitted part of the model, per method and regime (see below).
    estimate: per-GPU and per-host bytes of one step at a length, broken down by component.
    longest_fit, plan (a Plan with the estimate, the longest fitting length, chunk suggestions and the preset
        to start from), preflight (the check the examples run before their first step).
    quantised_linears / quantised_bytes / quantised_parts: QLoRA's 4-bit weights (``Setup.load_in_4bit``), counted
        as bitsandbytes holds them (the ``weights`` component; ``dequantised``: one linear unpacked for its matmul).
    trainable_count: the parameters the optimizer updates (the step-time model counts them too).

The model. Per GPU, for a sequence of T tokens (T_local = T / SP degree per rank, batch B):

    weights     every parameter, in the training dtype; divided over the GPUs under ZeRO-3
    grads       the trainable parameters' gradients; divided under ZeRO-2/3
    optimizer   AdamW state (fp32 master + 2 moments = 12 B/param in mixed precision, 2 moments = 8 B in fp32);
                divided under ZeRO-1/2/3; on the host with ``offload_optimizer``
    layer_inputs  L x B x T_local x d x dtype bytes: what StreamBP / checkpointing keep between forward and
                backward; on the host with ``long_seq.offload.layer_inputs='cpu'`` (pinned, per rank), on disk
                with ``'disk'`` (``Estimate.disk``; the host then holds two 16 MiB staging buffers per rank,
                ``disk_staging``); ceil(L / k) of them with ``long_seq.offload.keep_every = k``
    rebuilt_block with keep_every = k > 1: the block's inputs rebuilt in backward, waiting on the device (k - 1
                inputs, k when the kept ones are offloaded): structural, not yet checked against a measurement
    ring_kv     under Ulysses x ring (SP = u x r, r > 1, ``ops.sp_layout``): what ring attention holds beyond
                Ulysses alone. StreamBP: each layer's K/V of the whole sequence for Hkv_u = max(Hkv, u) / u heads
                with their float32 gradient accumulators (r - 1 local shards' worth more than Ulysses, plus one
                transient copy of the gathered keys); whole-shard methods: the K/V block in flight and its
                gradients'. Structural, from the buffers' sizes; not yet checked against a measurement
    activations the rest of the step's peak that grows with T_local: FITTED, ``per_token`` units of a
                method-specific size per token (hidden-size vectors, or vocab-size fp32 vectors for methods
                whose un-chunked LM head dominates)
    fixed       the rest that does not grow with T (chunk work space, LM-head chunk, allocator): FITTED, MiB
    buffers     a fixed 1 GiB per GPU for the CUDA context and communication buffers (not fitted: the
                measurements count from after the model's build, which already holds them)
    chunk_work  a StreamBP chunk smaller than the one the fit ran with (``FITTED_CHUNK``) holds less: the difference
                at the measured per-chunk-token slope (negative; absent at the fitted chunk and for "auto")
    dequantised with 4-bit weights (``load_in_4bit``): the widest quantised linear unpacked in the compute dtype;
                the ``weights`` then count the decoder's linears as bitsandbytes packs them (``quantised_bytes``:
                0.5 byte per weight, a float32 absmax per 64, or with double quantisation one byte per 64 and a
                float32 per 256 blocks), whole on every GPU; structural, exact against bitsandbytes' tensors

The fitted numbers come from the repository's own measurements (``benchmarks/plan_fit.py``): each
(method, regime) line is fitted on half of its measured points (every other length) and the error is reported
on the other half (``benchmarks/results/plan_validation.md``). Regimes: ``cpu`` (float32 models on CPU: the
Llama h512 / 4-layer shape of the cpu, memory and sp_memory suites) and ``gpu`` (bf16 on CUDA: the
Llama-3-8B LoRA rows measured on an H100 and an H200). Another model shape scales the fitted per-token term
with its own sizes: an estimate, not a measurement, until a run checks it.
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, field, replace
from typing import Literal, Mapping

from ds_longseq.batch_size import read_batch_size
from ds_longseq.config import LongSeqConfig
from ds_longseq.config_files import find_ds_config, read_json_file
from ds_longseq.families.dims import ModelDims
from ds_longseq.ops.chunk_sizes import largest_fitting
from ds_longseq.ops.sp_layout import sp_degrees
from ds_longseq.resolver import Launch, resolve

__all__ = [
    "ModelDims",
    "Method",
    "METHOD_OF_TECHNIQUE",
    "Setup",
    "Coefficient",
    "COEFFICIENTS",
    "HELD_OUT_ERROR",
    "FITTED_CHUNK",
    "Estimate",
    "Plan",
    "PreflightError",
    "estimate",
    "longest_fit",
    "resolve_keep",
    "sp_split",
    "plan",
    "preflight",
    "recommend_preset",
    "QuantType",
    "quantised_linears",
    "quantised_bytes",
    "quantised_parts",
    "trainable_count",
]

GIB = 1024**3
MIB = 1024**2
BUFFERS_BYTES = GIB  # CUDA context + NCCL / DeepSpeed buffers per GPU (not part of any fitted measurement)
DISK_STAGING_BYTES = 2 * 16 * MIB  # the disk tier's two staging buffers per rank (ops.disk_store.PIECE_BYTES each)
QuantType = Literal["nf4", "fp4"]
"""bitsandbytes' 4-bit data types (``bnb_4bit_quant_type``): the same bytes either way."""
Method = Literal["stock", "hf_gc", "alst", "alst_offload", "alst_offload_sync", "mst", "streambp"]
"""How the model trains: ds_longseq's techniques (``METHOD_OF_TECHNIQUE``), Hugging Face checkpointing (``hf_gc``,
what the examples turn on when no technique is), nothing (``stock``), or a competitor's recipe (``alst*``)."""
METHOD_OF_TECHNIQUE: dict[str, Method] = {"streambp": "streambp", "mini_seq": "mst"}
"""The planner's method for each ``long_seq`` technique it has measurements of, the first enabled one winning
(the two conflict anyway); these methods keep each layer's input only, so offload and keep_every apply to them."""


@dataclass(frozen=True)
class Setup:
    """How the model trains. ``method`` is ds_longseq's (``streambp``, ``mst`` = mini_seq, ``hf_gc`` =
    Hugging Face checkpointing, ``stock``) or a competitor's recipe (``alst``, ``alst_offload``: ALST's own
    checkpoint offload, ``alst_offload_sync``: the benchmarks' older imitation)."""

    method: Method = "streambp"
    offload_layer_inputs: bool = False
    disk_layer_inputs: bool = False  # long_seq.offload.layer_inputs='disk': the offloaded inputs go to files
    keep_every: int = 1  # long_seq.offload.keep_every: only every k-th layer input is kept (StreamBP)
    sequence_parallel: int = 1
    ring: int | None = None  # long_seq.sequence_parallel.ring: None chooses it from the heads (ops.sp_layout)
    zero_stage: int = 2
    gpus: int = 1
    nodes: int = 1
    dtype_bytes: int = 2
    lora_rank: int | None = None
    trainable_params: int | None = None  # counted from the model when known; default: all, or LoRA's at lora_rank
    offload_optimizer: bool = False
    # default: 12 (bf16 mixed precision: fp32 master + 2 moments), 8 (fp32: 2 moments)
    optimizer_bytes_per_param: int | None = None
    batch_size: int = 1
    device: Literal["cuda", "cpu"] = "cuda"
    chunk_size: int = 4096  # long_seq.streambp.chunk_size; 0 for "auto" (chosen at each step)
    lm_head_chunk_size: int = 4096
    # long_seq.streambp.keep_attention_output (StreamBP only): True / False, or "auto": kept where it fits
    # (``resolve_keep``, as the run's forward decides)
    keep_attention_output: bool | Literal["auto"] = "auto"
    # QLoRA: the decoder layers' linears held by bitsandbytes in 4 bits ("nf4" or "fp4"; the scripts' --load-in-4bit),
    # with their block scales quantised again (double_quant, the QLoRA paper's default; --no-double-quant turns it off)
    load_in_4bit: QuantType | None = None
    double_quant: bool = True

    def __post_init__(self):
        problems = []
        if self.gpus < 1 or self.nodes < 1 or self.gpus % self.nodes:
            problems.append(f"gpus={self.gpus} over nodes={self.nodes}: the GPU count must be a multiple of nodes")
        if self.sequence_parallel < 1 or self.gpus % self.sequence_parallel:
            problems.append(f"sequence_parallel={self.sequence_parallel} must divide gpus={self.gpus}")
        if self.ring is not None and (self.ring < 1 or self.sequence_parallel % self.ring):
            problems.append(f"ring={self.ring} must divide sequence_parallel={self.sequence_parallel}")
        if self.zero_stage not in (0, 1, 2, 3):
            problems.append(f"zero_stage={self.zero_stage}: DeepSpeed's stages are 0-3")
        if self.disk_layer_inputs and not self.offload_layer_inputs:
            problems.append("disk_layer_inputs=True is a kind of offload: set offload_layer_inputs=True too")
        if self.keep_every < 1:
            problems.append(f"keep_every={self.keep_every} must be >= 1")
        if self.lora_rank is not None and self.lora_rank < 1:
            problems.append(f"lora_rank={self.lora_rank} must be >= 1")
        if self.keep_attention_output not in (True, False, "auto"):
            problems.append(f"keep_attention_output={self.keep_attention_output!r} must be True, False or 'auto'")
        if self.load_in_4bit not in (None, *typing.get_args(QuantType)):
            problems.append(f"load_in_4bit={self.load_in_4bit!r} must be None, 'nf4' or 'fp4'")
        if self.load_in_4bit and self.lora_rank is None and self.trainable_params is None:
            problems.append(f"load_in_4bit={self.load_in_4bit!r}: 4-bit weights cannot be trained, only an adapter on "
                            "them: give the LoRA rank (--lora-rank R)")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def keeps_attention_outputs(self) -> bool:
        """Whether the step keeps the attention outputs beside the layer inputs (StreamBP with
        ``keep_attention_output`` True; "auto" is resolved against the memory by :func:`resolve_keep`)."""
        return self.method == "streambp" and self.keep_attention_output is True

    @property
    def keeps_layer_inputs(self) -> bool:
        """Whether the method keeps each layer's input between forward and backward (all but stock)."""
        return self.method != "stock"

    @classmethod
    def from_configs(cls, ds_config: str | os.PathLike | Mapping | None = None, *,
                     long_seq: LongSeqConfig | None = None,
                     device: str = "cuda", gpus: int = 1, nodes: int = 1, lora_rank: int | None = None,
                     batch_size: int | None = None, trainable_params: int | None = None,
                     load_in_4bit: QuantType | None = None, double_quant: bool = True) -> "Setup":
        """From a DeepSpeed config and its ``long_seq`` section, and the launch, resolved as a run would be
        (:func:`ds_longseq.resolver.resolve` against ``gpus`` ranks: a config no run could start with is refused here
        with the same problems).

        Args:
            ds_config: the DeepSpeed config (ZeRO stage, precision, micro-batch, optimizer offload): a dict, or a path
                or a shipped config's name.
            long_seq: its ``long_seq`` section, parsed; default: ``ds_config["long_seq"]``, used as it is when it
                is a :class:`LongSeqConfig` already, else parsed here (``LongSeqConfig.of``).
            device, gpus, nodes, lora_rank, batch_size, trainable_params, load_in_4bit, double_quant: the launch
                (see the fields).

        Raises:
            RunCannotStart: the config, or the config against ``gpus`` ranks, cannot start a run (a ValueError).
        """
        if ds_config is not None and not isinstance(ds_config, Mapping):
            ds_config = read_json_file(find_ds_config(ds_config))
        given = {**(ds_config or {}), **({"long_seq": long_seq} if long_seq is not None else {})}
        resolved = resolve(given, launch=Launch(world=gpus))
        ds_config, ls = resolved.ds_config, resolved.long_seq
        zero = ds_config.get("zero_optimization") or {}
        enabled = [t for t in METHOD_OF_TECHNIQUE if getattr(ls.section(t), "enabled", False)]
        # with no ds_longseq technique the examples turn Hugging Face checkpointing on
        method: Method = METHOD_OF_TECHNIQUE[enabled[0]] if enabled else "hf_gc"
        bf16 = (ds_config.get("bf16") or {}).get("enabled") or (ds_config.get("fp16") or {}).get("enabled")
        return cls(
            method=method,
            offload_layer_inputs=ls.offload.layer_inputs in ("cpu", "disk"),
            disk_layer_inputs=ls.offload.layer_inputs == "disk",
            keep_every=ls.offload.keep_every,
            sequence_parallel=ls.sequence_parallel.size,
            ring=ls.sequence_parallel.ring,
            zero_stage=int(zero.get("stage", 0)),
            gpus=gpus,
            nodes=nodes,
            dtype_bytes=2 if bf16 else 4,
            lora_rank=lora_rank,
            trainable_params=trainable_params,
            offload_optimizer=(zero.get("offload_optimizer") or {}).get("device") == "cpu",
            batch_size=batch_size or _micro_batch(ds_config, max(gpus // ls.sequence_parallel.size, 1)),
            device="cpu" if device == "cpu" else "cuda",
            chunk_size=_chunk(ls.streambp.chunk_size),
            lm_head_chunk_size=ls.lm_head.chunk_size,
            keep_attention_output=ls.streambp.keep_attention_output,
            load_in_4bit=load_in_4bit,
            double_quant=double_quant,
        )


def _micro_batch(ds_config: Mapping, replicas: int) -> int:
    """The micro-batch DeepSpeed will run with ``ds_config`` (any two of its batch keys, DeepSpeed's rule; "auto" as
    1, the Trainer's default; 1 where the config gives neither the micro-batch nor the global batch)."""
    if ds_config.get("train_batch_size") is None and ds_config.get("train_micro_batch_size_per_gpu") is None:
        return 1
    return read_batch_size(ds_config, replicas, micro_batch=1, gradient_accumulation=1).micro_batch


def _chunk(value) -> int:
    """A config's ``streambp.chunk_size`` as the planner's ``Setup.chunk_size`` ("auto": 0, chosen per step)."""
    return 0 if value == "auto" else int(value)


@dataclass(frozen=True)
class Coefficient:
    """The fitted part of one (regime, method): ``per_token`` units of ``unit`` per local token, ``fixed_mib``."""

    per_token: float
    fixed_mib: float
    unit: Literal["hidden", "vocab"] = "hidden"  # hidden: d x dtype bytes; vocab: V x 4 bytes (fp32 logits)
    fitted_on: str = ""


# Written by `python -m benchmarks.plan_fit --write` from the fit half of the measurements (every other length
# of each method's points); tests/test_plan.py re-fits the committed CSVs and checks these numbers.
# BEGIN FITTED
COEFFICIENTS: dict[tuple[str, str], Coefficient] = {
    ('cpu', 'alst'): Coefficient(7.122, 251.8, 'hidden',
                                  '5 points of cpu_suite.csv, memory_cpu.csv, memory_cpu_32k.csv'),
    ('cpu', 'alst_sp'): Coefficient(4.2583, 282.0, 'hidden',
                                  '2 points of sp_memory_cpu.csv'),
    ('cpu', 'hf_gc'): Coefficient(3.0474, -145.1, 'vocab',
                                  '4 points of cpu_suite.csv, memory_cpu.csv'),
    ('cpu', 'mst'): Coefficient(10.8201, 68.3, 'hidden',
                                  '5 points of cpu_suite.csv, memory_cpu.csv, memory_cpu_32k.csv'),
    ('cpu', 'mst_sp'): Coefficient(8.875, 58.3, 'hidden',
                                  '2 points of sp_memory_cpu.csv'),
    ('cpu', 'stock'): Coefficient(4.3797, -149.0, 'vocab',
                                  '4 points of cpu_suite.csv, memory_cpu.csv'),
    ('cpu', 'streambp'): Coefficient(4.1593, 112.2, 'hidden',
                                  '5 points of cpu_suite.csv, memory_cpu.csv, memory_cpu_32k.csv'),
    ('cpu', 'streambp_sp'): Coefficient(4.3792, 101.0, 'hidden',
                                  '2 points of sp_memory_cpu.csv'),
    ('gpu', 'alst'): Coefficient(25.6109, 147.4, 'hidden',
                                  '2 points of gpu_lora_h100.csv'),
    ('gpu', 'alst_offload'): Coefficient(58.1941, 409.1, 'hidden',
                                  '2 points of gpu_lora_real_alst_h200.csv'),
    ('gpu', 'alst_offload_sync'): Coefficient(28.414, 282.3, 'hidden',
                                  '3 points of gpu_lora_h100.csv'),
    ('gpu', 'hf_gc'): Coefficient(3.033, 144.0, 'vocab',
                                  '2 points of gpu_lora_h100.csv'),
    ('gpu', 'mst'): Coefficient(25.6109, 147.4, 'hidden',
                                  '2 points of gpu_lora_h100.csv'),
    ('gpu', 'streambp'): Coefficient(11.1804, 728.3, 'hidden',
                                  '2 points of gpu_lora_h100.csv'),
    ('gpu', 'streambp_offload'): Coefficient(11.5918, 622.2, 'hidden',
                                  '4 points of gpu_lora_h100.csv, gpu_lora_real_alst_h200.csv'),
}
HELD_OUT_ERROR: dict[str, float] = {'cpu': 0.1, 'gpu': 0.09}  # largest held-out error, rounded up, at least 5%
# END FITTED


def _key(setup: Setup) -> str:
    base = setup.method
    if setup.sequence_parallel > 1 and base in ("alst", "mst", "streambp"):
        return f"{base}_sp"
    if base == "streambp" and setup.offload_layer_inputs:
        return "streambp_offload"
    return base


def coefficient(setup: Setup) -> tuple[Coefficient, str]:
    """The fitted coefficient for ``setup`` and where it comes from (a note when borrowed from elsewhere)."""
    regime = "cpu" if setup.device == "cpu" else "gpu"
    key = _key(setup)
    base = key.removesuffix("_sp")
    for candidate, note in (
        ((regime, key), ""),
        ((regime, base), f"no {key} measurement in the {regime} regime: {base}'s"),
        (("gpu" if regime == "cpu" else "cpu", key), f"no {regime} measurement of {key}: the other regime's"),
    ):
        if candidate in COEFFICIENTS:
            return COEFFICIENTS[candidate], note
    raise ValueError(f"no fitted memory coefficient for method {key!r} (measured: "
                     f"{sorted({k for _, k in COEFFICIENTS})})")


BNB_BLOCK = 64
"""Weights per absmax in bitsandbytes' 4-bit blocks (``bnb_4bit`` quantisation's ``blocksize``)."""
BNB_NESTED_BLOCK = 256
"""Double quantisation: blocks per float32 absmax of the 8-bit absmaxes (the nested state's ``blocksize``)."""
BNB_CODE_BYTES = 16 * 4
"""Each quantised linear's code: the float32 levels of its 16 4-bit values (nf4's or fp4's)."""
BNB_NESTED_STATE_BYTES = 256 * 4 + 4
"""Each quantised linear's nested state under double quantisation: the 8-bit code's 256 float32 levels and the
float32 offset subtracted from the absmaxes."""


def quantised_linears(dims: ModelDims) -> tuple[int, ...]:
    """The weight counts of one decoder layer's linears that bitsandbytes holds in 4 bits: the attention's q, k, v and
    o, and a dense MLP's gate, up and down. The rest stays in the compute dtype (transformers' ``BitsAndBytesConfig``
    converts ``nn.Linear``s only and leaves the LM head out): the embeddings, the LM head, the norms, and an MoE's
    router and experts (its experts are 3-D parameters in transformers, not ``nn.Linear``s; checked on Mixtral)."""
    d, dh = dims.hidden_size, dims.head_dim
    q, kv = d * dims.num_heads * dh, d * dims.num_kv_heads * dh
    return (q, kv, kv, q) + (() if dims.num_experts else (d * dims.intermediate_size,) * 3)


def quantised_parts(numel: int, double_quant: bool = True) -> tuple[int, int]:
    """(the packed weight's bytes, its quantisation state's) for one linear of ``numel`` weights in 4 bits: two
    weights per byte in the parameter; the state (not a parameter, so ZeRO-3 leaves it whole) one absmax per
    ``BNB_BLOCK`` weights (float32; with ``double_quant`` one byte, plus a float32 per ``BNB_NESTED_BLOCK`` blocks and
    the nested code and offset), and the 4-bit code."""
    blocks = -(-numel // BNB_BLOCK)
    scales = blocks + 4 * -(-blocks // BNB_NESTED_BLOCK) + BNB_NESTED_STATE_BYTES if double_quant else 4 * blocks
    return (numel + 1) // 2, scales + BNB_CODE_BYTES


def quantised_bytes(numel: int, double_quant: bool = True) -> int:
    """Bytes bitsandbytes holds for one linear of ``numel`` weights in 4 bits (:func:`quantised_parts`, summed). Exact
    against ``Params4bit`` and its ``quant_state`` (tests/test_plan_write_config.py)."""
    return sum(quantised_parts(numel, double_quant))


FITTED_CHUNK = {"cpu": 1024, "gpu": 4096}
"""The StreamBP chunk the fitted measurements ran with (and that measured fastest there): the fitted ``fixed`` part
holds one chunk's work of this size."""
CHUNK_WORK_SLOPE = 46.5 / 60.2
"""The measured per-chunk-token peak over ``ModelDims.chunk_work_per_token``'s count (benchmarks/RESULTS.md section
12, CPU): what a chunk smaller than the fitted one saves is counted at the measured slope, not the analytic one."""


def _chunk_work_bytes(dims: ModelDims, setup: Setup, t_local: int) -> float:
    """The ``chunk_work`` component: a StreamBP chunk below ``FITTED_CHUNK`` holds less work than the fitted
    ``fixed`` part assumes (negative; 0 at the fitted chunk, for "auto", and for other methods). Larger chunks are
    not extrapolated (0): the measurements found them no faster."""
    fitted = min(FITTED_CHUNK["cpu" if setup.device == "cpu" else "gpu"], t_local)
    if setup.method != "streambp" or not setup.chunk_size or setup.chunk_size >= fitted:
        return 0.0
    per_token = dims.chunk_work_per_token(setup.dtype_bytes) * CHUNK_WORK_SLOPE
    return -(fitted - setup.chunk_size) * per_token * setup.batch_size


def _weight_bytes(dims: ModelDims, setup: Setup) -> tuple[float, float]:
    """(the ``weights`` component, the ``dequantised`` one). Weights: every parameter in the training dtype, divided
    over the GPUs under ZeRO-3 (and one layer gathered whole); with ``load_in_4bit`` the quantised linears
    (``quantised_linears``) as bitsandbytes holds them (``quantised_parts``): the packed weights are parameters,
    which ZeRO-3 partitions like any other (tests/test_qlora.py checks it), their quantisation states are not and
    stay whole on every GPU. Dequantised: the widest quantised linear unpacked in the compute dtype for its matmul,
    forward or backward (structural, not measured)."""
    b, world, zero3 = setup.dtype_bytes, setup.gpus, setup.zero_stage >= 3
    share = world if zero3 else 1
    linears = quantised_linears(dims) if setup.load_in_4bit else ()
    parts = [quantised_parts(n, setup.double_quant) for n in linears]
    layer_packed = sum(packed for packed, _ in parts)
    plain = dims.num_params - dims.num_layers * sum(linears)
    gathered = (dims.layer_params - sum(linears)) * b + layer_packed if zero3 and world > 1 else 0
    quantised = dims.num_layers * (layer_packed / share + sum(state for _, state in parts))
    return plain * b / share + gathered + quantised, max(linears, default=0) * b


def trainable_count(dims: ModelDims, setup: Setup) -> int:
    """The parameters the optimizer updates: counted, LoRA's at ``lora_rank``, or all."""
    if setup.trainable_params is not None:
        return setup.trainable_params
    return dims.lora_params(setup.lora_rank) if setup.lora_rank else dims.num_params


@dataclass
class Estimate:
    """Bytes of one training step at ``seq_len``: per GPU (``device``) and per host (``host``), by component."""

    seq_len: int
    device: dict[str, float]
    host: dict[str, float]
    note: str = ""
    disk: dict[str, float] = field(default_factory=dict)
    """Bytes per host on disk (``layer_inputs='disk'``), by component; empty otherwise."""

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def above_build(self) -> float:
        """What the benchmarks measure: the step's peak above the built model (no weights, no buffers)."""
        return sum(v for k, v in self.device.items() if k not in ("weights", "buffers"))

    def fits(self, device_bytes: float, host_bytes: float | None) -> bool:
        """Whether the step fits ``device_bytes`` per GPU and ``host_bytes`` per host (None: the host is not
        checked)."""
        return self.device_total <= device_bytes and (host_bytes is None or self.host_total <= host_bytes)


def estimate(dims: ModelDims, setup: Setup, seq_len: int, *, optimizer_step: bool = True,
             coef: Coefficient | None = None) -> Estimate:
    """Per-GPU and per-host bytes of one step of ``seq_len`` tokens (global; each rank holds seq_len / SP).

    ``optimizer_step``: count the optimizer state (a forward + backward alone does not create it);
    ``coef``: the fitted part to use (default: ``COEFFICIENTS``' for the setup)."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    coef, note = (coef, "") if coef is not None else coefficient(setup)
    b, world, sp = setup.dtype_bytes, setup.gpus, setup.sequence_parallel
    t_local = math.ceil(seq_len / sp) * setup.batch_size
    trainable = trainable_count(dims, setup)
    weights, dequantised = _weight_bytes(dims, setup)
    grads = trainable * b / (world if setup.zero_stage >= 2 else 1)
    state_bytes = setup.optimizer_bytes_per_param or (12 if b == 2 else 8)
    optimizer = trainable * state_bytes / (world if setup.zero_stage >= 1 else 1) if optimizer_step else 0.0
    one_input = t_local * dims.hidden_size * b
    k = setup.keep_every
    inputs = -(-dims.num_layers // k) * one_input if setup.keeps_layer_inputs else 0.0
    # beside each kept input, its layer's attention outputs (heads x head dim, and a log-sum-exp per head)
    one_output = t_local * dims.attention_output_bytes(b) if setup.keeps_attention_outputs else 0.0
    outputs = -(-dims.num_layers // k) * one_output
    unit = dims.hidden_size * b if coef.unit == "hidden" else dims.vocab_size * 4
    device = {
        "weights": weights,
        "grads": grads,
        "optimizer": 0.0 if setup.offload_optimizer else optimizer,
        "layer_inputs": 0.0 if setup.offload_layer_inputs else inputs,
        # offloaded with the inputs, one layer's waiting on the device until the end of its forward
        "attention_outputs": one_output if setup.offload_layer_inputs else outputs,
        # keep_every > 1: in backward one block's inputs are rebuilt and wait on the device (not yet measured)
        "rebuilt_block": (k - (0 if setup.offload_layer_inputs else 1)) * one_input if k > 1 else 0.0,
        "ring_kv": _ring_kv_bytes(dims, setup, t_local),
        "activations": coef.per_token * unit * t_local,
        "fixed": coef.fixed_mib * MIB,
        "buffers": BUFFERS_BYTES if setup.device == "cuda" else 0.0,
    }
    # components that only some setups have, so that the others' reports stay as they were
    chunk_work = _chunk_work_bytes(dims, setup, math.ceil(seq_len / sp))
    for name, value in (("dequantised", dequantised), ("chunk_work", chunk_work)):
        if value:
            device[name] = value
    ranks = setup.gpus_per_node
    on_disk = setup.disk_layer_inputs
    host = {
        "layer_inputs": inputs * ranks if setup.offload_layer_inputs and not on_disk else 0.0,
        "attention_outputs": outputs * ranks if setup.offload_layer_inputs and not on_disk else 0.0,
        # DeepSpeed's CPU Adam: fp32 gradients + master weights + 2 moments per parameter, this host's share
        "optimizer": trainable * (4 + 12) / world * ranks if setup.offload_optimizer else 0.0,
    }
    if on_disk:
        host["disk_staging"] = DISK_STAGING_BYTES * ranks
    disk = {"layer_inputs": inputs * ranks, "attention_outputs": outputs * ranks} if on_disk else {}
    return Estimate(seq_len, device, host, note, disk)


def resolve_keep(dims: ModelDims, setup: Setup, seq_len: int, device_bytes: float,
                 host_bytes: float | None = None) -> Setup:
    """``setup`` with ``keep_attention_output: "auto"`` decided for ``seq_len``: kept where the estimate with them
    fits (``device_bytes``, ``host_bytes``), as the run's forward decides (``forwards.keep_attention``); else as it
    is."""
    if setup.keep_attention_output != "auto":
        return setup
    kept = replace(setup, keep_attention_output=True)
    fits = setup.method == "streambp" and estimate(dims, kept, seq_len).fits(device_bytes, host_bytes)
    return kept if fits else replace(setup, keep_attention_output=False)


def sp_split(dims: ModelDims, setup: Setup) -> tuple[int, int]:
    """(u, r): the Ulysses and ring degrees ``setup``'s SP size runs on this model (``ops.sp_layout.sp_degrees``)."""
    return sp_degrees(setup.sequence_parallel, dims.num_heads, setup.ring, dims.num_kv_heads)


def _ring_kv_bytes(dims: ModelDims, setup: Setup, t_local: int) -> float:
    """The ``ring_kv`` component (module docstring) for ``t_local`` tokens per rank (batch included)."""
    u, r = sp_split(dims, setup)
    if r == 1:
        return 0.0
    b = setup.dtype_bytes
    acc = max(b, 4)  # gradients accumulate in float32 (or the model's wider dtype)
    shard = t_local * max(dims.num_kv_heads, u) * dims.head_dim  # one rank's K (or V) after the Ulysses exchange
    if setup.method == "streambp":  # (B, Hkv_u, T, D) K and V + their accumulators: r shards each, Ulysses held 1
        return 2 * (r - 1) * shard * (b + acc) + r * shard * b
    return 2 * shard * (b + 2 * acc)  # the received K/V block, and the dK/dV passed on and received


def longest_fit(dims: ModelDims, setup: Setup, device_bytes: float, host_bytes: float | None = None, *,
                granularity: int = 1024, limit: int = 1 << 26) -> int:
    """The longest multiple of ``granularity`` tokens (at most ``limit``) whose estimate fits ``device_bytes`` per
    GPU (and ``host_bytes`` per host); 0 when not even ``granularity`` does."""
    return granularity * largest_fitting(
        lambda k: estimate(dims, setup, k * granularity).fits(device_bytes, host_bytes), limit // granularity)


PRESETS = {
    "gpu1_zero3_offload_streambp.json": "one GPU: ZeRO-3, optimizer and layer inputs offloaded to the host",
    "gpu8_zero3_sp8_streambp.json": "one 8-GPU node: ZeRO-3, Ulysses SP over the 8 GPUs",
    "multinode_zero3_sp8_offload_streambp.json": "several nodes: ZeRO-3, SP 8 within a node, offload",
    "zero2_streambp.json": "CPU runs (1024-token chunks tuned for CPU)",
}


def recommend_preset(setup: Setup) -> str:
    """The ds_configs/ preset to start from for this launch."""
    if setup.device == "cpu":
        return "zero2_streambp.json"
    if setup.nodes > 1:
        return "multinode_zero3_sp8_offload_streambp.json"
    return "gpu8_zero3_sp8_streambp.json" if setup.gpus_per_node >= 8 else "gpu1_zero3_offload_streambp.json"


@dataclass
class Plan:
    """The planner's answer for one model, setup and memory."""

    dims: ModelDims
    setup: Setup
    device_bytes: float
    host_bytes: float | None
    estimate: Estimate
    longest: int
    options: list[str] = field(default_factory=list)
    preset: str = ""
    chunks: dict[str, int] = field(default_factory=dict)
    max_batch: int = 0
    """The largest micro-batch (``train_micro_batch_size_per_gpu``) of ``seq_len``-token sequences that fits."""

    @property
    def margin(self) -> float:
        return HELD_OUT_ERROR["cpu" if self.setup.device == "cpu" else "gpu"]

    @property
    def fits(self) -> bool:
        return self.estimate.fits(self.device_bytes, self.host_bytes)

    @property
    def surely_too_big(self) -> bool:
        """Above the memory even if the estimate is high by its measured held-out error."""
        e, m = self.estimate, 1 - self.margin
        return e.device_total * m > self.device_bytes or (
            self.host_bytes is not None and e.host_total * m > self.host_bytes)

    def report(self) -> str:
        e = self.estimate
        gib = lambda x: f"{x / GIB:8.2f} GiB"  # noqa: E731
        s = self.setup
        lines = [
            f"ds_longseq plan: {e.seq_len:,} tokens, method {_key(s)}, {s.gpus} GPU(s) on {s.nodes} node(s), "
            f"SP {s.sequence_parallel}{_split_text(self.dims, s)}, ZeRO-{s.zero_stage}, "
            f"{'LoRA r=' + str(s.lora_rank) if s.lora_rank else 'full'}{_quant_text(s)}, "
            f"{'bf16' if s.dtype_bytes == 2 else 'fp32'}, device {s.device}",
            f"per {'GPU' if s.device == 'cuda' else 'process (device = host memory)'}:",
            *(f"  {k:<13}{gib(v)}" for k, v in e.device.items()),
            f"  {'total':<13}{gib(e.device_total)}   of {gib(self.device_bytes).strip()}",
            "per host:",
            *(f"  {k:<13}{gib(v)}" for k, v in e.host.items()),
            f"  {'total':<13}{gib(e.host_total)}"
            + (f"   of {gib(self.host_bytes).strip()}" if self.host_bytes is not None else ""),
            *([f"per host on disk (long_seq.offload.disk_path): {gib(sum(e.disk.values())).strip()}"] if e.disk
              else []),
            f"estimate error: within {self.margin:.0%} on held-out measurements "
            "(benchmarks/results/plan_validation.md)" + (f"; {e.note}" if e.note else ""),
            f"fits: {'yes' if self.fits else 'NO'}; longest that fits: {self.longest:,} tokens",
            f"chunks: {', '.join(f'{k}={v}' for k, v in self.chunks.items())}",
            *([f"attention outputs: {'kept' if s.keep_attention_output else 'not kept'} "
               f"(streambp.keep_attention_output; kept, the backward skips one attention forward per layer)"]
              if s.method == "streambp" else []),
            f"micro-batch: up to {self.max_batch} such sequence(s) per step fit (train_micro_batch_size_per_gpu; a "
            "larger batch trains more samples per second where memory allows)" if self.max_batch else
            "micro-batch: not even one such sequence fits",
            f"preset to start from: ds_configs/{self.preset} ({PRESETS[self.preset]})",
        ]
        if self.options:
            lines += ["options that fit this length:", *(f"  - {o}" for o in self.options)]
        return "\n".join(lines)


def _quant_text(setup: Setup) -> str:
    """' on 4-bit nf4 weights (double quantisation)' for a QLoRA setup, else ''."""
    if not setup.load_in_4bit:
        return ""
    return f" on 4-bit {setup.load_in_4bit} weights ({'double' if setup.double_quant else 'single'} quantisation)"


def _split_text(dims: ModelDims, setup: Setup) -> str:
    """' (Ulysses u x ring r)' when the SP size runs a ring on this model, else ''."""
    u, r = sp_split(dims, setup)
    return f" (Ulysses {u} x ring {r})" if r > 1 else ""


def _options(dims: ModelDims, setup: Setup, seq_len: int, device_bytes: float, host_bytes: float | None) -> list[str]:
    """What would make ``seq_len`` fit: more SP, layer-input offload, optimizer offload, LoRA."""
    tries = []
    cuda = setup.device == "cuda"  # on CPU the device is the host: offloading moves nothing out of it
    layer_methods = set(METHOD_OF_TECHNIQUE.values())  # those that keep each layer's input only
    if cuda and setup.method in layer_methods and not setup.offload_layer_inputs:
        tries.append(("offload the layer inputs (long_seq.offload.layer_inputs='cpu')",
                      replace(setup, offload_layer_inputs=True)))
    if setup.method in layer_methods and not setup.disk_layer_inputs:
        tries.append(("the layer inputs on disk (long_seq.offload.layer_inputs='disk' with disk_path on a local disk)",
                      replace(setup, offload_layer_inputs=True, disk_layer_inputs=True)))
    if setup.method in layer_methods and setup.keep_every == 1:
        # sparse layer-input storage: the smallest k that fits (the fewest re-forwards; a block of k is rebuilt on
        # the device, so larger k is not always better: on one device ceil(L/k) + k - 1 inputs, least near sqrt(L))
        offloads = (False, True) if cuda and not setup.offload_layer_inputs else (setup.offload_layer_inputs,)
        for offload in offloads:
            for k in sorted({2, 4, 8, round(math.sqrt(dims.num_layers))} - {0, 1}):
                s = replace(setup, keep_every=k, offload_layer_inputs=offload)
                if k <= dims.num_layers and estimate(dims, s, seq_len).fits(device_bytes, host_bytes):
                    where = "offloaded, " if offload and not setup.offload_layer_inputs else ""
                    tries.append((f"keep every {k}-th layer input only ({where}long_seq.offload.keep_every={k})", s))
                    break
    if cuda and not setup.offload_optimizer:
        tries.append(("offload the optimizer (zero_optimization.offload_optimizer.device='cpu')",
                      replace(setup, offload_optimizer=True)))
    if setup.method not in ("streambp",):
        tries.append(("StreamBP (long_seq.streambp.enabled)", replace(setup, method="streambp")))
    sp = setup.sequence_parallel * 2
    while sp <= setup.gpus:
        if setup.gpus % sp == 0:
            tries.append((f"sequence parallelism {sp} (long_seq.sequence_parallel.size={sp})",
                          replace(setup, sequence_parallel=sp)))
            break
        sp *= 2
    tries.append((f"more GPUs with SP: {setup.gpus * 2} GPUs, SP {setup.sequence_parallel * 2}",
                  replace(setup, gpus=setup.gpus * 2, nodes=setup.nodes * 2 if setup.gpus_per_node >= 8 else
                          setup.nodes, sequence_parallel=setup.sequence_parallel * 2)))
    out = []
    for what, s in tries:
        try:
            e = estimate(dims, s, seq_len)
        except ValueError:
            continue
        if e.fits(device_bytes, host_bytes):
            out.append(f"{what}: {e.device_total / GIB:.1f} GiB per GPU, {e.host_total / GIB:.1f} GiB per host")
    return out


def plan(dims: ModelDims, setup: Setup, seq_len: int, device_bytes: float, host_bytes: float | None = None) -> Plan:
    """Estimate ``seq_len`` for ``setup`` against ``device_bytes`` per GPU (and ``host_bytes`` per host); a
    ``keep_attention_output`` of "auto" is decided for ``seq_len`` (:func:`resolve_keep`: the plan's setup says
    which), and the longest length is the one that fits without keeping (where "auto" stops keeping)."""
    given = setup
    longest = longest_fit(dims, given, device_bytes, host_bytes)
    setup = resolve_keep(dims, given, seq_len, device_bytes, host_bytes)
    e = estimate(dims, setup, seq_len)
    p = Plan(dims, setup, device_bytes, host_bytes, e, longest)
    if not p.fits:
        p.options = _options(dims, setup, seq_len, device_bytes, host_bytes)
    t_local = math.ceil(seq_len / setup.sequence_parallel)
    # what the measurements found best: 4096-token chunks and the whole-prefix key tile on GPU, 1024 on CPU
    best = FITTED_CHUNK["gpu" if setup.device == "cuda" else "cpu"]
    p.chunks = {"streambp.chunk_size": min(best, t_local), "lm_head.chunk_size": min(best, t_local)}
    p.preset = recommend_preset(setup)
    # the largest micro-batch of such sequences that fits: the memory StreamBP saves, spent on samples per step
    p.max_batch = largest_fitting(lambda n: estimate(dims, resolve_keep(
        dims, replace(given, batch_size=n), seq_len, device_bytes, host_bytes), seq_len).fits(device_bytes, host_bytes))
    return p


class PreflightError(RuntimeError):
    """A run that cannot fit, refused before its first step (nothing written)."""


def preflight(dims: ModelDims, setup: Setup, seq_len: int, *, device_bytes: float, host_bytes: float | None,
              override: bool = False, log=None) -> Plan:
    """Check ``seq_len`` against the memory actually available. Refuses (PreflightError) only when even an
    estimate low by its measured error would not fit, unless ``override``; warns through ``log`` when the
    estimate is above the memory but within that error; returns the plan."""
    p = plan(dims, setup, seq_len, device_bytes, host_bytes)
    if p.surely_too_big and not override:
        e = p.estimate
        where = "GPU" if setup.device == "cuda" else "process"
        host = "" if host_bytes is None else (
            f" and {e.host_total / GIB:.1f} GiB per host (available {host_bytes / GIB:.1f})")
        raise PreflightError(
            f"{seq_len:,} tokens do not fit: the planner estimates {e.device_total / GIB:.1f} GiB per {where} "
            f"(available {device_bytes / GIB:.1f}){host}, more than the memory even at its {p.margin:.0%} error. "
            f"Longest that fits: {p.longest:,} tokens. "
            + ("Options: " + "; ".join(p.options) + ". " if p.options else "")
            + "Run `python -m ds_longseq.plan` for the breakdown; pass --no-preflight to try anyway."
        )
    if not p.fits and log is not None:
        log(f"preflight: {seq_len:,} tokens may not fit (estimate {p.estimate.device_total / GIB:.1f} GiB per device "
            f"against {device_bytes / GIB:.1f} available, within the planner's {p.margin:.0%} error); trying")
    return p
