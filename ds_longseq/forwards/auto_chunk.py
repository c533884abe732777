"""StreamBP's automatic chunk size (``long_seq.streambp.chunk_size: "auto"``), chosen at every training forward.

The largest chunk, up to the whole sequence, whose work fits a memory budget: a short sequence then runs as one chunk
(one forward per layer in backward, no chunk loop, no K/V capture), a long one streams. Chunk sizes below the whole
sequence are powers of two, at least ``ops.chunk_sizes.MIN_CHUNK`` tokens; on CPU at most ``CPU_MAX_CHUNK`` (speed, not
memory).

Memory model (per device, B sequences of T local tokens, d hidden, L layers, b bytes per activation element):

    kept    what the forward keeps whatever the chunk: the layer inputs left on the device (all L, ceil(L/k) + k - 1
            with keep_every = k, none offloaded but the rebuilt block), the attention outputs kept on the device
            (``streambp.keep_attention_output``, ``forwards.keep_attention``), one layer's keys and values with their
            gradient buffers (StreamBP holds them across the chunks of a layer), the residual stream's gradient
            in and out, the LM head's logits work (its chunk, or all T without the chunked head), and the gradients
            of trainable parameters that have none yet (allocated by this backward)
    work    B x chunk x ``ModelDims.chunk_work_per_token`` (ANALYTIC: the activations one layer saves for a chunk
            and the backward's transient gradients, plus the score tiles where attention runs the math kernel;
            measured on CPU, benchmarks/auto_chunk.py: the real slope is 1/1.3 of it)
    budget  ``streambp.auto_budget_gib`` if set (for the work alone), else ``auto_free_fraction`` x the memory free
            when the forward starts (CUDA: free device memory plus what torch's allocator holds unused; CPU:
            available host memory), less kept.

Holds:
    CPU_MAX_CHUNK: the largest chunk on CPU (a speed cap).
    AutoChunkSettings: what it reads of the config.
    AutoChunkSize: the forward pre-hook on the base model that chooses the chunk size the StreamBP layers ask for.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from ds_longseq.families.dims import ModelDims
from ds_longseq.forwards.layer_input_offload import forward_tokens
from ds_longseq.logging import get_logger
from ds_longseq.ops import host_store as offload_ops
from ds_longseq.ops.chunk_attention import CPU_KV_BLOCK_SIZE
from ds_longseq.ops.chunk_sizes import choose_chunk_size, largest_fitting

if TYPE_CHECKING:
    from ds_longseq.config import LongSeqConfig

__all__ = ["CPU_MAX_CHUNK", "AutoChunkSettings", "AutoChunkSize", "free_bytes"]

logger = get_logger(__name__)

GIB = 1024**3

CPU_MAX_CHUNK = 4096
"""The largest chunk "auto" picks on CPU, whatever memory allows: there a chunk's activations stay in the caches,
and one 16K-token chunk ran the cpu suite's step slower than 1024-token chunks (36.2 s against 33.4 s, one
profiled step each, ``benchmarks/results/profile_cpu.md``: the norms, projections and MLP of the whole sequence
at once), while at 4K one chunk was faster (4.4 s against 4.9 s). With the cap, 8K (two 4096-token chunks) ran at
0.964x HF checkpointing's step, worst round 0.995x (``benchmarks/results/paired_cpu_auto.md``). On CUDA none: there
larger chunks only mean fewer kernel launches."""


def free_bytes(device: torch.device) -> int:
    """Memory free for a step on ``device``: CUDA's free memory plus what torch's allocator holds unused; on CPU the
    available host memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return offload_ops.host_available_bytes()


@dataclasses.dataclass(frozen=True)
class AutoChunkSettings:
    """What ``"auto"`` reads of the ``long_seq`` config (:meth:`of`)."""

    budget_gib: float | None
    """``streambp.auto_budget_gib`` (None: from free memory)."""
    free_fraction: float
    """``streambp.auto_free_fraction``."""
    kv_block_size: int | None
    """``attention.kv_block_size`` (None: the device default)."""
    offloaded: bool
    """Whether ``offload.layer_inputs`` takes the kept inputs off the device."""
    keep_every: int
    """``offload.keep_every``."""
    lm_head_chunk_size: int | None
    """``lm_head.chunk_size`` when the chunked head is on, else None (the whole sequence)."""

    @classmethod
    def of(cls, config: "LongSeqConfig") -> "AutoChunkSettings":
        return cls(budget_gib=config.streambp.auto_budget_gib, free_fraction=config.streambp.auto_free_fraction,
                   kv_block_size=config.attention.kv_block_size, offloaded=config.offload.layer_inputs is not None,
                   keep_every=config.offload.keep_every,
                   lm_head_chunk_size=config.lm_head.chunk_size if config.lm_head.enabled else None)


class AutoChunkSize:
    """Chooses the chunk size of the StreamBP layers before each training forward (installed by the StreamBP technique
    as the base model's forward pre-hook; each layer asks it for :attr:`chosen`).

    Args:
        dims: the model's sizes.
        settings: what it reads of the config (:class:`AutoChunkSettings`).
        model: the whole model, whose trainable parameters without a gradient yet count as kept (None: the base
            model's, the hook's module).
    """

    def __init__(self, dims: ModelDims, settings: AutoChunkSettings, model: torch.nn.Module | None = None):
        self.dims = dims
        self.model = model
        self.chosen: int | None = None
        """The chunk of the current forward, which each StreamBP layer asks for (``StreamBPLayerForward.chunk_size``);
        None before the first training forward."""
        self.budget_gib, self.free_fraction = settings.budget_gib, settings.free_fraction
        self.kv_block_size, self.offloaded = settings.kv_block_size, settings.offloaded
        self.keep_every, self.lm_head_chunk_size = settings.keep_every, settings.lm_head_chunk_size
        self.last: dict | None = None
        """The last choice: ``{"seq_len", "batch_size", "chunk_size", "work_bytes", "budget_bytes", "kept_bytes"}``."""
        self._logged: set[tuple[int, int]] = set()
        self.keep = None
        """The StreamBP layers' ``forwards.keep_attention.KeepAttentionOutput``, whose outputs kept on the device
        count as kept (set by the StreamBP technique; None: nothing kept)."""

    def inputs_on_device(self) -> int:
        """Layer inputs on the device at the peak: all L; ceil(L/k) + k - 1 with keep_every = k (k when offloaded:
        the rebuilt block); none when offloaded and k = 1."""
        num_layers, k = self.dims.num_layers, self.keep_every
        if self.offloaded:
            return k if k > 1 else 0
        return math.ceil(num_layers / k) + (k - 1 if k > 1 else 0)

    def kept_bytes(self, batch_size: int, seq_len: int, dtype_bytes: int, grads_to_come: int, *,
                   count_kept_outputs: bool = True) -> float:
        """What the forward keeps whatever the chunk (the module docstring's ``kept``), with the attention outputs
        kept on the device (:attr:`keep`) unless ``count_kept_outputs`` is False."""
        d = self.dims
        outputs = self.keep.device_bytes(batch_size, seq_len, dtype_bytes) if self.keep and count_kept_outputs else 0
        tokens = batch_size * seq_len
        inputs = self.inputs_on_device() * tokens * d.hidden_size * dtype_bytes
        kv = 4 * tokens * d.num_kv_heads * d.head_dim * dtype_bytes
        residual_grads = 2 * tokens * d.hidden_size * dtype_bytes
        head_tokens = min(self.lm_head_chunk_size or seq_len, seq_len) * (1 if self.lm_head_chunk_size else batch_size)
        head = 3 * head_tokens * d.vocab_size * 4  # float32 logits, their softmax and gradient
        return inputs + kv + residual_grads + head + grads_to_come + outputs

    def choose(self, batch_size: int, seq_len: int, dtype: torch.dtype, device: torch.device,
               grads_to_come: int = 0) -> int:
        """Pick the chunk for one forward of (B, T) on ``device`` (:attr:`chosen`, which the layers read); returns
        it."""
        b = dtype.itemsize
        tile = None if device.type == "cuda" and self.kv_block_size is None else min(
            self.kv_block_size or CPU_KV_BLOCK_SIZE, seq_len)  # a tile holds at most the sequence's keys
        score_bytes = 4 if dtype in (torch.float16, torch.bfloat16) else b  # tiles are merged in float32 at least
        work = self.dims.chunk_work_per_token(b, tile, score_bytes)
        kept = self.kept_bytes(batch_size, seq_len, b, grads_to_come)
        # the memory the step may use, read once: the chunk's budget and how many sequences it could take
        available = None if self.budget_gib is not None else self.free_fraction * free_bytes(device)
        budget = self.budget_gib * GIB if available is None else available - kept
        chunk = choose_chunk_size(seq_len, batch_size, work, budget,
                                  max_chunk=None if device.type == "cuda" else CPU_MAX_CHUNK)
        self.chosen = chunk
        max_batch = None
        if available is not None:  # the memory the step leaves: how many such sequences one step could take
            free = available + self.kept_bytes(batch_size, seq_len, b, 0)
            max_batch = largest_fitting(
                lambda n: self.kept_bytes(n, seq_len, b, grads_to_come) + n * chunk * work <= free)
        self.last = {"seq_len": seq_len, "batch_size": batch_size, "chunk_size": chunk,
                     "work_bytes": batch_size * chunk * work, "budget_bytes": budget, "kept_bytes": kept,
                     "max_batch_size": max_batch}
        if (seq_len, chunk) not in self._logged:
            self._logged.add((seq_len, chunk))
            fits = batch_size * chunk * work <= budget
            logger.info(
                "streambp.chunk_size auto: %d tokens per chunk for %d x %d tokens (%s; chunk work %.2f GiB of a "
                "%.2f GiB budget%s)%s", chunk, batch_size, seq_len, "one chunk" if chunk == seq_len else "streamed",
                batch_size * chunk * work / GIB, budget / GIB,
                "" if fits else ": even the smallest chunk exceeds it, the step may run out of memory",
                "" if max_batch is None or max_batch <= batch_size else
                f"; the free memory fits a micro-batch of up to {max_batch} such sequences at this chunk (an "
                "estimate: raise train_micro_batch_size_per_gpu / per_device_train_batch_size for more samples per "
                "second)",
            )
        return chunk

    def before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook (``with_kwargs=True``) of the base model: a training forward gets its chunk size."""
        found = forward_tokens(module, args, kwargs)
        if found is None:
            return  # generation: the layers run their stock forward
        tokens, dtype = found
        trainable = [p for p in (self.model or module).parameters() if p.requires_grad]
        grads_to_come = sum(p.numel() * p.element_size() for p in trainable if p.grad is None)
        self.choose(tokens.shape[0], tokens.shape[1], dtype, tokens.device,
                    grads_to_come if torch.is_grad_enabled() else 0)
