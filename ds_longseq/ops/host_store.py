"""Offload of the layer inputs a backward needs to host memory, and their return one layer ahead.

Holds:
    HostBufferPool: host buffers (pinned for CUDA tensors) and the copy streams, reused across steps.
    LayerInputOffloader: one forward's saved layer inputs; ``save(x)`` returns an :class:`OffloadedTensor`.
    OffloadedTensor: the handle of one saved tensor; ``load()`` in backward returns it on its device.
    host_available_bytes: host memory available to new allocations (what a check compares against).
    save_input / load_input: how an autograd Function keeps its input, on its device or offloaded.

Shape legend: B batch, T sequence, d hidden; L decoder layers.

Timeline on CUDA, compute stream S and copy stream X (one per device, owned by the pool), layers 0..L-1:

    forward  layer i:  X waits for S; X copies h_i (B, T, d) into pinned host slabs; h_i.record_stream(X),
                       and the offloader keeps no reference to h_i: the caching allocator reuses its memory
                       once X's copy is done, while S already runs layer i.
    backward layer i:  load(h_i): X copies h_i back (unless prefetched), then starts the copy of h_{i-1}
                       (the next layer to run backward: layers run backward in reverse, so the saves form
                       a stack); S waits for h_i's copy event only. h_i's slabs return to the pool.

Slabs: a tensor is stored in fixed-size host slabs (``SLAB_BYTES``; one power of two smaller than that for
a small tensor). torch's pinned-memory allocator rounds every block up to a power of two, so one buffer per
layer input could waste up to half of host memory; slabs waste at most one partial slab per tensor, and
a free slab serves any tensor that fits in it, so a later step with other sequence lengths reuses them.

On CPU tensors the same bookkeeping runs (copies into separate host slabs, synchronous, no streams): it
saves no memory, but lets CPU tests exercise the exact path a GPU run takes.
"""

from __future__ import annotations

import os
import weakref

import torch

from ds_longseq.logging import get_logger, warn_once
from ds_longseq.ops.phases import phase

__all__ = [
    "SLAB_BYTES",
    "HostBufferPool",
    "LayerInputOffloader",
    "OffloadedTensor",
    "SaveStack",
    "host_available_bytes",
    "ranks_on_this_host",
    "save_input",
    "load_input",
]

logger = get_logger(__name__)

SLAB_BYTES = 32 << 20
"""Bytes per host slab (a power of two: no rounding waste in torch's pinned allocator). A 1.2 GiB layer
input is 38 copies of 32 MiB, whose launch cost is negligible next to a layer's backward."""


def _slab_sizes(nbytes: int) -> list[int]:
    """Sizes of the slabs that hold ``nbytes``: full ``SLAB_BYTES`` slabs, or one power of two below that."""
    if nbytes >= SLAB_BYTES:
        return [SLAB_BYTES] * (-(-nbytes // SLAB_BYTES))
    if nbytes == 0:
        return []
    return [1 << (nbytes - 1).bit_length()]


LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
"""Where launchers put the number of this job's processes on this host: torchrun / accelerate, DeepSpeed's
launcher, Open MPI, MPICH."""


def ranks_on_this_host() -> int:
    """Processes of the job on this host, from the launcher's environment (``LOCAL_SIZE_VARIABLES``); 1 when
    none is set."""
    for name in LOCAL_SIZE_VARIABLES:
        try:
            return max(int(os.environ[name]), 1)
        except (KeyError, ValueError):
            continue
    return 1


def host_available_bytes() -> int:
    """Host memory available to new allocations without swapping, in bytes.

    ``MemAvailable`` from ``/proc/meminfo`` (free memory plus reclaimable cache), capped by the cgroup v2
    memory limit of this process when there is one (inside a container ``/proc/meminfo`` shows the whole
    machine); ``os.sysconf`` free pages where ``/proc/meminfo`` is missing.
    """
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024  # the file's unit is kB
                    break
    except (OSError, ValueError):
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_available_bytes()
    return available if limit is None else min(available, limit)


def _cgroup_available_bytes() -> int | None:
    """cgroup v2 ``memory.max`` minus the group's non-reclaimable usage, or None without a limit."""
    root = "/sys/fs/cgroup"
    try:
        with open(f"{root}/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(f"{root}/memory.current", encoding="ascii") as f:
            current = int(f.read())
        inactive_file = 0
        with open(f"{root}/memory.stat", encoding="ascii") as f:
            for line in f:
                if line.startswith("inactive_file "):
                    inactive_file = int(line.split()[1])  # page cache the kernel can drop
        return max(int(limit) - (current - inactive_file), 0)
    except (OSError, ValueError):
        return None


class HostBufferPool:
    """Host slabs for offloaded tensors, kept across steps, and one copy stream per CUDA device.

    Pinned allocation costs about as much as the copy it serves, so slabs are allocated once and reused;
    at steady state the pool owns what one training step has offloaded at its peak. Slabs are only ever
    written and read by copies on the pool's stream of their device, so a slab handed back while its
    copy is still queued can be handed out again at once: the next copy into it queues behind.
    """

    def __init__(self):
        self._free: dict[tuple[bool, int], list[torch.Tensor]] = {}  # (pinned, slab bytes) -> slabs
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.num_bytes = 0
        """Bytes of every slab the pool owns: free ones and those holding a saved tensor."""
        self.closed = False

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The copy stream of a CUDA ``device`` (created on first use: no CUDA call before a save)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _reusable(self, pinned: bool, size: int, taken: dict[int, int] | None = None) -> int | None:
        """Size of the smallest free slab of at least ``size`` bytes (after ``taken`` of each size), or None.

        A larger slab serves a smaller tensor (a later step with shorter sequences allocates nothing).
        """
        for have in sorted(k for p, k in self._free if p == pinned and k >= size):
            if len(self._free[(pinned, have)]) > (taken or {}).get(have, 0):
                return have
        return None

    def acquire(self, nbytes: int, pinned: bool) -> list[torch.Tensor]:
        """Slabs (flat uint8 host tensors) that together hold ``nbytes``, in order."""
        slabs = []
        for size in _slab_sizes(nbytes):
            have = self._reusable(pinned, size)
            if have is not None:
                slabs.append(self._free[(pinned, have)].pop())
            else:
                slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=pinned))
                self.num_bytes += size
        return slabs

    def release(self, slabs: list[torch.Tensor], pinned: bool) -> None:
        """Take slabs back for reuse (dropped instead once the pool is closed)."""
        for slab in slabs:
            if self.closed:
                self.num_bytes -= slab.numel()
            else:
                self._free.setdefault((pinned, slab.numel()), []).append(slab)

    @property
    def free_bytes(self) -> int:
        """Bytes of the slabs ready for reuse."""
        return sum(slab.numel() for slabs in self._free.values() for slab in slabs)

    def bytes_to_allocate(self, sizes: list[int], pinned: bool) -> int:
        """New host bytes that saving tensors of ``sizes`` bytes would allocate, after reusing free slabs
        (the same choices :meth:`acquire` makes, without making them)."""
        taken: dict[int, int] = {}
        new = 0
        for nbytes in sizes:
            for size in _slab_sizes(nbytes):
                have = self._reusable(pinned, size, taken)
                if have is None:
                    new += size
                else:
                    taken[have] = taken.get(have, 0) + 1
        return new

    def clear(self) -> None:
        """Drop every slab and stream; slabs still holding a saved tensor are dropped when it is loaded.

        Pinned slabs go back to torch's pinned-memory cache, which is emptied too so that the memory
        returns to the system.
        """
        pinned = any(key[0] for key in self._free) or bool(self._streams)
        for stream in self._streams.values():
            stream.synchronize()  # no copy into a slab may outlive it
        self.num_bytes -= self.free_bytes
        self._free.clear()
        self._streams.clear()
        self.closed = True
        if pinned:
            torch.accelerator.empty_host_cache()


class SavedTensor:
    """One tensor saved by an offload tier (a :class:`SaveStack`); :meth:`load` returns it once, in backward.

    The bookkeeping every tier's handle shares: its place in the stack, the tensor's shape, dtype, device and size,
    ``state`` (the stack's ``STORED`` until :meth:`_fetch` starts the copy back, then ``"fetching"``, then
    ``"consumed"``) and the once-only :meth:`load`. A tier's handle stores the tensor in its ``__init__`` (after this
    one), starts the copy back in ``_fetch`` and waits for it in ``_finish``.
    """

    WHAT = "an offloaded layer input"
    """How the error of a second load names the tensor."""
    FIX = ", or remove long_seq.offload.layer_inputs"
    """What that error adds after "run a new forward"."""

    def __init__(self, offloader: "SaveStack", index: int, tensor: torch.Tensor):
        self._offloader = offloader
        self.index = index
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.nbytes = tensor.numel() * tensor.element_size()
        self.state = offloader.STORED

    def _fetch(self) -> None:
        """Start the copy back to the device; sets ``state`` to ``"fetching"``."""
        raise NotImplementedError

    def _finish(self) -> torch.Tensor:
        """Wait for the copy back :meth:`_fetch` started; the tensor on its device, dropping this handle's hold."""
        raise NotImplementedError

    def load(self) -> torch.Tensor:
        """The saved tensor on its device, bitwise equal to what was saved; starts the copy back of the one saved
        before it (backward runs the layers in reverse: one layer ahead of its use).

        Raises:
            RuntimeError: the tensor was already loaded (a second backward through the same graph).
        """
        if self.state == "consumed":
            raise RuntimeError(
                f"{self.WHAT} was already used by an earlier backward through this graph: "
                "long_seq.offload.layer_inputs hands each input back once, so backward(retain_graph=True) "
                f"followed by a second backward is not supported; run a new forward{self.FIX}"
            )
        if self.state == self._offloader.STORED:
            self._fetch()
        self._offloader._prefetch_before(self.index)
        out = self._finish()
        self.state = "consumed"
        return out


class OffloadedTensor(SavedTensor):
    """One tensor saved by a :class:`LayerInputOffloader` in host slabs (pinned for a CUDA tensor)."""

    def __init__(self, offloader: "LayerInputOffloader", index: int, tensor: torch.Tensor):
        super().__init__(offloader, index, tensor)
        self.on_cuda = tensor.device.type == "cuda"
        self._event: torch.cuda.Event | None = None
        self._device_tensor: torch.Tensor | None = None
        pool = offloader.pool
        self._slabs = pool.acquire(self.nbytes, pinned=self.on_cuda)
        # view(uint8) needs a contiguous tensor; a layer input always is, so this copies nothing in practice
        src = tensor.detach().contiguous()
        flat = src.view(-1).view(torch.uint8)
        if self.on_cuda:
            stream = pool.stream(self.device)
            # The input was written on the compute stream: the copy must queue behind that work.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for slab, piece in zip(self._slabs, self._pieces(flat), strict=True):
                    slab[: piece.numel()].copy_(piece, non_blocking=True)
            # The caching allocator must not hand the input's memory out again before the copy has read it.
            src.record_stream(stream)
        else:
            for slab, piece in zip(self._slabs, self._pieces(flat), strict=True):
                slab[: piece.numel()].copy_(piece)

    def _pieces(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[i * SLAB_BYTES : (i + 1) * SLAB_BYTES] for i in range(len(self._slabs))]

    def _fetch(self) -> None:
        """Start the copy back to the device (CUDA: queued on the copy stream; CPU: done here)."""
        # Allocated on the compute stream that will use it. Its memory may have been freed by kernels
        # still queued there, so the copy stream waits for them before writing.
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        flat = out.view(-1).view(torch.uint8)
        pool = self._offloader.pool
        if self.on_cuda:
            stream = pool.stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for slab, piece in zip(self._slabs, self._pieces(flat), strict=True):
                    piece.copy_(slab[: piece.numel()], non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(stream)
        else:
            for slab, piece in zip(self._slabs, self._pieces(flat), strict=True):
                piece.copy_(slab[: piece.numel()])
        # Safe before the copy ends: a slab is only written again by a later copy on the same stream.
        pool.release(self._slabs, pinned=self.on_cuda)
        self._slabs = []
        self._device_tensor = out
        self.state = "fetching"

    def _finish(self) -> torch.Tensor:
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        out, self._device_tensor, self._event = self._device_tensor, None, None
        return out

    def __del__(self):
        # A graph freed without a backward: its slabs go back to the pool.
        slabs = getattr(self, "_slabs", None)
        if slabs:
            self._offloader.pool.release(slabs, pinned=self.on_cuda)
            self._slabs = []


class SaveStack:
    """The handles of one forward's saved tensors, in order: the bookkeeping every offload tier shares.

    A handle is a :class:`SavedTensor`. References are weak: the autograd graph owns the handles, so a
    graph freed without a backward releases their storage at once instead of when this stack dies.
    """

    STORED = "host"
    """The state of a saved handle whose copy back has not started."""
    SETTING = "long_seq.offload.layer_inputs"
    """How errors name the setting that chose this tier."""

    def __init__(self):
        self._saved: list[weakref.ref] = []

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device.type not in ("cuda", "cpu"):
            raise NotImplementedError(
                f"{self.SETTING} supports CUDA and CPU tensors, got one on {tensor.device}: remove "
                "long_seq.offload.layer_inputs"
            )

    def _track(self, handle):
        self._saved.append(weakref.ref(handle))
        return handle

    @property
    def num_saved(self) -> int:
        """Tensors saved and not yet loaded (nor freed with their graph)."""
        return sum(1 for ref in self._saved if (h := ref()) is not None and h.state == self.STORED)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the tensors saved and not yet loaded."""
        return sum(h.nbytes for ref in self._saved if (h := ref()) is not None and h.state == self.STORED)

    def _prefetch_before(self, index: int) -> None:
        """Start copying back the latest tensor saved before ``index`` that is still stored."""
        for ref in reversed(self._saved[:index]):
            handle = ref()
            if handle is None or handle.state == "consumed":
                continue
            if handle.state == self.STORED:
                handle._fetch()
            return


class LayerInputOffloader(SaveStack):
    """The layer inputs saved by one forward pass, in order; each is loaded back once, in backward.

    Backward runs the layers in reverse, so when layer i's input is loaded the offloader starts copying
    back the input saved just before it (layer i - 1's), one layer ahead of its use.

    Args:
        pool: where host slabs and copy streams come from (shared by every forward of a model).
    """

    def __init__(self, pool: HostBufferPool):
        super().__init__()
        self.pool = pool

    def save(self, tensor: torch.Tensor) -> OffloadedTensor:
        """Copy ``tensor`` (a (B, T, d) layer input) to host slabs; keep no reference to it."""
        self._check_device(tensor)
        if tensor.device.type == "cpu":
            warn_once(
                logger,
                "long_seq.offload.layer_inputs='cpu' on a model that runs on the CPU saves no memory (the layer "
                "inputs are already in host memory, and are copied once more); it is meant for GPU models",
            )
        return self._track(OffloadedTensor(self, len(self._saved), tensor))


def save_input(ctx, x: torch.Tensor, offloader: "LayerInputOffloader | None") -> None:
    """Keep an autograd Function's input for its backward: saved on its device, or in host memory
    through ``offloader``."""
    if offloader is None:
        ctx.save_for_backward(x)
        ctx.offloaded_input = None
    else:
        ctx.offloaded_input = offloader.save(x)


def load_input(ctx) -> torch.Tensor:
    """The input :func:`save_input` kept, on its device."""
    if ctx.offloaded_input is None:
        (x,) = ctx.saved_tensors
        return x
    with phase("offload.wait"):
        return ctx.offloaded_input.load()
