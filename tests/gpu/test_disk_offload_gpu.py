"""long_seq.offload.layer_inputs = "disk" on CUDA: pinned staging buffers, the store's copy stream, the I/O thread.

Written before any GPU ran it (2026-11-26). Skips where DeepSpeed's async_io op cannot be built (libaio's headers
missing: the GPU image has no network, so they come with the wheelhouse or not at all) or where the temporary
directory refuses O_DIRECT files. Results must be BITWISE those of the host-memory tier (the same kernels; only where
the saved inputs wait differs), and a forward must leave the layer inputs off the GPU.

Run with ``python -m pytest -q -m gpu tests/gpu/test_disk_offload_gpu.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

import ds_longseq
from ds_longseq.ops import disk_store
from tests.gpu.test_offload_gpu import HIDDEN, NUM_LAYERS, STREAMBP, _allocated_by_forward, _batch, _bitwise, _model
from tests.helpers import clone, loss_and_grads


@pytest.fixture
def disk_dir(tmp_path):
    try:
        disk_store.load_async_io()
        disk_store.check_disk_path(str(tmp_path))
    except (disk_store.AsyncIOUnavailable, OSError) as e:
        pytest.skip(f"no disk tier here: {e}")
    return tmp_path


def test_cuda_round_trip_is_bitwise(disk_dir):
    """CUDA tensors through pinned staging and the copy stream (pieces of 64 KiB: many, both buffers in turn),
    written while the compute stream still writes them, read back into freshly allocated memory."""
    store = disk_store.DiskStore(str(disk_dir), piece_bytes=64 << 10)
    off = disk_store.DiskOffloader(store)
    tensors, handles = [], []
    for i in range(4):
        t = torch.randn(3, 1000 + i, 77, device="cuda", dtype=torch.bfloat16) * (i + 1)  # queued on the stream
        tensors.append(t.clone())
        handles.append(off.save(t))
        t.mul_(0)  # must not reach the file: the copy waits for the save's event, not for this
    for h, t in zip(reversed(handles), reversed(tensors), strict=True):
        out = h.load()
        assert out.is_cuda and torch.equal(out, t)  # a copy: bitwise
    assert all(b.is_pinned() for b in store._staging[True])
    store.close()


@pytest.mark.parametrize("keep_every", [1, 2])
def test_streambp_disk_is_bitwise_the_host_tier(disk_dir, keep_every, monkeypatch):
    from ds_longseq.ops.tile_kernels import KERNEL_CHAINS

    monkeypatch.setitem(KERNEL_CHAINS, "cuda", ("math",))  # bitwise reproducible (see test_offload_gpu)
    model = _model(torch.bfloat16)
    batch = _batch(2048)
    host = ds_longseq.enable(clone(model), {**STREAMBP, "offload": {"layer_inputs": "cpu", "keep_every": keep_every}})
    disk = ds_longseq.enable(clone(model), {**STREAMBP, "offload": {
        "layer_inputs": "disk", "disk_path": str(disk_dir), "keep_every": keep_every}})
    ref = loss_and_grads(host, batch)
    if not _bitwise(ref, loss_and_grads(host, batch)):
        pytest.skip("the reference is not bitwise reproducible on this GPU")
    for _ in range(2):  # by construction: the disk tier only copies the kept inputs (same kernels, same operands)
        assert _bitwise(loss_and_grads(disk, batch), ref)
    gc.collect()
    one_input = 2 * 2048 * HIDDEN * 2
    held = _allocated_by_forward(disk, batch)
    assert held < NUM_LAYERS * one_input  # the inputs went to disk (plus what one layer's backward needs)
