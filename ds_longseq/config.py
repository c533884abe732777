"""Typed configuration of ds_longseq: the ``"long_seq"`` section of a DeepSpeed JSON file.

Holds:
    StreamBPConfig, MiniSeqConfig, LMHeadConfig, SequenceParallelConfig, OffloadConfig, ApproxBPConfig,
        AdjointConfig, AttentionConfig, WatchdogConfig: one dataclass per section, each with its own rules: a
        field's in its annotation (its type, ``Literal`` choices, a :class:`Rule`), those between its fields in
        its ``problems()`` method.
    Rule: what a good value of one field is beyond its type, and how the message words it.
    LongSeqConfig: the whole section, with ``from_dict`` that parses it (every problem reported at once) and
        ``of``, which takes a dict or an already-parsed config, so each entry point parses its section once.
    LongSeqConfigError: the single error raised for a bad section.
    register_technique / unregister_technique: how ``ds_longseq.techniques`` declares a technique's section,
        activity, conflicts and needs, which ``from_dict`` then checks (this module imports no technique).

Reading the JSON files a section comes in, and finding the shipped configs: ``ds_longseq/config_files.py``.

Where the rules are: generic checks (unknown keys, types, choices) here, once for every section; a section's
own rules on its dataclass below; rules between techniques (``conflicts_with``, ``needs_one_of``) on the
technique, in ``ds_longseq/techniques/<name>.py``. The section dataclasses stay in this module rather than
beside their techniques because this is the bottom layer: ``LongSeqConfig`` holds them as typed fields, and
``modules``, ``engine`` and the planner read them without importing the techniques (which pull in torch and
transformers); ``attention`` and ``watchdog`` belong to no technique.

Vocabulary (see the README glossary): a *chunk* is a slice of the sequence processed at once
(``chunk_size`` tokens, or ``num_chunks`` slices); a *block* is a tile of keys inside the
attention kernel (``kv_block_size``).
"""

from __future__ import annotations

import dataclasses
import os
import typing
import warnings
from dataclasses import dataclass, field
from types import UnionType as _UnionType
from typing import Annotated, Any, Callable, Literal, Mapping

from ds_longseq.rules import Start, deepspeed_sp_size, start_rule

__all__ = [
    "LongSeqConfig",
    "LongSeqConfigError",
    "StreamBPConfig",
    "MiniSeqConfig",
    "LMHeadConfig",
    "SequenceParallelConfig",
    "OffloadConfig",
    "ApproxBPConfig",
    "AdjointConfig",
    "AttentionConfig",
    "WatchdogConfig",
    "Rule",
    "register_technique",
    "unregister_technique",
    "registered_techniques",
]


class LongSeqConfigError(ValueError):
    """A ``long_seq`` section is invalid. The message lists every problem found, one per line."""

    def __init__(self, problems: list[str], what: str = "invalid long_seq config"):
        self.problems = list(problems)
        super().__init__(
            "{} ({} problem{}):\n  - {}".format(
                what, len(problems), "" if len(problems) == 1 else "s", "\n  - ".join(problems)
            )
        )


def _positive_number(value: Any) -> bool:
    """An int or float (not a bool) above 0: what a float field such as a number of seconds accepts."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class Rule:
    """What a good value of one field is, beyond its type: declared in the field's annotation, next to its
    docstring (``x: Annotated[float, Rule("a fraction in (0, 1]", lambda v: v <= 1)] = 0.8``).

    Every field is checked against its annotation by ``LongSeqConfig.from_dict`` (types, ``Literal`` choices,
    None where the type allows it); a Rule narrows that and words the message
    (``long_seq.<section>.<field> must be <must_be>, got <value>``). Rules between fields are the section's
    ``problems()`` method.
    """

    must_be: str
    """The good values, as the message names them ("a positive number of GiB")."""
    holds: Callable[[Any], bool] | None = None
    """The test, given a value of the field's type (None: every such value is good)."""


@dataclass
class StreamBPConfig:
    """StreamBP over whole decoder layers (StreamBP paper, Sec. 3.2.2)."""

    enabled: bool = False
    """Run every decoder layer through StreamBP: forward keeps only the layer input, backward
    re-forwards the layer chunk by chunk (last chunk first) with exact gradients."""
    chunk_size: int | Literal["auto"] = 1024
    """Tokens per chunk of the query sequence, in forward and in backward. The last chunk may be
    shorter; a sequence shorter than ``chunk_size`` is one chunk. ``"auto"``: at every training
    forward, the largest chunk (the whole sequence, else a power of two of at least 128 tokens; on CPU
    at most 4096) whose work fits the memory budget (``auto_budget_gib`` / ``auto_free_fraction``): a
    short sequence runs as one chunk, a long one streams (``forwards.auto_chunk`` has the model)."""
    auto_budget_gib: Annotated[float | None, Rule("a positive number of GiB")] = None
    """With ``chunk_size: "auto"`` only: GiB one chunk's work may take (the activations of one layer
    over one chunk, forward and backward). None: ``auto_free_fraction`` of the memory free when the
    forward starts, less what the forward keeps whatever the chunk."""
    auto_free_fraction: Annotated[float, Rule("a fraction in (0, 1]", lambda v: v <= 1)] = 0.8
    """With ``chunk_size: "auto"`` and no ``auto_budget_gib``: the fraction of free memory the step may
    use (the rest is headroom for what the model does not count: allocator fragmentation, buffers)."""
    keep_attention_output: Literal[True, False, "auto"] = "auto"
    """Keep each attention layer's attention output and log-sum-exp from the forward, beside its input and in the
    same tier (the device, or ``offload.layer_inputs``' host memory or disk; only the layers whose input is kept
    under ``offload.keep_every``), so the backward's chunk replay runs the attention's backward alone instead of
    recomputing its forward (one attention forward per layer per step fewer; exact). Costs per token and layer the
    attention output (heads x value dim, the hidden size for most families) plus one float per head. ``"auto"``:
    kept when the tier has room for it at the step's length (``forwards.keep_attention`` decides at each training
    forward, as the planner counts; the start-up log says which). Layers with a recurrent mixer keep replaying."""

    def problems(self) -> list[str]:
        """The auto-chunk budget is set only with ``chunk_size: "auto"``, which alone reads it."""
        if self.chunk_size != "auto" and (self.auto_budget_gib is not None or self.auto_free_fraction != 0.8):
            return ["long_seq.streambp.auto_budget_gib and auto_free_fraction are only used with "
                    f"chunk_size='auto' (got chunk_size={self.chunk_size!r}): set chunk_size to 'auto', or remove them"]
        return []


@dataclass
class AttentionConfig:
    """The chunk attention kernel that every ds_longseq attention path runs (StreamBP's chunks, the
    sequence-parallel all-to-all, mini-sequence's full-sequence pass)."""

    kv_block_size: int | None = None
    """Keys per tile inside the chunk attention kernel. None (default): the whole prefix in one
    tile on CUDA (the fused kernels hold no score tile, and one call per chunk is fastest), 1024
    keys on CPU, where a tile bounds the scores held at once to (B, H, chunk_size, kv_block_size)."""
    single_call: Literal[True, False] | None = None
    """One kernel call per chunk per direction (the prefix and the chunk's own keys together, with a bottom-right
    causal mask) instead of a tile per key block plus the diagonal, merged by log-sum-exp. None (default): where
    the kernel the prefix tile would run on takes that mask itself and the chunk needs no other mask:
    FlashAttention-2 (CUDA, where cuDNN, top-left only and about twice as fast on an H100, is not chosen) and the
    memory-efficient kernel without GQA; never on CPU (the fused CPU op's causal mask is top-left). True: wherever
    the chunk needs no other mask (padding, packed documents, windows and softcaps keep the tiles), on the math
    kernel when no fused one takes it, which holds a (chunk x keys) score matrix. False: always tiles."""


@dataclass
class MiniSeqConfig:
    """MsT mini-sequence MLP (MsT paper, Alg. 1 and App. B), for use without StreamBP."""

    enabled: bool = False
    """Run every decoder layer's MLP in ``mlp_num_chunks`` sequence chunks, forward and backward,
    so the (T x intermediate) activations never exist at once."""
    mlp_num_chunks: int = 8
    """Number of sequence chunks for the MLP. Chunks are as even as possible (``torch.tensor_split``);
    no token is dropped when T is not a multiple."""


@dataclass
class LMHeadConfig:
    """Chunked LM head + causal-LM cross entropy (StreamBP Sec. 3.2.1, MsT Alg. 2)."""

    enabled: bool = False
    """Compute the loss without materialising (B x T x V) logits or their gradient. The model's
    output then has ``logits=None`` when ``labels`` are given."""
    chunk_size: int = 1024
    """Valid (non-ignored) tokens per chunk of logits: one chunk holds (chunk_size x V) float32
    values (512 MiB at V = 128K), in forward and in backward."""


@dataclass
class SequenceParallelConfig:
    """Sequence parallelism: ``size`` ranks share one sequence, each holding ``T / size`` of its tokens. DeepSpeed-
    Ulysses (MsT paper Sec. 3.3 / App. E: attention exchanges heads for tokens, consecutive tokens per rank) over
    as many ranks as the heads allow, times ring attention (K/V blocks passed around, zigzag shards) over the rest."""

    size: int = 1
    """Ranks per sequence (1 = off). The world size must be a multiple; the remaining factor is data
    parallel. Must equal DeepSpeed's top-level ``sequence_parallel_size`` when that is set too."""
    ring: int | None = None
    """Ring degree r of ``size`` = u x r (u: the Ulysses degree). None: chosen from the model, u the largest
    divisor of ``size`` that divides the query heads and divides or is a multiple of the key/value heads, r the rest
    (``ops.sp_layout.sp_degrees``), so any size works on any model; 1: Ulysses alone (``size`` must fit both head
    counts so). A ring that leaves a u the heads do not fit is refused, naming the ones that work. StreamBP gathers
    each layer's K/V over the ring (``ops.ulysses.UlyssesRingExchange``)."""
    recurrent: Literal["heads", "pass_state"] = "heads"
    """How a hybrid's recurrent layers (linear attention, Mamba-2, short convolutions) run across the group.
    ``"heads"``: each rank runs the whole sequence's recurrence for 1/size of the heads, at the same time as
    the others (the mixer's input gathered, its output reduce-scattered: 2 x T x d elements moved per layer;
    each rank holds the (B, T, d) gathered input and the mixer's activations for its heads over T while that
    layer runs). ``"pass_state"``: each rank continues from the state the previous rank ended with, sent
    point to point (nothing of size T, but the ranks run that layer one after the other); StreamBP only."""

    @property
    def enabled(self) -> bool:
        """Whether sequences are split over more than one rank."""
        return self.size > 1 if isinstance(self.size, int) else False

    def problems(self) -> list[str]:
        """The ring degree divides the size."""
        size, ring = self.size, self.ring
        if isinstance(size, int) and isinstance(ring, int) and ring > 0 and size > 0 and size % ring:
            return [f"long_seq.sequence_parallel.ring={ring} does not divide size={size}: choose a divisor of {size}, "
                    "or leave ring unset (chosen from the model's heads)"]
        return []


# ---- start rules beside the sections they are about (ds_longseq.rules; run by ds_longseq.resolver.resolve) ----


def _local_length(start: Start) -> tuple[int, str]:
    """(tokens per rank of one sequence, how a message names them)."""
    seq_len, size = start.run.seq_len, start.long_seq.sequence_parallel.size
    if size == 1:
        return seq_len, f"the sequence length {seq_len}"
    local = -(-seq_len // size)
    return local, f"the local shard {local} (sequence length {seq_len} / sequence_parallel size {size})"


@start_rule("streambp.chunk_within_sequence", needs=("seq_len",), warns=True)
def _streambp_chunk_within_sequence(start: Start) -> list[str]:
    """A chunk larger than the (local) sequence is legal, the whole sequence one chunk
    (``ops.streambp_autograd.chunk_bounds`` returns one span), so short runs with the shipped configs work; worth a
    warning, as the chunking then does nothing (StreamBP becomes plain per-layer recompute)."""
    streambp = start.long_seq.streambp
    local, where = _local_length(start)
    if not streambp.enabled or streambp.chunk_size == "auto" or streambp.chunk_size <= local or local <= 0:
        return []
    return [f"long_seq.streambp.chunk_size={streambp.chunk_size} exceeds {where}: each sequence is one chunk, so "
            f"StreamBP acts as plain per-layer recompute; set chunk_size below {local} to stream"]


@start_rule("mini_seq.chunks_within_sequence", needs=("seq_len",), warns=True)
def _mini_seq_chunks_within_sequence(start: Start) -> list[str]:
    """More MLP chunks than tokens is legal (the empty chunks are skipped), and worth a warning."""
    mini_seq = start.long_seq.mini_seq
    local, where = _local_length(start)
    if not mini_seq.enabled or mini_seq.mlp_num_chunks <= local or local <= 0:
        return []
    return [f"long_seq.mini_seq.mlp_num_chunks={mini_seq.mlp_num_chunks} exceeds {where}: the MLP runs in {local} "
            f"one-token chunks (the empty ones are skipped); set mlp_num_chunks <= {local}"]


@start_rule("sequence_parallel.matches_deepspeed")
def _sequence_parallel_matches_deepspeed(start: Start) -> list[str]:
    """DeepSpeed's top-level ``sequence_parallel_size`` and ours name the same thing: either turns it on (the
    resolver adopts DeepSpeed's when ours is unset), both must agree."""
    ds_size, ours = deepspeed_sp_size(start.ds_config), start.long_seq.sequence_parallel.size
    if ds_size is None or ds_size == ours:
        return []
    return [f"sequence_parallel_size={ds_size} but long_seq.sequence_parallel.size={ours}: set them equal (or keep "
            "only one of them)"]


@start_rule("sequence_parallel.no_data_parallel_size")
def _sequence_parallel_no_data_parallel_size(start: Start) -> list[str]:
    """Under sequence parallelism ds_longseq builds DeepSpeed's groups, whose data-parallel degree follows."""
    if not start.long_seq.sequence_parallel.enabled or "data_parallel_size" not in start.ds_config:
        return []
    return ["data_parallel_size is set: with sequence parallelism ds_longseq builds DeepSpeed's groups (world / "
            "sequence_parallel_size data-parallel replicas); remove data_parallel_size"]


@start_rule("sequence_parallel.divides_world", needs=("world",))
def _sequence_parallel_divides_world(start: Start) -> list[str]:
    """The launched ranks are whole sequence-parallel groups."""
    size, world = start.long_seq.sequence_parallel.size, start.launch.world
    if world % size == 0:
        return []
    ranks = f"{world} rank{'s' * (world != 1)}"
    return [f"sequence_parallel size {size} does not divide the {ranks}: launch a multiple of {size} (e.g. --num_gpus "
            f"{size}), or use a config with a smaller size"]


@start_rule("sequence_parallel.needs_deepspeed", needs=("deepspeed",))
def _sequence_parallel_needs_deepspeed(start: Start) -> list[str]:
    """The sequence-parallel groups are DeepSpeed's: the Trainer without a DeepSpeed config has none."""
    if start.launch.deepspeed or not start.long_seq.sequence_parallel.enabled:
        return []
    return ["sequence_parallel needs DeepSpeed: pass TrainingArguments(deepspeed=<config>) with the section"]


@dataclass
class OffloadConfig:
    """Where the tensors kept between forward and backward live (ALST-style offload to host memory)."""

    layer_inputs: Literal["cpu", "disk"] | None = None
    """``"cpu"``: keep each decoder layer's input, the only activation StreamBP (or, with mini_seq, a
    per-layer checkpoint) holds from forward to backward, in pinned host memory instead of on the
    GPU; it is copied back one layer ahead in backward. ``"disk"``: in files under ``disk_path``
    instead, written and read with DeepSpeed's async I/O op (libaio, ``O_DIRECT``: no page cache),
    read back one layer ahead; host memory holds two 16 MiB staging buffers. ``None``: keep it on the
    device. Memory (or disk) needed: num_layers x batch x T x hidden_size x dtype bytes, i.e.
    num_layers x d x dtype bytes x batch per token (256 KiB per token at the Llama-3-8B shape in bf16:
    32 x 4096 x 2). Needs ``streambp`` or ``mini_seq``."""

    disk_path: Annotated[str | None, Rule("a directory path")] = None
    """With ``layer_inputs: "disk"`` (and only then): an existing, writable directory on a local disk
    (NVMe ideally; not tmpfs, which is memory). Each rank writes into a directory of its own in it
    (``ds_longseq-rank<r>-*``), whose files are removed as they are read back, and which is removed
    when the model is disabled, the process exits, or a step fails."""

    keep_every: int = 1
    """k: keep the input of every k-th decoder layer only (layers 0, k, 2k, ...; where ``layer_inputs`` says: on
    the device, or ``"cpu"``) and rebuild the others in backward by running the layers between two kept inputs
    forward again, chunk by chunk, once per block: exact, for about one extra forward of (k-1)/k of the layers. Held
    at the peak: the ceil(L/k) kept inputs (in host memory with ``layer_inputs``: k times less host memory) plus
    one block's k - 1 rebuilt inputs on the device in backward; on one device ceil(L/k) + k - 1 inputs instead of
    L, least near k = sqrt(L) (e.g. 11 instead of 32 at k = 4 or 8 for 32 layers). 1 (default): keep every
    input. Needs ``streambp`` or ``mini_seq`` (whose
    layers then become one checkpoint each, as with ``layer_inputs``)."""

    def problems(self) -> list[str]:
        """``disk_path`` goes with ``layer_inputs: "disk"``, both ways. (That offload needs streambp or mini_seq is
        the technique's ``needs_one_of``, checked with the other techniques' needs.)"""
        where_to, path = self.layer_inputs, self.disk_path
        if where_to == "disk" and path is None:
            return ["long_seq.offload.layer_inputs='disk' needs long_seq.offload.disk_path: a directory on a "
                    "local disk (each rank writes a directory of its own there)"]
        if path is not None and where_to != "disk":
            return [f"long_seq.offload.disk_path={path!r} is only used with layer_inputs='disk' (got "
                    f"layer_inputs={where_to!r}): set layer_inputs to 'disk', or remove disk_path"]
        return []


@dataclass
class ApproxBPConfig:
    """Approx-BP activations and memory-sharing norms (Approx-BP paper, Secs. 4-5): smaller saved
    activations for every path (stock, checkpointing, MsT, StreamBP), forward unchanged."""

    activation: Literal["resilu2", "regelu2"] | None = None
    """``"resilu2"`` (SiLU models) / ``"regelu2"`` (GELU models, erf or tanh form): the MLP activation keeps
    its forward bit for bit but saves 2 bits per element (a quarter byte instead of the input) and
    backpropagates the derivative of the paper's fitted 3-ReLU combination, a 4-step function. NOT the
    exact gradient: the paper's claim, which docs/APPROX_BP.md measures, is unchanged convergence.
    ``None``: the stock activation."""
    norm: Literal["ms_rmsnorm", "ms_layernorm"] | None = None
    """``"ms_rmsnorm"`` / ``"ms_layernorm"``: fold each norm's weight (and LayerNorm bias) into the linear
    layers that consume it (q/k/v, gate/up, the LM head), so the norm saves only its output, which those
    layers save anyway, plus one scalar per token. Exact: the folded model computes the same function
    and its gradients are exact for the folded parameters (the weights are re-parameterised, see
    docs/APPROX_BP.md). ``None``: stock norms."""

    @property
    def enabled(self) -> bool:
        """Whether any Approx-BP replacement is switched on."""
        return self.activation is not None or self.norm is not None


@dataclass
class AdjointConfig:
    """Adjoint sharding (paper 002) for ``ds_longseq.adjoint.ResidualSSMForCausalLM``: gradients of the
    residual SSM stack from an adjoint scan and per-token vector-Jacobian products, with the layers
    split across the ranks of the job (one stage per rank). For SSM models only: the transformer
    techniques (streambp, mini_seq, sequence_parallel, offload, approx_bp) must be off."""

    enabled: bool = False
    """Compute the SSM model's gradients by adjoint sharding instead of autograd."""
    chunk_size: int = 1024
    """Tokens per batched vector-Jacobian product and per chunk of LM-head logits: memory holds one
    chunk's graph (and C x V logits) at a time."""
    truncation: Annotated[int | None, Rule("a positive integer (T-bar >= 1; null for exact gradients)")] = None
    """T-bar of truncated adjoint sharding (Sec. 4.3): each token's loss reaches back through its last
    T-bar state transitions only. NOT the exact gradient unless T-bar >= the sequence length
    (docs/ADJOINT.md measures the error). None: exact."""
    layer_split: Annotated[list[int] | None, Rule("a list of positive layer counts (one per rank)")] = None
    """Layers per rank, one entry per process of the job (summing to the model's layers). None: as
    even as possible. A single process owns every layer."""


@dataclass
class WatchdogConfig:
    """The peer watchdog of ``ds_longseq.engine.initialize`` (``ds_longseq.processes.watchdog``): when a rank
    dies, the job stops within a bounded time with a message naming it. Runs on jobs of 2+ ranks whose
    processes a launcher started (deepspeed, torchrun, mpirun, srun)."""

    enabled: bool = True
    """Start the watchdog (a heartbeat thread per rank over the job's rendezvous store; rank 0 monitors)."""
    heartbeat_s: Annotated[float, Rule("a positive number of seconds")] = 1.0
    """Seconds between a rank's heartbeats. A rank that is failing anyway (an uncaught exception, or
    SIGTERM from its launcher) watches the heartbeats for max(3 x heartbeat_s, 3 s) to name the dead."""
    peer_timeout_s: Annotated[float, Rule("a positive number of seconds")] = 120.0
    """Rank 0 stops the job when a rank's heartbeat stood still this long: the bound on a hang in a
    collective that waits for a dead rank (NCCL waits for the process-group timeout, 30 min, otherwise;
    gloo fails at once). Must exceed 3 x heartbeat_s."""

    def problems(self) -> list[str]:
        """The timeout leaves room for a few heartbeats: a live rank is never declared dead between two."""
        hb, timeout = self.heartbeat_s, self.peer_timeout_s
        if _positive_number(hb) and _positive_number(timeout) and timeout <= 3 * hb:  # (else a type problem)
            return [f"long_seq.watchdog.peer_timeout_s={timeout:g} must exceed 3 x heartbeat_s={hb:g}: a live rank "
                    "could be declared dead between two heartbeats; raise peer_timeout_s or lower heartbeat_s"]
        return []


_SECTIONS: dict[str, type] = {
    "streambp": StreamBPConfig,
    "mini_seq": MiniSeqConfig,
    "lm_head": LMHeadConfig,
    "sequence_parallel": SequenceParallelConfig,
    "offload": OffloadConfig,
    "approx_bp": ApproxBPConfig,
    "adjoint": AdjointConfig,
    "attention": AttentionConfig,
    "watchdog": WatchdogConfig,
}


_TECHNIQUES: dict[str, Any] = {}
"""Registered techniques by section name, in registration order (``ds_longseq.techniques.base.Technique``
subclasses, read duck-typed: ``name``, ``Config``, ``active``, ``describe``, ``conflicts_with``,
``needs_one_of``, ``needs_reason``)."""
_BUILTIN_SECTIONS = frozenset(_SECTIONS)


def register_technique(technique: Any) -> None:
    """Declare a technique's config section and rules (called by ``ds_longseq.techniques.register``).

    A technique whose ``name`` is not a built-in section adds its ``Config`` dataclass as a new section
    (``long_seq.<name>``), parsed and checked like the built-in ones and held in ``LongSeqConfig.extra``.
    """
    name = technique.name
    if name in _TECHNIQUES:
        raise ValueError(f"a technique named {name!r} is already registered ({_TECHNIQUES[name].__name__})")
    if name not in _SECTIONS:
        if not dataclasses.is_dataclass(getattr(technique, "Config", None)):
            raise TypeError(f"technique {name!r} must declare its config section as a dataclass Config")
        _SECTIONS[name] = technique.Config
    _TECHNIQUES[name] = technique


def unregister_technique(name: str) -> None:
    """Undo :func:`register_technique` (tests that add a technique remove it again)."""
    _TECHNIQUES.pop(name, None)
    if name not in _BUILTIN_SECTIONS:
        _SECTIONS.pop(name, None)


BUILTIN_TECHNIQUES = "ds_longseq.techniques"
"""The package whose import registers the built-in techniques (it loads torch)."""


def _load_builtin_techniques() -> None:
    """Import the built-in techniques once, so a config's rules never depend on what happened to be imported first
    (a section's conflicts and needs, ``any_enabled``, the techniques' engine rule). While that package is being
    imported (a technique asks the registry during its own import) the module is already in ``sys.modules``."""
    import importlib
    import sys

    if BUILTIN_TECHNIQUES not in sys.modules:
        importlib.import_module(BUILTIN_TECHNIQUES)


def registered_techniques() -> dict[str, Any]:
    """The registered techniques by name, in registration order (the built-in ones loaded first)."""
    _load_builtin_techniques()
    return dict(_TECHNIQUES)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


_TYPE_CHECKS: dict[Any, tuple[Callable[[Any], bool], str]] = {
    # every int and float of a section is a size, a count or a duration: positive
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (_positive_int, "a positive integer"),
    float: (_positive_number, "a positive number"),
    str: (lambda v: isinstance(v, (str, os.PathLike)) and bool(str(v)), "a non-empty string"),
    list[int]: (lambda v: isinstance(v, (list, tuple)) and bool(v) and all(map(_positive_int, v)),
                "a non-empty list of positive integers"),
}
"""A field's type (the part of its annotation that is not None or a Literal) -> (test, what the message calls a
good value). The generic half of validation: a section adds only what its types cannot say (a ``Rule`` in the
annotation, rules between fields in its ``problems()``)."""


def _field_problem(section_cls: type, name: str, value: Any, where: str) -> str | None:
    """What is wrong with ``value`` for field ``name`` by its annotation (None when nothing is), e.g.
    ``long_seq.streambp.chunk_size must be a positive integer, got 0``.

    The annotation says it all: ``X | None`` admits None, ``Literal[...]`` its values, a plain type passes
    ``_TYPE_CHECKS``, ``Annotated[..., Rule(...)]`` narrows that and words the message.
    """
    hint = typing.get_type_hints(section_cls, include_extras=True)[name]
    rules: list[Rule] = []
    if typing.get_origin(hint) is Annotated:
        hint, *meta = typing.get_args(hint)
        rules = [m for m in meta if isinstance(m, Rule)]
    if typing.get_origin(hint) is Literal:  # Literal[...] alone (get_args would give its values)
        parts: tuple[Any, ...] = (hint,)
    else:
        parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, _UnionType) else (hint,)
    choices: list[Any] = []
    types = []
    for part in parts:
        if part is type(None):
            choices.append(None)
        elif typing.get_origin(part) is Literal:
            choices.extend(typing.get_args(part))
        else:
            types.append(part)
    if value in choices:
        return None
    if not types:
        allowed = " or ".join("null (None)" if c is None else repr(c) for c in choices)
        return f"{where} must be {allowed}, got {value!r}"
    kind = types[0]
    test, must_be = _TYPE_CHECKS.get(kind, (lambda v: isinstance(v, typing.get_origin(kind) or kind),
                                            f"a {getattr(kind, '__name__', kind)}"))
    if test(value) and all(r.holds is None or r.holds(value) for r in rules):
        return None
    # the named values a field takes besides its type ("auto"), so the message lists every accepted value
    others = "".join(f" or {c!r}" for c in choices if c is not None)
    return f"{where} must be {rules[0].must_be if rules else must_be}{others}, got {value!r}"


def _elsewhere(key: str, *, besides: str | None = None) -> str:
    """A hint for an unknown key that is a field of other sections: where it belongs ("" when nowhere)."""
    homes = [f"long_seq.{name}.{key}" for name, cls in _SECTIONS.items()
             if name != besides and key in {f.name for f in dataclasses.fields(cls)}]
    return f"; {key!r} is {' or '.join(homes)}: move it there" if homes else ""


@dataclass
class LongSeqConfig:
    """The ``"long_seq"`` section: which long-sequence techniques to apply and their sizes.

    Build it from a dict with :meth:`from_dict` (unknown keys, wrong types, non-positive sizes and
    contradictory settings raise one :class:`LongSeqConfigError` listing every problem).
    """

    streambp: StreamBPConfig = field(default_factory=StreamBPConfig)
    """Whole-layer StreamBP."""
    mini_seq: MiniSeqConfig = field(default_factory=MiniSeqConfig)
    """MsT mini-sequence MLP."""
    lm_head: LMHeadConfig = field(default_factory=LMHeadConfig)
    """Chunked LM head and loss."""
    sequence_parallel: SequenceParallelConfig = field(default_factory=SequenceParallelConfig)
    """Ulysses sequence parallelism over ``size`` ranks."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Offload of the layer inputs kept for backward to host memory."""
    approx_bp: ApproxBPConfig = field(default_factory=ApproxBPConfig)
    """Approx-BP activations and memory-sharing norms."""
    adjoint: AdjointConfig = field(default_factory=AdjointConfig)
    """Adjoint sharding of residual SSM models."""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    """The chunk attention kernel's tile size."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """The peer watchdog of multi-rank jobs (names a dead rank, bounds the hang)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Sections of techniques registered beyond the built-in ones, by name (``long_seq.<name>``); also
    readable as attributes (``config.<name>``)."""

    def __getattr__(self, name: str) -> Any:
        # only called when normal lookup fails: a registered technique's section
        if name != "extra" and name in _SECTIONS and name not in _BUILTIN_SECTIONS:
            return self.section(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def section(self, name: str) -> Any:
        """The section ``name`` (built-in or registered), its defaults when the dict did not set it."""
        if name in _BUILTIN_SECTIONS:
            return getattr(self, name)
        if name in self.extra:
            return self.extra[name]
        if name in _SECTIONS:
            return _SECTIONS[name]()
        raise KeyError(f"no long_seq section {name!r}: sections are {sorted(_SECTIONS)}")

    @classmethod
    def of(cls, config: Mapping[str, Any] | "LongSeqConfig" | None) -> "LongSeqConfig":
        """``config`` typed and checked, parsed only if nobody parsed it yet: a ``LongSeqConfig`` (the section an
        entry point parsed and passes down, or one built in code) is validated and returned as it is; a dict or
        None is parsed by :meth:`from_dict`. What a function that takes either calls (``enable``,
        ``engine.split_config``, the planner), so each entry point parses its section once."""
        if isinstance(config, LongSeqConfig):
            config.validate()
            return config
        return cls.from_dict(config)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | "LongSeqConfig" | None) -> "LongSeqConfig":
        """Parse and validate a ``long_seq`` dict (a ``LongSeqConfig`` is passed through, validated: see :meth:`of`,
        which callers inside the package use so that a parsed config never comes here again)."""
        if data is None:
            return cls()
        if isinstance(data, LongSeqConfig):
            data.validate()
            return data
        if not isinstance(data, Mapping):
            raise LongSeqConfigError([f"long_seq must be a dict or LongSeqConfig, got {type(data).__name__}"])
        problems: list[str] = []
        sections: dict[str, Any] = {}
        for key, value in data.items():
            if key not in _SECTIONS:
                problems.append(f"unknown key long_seq.{key!r}: valid keys are {sorted(_SECTIONS)}{_elsewhere(key)}")
                continue
            section_cls = _SECTIONS[key]
            if not isinstance(value, Mapping):
                problems.append(f"long_seq.{key} must be a dict, got {type(value).__name__}")
                continue
            names = {f.name for f in dataclasses.fields(section_cls)}
            kwargs = {}
            for sub_key, sub_value in value.items():
                if sub_key not in names:
                    problems.append(f"unknown key long_seq.{key}.{sub_key!r}: valid keys are {sorted(names)}"
                                    + _elsewhere(sub_key, besides=key))
                else:
                    kwargs[sub_key] = sub_value
            sections[key] = section_cls(**kwargs)
        extra = {k: sections.pop(k) for k in list(sections) if k not in _BUILTIN_SECTIONS}
        config = cls(**sections, extra=extra)
        problems.extend(config._problems())
        if problems:
            raise LongSeqConfigError(problems)
        config._warn_no_effect(data)
        return config

    def validate(self) -> None:
        """Raise :class:`LongSeqConfigError` listing every problem, if there is any.

        What a caller that is handed an already-parsed config runs (``enable``, ``engine.split_config``): it may
        have been built or changed in code, and checking it is cheap; parsing happens once, in :meth:`from_dict`.
        """
        problems = self._problems()
        if problems:
            raise LongSeqConfigError(problems)

    def to_dict(self) -> dict[str, Any]:
        """The section as a plain dict (round-trips through :meth:`from_dict`)."""
        out = {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"}
        out.update({name: dataclasses.asdict(section) for name, section in self.extra.items()})
        return out

    @property
    def any_enabled(self) -> bool:
        """Whether at least one technique is switched on."""
        return any(technique.active(self) for technique in registered_techniques().values())

    def _problems(self) -> list[str]:
        """Every problem: each section's fields against their annotations, then the section's own rules
        (its ``problems()``, next to its fields), then the registered techniques' conflicts and needs."""
        problems: list[str] = []
        for name in _SECTIONS:
            section = self.section(name)
            for f in dataclasses.fields(section):
                problem = _field_problem(type(section), f.name, getattr(section, f.name), f"long_seq.{name}.{f.name}")
                if problem is not None:
                    problems.append(problem)
            own_rules = getattr(section, "problems", None)
            if callable(own_rules):
                problems.extend(own_rules())
        return problems + self._rule_problems()

    def _rule_problems(self) -> list[str]:
        """The registered techniques' declared conflicts and needs, among the active ones."""
        problems = []
        active = {name: t for name, t in registered_techniques().items() if t.active(self)}
        reported: set[frozenset[str]] = set()
        for name, technique in active.items():
            for other, reason in technique.conflicts_with.items():
                pair = frozenset((name, other))
                if other in active and pair not in reported:
                    reported.add(pair)
                    problems.append(
                        f"{technique.describe(self)} and {active[other].describe(self)} are both enabled: {reason}"
                    )
            needs = technique.needs_one_of
            if needs and not any(n in active for n in needs):
                wanted = " or ".join(f"long_seq.{n}" for n in needs)
                problems.append(f"{technique.describe(self)} needs {wanted}: {technique.needs_reason}")
        return problems

    def _warn_no_effect(self, data: Mapping[str, Any]) -> None:
        for name, value in data.items():
            section = self.section(name)
            default = type(section)()
            if "enabled" not in {f.name for f in dataclasses.fields(section)}:
                continue  # sections switched on by a size, not a flag
            changed = sorted(k for k in value if k != "enabled" and getattr(section, k) != getattr(default, k))
            if not section.enabled and changed:
                warnings.warn(
                    f"long_seq.{name} sets {changed} but long_seq.{name}.enabled is false: "
                    "those options have no effect",
                    stacklevel=3,
                )
