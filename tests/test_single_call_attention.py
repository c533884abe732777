"""One attention kernel call per chunk per direction (prefix and diagonal together, bottom-right causal mask),
against the tiled path and a dense reference in float64.

On CPU no fused kernel takes a bottom-right mask (the fused CPU op's ``is_causal`` is top-left), so "auto" stays
tiled there and these tests force the one call onto the math kernel, which takes any mask: they check the plumbing
(joined keys, the split of dK/dV between the prefix's sink and the chunk's own keys, StreamBP's key buffers) that
the fused CUDA kernels share. tests/gpu/test_cuda_kernels.py runs FlashAttention-2 and the memory-efficient kernel
the same way, with a top-left mask as the mutation that must fail.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import ds_longseq
from ds_longseq.ops import chunk_attention as attention_ops
from ds_longseq.ops import tile_kernels
from ds_longseq.ops.chunk_attention import chunk_causal_attention
from tests.helpers import compare, loss_and_grads, make_batch, make_model
from tests.test_ops import reference_attention

DT = torch.float64


def _inputs(B=2, H=4, Hkv=2, C=9, S=23, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, C, D, generator=g, dtype=DT)
    k_all = torch.randn(B, Hkv, S + C, D, generator=g, dtype=DT)
    v_all = torch.randn(B, Hkv, S + C, D, generator=g, dtype=DT)
    go = torch.randn(B, H, C, D, generator=g, dtype=DT)
    return q, k_all, v_all, go


def _run(q, k_all, v_all, go, S, *, single_call, sink_own=False, kernel="math", block=5):
    """(out, dq, dk_own, dv_own, dk_prefix, dv_prefix): the chunk is the last C keys, the prefix a constant whose
    gradient is added into a sink (and the chunk's own too with ``sink_own``, as sequence parallelism does)."""
    qc = q.clone().requires_grad_()
    k, v = (t[:, :, S:].clone().requires_grad_() for t in (k_all, v_all))
    sink = tuple(torch.zeros_like(t) for t in (k_all, v_all))
    out = chunk_causal_attention(
        qc, k, v, scale=q.shape[-1] ** -0.5, k_prefix=k_all[:, :, :S], v_prefix=v_all[:, :, :S],
        prefix_grad_sink=sink, sink_own_keys=sink_own, kv_block_size=block, kernel=kernel,
        joined_kv=(k_all, v_all), single_call=single_call,
    )
    wrt = (qc,) if sink_own else (qc, k, v)
    grads = torch.autograd.grad(out, wrt, go)
    dq = grads[0]
    if sink_own:
        dk, dv = sink[0][:, :, S:], sink[1][:, :, S:]
    else:
        dk, dv = grads[1], grads[2]
    return [out.detach(), dq, dk, dv, sink[0][:, :, :S], sink[1][:, :, :S]]


def _reference(q, k_all, v_all, go, S):
    q, k_all, v_all = (t.clone().requires_grad_() for t in (q, k_all, v_all))
    out = reference_attention(q, k_all, v_all, None)
    dq, dk, dv = torch.autograd.grad(out, (q, k_all, v_all), go)
    return [out.detach(), dq, dk[:, :, S:], dv[:, :, S:], dk[:, :, :S], dv[:, :, :S]]


@pytest.mark.parametrize("H,Hkv,C,S", [(4, 2, 9, 23), (4, 4, 9, 23), (3, 1, 1, 17), (2, 2, 16, 4)])
@pytest.mark.parametrize("sink_own", [False, True])
def test_one_call_matches_tiles_and_dense_reference(H, Hkv, C, S, sink_own):
    q, k_all, v_all, go = _inputs(H=H, Hkv=Hkv, C=C, S=S)
    ref = _reference(q, k_all, v_all, go, S)
    one = _run(q, k_all, v_all, go, S, single_call=True, sink_own=sink_own)
    tiles = _run(q, k_all, v_all, go, S, single_call=False, sink_own=sink_own)
    for a, b, r in zip(one, tiles, ref, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _count(fn, name: str) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == name)


def test_one_kernel_call_per_direction_counted_by_the_profiler():
    """The math kernel makes 2 batched matmuls per tile in forward and 5 in backward: one kernel call each way for
    the one-call chunk, one per tile (3 prefix tiles of 5 keys and the diagonal here) for the tiled one."""
    q, k_all, v_all, go = _inputs(C=9, S=14)
    for single, tiles in ((True, 1), (False, 4)):
        qc = q.clone().requires_grad_()
        k, v = (t[:, :, 14:].clone().requires_grad_() for t in (k_all, v_all))
        sink = tuple(torch.zeros_like(t) for t in (k_all, v_all))

        def fwd(qc=qc, k=k, v=v, sink=sink, single=single):
            return chunk_causal_attention(qc, k, v, scale=0.3, k_prefix=k_all[:, :, :14], v_prefix=v_all[:, :, :14],
                                          kv_block_size=5, kernel="math", joined_kv=(k_all, v_all),
                                          prefix_grad_sink=sink, single_call=single)

        assert _count(fwd, "aten::bmm") == 2 * tiles
        out = fwd()
        assert _count(lambda out=out, wrt=(qc, k, v): torch.autograd.grad(out, wrt, go), "aten::bmm") == 5 * tiles


def test_a_top_left_mask_in_the_one_call_fails_the_reference(monkeypatch):
    """The mutation: the math kernel's causal mask aligned top-left (as the fused CPU op's and cuDNN's are) on the
    one-call tile. Queries then lose the prefix keys past their own index: the output must no longer match."""
    q, k_all, v_all, go = _inputs()
    ref = _reference(q, k_all, v_all, go, 23)

    def top_left(mask, rows, n, device):
        keep = torch.ones(rows, n, dtype=torch.bool, device=device).tril()
        return keep.view(1, 1, rows, n) if mask.causal else None

    monkeypatch.setattr(tile_kernels, "_keep", top_left)
    out = _run(q, k_all, v_all, go, 23, single_call=True)[0]
    assert (out - ref[0]).abs().max() > 1e-2


def test_one_call_is_refused_with_the_reason_or_left_to_tiles():
    """A named kernel that cannot take the one call is an error naming why; a chunk that needs another mask or
    comes without joined keys is tiled (the same numbers)."""
    q, k_all, v_all, go = _inputs()
    with pytest.raises(ValueError, match="top-left"):
        _run(q, k_all, v_all, go, 23, single_call=True, kernel="cpu_flash")
    with pytest.raises(ValueError, match="joined_kv must hold"):
        chunk_causal_attention(q, k_all[:, :, 23:], v_all[:, :, 23:], scale=0.3, k_prefix=k_all[:, :, :23],
                               v_prefix=v_all[:, :, :23], joined_kv=(k_all[:, :, 1:], v_all[:, :, 1:]),
                               single_call=True)
    one_call = attention_ops._one_call_kernel
    assert one_call(True, "auto", q, 2, 32, True, True) == "math"
    assert one_call(True, "auto", q, 2, 32, False, True) is None  # padding, documents, a window or a softcap
    assert one_call(True, "auto", q, 2, 32, True, False) is None  # no joined keys
    assert one_call(True, "auto", q, 2, 9, True, True) is None  # no prefix: one square tile already
    assert one_call(False, "math", q, 2, 32, True, True) is None


def test_auto_stays_tiled_on_cpu():
    """The fused CPU kernel's causal mask is top-left: "auto" keeps the tiles (and never picks math's one call,
    which would hold the chunk's whole score matrix)."""
    q, k_all, v_all, go = _inputs(C=9, S=14)
    k, v = (t[:, :, 14:] for t in (k_all, v_all))
    assert attention_ops._one_call_kernel(None, "auto", q, 2, 23, True, True) is None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        chunk_causal_attention(q, k, v, scale=0.3, k_prefix=k_all[:, :, :14], v_prefix=v_all[:, :, :14],
                               kv_block_size=5, joined_kv=(k_all, v_all))
    calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_dot_product_flash_attention_for_cpu")
    assert calls == 4


def _counting_one_call(used: list):
    """Wrap ``_one_call_kernel`` to record what it chose for each chunk (None: tiles)."""
    original = attention_ops._one_call_kernel

    def counted(*args):
        name = original(*args)
        used.append(name)
        return name

    return counted


def test_streambp_model_with_one_call_chunks_matches_stock(monkeypatch):
    """``long_seq.attention.single_call: true``: StreamBP's chunks attend through the stream's joined key buffers
    (written in forward and in the backward's re-forward; on CPU the math kernel takes the one call). Loss and every
    gradient match the stock model (float64, sdpa reference) to 1e-10, and the one call did run."""
    model, batch = make_model("llama", DT, num_layers=2), make_batch(seq_len=37, pad=False)
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=DT)
    used = []
    monkeypatch.setattr(attention_ops, "_one_call_kernel", _counting_one_call(used))
    # the chunked head computes the loss in float64 (the stock loss upcasts logits to float32 only)
    ds_longseq.enable(model, {"streambp": {"enabled": True, "chunk_size": 10}, "lm_head": {"enabled": True},
                              "attention": {"single_call": True}})
    errs = compare(loss_and_grads(model, batch), ref)
    assert max(errs.values()) < 1e-10, errs
    # 4 chunks, 3 with a prefix, per layer: forward and re-forward (+ the first forward's per-layer probe)
    assert used.count("math") >= 2 * 2 * 3


def _sp_worker(rank, world):
    import tests.test_sequence_parallel as sp_tests
    from ds_longseq.forwards.unread_outputs import UnreadLinear

    used, zeros = [], {}
    attention_ops._one_call_kernel = _counting_one_call(used)
    stock_call = UnreadLinear.__call__

    def counted(self, x):  # uncomputed outputs per projection width (q: 4 heads, k and v: 2 heads of llama's)
        if self.mode == "zeros":
            zeros[self.module.out_features] = zeros.get(self.module.out_features, 0) + 1
        return stock_call(self, x)

    UnreadLinear.__call__ = counted
    sp_tests.SP_CASES["one_call"] = {**sp_tests.SP_CASES["streambp"], "attention": {"single_call": True}}
    out = sp_tests.exactness_worker(rank, world, "llama", {}, ["one_call"], None, left_pad=False)
    return {**out, "one_calls": used.count("math"), "tiled": used.count(None), "zeros": zeros}


@pytest.mark.kernel_paths  # the skips' counts hold on every BLAS (tests/test_kernel_paths.py runs it under 2 more)
def test_sequence_parallel_streambp_with_one_call_chunks_matches_stock():
    """Under Ulysses (2 CPU ranks, float64) every chunk attends the exchanged, heads-sharded keys of the whole
    sequence: the one call takes them joined up to the chunk, its dK/dV go to the exchange's sink. Row 1's right
    padding keeps the chunks that see it tiled, so each rank runs both paths; against the stock model to 1e-10.
    The chunk loops leave the key/value projections uncomputed (the attention reads the exchanged ones)."""
    from tests.dist_utils import run_distributed
    from tests.helpers import full_precision_norms
    from tests.test_sequence_parallel import _check, global_batch

    results = run_distributed(_sp_worker, world_size=2, args=(2,))
    model = full_precision_norms(make_model("llama", DT))
    ref = loss_and_grads(model, global_batch(left_pad=False), use_reference=True, ref_dtype=DT)
    _check(results, ref, 2, ["one_call"])
    assert all(r["one_calls"] > 0 for r in results)
    assert any(r["tiled"] > 0 for r in results)
    config = model.config
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    for r in results:
        # 20 tokens per rank in chunks of 3: 7 chunks, 2 layers, k and v; in the backward's loop only (the forward's
        # ran before the layer's probe, which follows its first training forward)
        assert r["zeros"][kv_out] == 7 * 2 * 2, r["zeros"]
        assert r["zeros"][q_out] > 0
