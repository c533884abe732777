"""The fused CUDA tile kernels against the math tile and a float64 dense reference.

Grid: chunk length C, prefix length S, heads / kv heads (GQA and not), head dim, padding (none,
left padding that leaves early rows with no key at all, right padding), tile size (whole prefix,
and tiles that split it). Each case runs the op's forward and backward (dQ, dK, dV of the chunk
and the prefix gradients added into a sink) and compares with the same computation in float64 on
the CPU. Tolerances: float32 kernels land at ~1e-6 relative; half-precision kernels are judged
against the math tile's own error in the same dtype (both round inputs and output the same way).
"""

import itertools
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from ds_longseq.ops.chunk_attention import chunk_causal_attention
from ds_longseq.ops.lm_head_loss import _mixed_addmm_works, chunked_lm_head_loss, shift_causal_labels
from ds_longseq.ops.tile_kernels import KERNELS, attention_kernel_for

CUDA = torch.device("cuda")


def _dense_reference(q, k_all, v_all, valid, sinks=None):
    """float64 bottom-right causal attention with padding; rows with no key give 0. ``sinks``: (H,) one
    zero-value sink logit per head (gpt-oss). Values may have their own head dim (multi-head latent attention)."""
    H, Hkv, C, N = q.shape[1], k_all.shape[1], q.shape[2], k_all.shape[2]
    k, v = k_all.repeat_interleave(H // Hkv, 1), v_all.repeat_interleave(H // Hkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = torch.ones(C, N, dtype=torch.bool).tril(N - C)[None, None]
    if valid is not None:
        keep = keep & valid[:, None, None, :]
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, H, 1, 1).expand(*scores.shape[:3], 1)], -1)
    return torch.softmax(scores, -1)[..., :N].nan_to_num(0.0) @ v


def _inputs(B, H, Hkv, C, S, D, padding, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, C, D, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(B, Hkv, S + C, D, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(B, Hkv, S + C, D, generator=g, dtype=torch.float64)
    go = torch.randn(B, H, C, D, generator=g, dtype=torch.float64)
    valid = None
    if padding == "left":  # the first 9 keys: rows of the chunk see no key at all when S == 0
        # (Not the whole prefix: a row whose only key is its own has dK = 0 exactly, a cancellation
        # whose float32 noise, relative to the tiny dK norm, measures nothing about the kernels.)
        valid = torch.ones(B, S + C, dtype=torch.bool)
        valid[0, : min(S + C - 1, 9)] = False
    elif padding == "right":
        valid = torch.ones(B, S + C, dtype=torch.bool)
        valid[-1, -3:] = False
    return q, k, v, go, valid


def _run(q, k, v, go, valid, S, dtype, kernel, block):
    """The op on CUDA in ``dtype``: (out, dq, dk_chunk, dv_chunk, dk_prefix, dv_prefix) in float64."""
    to = lambda t: t.to(CUDA, dtype)  # noqa: E731
    qc = to(q).requires_grad_()
    kc, vc = to(k[:, :, S:]).requires_grad_(), to(v[:, :, S:]).requires_grad_()
    sink = tuple(torch.zeros(t[:, :, :S].shape, device=CUDA) for t in (k, v))
    out = chunk_causal_attention(
        qc, kc, vc, scale=q.shape[-1] ** -0.5, k_prefix=to(k[:, :, :S]) if S else None,
        v_prefix=to(v[:, :, :S]) if S else None, key_valid=None if valid is None else valid.to(CUDA),
        kv_block_size=block, prefix_grad_sink=sink if S else None, kernel=kernel,
    )
    dq, dk, dv = torch.autograd.grad(out, (qc, kc, vc), to(go))
    return [t.double().cpu() for t in (out, dq, dk, dv, *sink)]


def _reference(q, k, v, go, valid, S):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = _dense_reference(q, k, v, valid)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    return [out.detach(), dq, dk[:, :, S:], dv[:, :, S:], dk[:, :, :S], dv[:, :, :S]]


def _sdpa_baseline(q, k, v, go, valid, S, dtype):
    """torch's own SDPA on the whole problem in ``dtype`` (explicit bottom-right mask): the baseline's
    own half-precision error, as in the bf16 protocol. Rows with no key are zeroed like ours."""
    C, N = q.shape[2], k.shape[2]
    keep = torch.ones(C, N, dtype=torch.bool).tril(N - C)[None, None]
    if valid is not None:
        keep = keep & valid[:, None, None, :]
    qc, kc, vc = (t.to(CUDA, dtype).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=keep.to(CUDA), enable_gqa=True,
                                         scale=q.shape[-1] ** -0.5)
    seen = keep.any(-1, keepdim=True).to(CUDA)
    out = torch.where(seen, out, torch.zeros_like(out))
    dq, dk, dv = torch.autograd.grad(out, (qc, kc, vc), go.to(CUDA, dtype))
    res = [t.double().cpu() for t in (out, dq, dk[:, :, S:], dv[:, :, S:], dk[:, :, :S], dv[:, :, :S])]
    return [r.nan_to_num(0.0) for r in res]


def _report(**record):
    """Append one case's errors to $DS_LONGSEQ_GPU_REPORT (JSON lines), for benchmarks/RESULTS.md."""
    path = os.environ.get("DS_LONGSEQ_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.numel() else 0.0


NAMES = ("out", "dq", "dk", "dv", "dk_prefix", "dv_prefix")
GRID = list(
    itertools.product(
        [(1, 1), (4, 1), (8, 2), (4, 4)],  # (H, Hkv)
        [(16, 0), (13, 37), (64, 128), (1, 40)],  # (C, S)
        [64, 128],  # D
        ["none", "left", "right"],
    )
)


@pytest.mark.parametrize("heads,lengths,D,padding", GRID)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_kernels_match_math_tile(heads, lengths, D, padding, dtype):
    (H, Hkv), (C, S) = heads, lengths
    q, k, v, go, valid = _inputs(2, H, Hkv, C, S, D, padding)
    ref = _reference(q, k, v, go, valid, S)
    base = _sdpa_baseline(q, k, v, go, valid, S, dtype)
    for block in (None, 24):  # the whole prefix in one tile (CUDA default), and split tiles
        ours = _run(q, k, v, go, valid, S, dtype, "auto", block)
        math_ = _run(q, k, v, go, valid, S, dtype, "math", block)
        errs, baseline = [], []
        for name, o, m, b, r in zip(NAMES, ours, math_, base, ref, strict=True):
            err_o, err_m, err_b = _rel(o, r), _rel(m, r), _rel(b, r)
            _report(test="auto", H=H, Hkv=Hkv, C=C, S=S, D=D, padding=padding, dtype=str(dtype), block=block,
                    tensor=name, err=err_o, err_math=err_m, err_sdpa=err_b)
            if dtype == torch.float32:
                # float32 kernels accumulate in float32; where torch's own SDPA (the same efficient
                # kernel) loses more, we may lose as much
                assert err_o < max(2e-5, 1.5 * err_b), (name, block, err_o, err_m, err_b)
            errs.append(err_o)
            baseline.append(max(err_m, err_b))
        if dtype != torch.float32:
            # half precision, the bf16 protocol of the model tests: worst and mean error over output and
            # gradients no worse than the better of the math tile and torch's SDPA in the same dtype
            # (per tensor the ratio is noisy: one key's dK is 128 bf16 numbers)
            assert max(errs) <= 1.5 * max(baseline) + 1e-3, (block, errs, baseline)
            assert sum(errs) <= 1.5 * sum(baseline) + 1e-3, (block, errs, baseline)


@pytest.mark.parametrize("kernel,dtype,padding", [
    ("cuda_cudnn", torch.bfloat16, "none"),
    ("cuda_cudnn", torch.float16, "none"),
    ("cuda_flash", torch.bfloat16, "none"),
    ("cuda_flash", torch.float16, "none"),
    ("cuda_efficient", torch.float32, "left"),
    ("cuda_efficient", torch.bfloat16, "left"),
    ("cuda_efficient", torch.float16, "right"),
    ("cuda_efficient", torch.float32, "none"),
])
def test_each_named_kernel_against_reference(kernel, dtype, padding):
    q, k, v, go, valid = _inputs(2, 8, 2, 48, 80, 128, padding, seed=3)
    ref = _reference(q, k, v, go, valid, 80)
    math_ = _run(q, k, v, go, valid, 80, dtype, "math", None)
    base = _sdpa_baseline(q, k, v, go, valid, 80, dtype)
    ours = _run(q, k, v, go, valid, 80, dtype, kernel, None)
    for name, o, m, b, r in zip(NAMES, ours, math_, base, ref, strict=True):
        err_o, err_m, err_b = _rel(o, r), _rel(m, r), _rel(b, r)
        _report(test=kernel, dtype=str(dtype), padding=padding, tensor=name, err=err_o, err_math=err_m, err_sdpa=err_b)
        bound = max(2e-5, 1.5 * err_b) if dtype == torch.float32 else 1.5 * max(err_m, err_b) + 1e-3
        assert err_o <= bound, (name, err_o, err_m, err_b)


def test_auto_picks_fused_kernels_and_falls_back_without_error():
    q = torch.zeros(1, 4, 32, 64, device=CUDA, dtype=torch.bfloat16)
    fastest = "cuda_cudnn" if torch.cuda.get_device_capability() >= (9, 0) else "cuda_flash"
    assert attention_kernel_for(q) == fastest
    assert attention_kernel_for(torch.zeros_like(q[..., :1]).expand(1, 4, 32, 200)) == "cuda_flash"  # head dim 200
    assert attention_kernel_for(q[:, :, :8]) == "cuda_flash"  # 8 query rows: below cuDNN's minimum here
    assert attention_kernel_for(q, padded=True) == "cuda_efficient"
    assert attention_kernel_for(q.float()) == "cuda_efficient"
    assert attention_kernel_for(q.double()) == "math"
    assert attention_kernel_for(q[..., :36]) == "math"  # head dim 36: neither fused kernel takes it
    assert KERNELS["cuda_flash"].refuses(q.double(), None).startswith("flash attention takes")


def test_streaming_chunks_with_prefix_sinks_equals_dense_on_cuda():
    """StreamBP's use: chunks in reverse order, prefix as constants with gradients added to sinks."""
    B, H, Hkv, T, D, chunk = 2, 8, 2, 150, 64, 32
    q, k, v, go, _ = _inputs(B, H, Hkv, T, 0, D, "none", seed=5)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :7] = False
    ref = _reference(q, k, v, go, valid, 0)
    for dtype in (torch.float32, torch.bfloat16):
        K, V = k.to(CUDA, dtype), v.to(CUDA, dtype)
        dk = torch.zeros(K.shape, device=CUDA)
        dv = torch.zeros(V.shape, device=CUDA)
        dq = torch.zeros(q.shape, device=CUDA)
        for s in reversed(range(0, T, chunk)):
            e = min(s + chunk, T)
            qc = q[:, :, s:e].to(CUDA, dtype).requires_grad_()
            kc, vc = K[:, :, s:e].clone().requires_grad_(), V[:, :, s:e].clone().requires_grad_()
            out = chunk_causal_attention(qc, kc, vc, scale=D**-0.5, k_prefix=K[:, :, :s], v_prefix=V[:, :, :s],
                                         key_valid=valid[:, :e].to(CUDA), prefix_grad_sink=(dk, dv))
            gq, gk, gv = torch.autograd.grad(out, (qc, kc, vc), go[:, :, s:e].to(CUDA, dtype))
            dq[:, :, s:e] = gq.float()
            dk[:, :, s:e] += gk.float()
            dv[:, :, s:e] += gv.float()
        # bf16: the sinks sum float32 shares of bf16-rounded tile gradients over 5 chunks
        bound = 2e-5 if dtype == torch.float32 else 2e-2
        for name, got, want in (("dq", dq, ref[1]), ("dk", dk, ref[2]), ("dv", dv, ref[3])):
            err = _rel(got.double().cpu(), want)
            _report(test="streaming", dtype=str(dtype), tensor=name, err=err)
            assert err < bound, (dtype, name, err)


def test_lm_head_weight_grad_in_float32_on_cuda():
    """bf16 head: the chunked weight gradient is no further from float64 than one bf16 GEMM."""
    torch.manual_seed(0)
    V, d, T = 4099, 256, 3001
    hidden = torch.randn(1, T, d, dtype=torch.float64)
    weight = torch.randn(V, d, dtype=torch.float64) * 0.05
    targets = shift_causal_labels(torch.randint(0, V, (1, T)))
    valid = targets[0] != -100

    def grads(h, w, chunked):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        if chunked:
            loss, _ = chunked_lm_head_loss(h, w, targets.to(h.device), chunk_size=256)
        else:
            logits = (h[0] @ w.t()).to(torch.float64 if h.dtype == torch.float64 else torch.float32)
            loss = torch.nn.functional.cross_entropy(logits[valid.to(h.device)], targets[0][valid].to(h.device),
                                                     reduction="sum")
        return [t.double().cpu() for t in (loss, *torch.autograd.grad(loss, (h, w)))]

    exact = grads(hidden, weight, False)
    stock = grads(hidden.to(CUDA, torch.bfloat16), weight.to(CUDA, torch.bfloat16), False)
    ours = grads(hidden.to(CUDA, torch.bfloat16), weight.to(CUDA, torch.bfloat16), True)
    mixed = _mixed_addmm_works(CUDA)
    for name, s, o, r in zip(("loss", "dh", "dw"), stock, ours, exact, strict=True):
        _report(test="lm_head", tensor=name, err=_rel(o, r), err_stock=_rel(s, r), mixed_addmm=mixed)
        assert _rel(o, r) <= 1.5 * _rel(s, r) + 1e-6, (name, _rel(o, r), _rel(s, r))


# Not yet run on a GPU (README, "GPU status"): the sink and value-head-dim paths of the fused kernels.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D,Dv,sinks", [(192, 128, False), (64, 64, True), (96, 64, True)],
                         ids=["mla_deepseek_dims", "sinks", "mla_and_sinks"])
def test_value_head_dims_and_sinks_match_reference(dtype, D, Dv, sinks):
    """Values of another head dim than the keys (zero-padded for the fused kernels) and attention sinks, with
    a prefix in tiles and through the sink buffers, against float64: float32 at 2e-5, bf16 no worse than the
    math tile in bf16 (the kernels' own rounding)."""
    B, H, Hkv, C, S = 2, 8, 2, 48, 80
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, C, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S + C, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S + C, Dv, generator=g, dtype=torch.float64)
    s = torch.randn(H, generator=g, dtype=torch.float64) if sinks else None
    go = torch.randn(B, H, C, Dv, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([s.clone().requires_grad_()] if sinks else [])
    out = _dense_reference(*leaves[:3], None, leaves[3] if sinks else None)
    ref = [out.detach(), *torch.autograd.grad(out, leaves, go)]

    def run(kernel):
        to = lambda t: t.to(CUDA, dtype)  # noqa: E731
        qc, kc, vc = to(q).requires_grad_(), to(k[:, :, S:]).requires_grad_(), to(v[:, :, S:]).requires_grad_()
        sc = [to(s).requires_grad_()] if sinks else []
        buffers = (torch.zeros(B, Hkv, S, D, device=CUDA), torch.zeros(B, Hkv, S, Dv, device=CUDA))
        o = chunk_causal_attention(qc, kc, vc, scale=D**-0.5, k_prefix=to(k[:, :, :S]), v_prefix=to(v[:, :, :S]),
                                   kv_block_size=32, prefix_grad_sink=buffers, kernel=kernel,
                                   sink_logits=sc[0] if sinks else None)
        grads = torch.autograd.grad(o, [qc, kc, vc, *sc], to(go))
        dk = torch.cat([buffers[0], grads[1].float()], 2)
        dv = torch.cat([buffers[1], grads[2].float()], 2)
        return [t.double().cpu() for t in (o, grads[0], dk, dv, *grads[3:])]

    ours, math_ = run("auto"), run("math")
    for name, o, m, r in zip(("out", "dq", "dk", "dv", "dsinks"), ours, math_, ref, strict=False):
        err_o, err_m = _rel(o, r), _rel(m, r)
        _report(test="value_head_dims_and_sinks", D=D, Dv=Dv, sinks=sinks, dtype=str(dtype), tensor=name, err=err_o,
                err_math=err_m)
        bound = 2e-5 if dtype == torch.float32 else 1.5 * err_m + 1e-3
        assert err_o <= bound, (name, err_o, err_m)


# --- one kernel call per chunk (prefix and diagonal together, bottom-right causal mask) -------------------------


def _run_one_call(q, k, v, go, S, dtype, kernel, single_call):
    """The op on CUDA with the keys joined (as StreamBP's and Ulysses' buffers give them): same outputs as ``_run``."""
    to = lambda t: t.to(CUDA, dtype)  # noqa: E731
    joined = (to(k), to(v))
    qc = to(q).requires_grad_()
    kc, vc = joined[0][:, :, S:].clone().requires_grad_(), joined[1][:, :, S:].clone().requires_grad_()
    sink = tuple(torch.zeros(t[:, :, :S].shape, device=CUDA) for t in (k, v))
    out = chunk_causal_attention(
        qc, kc, vc, scale=q.shape[-1] ** -0.5, k_prefix=joined[0][:, :, :S], v_prefix=joined[1][:, :, :S],
        prefix_grad_sink=sink, kernel=kernel, joined_kv=joined, single_call=single_call,
    )
    dq, dk, dv = torch.autograd.grad(out, (qc, kc, vc), to(go))
    return [t.double().cpu() for t in (out, dq, dk, dv, *sink)]


@pytest.mark.parametrize("kernel,dtype,H,Hkv", [
    ("cuda_flash", torch.bfloat16, 8, 2),
    ("cuda_flash", torch.float16, 4, 4),
    ("cuda_efficient", torch.float32, 4, 4),
    ("cuda_efficient", torch.bfloat16, 4, 4),
])
def test_one_call_kernels_match_reference_and_tiles(kernel, dtype, H, Hkv):
    """FlashAttention-2's is_causal and the memory-efficient kernel's mask type 2 on a chunk with more keys than
    queries: bottom-right aligned, so one call per direction gives what the tiles give (errors judged as above)."""
    S = 200
    q, k, v, go, _ = _inputs(2, H, Hkv, 48, S, 128, "none", seed=7)
    ref = _reference(q, k, v, go, None, S)
    math_ = _run(q, k, v, go, None, S, dtype, "math", None)
    base = _sdpa_baseline(q, k, v, go, None, S, dtype)
    ours = _run_one_call(q, k, v, go, S, dtype, kernel, True)
    for name, o, m, b, r in zip(NAMES, ours, math_, base, ref, strict=True):
        err_o, err_m, err_b = _rel(o, r), _rel(m, r), _rel(b, r)
        _report(test=f"one_call_{kernel}", dtype=str(dtype), H=H, Hkv=Hkv, tensor=name, err=err_o, err_math=err_m,
                err_sdpa=err_b)
        bound = max(2e-5, 1.5 * err_b) if dtype == torch.float32 else 1.5 * max(err_m, err_b) + 1e-3
        assert err_o <= bound, (name, err_o, err_m, err_b)


def test_one_call_counted_by_the_profiler_and_a_top_left_mask_fails(monkeypatch):
    """One flash call forward and one backward per chunk with the one call, two each with tiles (the prefix tile
    and the diagonal), counted by torch.profiler. The mutation: cuDNN's top-left causal mask let onto the one-call
    tile must miss the reference by far."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, go, _ = _inputs(2, 8, 2, 48, 200, 128, "none", seed=8)
    for single, calls in ((True, 1), (False, 2)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _run_one_call(q, k, v, go, 200, torch.bfloat16, "cuda_flash", single)
        counts = {e.key: e.count for e in prof.key_averages()}
        assert counts.get("aten::_scaled_dot_product_flash_attention", 0) == calls, counts
        assert counts.get("aten::_scaled_dot_product_flash_attention_backward", 0) == calls, counts
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is used on sm90+ only")
    ref = _reference(q, k, v, go, None, 200)
    monkeypatch.setattr(KERNELS["cuda_cudnn"], "bottom_right", True)
    wrong = _run_one_call(q, k, v, go, 200, torch.bfloat16, "cuda_cudnn", True)
    assert _rel(wrong[0], ref[0]) > 0.1


def test_auto_one_call_only_where_the_prefix_tile_kernel_takes_it():
    """cuDNN (Hopper, head dim <= 128) keeps the tiles; where flash would take the prefix tile (head dim 160, or
    before sm90) or the memory-efficient kernel without GQA (float32), one call."""
    from ds_longseq.ops.chunk_attention import _one_call_kernel

    q = torch.zeros(1, 8, 64, 128, device=CUDA, dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert _one_call_kernel(None, "auto", q, 2, 512, True, True) == (None if hopper else "cuda_flash")
    wide = torch.zeros(1, 8, 64, 160, device=CUDA, dtype=torch.bfloat16)
    assert _one_call_kernel(None, "auto", wide, 2, 512, True, True) == "cuda_flash"
    assert _one_call_kernel(None, "auto", q.float(), 8, 512, True, True) == "cuda_efficient"
    assert _one_call_kernel(None, "auto", q.float(), 2, 512, True, True) is None  # GQA: K/V would be repeated
    assert _one_call_kernel(None, "auto", q, 2, 512, False, True) is None  # padding / documents / window / softcap
