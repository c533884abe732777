"""Whether StreamBP keeps each layer's attention output for its backward (``long_seq.streambp.keep_attention_output``).

Kept (``ops.kept_attention``), the backward's chunk replay runs the attention's backward alone: one attention
forward per layer per step fewer. The cost is memory, in the tier the layer inputs live in: per token and kept
layer, the attention output of every head plus one log-sum-exp per head (``ModelDims.attention_output_bytes``).
``true`` / ``false`` fix it; ``"auto"`` decides at every training forward, from the memory free in that tier when
the forward starts:

    device  (no ``offload.layer_inputs``) kept when the outputs fit ``auto_free_fraction`` of the free device memory
            (host memory on CPU) less what the step holds anyway at its smallest chunk (the automatic chunk size's
            memory model: the layer inputs, K/V, gradients, the LM head's work, one chunk's work); the automatic
            chunk size then counts them as kept (they come before a larger chunk: fewer FLOPs for certain, where a
            larger chunk only means fewer kernel launches)
    host    (``"cpu"``) kept when they fit that fraction of the available host memory beside the offloaded inputs
    disk    (``"disk"``) kept when they fit the free space of ``offload.disk_path`` beside the inputs

so a length that runs without keeping still runs: "auto" only ever spends memory that is free. The planner counts
the same bytes (``plan.estimate``'s ``attention_outputs``).

Holds:
    KeepAttentionOutput: the decision the StreamBP layers read (:attr:`KeepAttentionOutput.chosen`), and under
        "auto" the base model's forward pre-hook that makes it.
"""

from __future__ import annotations

import math
import shutil

import torch

from ds_longseq.families.dims import ModelDims
from ds_longseq.forwards.auto_chunk import GIB, AutoChunkSize, free_bytes
from ds_longseq.forwards.layer_input_offload import LayerInputOffload, forward_tokens
from ds_longseq.logging import get_logger
from ds_longseq.ops import host_store
from ds_longseq.ops.chunk_sizes import MIN_CHUNK

__all__ = ["KeepAttentionOutput"]

logger = get_logger(__name__)


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB / 10 else f"{num_bytes / 2**20:.2f} MiB"


class KeepAttentionOutput:
    """Whether this forward's StreamBP attention layers keep their attention outputs (:attr:`chosen`).

    Args:
        setting: ``streambp.keep_attention_output`` (True, False or "auto").
        dims: the model's sizes (None only with a fixed setting: "auto" decides on them).
        num_layers: the attention layers that would keep (StreamBP layers with no recurrent mixer).
        estimator: the automatic chunk size's memory model (the one the layers ask when the chunk size is "auto";
            under "auto" it then counts the kept outputs as held on the device).
        chunk_size: ``streambp.chunk_size`` (an int, or "auto": the smallest chunk is assumed in the decision).
        offload: the model's layer-input offload (its tier and kept layers), or None (the device).
    """

    def __init__(self, setting: bool | str, dims: ModelDims | None, num_layers: int, estimator: AutoChunkSize | None,
                 chunk_size: int | str, offload: LayerInputOffload | None = None):
        self.setting = setting
        self.dims, self.num_layers, self.estimator = dims, num_layers, estimator
        self.chunk_size, self.offload = chunk_size, offload
        self.chosen: bool | None = None if setting == "auto" else bool(setting)
        """This forward's decision, which every StreamBP layer reads; None under "auto" before the first training
        forward (a layer called on its own then keeps nothing)."""
        self.last: dict | None = None
        """The last "auto" decision: ``{"seq_len", "batch_size", "kept", "bytes", "room_bytes", "tier"}``."""
        self._logged: set[tuple[int, bool]] = set()

    @property
    def tier(self) -> str:
        """Where kept outputs go: "device", "host" or "disk" (with the layer inputs)."""
        layer_inputs = None if self.offload is None else self.offload.layer_inputs
        return {None: "device", "cpu": "host", "disk": "disk"}[layer_inputs]

    @property
    def kept_layers(self) -> int:
        """Layers whose outputs are kept: every attention layer, or those whose input is kept (``keep_every``)."""
        k = 1 if self.offload is None else self.offload.keep_every
        return math.ceil(self.num_layers / k)

    def output_bytes(self, batch_size: int, seq_len: int, dtype_bytes: int) -> int:
        """Bytes of every kept layer's attention outputs for (B, T) tokens."""
        return self.kept_layers * batch_size * seq_len * self.dims.attention_output_bytes(dtype_bytes)

    def device_bytes(self, batch_size: int, seq_len: int, dtype_bytes: int) -> int:
        """What keeping puts on the device in this forward (0: not kept, or kept in host memory or on disk); the
        automatic chunk size counts it as kept."""
        if not self.chosen or self.tier != "device":
            return 0
        return self.output_bytes(batch_size, seq_len, dtype_bytes)

    def _room(self, batch_size: int, seq_len: int, dtype: torch.dtype, device: torch.device,
              grads_to_come: int) -> float:
        """Bytes of the tier free for the kept outputs, after what the step holds there anyway."""
        fraction, b = self.estimator.free_fraction, dtype.itemsize
        tier = self.tier
        if tier == "device":
            chunk = min(MIN_CHUNK if self.chunk_size == "auto" else int(self.chunk_size), seq_len)
            tile = None if device.type == "cuda" else self.estimator.kv_block_size
            work = batch_size * chunk * self.dims.chunk_work_per_token(b, tile)
            held = self.estimator.kept_bytes(batch_size, seq_len, b, grads_to_come, count_kept_outputs=False)
            return fraction * free_bytes(device) - held - work
        inputs = self.offload.bytes_needed(batch_size, seq_len, dtype)
        if tier == "host":
            return fraction * host_store.host_available_bytes() - inputs
        return fraction * shutil.disk_usage(self.offload.store.dir).free - inputs

    def decide(self, batch_size: int, seq_len: int, dtype: torch.dtype, device: torch.device,
               grads_to_come: int = 0) -> bool:
        """Under "auto": keep if this forward's outputs fit the tier's room (:attr:`chosen`); returns it."""
        need = self.output_bytes(batch_size, seq_len, dtype.itemsize)
        room = self._room(batch_size, seq_len, dtype, device, grads_to_come)
        self.chosen = need <= room
        self.last = {"seq_len": seq_len, "batch_size": batch_size, "kept": self.chosen, "bytes": need,
                     "room_bytes": room, "tier": self.tier}
        if (seq_len, self.chosen) not in self._logged:
            self._logged.add((seq_len, self.chosen))
            logger.info("streambp.keep_attention_output auto: %s for %d x %d tokens (%s of attention outputs for %d "
                        "layer(s) in %s memory, %s free for them)",
                        "kept" if self.chosen else "not kept (the replay recomputes the attention)", batch_size,
                        seq_len, _size(need), self.kept_layers, self.tier, _size(max(room, 0)))
        return self.chosen

    def before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook (``with_kwargs=True``) of the base model under "auto", registered before the automatic
        chunk size's (which then counts what is kept): a training forward gets its decision."""
        found = forward_tokens(module, args, kwargs)
        if found is None:
            return  # generation: the layers run their stock forward
        tokens, dtype = found
        if not torch.is_grad_enabled():
            self.chosen = False  # nothing is kept for a backward that will not run
            return
        trainable = [p for p in (self.estimator.model or module).parameters() if p.requires_grad]
        grads_to_come = sum(p.numel() * p.element_size() for p in trainable if p.grad is None)
        self.decide(tokens.shape[0], tokens.shape[1], dtype, tokens.device, grads_to_come)
