"""long_seq.offload.layer_inputs on CUDA: pinned slabs, the copy stream and the prefetch, for real.

Each test builds its model directly on the GPU and runs in seconds on one H100. Offloading only moves
the saved layer inputs to host memory and back, so results must be BITWISE those without offload.
Every comparison first runs the reference twice: if this GPU's kernels are not bitwise reproducible
run to run, a bitwise comparison would test nothing, and the test says so instead of passing.

Run with ``python -m pytest -q -m gpu tests/gpu/test_offload_gpu.py``.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import ds_longseq
from tests.helpers import clone, layer_input_offload, loss_and_grads, make_batch, make_model

NUM_LAYERS, HIDDEN = 4, 512
OFFLOAD = {"offload": {"layer_inputs": "cpu"}}
STREAMBP = {
    "streambp": {"enabled": True, "chunk_size": 1024}, "attention": {"kv_block_size": 1024},
    "lm_head": {"enabled": True, "chunk_size": 1024},
}
MST = {"mini_seq": {"enabled": True, "mlp_num_chunks": 4}, "lm_head": {"enabled": True, "chunk_size": 1024}}


def _model(dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("cuda"):
        model = make_model(
            "llama",
            dtype,
            num_layers=NUM_LAYERS,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=8192,
        )
    # make_model's std 0.15 suits hidden 64; at 512 it would overflow bf16 activations after 4 layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_tokens" not in name:
                p.normal_(0.0, HIDDEN**-0.5)
    return model


def _batch(seq_len: int) -> dict[str, torch.Tensor]:
    return {k: v.cuda() for k, v in make_batch(batch=2, seq_len=seq_len).items()}


def _bitwise(a, b) -> bool:
    # by construction for the comparisons here: offload only copies the saved layer inputs to host memory and back
    # (and MsT's layer checkpoint recomputes each layer from its input as Hugging Face checkpointing does), so the
    # same kernels run on the same operands; _require_reproducible rules out run-to-run nondeterminism first
    (loss_a, grads_a, embed_a), (loss_b, grads_b, embed_b) = a, b
    return (
        torch.equal(loss_a, loss_b)
        and torch.equal(embed_a, embed_b)
        and set(grads_a) == set(grads_b)
        and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    )


@pytest.fixture(autouse=True)
def _deterministic():
    """Deterministic CUDA algorithms (embedding backward, cuBLAS) for bitwise comparisons; restored after."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _require_reproducible(model, batch, context=contextlib.nullcontext):
    """The reference run, twice: its result, or a skip if the kernels are not bitwise reproducible."""
    with context():
        first, second = loss_and_grads(model, batch), loss_and_grads(model, batch)
    if not _bitwise(first, second):
        pytest.skip("the reference is not bitwise reproducible on this GPU: a bitwise comparison would test nothing")
    assert torch.isfinite(first[0])
    return first


def _pool(model):
    return layer_input_offload(model).pool


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streambp_offload_bitwise(dtype, monkeypatch):
    # The math attention tile: the fused kernels' backwards accumulate dQ with atomics, so two runs
    # differ in the last bits and a bitwise check would compare nothing (the H100 showed it).
    from ds_longseq.ops.tile_kernels import KERNEL_CHAINS

    monkeypatch.setitem(KERNEL_CHAINS, "cuda", ("math",))
    model = _model(dtype)
    batch = _batch(2048)
    ref = _require_reproducible(ds_longseq.enable(clone(model), STREAMBP), batch)
    offloaded = ds_longseq.enable(clone(model), {**STREAMBP, **OFFLOAD})
    owned = []
    for _ in range(2):  # the second step reuses the pinned slabs
        assert _bitwise(loss_and_grads(offloaded, batch), ref)
        pool = _pool(offloaded)
        assert pool.free_bytes == pool.num_bytes
        owned.append(pool.num_bytes)
    assert owned[0] == owned[1] >= NUM_LAYERS * 2 * 2048 * HIDDEN * dtype.itemsize
    assert all(slab.is_pinned() for slabs in pool._free.values() for slab in slabs)


def _allocated_by_forward(model, batch) -> int:
    """GPU bytes a training forward leaves allocated until its backward (then runs the backward)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(**batch).loss
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streambp_offload_frees_the_layer_inputs_after_forward(dtype):
    seq_len = 4096
    model = _model(dtype)
    batch = _batch(seq_len)
    plain = ds_longseq.enable(clone(model), STREAMBP)
    offloaded = ds_longseq.enable(clone(model), {**STREAMBP, **OFFLOAD})
    _allocated_by_forward(offloaded, batch)  # first step: pinned slabs and the copy stream get created
    held_plain = _allocated_by_forward(plain, batch)
    held_offloaded = _allocated_by_forward(offloaded, batch)
    per_layer = 2 * seq_len * HIDDEN * dtype.itemsize
    # All L inputs leave the GPU; one may still be counted while its copy to the host is in flight,
    # and 10% covers allocator rounding.
    assert held_plain - held_offloaded >= 0.9 * (NUM_LAYERS - 1) * per_layer, (held_plain, held_offloaded, per_layer)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32_autocast_bf16"])
def test_mst_offload_bitwise_hf_checkpointing(autocast):
    """MsT + offload (our layer checkpoint, input in host memory) against MsT + Hugging Face checkpointing.

    The math SDPA backend: the fused ones accumulate dQ with atomics, not reproducible bit for bit.
    Under autocast the recompute must re-enter it (backward runs on autograd's thread).
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = _model(torch.float32 if autocast else torch.bfloat16)
    batch = _batch(2048)

    @contextlib.contextmanager
    def context():
        with sdpa_kernel(SDPBackend.MATH), torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            yield

    hf_gc = ds_longseq.enable(clone(model), MST)
    # transformers 5.23 renamed it; the GPU image's 5.17 has only the old name
    enable = getattr(hf_gc, "activation_checkpointing_enable", None) or hf_gc.gradient_checkpointing_enable
    enable()
    hf_gc.train()
    ref = _require_reproducible(hf_gc, batch, context)
    offloaded = ds_longseq.enable(clone(model), {**MST, **OFFLOAD}).train()
    for _ in range(2):
        with context():
            assert _bitwise(loss_and_grads(offloaded, batch), ref)
