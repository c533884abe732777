"""Layer-input offload for one model: the host pool, the per-forward offloader and the host-memory check.

Holds:
    LayerInputOffload: installed by ``enable`` when ``long_seq.offload`` is set; its forward pre-hook on the base
        model (``model.model``) checks host memory (``layer_inputs="cpu"``) or disk space (``"disk"``) and starts a
        fresh :class:`~ds_longseq.ops.host_store.LayerInputOffloader` (or
        :class:`~ds_longseq.ops.disk_store.DiskOffloader`) for each training forward, which every decoder layer
        (StreamBP, or the mini_seq layer checkpoint) saves its input through.
    HostMemoryError: a training forward whose layer inputs would not fit in host memory.
    DiskSpaceError: a training forward whose layer inputs would not fit in the free space under ``disk_path``.

Shape legend: B batch, T sequence (the local shard under sequence parallelism), d hidden; L layers.
"""

from __future__ import annotations

import os
import shutil

import torch

from ds_longseq.compat import pop_cache
from ds_longseq.logging import get_logger
from ds_longseq.ops import host_store as offload_ops
from ds_longseq.ops.disk_store import ALIGNMENT, DiskOffloader, DiskStore
from ds_longseq.ops.host_store import HostBufferPool, LayerInputOffloader
from ds_longseq.ops.sparse_inputs import SparseInputs

logger = get_logger(__name__)

__all__ = ["LayerInputOffload", "HostMemoryError", "DiskSpaceError", "forward_tokens"]

# the base model's positional parameters (the fourth is its KV cache, ``past_key_values`` before transformers 5.24)
_INPUT_NAMES = ("input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache")


def forward_tokens(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.dtype] | None:
    """The (B, T, ...) token tensor of a base model's forward and its residual stream's dtype, from a forward
    pre-hook's ``args`` / ``kwargs``; None for a call with a KV cache (generation: layers run the stock forward) or
    with no 2-D tokens (a call the model itself will refuse)."""
    kwargs = {**dict(zip(_INPUT_NAMES, args, strict=False)), **kwargs}
    embeds = kwargs.get("inputs_embeds")
    tokens = embeds if embeds is not None else kwargs.get("input_ids")
    if tokens is None or tokens.dim() < 2 or pop_cache(kwargs) is not None:
        return None
    # The residual stream has the embedding's dtype, also under autocast (embeddings are not autocast). Read off
    # parameters(), not `.weight`: under ZeRO-3 a parameter fetched by name during a forward is gathered and kept as
    # the running module's (here the whole base model's) for its whole forward, which held a tied embedding gathered
    # through every layer (one gather fewer, and its full size on every rank: the counted collectives showed it)
    return tokens, embeds.dtype if embeds is not None else next(module.get_input_embeddings().parameters()).dtype


class HostMemoryError(MemoryError):
    """The layer inputs of a training forward would not fit in the host memory that is available."""


class DiskSpaceError(OSError):
    """The layer inputs of a training forward would not fit in the free space under ``offload.disk_path``."""


def _fmt_bytes(num_bytes: int) -> str:
    """``"75776 bytes (74.0 KiB)"``: exact, and readable at any size."""
    size, unit = float(num_bytes), "bytes"
    for next_unit in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, next_unit
    return f"{num_bytes} bytes" if unit == "bytes" else f"{num_bytes} bytes ({size:.1f} {unit})"


class LayerInputOffload:
    """One model's offload of decoder-layer inputs to host memory.

    Args:
        num_layers: L, the decoder layers that save their input through :meth:`offloader`.
        hidden_size: d.
        layer_inputs: where kept inputs live: ``"cpu"`` (host memory), ``"disk"`` (files under ``disk_path``), or
            None (on the device: only ``keep_every`` > 1 makes this object useful then).
        keep_every: k (``long_seq.offload.keep_every``).
        disk_path: the directory ``"disk"`` writes a directory of this rank's into.
        rank: this process's rank (names that directory).

    Raises:
        AsyncIOUnavailable, OSError: ``"disk"`` without DeepSpeed's async I/O op, or with an unusable ``disk_path``
            (``ops.disk_store.DiskStore``).
    """

    def __init__(self, num_layers: int, hidden_size: int, *, layer_inputs: str | None = "cpu", keep_every: int = 1,
                 disk_path: str | None = None, rank: int = 0):
        if layer_inputs not in ("cpu", "disk", None):
            raise ValueError(f"layer_inputs must be 'cpu', 'disk' or None, got {layer_inputs!r}")
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.layer_inputs = layer_inputs
        self.keep_every = keep_every
        self.pool = HostBufferPool()
        self.store = DiskStore(disk_path, rank) if layer_inputs == "disk" else None
        self.current: LayerInputOffloader | DiskOffloader | SparseInputs | None = None
        """What the training forward in progress saves layer inputs through (None between forwards)."""

    @property
    def host(self) -> bool:
        """Whether kept inputs go to host memory."""
        return self.layer_inputs == "cpu"

    def _new(self) -> LayerInputOffloader | DiskOffloader | SparseInputs:
        offloader = {"cpu": lambda: LayerInputOffloader(self.pool), "disk": lambda: DiskOffloader(self.store),
                     None: lambda: None}[self.layer_inputs]()
        return offloader if self.keep_every == 1 else SparseInputs(self.keep_every, offloader)

    def offloader(self) -> LayerInputOffloader | DiskOffloader | SparseInputs:
        """What a layer saves its input through: the current forward's, or a fresh one for a layer called on its
        own (outside the model's forward), which then gets no prefetch (and keeps its input)."""
        return self.current if self.current is not None else self._new()

    @property
    def kept_layers(self) -> int:
        """Layer inputs a forward keeps: all L, or ceil(L / keep_every) with sparse storage."""
        return -(-self.num_layers // self.keep_every)

    def bytes_needed(self, batch_size: int, seq_len: int, dtype: torch.dtype) -> int:
        """Host bytes that saving the kept inputs of (B, T, d) ``dtype`` takes: kept layers x B x T x d x itemsize."""
        return self.kept_layers * batch_size * seq_len * self.hidden_size * dtype.itemsize

    def before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook (``with_kwargs=True``) of the base model: runs before the embedding."""
        self.current = None
        found = forward_tokens(module, args, kwargs)
        if found is None:
            return  # generation (layers run the stock forward) or a call the model itself will refuse
        tokens, dtype = found
        training = torch.is_grad_enabled() and (
            tokens.requires_grad or any(p.requires_grad for p in module.parameters())
        )
        if not training:
            return  # nothing is kept for backward, so nothing is offloaded
        if self.host:
            self.check_host_memory(tokens.shape[0], tokens.shape[1], dtype, pinned=tokens.device.type == "cuda")
        elif self.store is not None:
            self.check_disk_space(tokens.shape[0], tokens.shape[1], dtype)
        self.current = self._new()

    def after_forward(self, module, args, kwargs, output) -> None:
        """Forward hook (``always_call=True``): the forward's handles stay with its autograd graph."""
        self.current = None

    def check_host_memory(self, batch_size: int, seq_len: int, dtype: torch.dtype, pinned: bool) -> None:
        """Raise :class:`HostMemoryError` if this forward's layer inputs cannot fit in host memory.

        Slabs the pool already holds count as available (they are reused, and host memory reports
        them as used). Every process of the job on this host is assumed to offload as much at the same
        time: their sum must fit.
        """
        per_layer = batch_size * seq_len * self.hidden_size * dtype.itemsize
        to_allocate = self.pool.bytes_to_allocate([per_layer] * self.kept_layers, pinned)
        if to_allocate == 0:
            return
        ranks = offload_ops.ranks_on_this_host()
        available = offload_ops.host_available_bytes()
        if to_allocate * ranks <= available:
            # the first training forward (and a longer one later) allocates host slabs: say how much, once each
            logger.info(
                "offload: allocating %s of %shost memory for layer inputs (%d layers x batch %d x %d tokens; kept and "
                "reused by later steps)", _fmt_bytes(to_allocate), "pinned " if pinned else "", self.kept_layers,
                batch_size, seq_len,
            )
            return
        needed = self.bytes_needed(batch_size, seq_len, dtype)
        shape = (
            f"{self.kept_layers} layers x batch {batch_size} x {seq_len} tokens x hidden {self.hidden_size} x "
            f"{dtype.itemsize} bytes ({dtype})"
        )
        per_host = f", x {ranks} processes on this host" if ranks > 1 else ""
        raise HostMemoryError(
            f"long_seq.offload.layer_inputs='cpu' needs {_fmt_bytes(needed)} of host memory for this forward's "
            f"layer inputs ({shape}{per_host}; {_fmt_bytes(to_allocate * ranks)} still to allocate after reusing "
            f"{_fmt_bytes(self.pool.free_bytes)} already pooled) but only {_fmt_bytes(available)} is available. "
            "Use shorter sequences or a smaller batch, keep every k-th layer's input only "
            "(long_seq.offload.keep_every: k times less), more sequence-parallel ranks "
            "(long_seq.sequence_parallel.size: each rank keeps T / size tokens), or remove "
            "long_seq.offload.layer_inputs to keep the inputs on the device. Nothing was computed."
        )

    def check_disk_space(self, batch_size: int, seq_len: int, dtype: torch.dtype) -> None:
        """Raise :class:`DiskSpaceError` if this forward's layer inputs cannot fit in the free space under
        ``disk_path`` (every process of the job on this host is assumed to write as much to the same filesystem)."""
        per_layer = batch_size * seq_len * self.hidden_size * dtype.itemsize
        needed = self.kept_layers * -(-per_layer // ALIGNMENT) * ALIGNMENT  # each file is padded for O_DIRECT
        ranks = offload_ops.ranks_on_this_host()
        free = shutil.disk_usage(self.store.dir).free
        if needed * ranks <= free:
            return
        shape = (f"{self.kept_layers} layers x batch {batch_size} x {seq_len} tokens x hidden {self.hidden_size} x "
                 f"{dtype.itemsize} bytes ({dtype})")
        per_host = f", x {ranks} processes on this host" if ranks > 1 else ""
        raise DiskSpaceError(
            f"long_seq.offload.layer_inputs='disk' needs {_fmt_bytes(needed * ranks)} under "
            f"{os.path.dirname(self.store.dir)} for this forward's layer inputs ({shape}{per_host}) but only "
            f"{_fmt_bytes(free)} is free there. Free space, point long_seq.offload.disk_path at a larger disk, keep "
            "every k-th layer's input only (long_seq.offload.keep_every: k times less), or use more "
            "sequence-parallel ranks. Nothing was computed or written."
        )

    def close(self) -> None:
        """Free the pool's host memory and remove this rank's disk directory (``disable``)."""
        self.current = None
        self.pool.clear()
        if self.store is not None:
            self.store.close()
