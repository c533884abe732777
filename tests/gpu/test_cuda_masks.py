"""Document segments, sliding windows and softcapping on the CUDA kernels, against the float64 dense
reference of ``tests/test_attention_masks.py``: float32 to ~1e-5; bfloat16 no worse than the math
tile's own bfloat16 error on the same inputs (both round inputs and outputs the same way)."""

import pytest
import torch

from ds_longseq.ops.chunk_attention import chunk_causal_attention, query_lower_bounds
from tests.test_attention_masks import CASES, dense_reference, doc_starts

CUDA = torch.device("cuda")


def _problem(case, seed=0):
    B, H, Hkv, S, K, C, docs, window, softcap, padded = CASES[case]
    g = torch.Generator().manual_seed(seed)
    N, D = S + K, 64
    q = torch.randn(B, H, C, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64)
    go = torch.randn(B, H, C, D, generator=g, dtype=torch.float64)
    first_q = N - C
    starts = None if docs is None else doc_starts(docs, N)[:, first_q:]
    lo = query_lower_bounds(torch.arange(first_q, N), starts, window)
    valid = None
    if padded:
        valid = torch.ones(B, N, dtype=torch.bool)
        valid[0, 2:4] = False
        valid[-1, -3] = False
    return q, k, v, go, lo, valid, softcap, S


def _grads(q, k, v, go, lo, valid, softcap, S, dtype, kernel, block, device):
    to = lambda t: t.to(device, dtype)  # noqa: E731
    qc = to(q).requires_grad_()
    kc, vc = to(k[:, :, S:]).requires_grad_(), to(v[:, :, S:]).requires_grad_()
    sink = tuple(torch.zeros(t[:, :, :S].shape, device=device, dtype=torch.float32) for t in (k, v))
    out = chunk_causal_attention(
        qc, kc, vc, scale=q.shape[-1] ** -0.5, k_prefix=to(k[:, :, :S]) if S else None,
        v_prefix=to(v[:, :, :S]) if S else None, key_valid=None if valid is None else valid.to(device),
        kv_block_size=block, prefix_grad_sink=sink if S else None, kernel=kernel,
        query_lo=None if lo is None else lo.to(device), softcap=softcap,
    )
    dq, dk, dv = torch.autograd.grad(out, (qc, kc, vc), to(go))
    return [t.double().cpu() for t in (out, dq, dk, dv, *(sink if S else ()))]


def _reference(q, k, v, go, lo, valid, softcap, S):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    B, C = q.shape[0], q.shape[2]
    out = dense_reference(q, k, v, k.shape[2] - C, None if lo is None else lo.expand(B, C), valid, softcap,
                          q.shape[-1] ** -0.5)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), go)
    res = [out.detach(), dq, dk[:, :, S:], dv[:, :, S:]]
    return res + ([dk[:, :, :S], dv[:, :, :S]] if S else [])


def _errs(got, ref):
    return [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(got, ref, strict=True)]


@pytest.mark.parametrize("block", [4, None])
@pytest.mark.parametrize("kernel", ["auto", "cuda_efficient"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_masked_cuda_kernels_float32(case, kernel, block):
    problem = _problem(case)
    if kernel == "cuda_efficient" and problem[6] is not None:
        pytest.skip("the memory-efficient kernel has no softcap (auto falls back to math)")
    ref = _reference(*problem)
    errs = _errs(_grads(*problem, torch.float32, kernel, block, CUDA), ref)
    assert max(errs) < 1e-5, errs


@pytest.mark.parametrize("case", sorted(CASES))
def test_masked_cuda_kernels_bf16_no_worse_than_math_tile(case):
    problem = _problem(case)
    ref = _reference(*problem)
    ours = _errs(_grads(*problem, torch.bfloat16, "auto", None, CUDA), ref)
    math = _errs(_grads(*problem, torch.bfloat16, "math", None, CUDA), ref)
    assert max(ours) <= 2 * max(math) + 1e-3, (ours, math)


def test_backward_never_syncs_with_the_host():
    """Padding and document cuts are planned on the host once, in forward: the backward of a padded,
    packed chunk queues its kernels without waiting for the GPU."""
    q, k, v, go, lo, valid, softcap, S = _problem("docs_padding")
    to = lambda t: t.to(CUDA, torch.bfloat16)  # noqa: E731
    qc, kc, vc = to(q).requires_grad_(), to(k[:, :, S:]).requires_grad_(), to(v[:, :, S:]).requires_grad_()
    sink = tuple(torch.zeros(t[:, :, :S].shape, device=CUDA) for t in (k, v))
    out = chunk_causal_attention(qc, kc, vc, scale=0.125, k_prefix=to(k[:, :, :S]), v_prefix=to(v[:, :, :S]),
                                 key_valid=valid.to(CUDA), prefix_grad_sink=sink, query_lo=lo.to(CUDA))
    grad = to(go)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out.backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert qc.grad is not None


def test_packed_diagonal_tiles_run_unmasked_fused_kernels(monkeypatch):
    """A chunk of several whole documents is split into one square causal tile per document, which
    the unmasked fused kernels take (cuDNN on sm90+, else flash) instead of a masked kernel."""
    import ds_longseq.ops.chunk_attention as attention

    C, D, H = 256, 64, 4
    lo = doc_starts([[64, 128, 64]], C)
    q, k, v = (torch.randn(1, H, C, D, device=CUDA, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    picked = []
    real_pick = attention.pick_kernel

    def spy(requested, qt, mask):
        kernel = real_pick(requested, qt, mask)
        picked.append((mask.causal, kernel.name))
        return kernel

    monkeypatch.setattr(attention, "pick_kernel", spy)
    out = chunk_causal_attention(q, k, v, scale=D**-0.5, query_lo=lo.to(CUDA))
    out.backward(torch.randn_like(out))
    diag = [name for causal, name in picked if causal]
    assert len(diag) == 6  # 3 documents, forward and backward
    assert set(diag) <= {"cuda_cudnn", "cuda_flash"}, diag
