"""``long_seq.offload.layer_inputs = "disk"``: kept layer inputs in files, through DeepSpeed's async I/O op.

Exact: float64 against the stock model at 1e-10 and bitwise against keeping the inputs in memory, with StreamBP
(every k, packed documents), mini_seq's layer checkpoints, ZeRO-3 on 2 ranks (a directory per rank) and sequence
parallelism. Stored: one file per kept input while forward-to-backward, none after a step, none after a failed
forward, the rank's directory gone on disable; the files bypass the page cache (O_DIRECT: no resident pages, against
a buffered write of the same bytes that leaves them resident). Refusals before compute, leaving nothing on disk: no
disk_path, disk_path without "disk", a missing / non-directory / unwritable / tmpfs path, too little free space, no
async I/O op (naming libaio-dev).

The directory is on a real filesystem (``O_DIRECT`` is refused by tmpfs); tests skip, naming ``.ci/install_aio.sh``,
where DeepSpeed's async_io op cannot be built (the CI installs libaio-dev and builds it once).
"""

from __future__ import annotations

import ctypes
import gc
import math
import mmap
import os
import shutil
from pathlib import Path

import pytest
import torch

import ds_longseq
from ds_longseq import LongSeqConfigError
from ds_longseq.ops import disk_store
from ds_longseq.ops.disk_store import ALIGNMENT, AsyncIOUnavailable, DiskOffloader, DiskStore
from tests.helpers import clone, compare, layer_input_offload, loss_and_grads, make_batch, make_model

LAYERS = 5
STREAMBP = {
    "streambp": {"enabled": True, "chunk_size": 8}, "attention": {"kv_block_size": 6},
    "lm_head": {"enabled": True, "chunk_size": 7},
}


def _aio_missing() -> str | None:
    try:
        disk_store.load_async_io()
    except AsyncIOUnavailable as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_aio_missing() is not None, reason=f"DeepSpeed's async_io op is not available here "
                                f"(run bash .ci/install_aio.sh): {_aio_missing()}")


@pytest.fixture
def disk_dir(tmp_path):
    """An empty directory on a filesystem that takes O_DIRECT files: pytest's tmp_path, or one under the repository
    where the temporary directory is tmpfs."""
    try:
        disk_store.check_disk_path(str(tmp_path))
        yield tmp_path
        return
    except OSError:
        pass
    path = Path(__file__).resolve().parent.parent / ".disk_tier_test" / tmp_path.name
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _disk(path, k: int = 1, base: dict = STREAMBP) -> dict:
    return {**base, "offload": {"layer_inputs": "disk", "disk_path": str(path), "keep_every": k}}


def _bitwise(a, b):
    # by construction: the disk tier only copies the kept inputs out and back; every kernel sees the same operands
    (la, ga, ea), (lb, gb, eb) = a, b
    assert torch.equal(la, lb) and torch.equal(ea, eb) and set(ga) == set(gb)
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def _offload(model):
    """The model's ``forwards.layer_input_offload.LayerInputOffload`` (the base model's forward pre-hook's object)."""
    return layer_input_offload(model)


def _all_files(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*"))


# -- the store ---------------------------------------------------------------------------------------------------------


# bitwise by construction: copies
def test_store_round_trip_is_bitwise_and_removes_its_files(disk_dir):
    """Sizes that are not multiples of the alignment nor of the piece (8 KiB here: many pieces, both staging buffers
    in turn), several dtypes; read back in reverse (prefetching the one before); each file gone once read."""
    store = DiskStore(str(disk_dir), rank=3, piece_bytes=8192)
    assert os.path.basename(store.dir).startswith("ds_longseq-rank3-")
    tensors = [torch.randn(2, 1000 + 7 * i, 13, dtype=dtype)
               for i, dtype in enumerate((torch.float64, torch.float32, torch.bfloat16, torch.float64))]
    tensors.append(torch.randn(0, 5))  # empty: no piece at all
    off = DiskOffloader(store)
    handles = [off.save(t) for t in tensors]
    assert off.num_saved == len(tensors) and off.saved_bytes == sum(t.numel() * t.element_size() for t in tensors)
    for h, t in zip(reversed(handles), reversed(tensors), strict=True):
        out = h.load()
        assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
    store.submit(lambda: None).result()  # the queued removals ran
    assert store.files == [] and off.num_saved == 0
    with pytest.raises(RuntimeError, match="already used by an earlier backward"):
        handles[0].load()
    written = store.stats.bytes_written
    assert written == store.stats.bytes_read == sum(t.numel() * t.element_size() for t in tensors)
    assert set(store.stats.throughput()) == {"write_gb_s", "read_gb_s"}
    store.close()
    assert not os.path.exists(store.dir) and _all_files(disk_dir) == []


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache: mincore(2) over a read-only mapping of it (mapping reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_files_bypass_the_page_cache(disk_dir):
    """What the store writes is not left in the page cache (O_DIRECT), so the host memory it saves is really saved;
    the same bytes written through Python's buffered file API stay resident (the check can tell)."""
    store = DiskStore(str(disk_dir))
    x = torch.randn(4 << 20)  # 16 MiB: one piece
    handle = DiskOffloader(store).save(x)
    handle._written.result()
    assert _resident_pages(handle.path) == 0
    control = disk_dir / "buffered.bin"
    control.write_bytes(x.numpy().tobytes())
    assert _resident_pages(str(control)) > (4 << 22) // mmap.PAGESIZE // 2
    torch.testing.assert_close(handle.load(), x, rtol=0, atol=0)  # a copy: bitwise
    store.close()


# -- exact, through the model ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_disk_tier_is_exact(k, disk_dir):
    """float64 against the stock model, bitwise against the inputs kept in memory, over two steps; after the forward
    one file per kept input and two of its layer's attention outputs (and its input freed), after the step none."""
    model = make_model("llama", torch.float64, num_layers=LAYERS)
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    in_memory = ds_longseq.enable(clone(model), {**STREAMBP, "offload": {"keep_every": k}})
    on_disk = ds_longseq.enable(clone(model), _disk(disk_dir, k)).train()
    store = _offload(on_disk).store
    (rank_dir,) = _all_files(disk_dir)
    for _ in range(2):
        loss = on_disk(**batch).loss
        store.submit(lambda: None).result()  # the queued writes are done
        kept = math.ceil(LAYERS / k)
        # beside each kept input its layer's attention outputs (keep_attention_output "auto"): two files, every
        # chunk's (B, H, C, D) outputs in one (the input's bytes) and their (B, H, C) log-sum-exps in the other
        assert len(store.files) == 3 * kept
        per_input = batch["input_ids"].numel() * model.config.hidden_size * 8
        per_lse = batch["input_ids"].numel() * model.config.num_attention_heads * 8
        aligned = (lambda n: -(-n // ALIGNMENT) * ALIGNMENT)
        assert store.disk_bytes == kept * (2 * aligned(per_input) + aligned(per_lse))
        del loss
        gc.collect()
        store.submit(lambda: None).result()
        assert store.files == []  # a graph freed without backward takes its files along
        ours = loss_and_grads(on_disk, batch)
        store.submit(lambda: None).result()
        assert store.files == []
        assert max(compare(ours, ref).values()) < 1e-10  # float64 round-off over 5 layers: ~1e-15
        _bitwise(ours, loss_and_grads(in_memory, batch))
    ds_longseq.disable(on_disk)
    assert _all_files(disk_dir) == [] and rank_dir


def test_disk_tier_with_packed_documents_and_mini_seq(disk_dir):
    """Packed documents (position_ids restart) under StreamBP, and mini_seq's per-layer checkpoints, both bitwise
    against the host-memory tier."""
    from tests.test_sparse_inputs import MST, _packed_batch

    model = make_model("qwen3", torch.float32, num_layers=4)
    batch = _packed_batch()
    _bitwise(loss_and_grads(ds_longseq.enable(clone(model), _disk(disk_dir, 3)), batch),
             loss_and_grads(ds_longseq.enable(clone(model), {**STREAMBP, "offload": {"layer_inputs": "cpu"}}), batch))
    model = make_model("llama", torch.float64, num_layers=LAYERS)
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    ours = loss_and_grads(ds_longseq.enable(clone(model), _disk(disk_dir, 1, MST)).train(), batch)
    assert max(compare(ours, ref).values()) < 1e-10
    _bitwise(ours, loss_and_grads(ds_longseq.enable(clone(model), {**MST, "offload": {"layer_inputs": "cpu"}}).train(),
                                  batch))


def test_a_failed_forward_leaves_nothing_on_disk(disk_dir):
    """An exception in the middle of the forward (layer 3 of 5): the files of layers 0-2 are removed with the graph,
    and the next step runs and is exact."""
    model = make_model("llama", torch.float64, num_layers=LAYERS)
    batch = make_batch()
    on_disk = ds_longseq.enable(clone(model), _disk(disk_dir)).train()
    store = _offload(on_disk).store

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    hook = on_disk.model.layers[3].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        on_disk(**batch)
    hook.remove()
    gc.collect()
    store.submit(lambda: None).result()
    assert store.files == []
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    assert max(compare(loss_and_grads(on_disk, batch), ref).values()) < 1e-10
    store.submit(lambda: None).result()
    assert store.files == []


def test_a_failed_write_stops_the_forward(disk_dir, monkeypatch):
    """A write that leaves its file short (a full disk: DeepSpeed's op does not report it) raises at the next save,
    naming the file; the files are removed."""
    model = make_model("llama", torch.float32, num_layers=LAYERS)
    on_disk = ds_longseq.enable(model, _disk(disk_dir)).train()
    store = _offload(on_disk).store
    real_getsize = os.path.getsize
    monkeypatch.setattr(disk_store.os.path, "getsize", lambda p: 0 if p.endswith(".bin") else real_getsize(p))
    monkeypatch.setattr(DiskOffloader, "save", _waiting_save(DiskOffloader.save))
    with pytest.raises(OSError, match="disk full"):
        on_disk(**make_batch())
    monkeypatch.undo()
    gc.collect()
    store.submit(lambda: None).result()
    assert store.files == []


def _waiting_save(save):
    def waiting(self, tensor):
        handle = save(self, tensor)
        try:
            handle._written.exception()  # let the write finish, so the next save sees its result
        except Exception:
            pass
        return handle
    return waiting


# -- distributed -------------------------------------------------------------------------------------------------------


def disk_train_worker(rank: int, stage: int, config: dict):
    """test_engine_dist's training worker, recording the directories the disk stores made."""
    from tests.test_engine_dist import train_worker

    made = []
    init = DiskStore.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(os.path.basename(self.dir))

    DiskStore.__init__ = recording
    return {**train_worker(rank, stage, 1, False, config), "dirs": made}


@pytest.mark.slow  # heavy: the default run keeps disk offload under sequence parallelism and a process exiting mid-step
def test_under_zero3_matches_the_single_process_reference(disk_dir):
    """2 gloo ranks through ds_longseq.engine.initialize, ZeRO-3, different data per rank, keep_every 2 on disk: 3 SGD
    steps equal plain autograd; each rank wrote into a directory of its own, and none is left."""
    from tests.dist_utils import run_distributed
    from tests.test_engine_dist import STREAMBP as ENGINE_STREAMBP
    from tests.test_engine_dist import reference_run

    config = {**ENGINE_STREAMBP, "offload": {"keep_every": 2, "layer_inputs": "disk", "disk_path": str(disk_dir)}}
    results = run_distributed(disk_train_worker, 2, (3, config))
    assert [len(r["dirs"]) for r in results] == [1, 1]
    assert [r["dirs"][0].split("-")[1] for r in results] == ["rank0", "rank1"]
    reference = reference_run(2, 1, False)
    for name, ref in reference.items():
        for rank, result in enumerate(results):
            err = ((result["params"][name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (name, rank, err)  # float32 round-off over 3 SGD steps, as test_engine_dist
    assert _all_files(disk_dir) == []


def sp_disk_worker(rank: int, world: int, path: str):
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from tests.helpers import full_precision_norms
    from tests.test_sequence_parallel import SP_CASES, global_batch

    local = shard_batch(global_batch(), rank, world)
    results = []
    for extra in ({}, {"offload": {"keep_every": 2, "layer_inputs": "disk", "disk_path": path}}):
        model = full_precision_norms(make_model("llama", torch.float64, num_layers=4))
        cfg = {**SP_CASES["streambp"], **extra, "sequence_parallel": {"size": world}}
        ds_longseq.enable(model, cfg, sp_group=dist.group.WORLD).train()
        results.append(loss_and_grads(model, local))
    (la, ga, ea), (lb, gb, eb) = results  # by construction bitwise: the disk tier only copies (see _bitwise)
    return torch.equal(la, lb) and torch.equal(ea, eb) and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_under_sequence_parallelism_is_bitwise_streambp(disk_dir):
    from tests.dist_utils import run_distributed

    assert run_distributed(sp_disk_worker, world_size=2, args=(2, str(disk_dir))) == [True, True]


# -- refusals ----------------------------------------------------------------------------------------------------------


def test_bad_disk_settings_are_refused_before_anything_is_written(disk_dir, monkeypatch):
    model = make_model("llama", torch.float32, num_layers=4)
    with pytest.raises(LongSeqConfigError, match="layer_inputs='disk' needs long_seq.offload.disk_path"):
        ds_longseq.enable(clone(model), {**STREAMBP, "offload": {"layer_inputs": "disk"}})
    with pytest.raises(LongSeqConfigError, match="only used with layer_inputs='disk'"):
        ds_longseq.enable(clone(model), {**STREAMBP, "offload": {"layer_inputs": "cpu", "disk_path": str(disk_dir)}})
    with pytest.raises(LongSeqConfigError, match="disk_path must be a directory path"):
        ds_longseq.enable(clone(model), {**STREAMBP, "offload": {"layer_inputs": "disk", "disk_path": 3}})
    with pytest.raises(OSError, match="is not an existing directory"):
        ds_longseq.enable(clone(model), _disk(disk_dir / "missing"))
    (disk_dir / "a_file").write_text("")
    with pytest.raises(OSError, match="is not an existing directory"):
        ds_longseq.enable(clone(model), _disk(disk_dir / "a_file"))
    real_access = os.access
    monkeypatch.setattr(disk_store.os, "access", lambda p, mode: False if str(p) == str(disk_dir) else
                        real_access(p, mode))  # (root may write anywhere: the check itself is what is tested)
    with pytest.raises(OSError, match="is not writable by this process"):
        ds_longseq.enable(clone(model), _disk(disk_dir))
    monkeypatch.undo()
    if disk_store.filesystem_type("/dev/shm") == "tmpfs":
        with pytest.raises(OSError, match="is on tmpfs, which is memory"):
            ds_longseq.enable(clone(model), _disk("/dev/shm"))
        assert not [f for f in os.listdir("/dev/shm") if f.startswith((".ds_longseq", "ds_longseq"))]
    assert _all_files(disk_dir) == ["a_file"]


def test_too_little_free_space_is_refused_before_compute(disk_dir, monkeypatch):
    from ds_longseq.forwards import layer_input_offload as offload_module

    model = ds_longseq.enable(make_model("llama", torch.float32, num_layers=4), _disk(disk_dir, 2)).train()
    batch = make_batch()
    need = 2 * -(-batch["input_ids"].numel() * model.config.hidden_size * 4 // ALIGNMENT) * ALIGNMENT
    usage = shutil.disk_usage(disk_dir)
    monkeypatch.setattr(offload_module.shutil, "disk_usage", lambda p: usage._replace(free=need - 1))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(offload_module.DiskSpaceError, match=f"needs {need} bytes .* only {need - 1} bytes"):
        model(**batch)
    assert calls == [] and _offload(model).store.files == []  # nothing computed, nothing written
    monkeypatch.setattr(offload_module.shutil, "disk_usage", lambda p: usage._replace(free=need))
    model(**batch).loss.backward()


def test_without_the_async_io_op_the_error_names_libaio(disk_dir, monkeypatch):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    disk_store.load_async_io.cache_clear()
    try:
        with pytest.raises(AsyncIOUnavailable, match="apt-get install libaio-dev"):
            ds_longseq.enable(make_model("llama", torch.float32, num_layers=4), _disk(disk_dir))
    finally:
        disk_store.load_async_io.cache_clear()
    assert _all_files(disk_dir) == []


def test_a_process_that_exits_mid_step_leaves_nothing(disk_dir):
    """A process that ends between forward and backward, without disable: its directory goes at exit."""
    import subprocess
    import sys

    code = (
        "import torch, ds_longseq\n"
        "from tests.helpers import make_batch, make_model\n"
        f"cfg = {_disk(disk_dir)!r}\n"
        "model = ds_longseq.enable(make_model('llama', torch.float32, num_layers=3), cfg).train()\n"
        "loss = model(**make_batch()).loss\n"
        "import os; print(len(os.listdir(cfg['offload']['disk_path'])))\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1"  # the rank's directory existed, files in it
    assert _all_files(disk_dir) == []


def test_staging_buffers_fit_the_memlock_limit(disk_dir, monkeypatch):
    """Without CAP_IPC_LOCK a process may page-lock only RLIMIT_MEMLOCK bytes (8 MiB by default for users): the two
    staging buffers shrink to fit it (and the round trip stays bitwise), or the store refuses, naming ulimit -l."""
    monkeypatch.setattr(disk_store, "lockable_bytes", lambda: 1 << 20)
    store = DiskStore(str(disk_dir))
    assert store.piece_bytes == 512 << 10
    x = torch.randn(3, 100_000)  # 1.2 MB: three pieces
    h = DiskOffloader(store).save(x)
    assert torch.equal(h.load(), x)  # a copy: bitwise
    store.close()
    monkeypatch.setattr(disk_store, "lockable_bytes", lambda: 4096)
    with pytest.raises(OSError, match="ulimit -l"):
        DiskStore(str(disk_dir))
    assert _all_files(disk_dir) == []
