"""Layer inputs on disk (``long_seq.offload.layer_inputs = "disk"``), through DeepSpeed's async I/O op.

The disk tier of layer-input offload: what ``ops.host_store`` keeps in host memory goes to one file per saved input
in a directory of this rank's under ``long_seq.offload.disk_path``, written and read with DeepSpeed's ``async_io``
op (``deepspeed.ops.op_builder.AsyncIOBuilder``, libaio: the engine ZeRO-Infinity swaps to NVMe with). Files are
opened with ``O_DIRECT`` by that op, so they do not fill the page cache: host memory holds only the two staging
buffers, whatever the sequence length.

Holds:
    AsyncIOUnavailable: the op cannot be built here (libaio's headers missing), with the package to install.
    load_async_io: DeepSpeed's async_io op, built on first use (cached in torch's extension directory).
    DiskStore: one rank's directory, I/O thread, aio handles and staging buffers; kept across steps, removed on close.
    DiskOffloader: one forward's saved layer inputs (the ``LayerInputOffloader`` interface): ``save(x)`` returns a
        :class:`DiskTensor`; ``load()`` in backward returns the tensor and starts reading the one saved before it.
    DiskTensor: the handle of one saved tensor, whose file is removed once it is read back or its graph is freed.

Shape legend: B batch, T sequence, d hidden; L decoder layers.

Timeline (one I/O thread per store runs the jobs in order; the compute thread only queues them and waits on reads):

    forward  layer i:  save(h_i): queue "write h_i"; the thread copies h_i (B, T, d) piece by piece (``PIECE_BYTES``)
                       into two staging buffers in turn and writes each piece at its offset while the next is copied
                       (double-buffered); h_i is released once its last piece is copied. The compute thread goes on
                       with layer i at once.
    backward layer i:  load(h_i): allocate h_i on its device, queue "read h_i" (unless prefetched), then queue
                       "read h_{i-1}" (the next layer to run backward: the saves form a stack), wait for h_i only.
                       Its file is removed once read.

On CUDA the pieces pass through pinned staging buffers on a copy stream of the store's (device-to-host copies wait
for the compute stream's work at save time, host-to-device ones for the allocation's stream at load time).

Failure: a file whose graph is freed without a backward (an exception in forward or loss) is removed when the
handle dies; ``DiskStore.close`` (``disable``, and at interpreter exit) removes the rank's directory and everything
in it. Free space is checked before a forward (``forwards.layer_input_offload``), because the op does not report
short writes; every write is checked against the file's size once it completes.
"""

from __future__ import annotations

import concurrent.futures
import errno
import functools
import os
import resource
import shutil
import tempfile
import threading
import time
import weakref

import torch

from ds_longseq.logging import get_logger
from ds_longseq.ops.host_store import SavedTensor, SaveStack

__all__ = ["PIECE_BYTES", "ALIGNMENT", "AsyncIOUnavailable", "load_async_io", "DiskStore", "DiskOffloader",
           "DiskTensor", "check_disk_path", "filesystem_type", "lockable_bytes"]

logger = get_logger(__name__)

PIECE_BYTES = 16 << 20
"""Bytes per I/O piece and per staging buffer (two of them per store): what host memory the disk tier holds
besides the device tensors. 16 MiB requests keep an NVMe busy (ZeRO-Infinity's default block is 1 MiB with a queue
of 8 or more)."""

ALIGNMENT = 4096
"""``O_DIRECT`` needs buffer addresses, file offsets and sizes aligned to the device's logical block (512 bytes on
most drives, 4 KiB on some): pieces start at multiples of ``PIECE_BYTES`` and the last one is padded to 4 KiB."""

INSTALL_HINT = ("install libaio's development package (Debian/Ubuntu: apt-get install libaio-dev; RHEL/Fedora: "
                "dnf install libaio-devel; conda: conda install -c conda-forge libaio), then run again: DeepSpeed "
                "builds its async_io op on first use")


class AsyncIOUnavailable(RuntimeError):
    """DeepSpeed's async I/O op cannot be built or loaded on this machine."""


@functools.lru_cache(maxsize=None)
def load_async_io():
    """DeepSpeed's ``async_io`` extension module (``aio_handle``), built on first use and cached by torch.

    Raises:
        AsyncIOUnavailable: libaio's headers or library are missing, or the build failed; says what to install.
    """
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as e:
        raise AsyncIOUnavailable(
            f"long_seq.offload.layer_inputs='disk' needs DeepSpeed's async I/O op, and deepspeed does not import ({e})"
        ) from e
    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise AsyncIOUnavailable(
            "long_seq.offload.layer_inputs='disk' needs DeepSpeed's async I/O op, which cannot be built here: libaio "
            f"was not found; {INSTALL_HINT}. Or use layer_inputs='cpu' (host memory) with keep_every to need less"
        )
    logger.info("offload: loading DeepSpeed's async_io op (the first use on a machine builds it, ~3 minutes on 2 "
                "cores; then cached under %s)", os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions"))
    try:
        return builder.load(verbose=False)
    except Exception as e:  # a compiler error surfaces as RuntimeError or CalledProcessError, depending on the step
        raise AsyncIOUnavailable(
            f"long_seq.offload.layer_inputs='disk': building DeepSpeed's async_io op failed ({type(e).__name__}: {e}); "
            f"{INSTALL_HINT}"
        ) from e


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


CAP_IPC_LOCK = 14  # capabilities(7): lock memory beyond RLIMIT_MEMLOCK


def lockable_bytes() -> int | None:
    """Bytes this process may page-lock (``mlock``), or None without a limit: RLIMIT_MEMLOCK's soft limit, unless
    the process holds CAP_IPC_LOCK (root outside most containers) or the limit is infinite."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    except OSError:
        caps = 0
    return None if caps >> CAP_IPC_LOCK & 1 else soft


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` is on (``"ext4"``, ``"tmpfs"``, ...), from ``/proc/self/mounts`` (the
    mount point that is the longest prefix of its real path), or None where that file is missing."""
    real, best, fstype = os.path.realpath(path), "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, fields[2]
    except OSError:
        return None
    return fstype


def check_disk_path(path: str) -> None:
    """Raise ``OSError`` unless ``path`` is an existing directory on a disk this process can write files to with
    ``O_DIRECT``: not tmpfs or ramfs (memory: the layer inputs would take as much RAM there as in host memory)."""
    where = f"long_seq.offload.disk_path={path!r}"
    if not os.path.isdir(path):
        raise OSError(errno.ENOENT, f"{where} is not an existing directory: create it (on a local disk, NVMe "
                                    "ideally) or point disk_path at one")
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"{where} is not writable by this process: choose a directory you can write to")
    fstype = filesystem_type(path)
    if fstype in ("tmpfs", "ramfs"):
        raise OSError(errno.EINVAL, f"{where} is on {fstype}, which is memory: the layer inputs written there would "
                                    "use as much RAM as keeping them in host memory. Choose a directory on a disk")
    fd, probe = tempfile.mkstemp(prefix=".ds_longseq_probe_", dir=path)
    os.close(fd)
    try:
        direct = os.open(probe, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
        os.close(direct)
    except OSError as e:
        raise OSError(e.errno, f"{where} does not accept O_DIRECT files ({e.strerror}; {fstype or 'unknown'} "
                               "filesystem), which DeepSpeed's async I/O op opens its files with. Choose a "
                               "directory on a local disk") from e
    finally:
        os.unlink(probe)


class _Stats:
    """What a store moved, and how long its I/O thread spent on it (copies included)."""

    def __init__(self):
        self.bytes_written = self.bytes_read = 0
        self.write_seconds = self.read_seconds = 0.0

    def throughput(self) -> dict[str, float]:
        """``{"write_gb_s", "read_gb_s"}`` (10^9 bytes per second of I/O-thread time; 0 before any I/O)."""
        w = self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0
        r = self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0
        return {"write_gb_s": w, "read_gb_s": r}


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


class DiskStore:
    """One rank's files of saved layer inputs under ``disk_path``, and what writes and reads them; kept across steps.

    Args:
        disk_path: an existing, writable directory on a local disk (checked with :func:`check_disk_path`).
        rank: this process's rank in the job (names its directory: a directory per rank).
        piece_bytes: bytes per I/O piece and staging buffer (a multiple of ``ALIGNMENT``).

    Raises:
        AsyncIOUnavailable: DeepSpeed's async_io op cannot be built here.
        OSError: ``disk_path`` is missing, not writable, or refuses ``O_DIRECT``.
    """

    def __init__(self, disk_path: str, rank: int = 0, *, piece_bytes: int = PIECE_BYTES):
        if piece_bytes <= 0 or piece_bytes % ALIGNMENT:
            raise ValueError(f"piece_bytes must be a positive multiple of {ALIGNMENT}, got {piece_bytes}")
        check_disk_path(disk_path)
        self._aio = load_async_io()
        limit = lockable_bytes()
        if limit is not None and 2 * piece_bytes > limit:
            # a CPU model's staging buffers are page-locked (DeepSpeed's op needs them so): two must fit the limit
            fitted = limit // 2 // ALIGNMENT * ALIGNMENT
            if fitted < ALIGNMENT:
                raise OSError(errno.ENOMEM, f"long_seq.offload.layer_inputs='disk' needs two page-locked staging "
                                            f"buffers, and this process may lock only {limit} bytes "
                                            "(RLIMIT_MEMLOCK): raise it (ulimit -l, or memlock in "
                                            "/etc/security/limits.conf or the container's settings)")
            logger.info("offload: staging buffers of %d bytes instead of %d (RLIMIT_MEMLOCK allows %d locked bytes)",
                        fitted, piece_bytes, limit)
            piece_bytes = fitted
        self.piece_bytes = piece_bytes
        self.dir = tempfile.mkdtemp(prefix=f"ds_longseq-rank{rank}-", dir=disk_path)
        # one handle per staging buffer: wait() on a handle waits for all of its requests, so a buffer's own
        # handle tells when that buffer is free again without waiting for the other one
        self._handles = [self._aio.aio_handle(1 << 20, 32, False, True, 1) for _ in range(2)]
        self._staging: dict[bool, list[torch.Tensor]] = {}  # pinned for CUDA (True) or page-locked (False)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_longseq_disk")
        self._next_id = 0
        self._lock = threading.Lock()
        self.stats = _Stats()
        self.closed = False
        self._finalizer = weakref.finalize(self, _remove_tree, self.dir)  # also runs at interpreter exit

    # -- files -------------------------------------------------------------------------------------------------------
    def new_path(self) -> str:
        """A fresh file name in this rank's directory."""
        with self._lock:
            n, self._next_id = self._next_id, self._next_id + 1
        return os.path.join(self.dir, f"input-{n}.bin")

    @property
    def files(self) -> list[str]:
        """The files in this rank's directory now (saved inputs not yet read back or freed)."""
        try:
            return sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []

    @property
    def disk_bytes(self) -> int:
        """Bytes of the files in this rank's directory now."""
        return sum(os.path.getsize(os.path.join(self.dir, f)) for f in self.files)

    # -- the I/O thread ----------------------------------------------------------------------------------------------
    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the store's I/O thread, after every job queued before it."""
        if self.closed:
            raise RuntimeError("long_seq.offload: the disk store was closed (the model was disabled)")
        return self._thread.submit(fn, *args)

    def remove(self, path: str) -> None:
        """Queue the removal of ``path`` (after the writes and reads queued before it)."""
        if self.closed:
            return  # close() removes the whole directory
        try:
            self._thread.submit(_unlink, path)
        except RuntimeError:  # the interpreter is shutting down (no new jobs): the directory goes at exit anyway
            pass

    def _buffers(self, pinned: bool) -> list[torch.Tensor]:
        if pinned not in self._staging:
            if pinned:
                self._staging[pinned] = [torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=True)
                                         for _ in range(2)]
            else:
                example = torch.empty(0, dtype=torch.uint8)
                buffers = [h.new_cpu_locked_tensor(self.piece_bytes, example) for h in self._handles]
                if any(b.data_ptr() == 0 for b in buffers):  # DeepSpeed's allocator returns null when mlock fails
                    raise OSError(errno.ENOMEM, f"long_seq.offload.layer_inputs='disk': page-locking two staging "
                                                f"buffers of {self.piece_bytes} bytes failed (mlock): raise the "
                                                "memlock limit (ulimit -l) or free memory")
                self._staging[pinned] = buffers
        return self._staging[pinned]

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The copy stream of a CUDA ``device`` (used by the I/O thread only)."""
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pieces(self, nbytes: int):
        for start in range(0, nbytes, self.piece_bytes):
            yield start, min(self.piece_bytes, nbytes - start)

    def write(self, flat: torch.Tensor, path: str, ready: "torch.cuda.Event | None") -> None:
        """(I/O thread) Write the bytes of ``flat`` (uint8, on CPU or CUDA) to ``path``, padded to ``ALIGNMENT``.

        ``ready``: on CUDA, recorded on the compute stream after ``flat`` was written; the copies wait for it. A write
        that fails removes what it wrote of the file.
        """
        try:
            self._write(flat, path, ready)
        except BaseException:
            _unlink(path)
            raise

    def _write(self, flat: torch.Tensor, path: str, ready: "torch.cuda.Event | None") -> None:
        t0 = time.perf_counter()
        on_cuda = flat.device.type == "cuda"
        buffers, busy = self._buffers(on_cuda), [False, False]
        stream = self.stream(flat.device) if on_cuda else None
        if on_cuda:
            stream.wait_event(ready)
        for k, (start, size) in enumerate(self._pieces(flat.numel())):
            slot = k % 2
            if busy[slot]:
                self._wait(slot)
            buf = buffers[slot]
            if on_cuda:
                with torch.cuda.stream(stream):
                    buf[:size].copy_(flat[start:start + size], non_blocking=True)
                stream.synchronize()
            else:
                buf[:size].copy_(flat[start:start + size])
            padded = _round_up(size, ALIGNMENT)
            if padded > size:
                buf[size:padded].zero_()
            if self._handles[slot].async_pwrite(buf[:padded], path, start) != 0:
                self._drain(busy)
                raise OSError(errno.EIO, f"long_seq.offload: could not open {path} for writing")
            busy[slot] = True
        self._drain(busy)
        expected = _round_up(flat.numel(), ALIGNMENT)
        written = os.path.getsize(path) if flat.numel() else 0
        if written < expected:
            raise OSError(errno.ENOSPC, f"long_seq.offload: {path} holds {written} of {expected} bytes after its "
                                        "write (disk full?): free space under disk_path or use a larger disk")
        self.stats.bytes_written += flat.numel()
        self.stats.write_seconds += time.perf_counter() - t0

    def read(self, flat: torch.Tensor, path: str, allocated: "torch.cuda.Event | None") -> None:
        """(I/O thread) Fill ``flat`` (uint8, on CPU or CUDA) from ``path``.

        ``allocated``: on CUDA, recorded on the compute stream after ``flat`` was allocated (its memory may have been
        freed by kernels still queued there); the copies wait for it, and the call returns once they are done.
        """
        t0 = time.perf_counter()
        on_cuda = flat.device.type == "cuda"
        buffers = self._buffers(on_cuda)
        stream = self.stream(flat.device) if on_cuda else None
        if on_cuda:
            stream.wait_event(allocated)
        pieces = list(self._pieces(flat.numel()))

        def start_read(k: int) -> None:
            start, size = pieces[k]
            if self._handles[k % 2].async_pread(buffers[k % 2][:_round_up(size, ALIGNMENT)], path, start) != 0:
                raise OSError(errno.EIO, f"long_seq.offload: could not read {path} (removed, or shorter than "
                                         f"{start + size} bytes)")

        if pieces:
            start_read(0)
        for k, (start, size) in enumerate(pieces):
            slot = k % 2
            if k + 1 < len(pieces):
                start_read(k + 1)  # the next piece reads into the other buffer while this one is copied out
            self._wait(slot)
            if on_cuda:
                with torch.cuda.stream(stream):
                    flat[start:start + size].copy_(buffers[slot][:size], non_blocking=True)
                stream.synchronize()  # the buffer is read again two pieces on
            else:
                flat[start:start + size].copy_(buffers[slot][:size])
        self.stats.bytes_read += flat.numel()
        self.stats.read_seconds += time.perf_counter() - t0

    def _wait(self, slot: int) -> None:
        self._handles[slot].wait()

    def _drain(self, busy: list[bool]) -> None:
        for slot, pending in enumerate(busy):
            if pending:
                self._wait(slot)
                busy[slot] = False

    def close(self) -> None:
        """Finish queued I/O, free the staging buffers and remove this rank's directory with every file in it."""
        if self.closed:
            return
        self.closed = True
        self._thread.shutdown(wait=True)
        for pinned, buffers in self._staging.items():
            if not pinned:
                for handle, buf in zip(self._handles, buffers, strict=True):
                    handle.free_cpu_locked_tensor(buf)
        self._staging.clear()
        self._streams.clear()
        self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class DiskTensor(SavedTensor):
    """One tensor saved by a :class:`DiskOffloader` in a file of its rank's store.

    ``load`` also raises OSError where its write or read failed (disk full, file removed)."""

    WHAT = "a layer input offloaded to disk"
    FIX = ""

    def __init__(self, offloader: "DiskOffloader", index: int, tensor: torch.Tensor):
        super().__init__(offloader, index, tensor)
        store = offloader.store
        self.path = store.new_path()
        # view(uint8) needs a contiguous tensor; a layer input always is, so this copies nothing in practice
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        ready = None
        if tensor.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tensor.device))
        # the job holds ``flat`` until its last piece is copied: the device memory is then free for reuse
        self._written = store.submit(store.write, flat, self.path, ready)
        self._read: concurrent.futures.Future | None = None
        self._out: torch.Tensor | None = None

    def _fetch(self) -> None:
        """Allocate the tensor on its device and queue its read (after its write)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        allocated = None
        if self.device.type == "cuda":
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(self.device))
        store = self._offloader.store
        self._read = store.submit(store.read, out.view(-1).view(torch.uint8), self.path, allocated)
        store.remove(self.path)
        self._out = out
        self.state = "fetching"

    def _finish(self) -> torch.Tensor:
        self._written.result()  # raises the write's error, if any
        self._read.result()
        out, self._out = self._out, None
        return out

    def __del__(self):
        # A graph freed without a backward: its file goes (after its write), so nothing stays on disk.
        if getattr(self, "state", "consumed") == "disk":
            self._offloader.store.remove(self.path)


class DiskOffloader(SaveStack):
    """The layer inputs saved to disk by one forward pass, in order; each is read back once, in backward.

    Backward runs the layers in reverse, so when layer i's input is loaded the offloader queues the read of the input
    saved just before it (layer i - 1's), one layer ahead of its use.

    Args:
        store: the rank's :class:`DiskStore` (shared by every forward of a model).
    """

    STORED = "disk"
    SETTING = "long_seq.offload.layer_inputs='disk'"

    def __init__(self, store: DiskStore):
        super().__init__()
        self.store = store

    def save(self, tensor: torch.Tensor) -> DiskTensor:
        """Queue the write of ``tensor`` (a (B, T, d) layer input) to disk; the handle keeps no reference to it."""
        self._check_device(tensor)
        if self._saved and (last := self._saved[-1]()) is not None and last._written.done():
            last._written.result()  # a failed write (disk full) stops the forward here, not in backward
        return self._track(DiskTensor(self, len(self._saved), tensor))
