"""Document segments, sliding windows and logit softcapping in the chunk attention op, against a
dense float64 reference on every output and gradient (prefix gradients through the sink too)."""

import pytest
import torch

from ds_longseq.ops.chunk_attention import _plan, chunk_causal_attention, query_lower_bounds


def dense_reference(q, k_all, v_all, first_q, lo, valid, softcap, scale):
    """(B, H, C, D) softmax attention with an explicit (B, C, N) mask; rows seeing nothing give 0."""
    B, H, C, D = q.shape
    R = H // k_all.shape[1]
    k, v = k_all.repeat_interleave(R, 1), v_all.repeat_interleave(R, 1)
    scores = (q * scale) @ k.transpose(-1, -2)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    N = k.shape[2]
    pos = torch.arange(first_q, first_q + C).view(1, C, 1)
    keys = torch.arange(N).view(1, 1, N)
    keep = (keys <= pos).expand(B, C, N)
    if lo is not None:
        keep = keep & (keys >= lo.view(-1, C, 1))
    if valid is not None:
        keep = keep & valid.view(B, 1, N)
    scores = scores.masked_fill(~keep.unsqueeze(1), float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return p @ v


def doc_starts(lengths_per_row, T):
    """(B, T) global index of each token's document start, from per-row document lengths."""
    rows = []
    for lengths in lengths_per_row:
        assert sum(lengths) == T
        starts = []
        pos = 0
        for n in lengths:
            starts += [pos] * n
            pos += n
        rows.append(starts)
    return torch.tensor(rows)


CASES = {
    # name: (B, H, Hkv, S, K, C, docs per row (None: one), window, softcap, padded)
    "docs": (2, 4, 2, 13, 9, 9, [[1, 7, 5, 4, 5], [11, 1, 10]], None, None, False),
    "docs_one_token_first": (1, 2, 2, 10, 6, 6, [[1, 15]], None, None, False),
    "window": (1, 4, 1, 17, 7, 7, None, 5, None, False),
    "window_wider_than_prefix": (2, 2, 2, 5, 4, 4, None, 40, None, False),
    "docs_window_softcap": (2, 4, 2, 12, 8, 8, [[3, 9, 8], [14, 6]], 6, 1.5, False),
    "softcap_only": (1, 4, 4, 9, 5, 5, None, None, 2.0, False),
    "docs_padding": (2, 2, 1, 11, 7, 7, [[5, 6, 7], [18]], None, None, True),
    "generation_form": (1, 4, 2, 0, 20, 6, [[4, 9, 7]], None, None, False),
    # many tiny documents in a 64-row chunk: cuts closer than C / 32 rows are merged (masked tiles)
    "tiny_docs_merged": (1, 2, 1, 6, 64, 64, [[9, 1, 1, 2, 1, 3, 20, 1, 1, 31]], None, None, False),
    # the rows of a batch start documents at different rows: only the common starts split the diagonal
    "docs_differ_across_batch": (2, 2, 2, 4, 12, 12, [[4, 5, 7], [4, 3, 2, 7]], None, None, False),
    "docs_padding_split_diagonal": (2, 2, 2, 0, 10, 10, [[4, 6], [4, 6]], None, None, True),
}


@pytest.mark.parametrize("dv", [8, 5, 12], ids=["dv=d", "dv<d", "dv>d"])  # values of their own head dim (MLA)
@pytest.mark.parametrize("kernel", ["auto", "math"])
@pytest.mark.parametrize("block", [3, 4, 1024])
@pytest.mark.parametrize("case", sorted(CASES))
def test_masked_chunk_attention_matches_dense_float64(case, block, kernel, dv):
    B, H, Hkv, S, K, C, docs, window, softcap, padded = CASES[case]
    torch.manual_seed(hash(case) % 1000)
    N, D = S + K, 8
    dt = torch.float64
    q = torch.randn(B, H, C, D, dtype=dt, requires_grad=True)
    k_all = torch.randn(B, Hkv, N, D, dtype=dt, requires_grad=True)
    v_all = torch.randn(B, Hkv, N, dv, dtype=dt, requires_grad=True)
    first_q = N - C
    positions = torch.arange(first_q, N)
    starts = None if docs is None else doc_starts(docs, N)[:, first_q:]
    lo = query_lower_bounds(positions, starts, window)
    valid = None
    if padded:
        valid = torch.ones(B, N, dtype=torch.bool)
        valid[0, 2:4] = False  # padding inside a document of the prefix
        valid[1, -3] = False
    scale = D**-0.5
    grad = torch.randn(B, H, C, dv, dtype=dt)

    ref = dense_reference(q, k_all, v_all, first_q, None if lo is None else lo.expand(B, C), valid, softcap, scale)
    ref_grads = torch.autograd.grad(ref, (q, k_all, v_all), grad)

    sink = (torch.zeros(B, Hkv, S, D, dtype=dt), torch.zeros(B, Hkv, S, dv, dtype=dt)) if S else None
    out = chunk_causal_attention(
        q, k_all[:, :, S:], v_all[:, :, S:], scale=scale,
        k_prefix=k_all[:, :, :S].detach() if S else None, v_prefix=v_all[:, :, :S].detach() if S else None,
        key_valid=valid, kv_block_size=block, prefix_grad_sink=sink, query_lo=lo, softcap=softcap, kernel=kernel,
    )
    dq, dk_own, dv_own = torch.autograd.grad(out, (q, k_all, v_all), grad, allow_unused=True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dq, ref_grads[0], rtol=1e-10, atol=1e-10)
    dk = dk_own.clone()
    dv = dv_own.clone()
    if S:
        dk[:, :, :S] += sink[0]
        dv[:, :, :S] += sink[1]
    torch.testing.assert_close(dk, ref_grads[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv, ref_grads[2], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("origin", ["none", "left_padding", "documents"])
# bitwise by construction: integer bounds
def test_attention_chunk_bounds_follow_transformers_chunked_mask(origin):
    """query_lower_bounds with attention chunks of 4: the first key each query sees is the first key of
    transformers' chunked_overlay ((j - origin) // A == (i - origin) // A, j <= i)."""
    A, N, C = 4, 23, 9
    positions = torch.arange(N - C, N)
    if origin == "none":
        chunk_origin, o = None, torch.zeros(2, C, dtype=torch.long)
    elif origin == "left_padding":
        chunk_origin = torch.tensor([[3], [6]])
        o = chunk_origin.expand(2, C)
    else:
        chunk_origin = doc_starts([[5, 10, 8], [13, 10]], N)[:, N - C:]
        o = chunk_origin
    lo = query_lower_bounds(positions, None, None, A, chunk_origin).expand(2, C)
    keys = torch.arange(N).view(1, 1, N)
    i = positions.view(1, C, 1)
    seen = (keys <= i) & (torch.div(keys - o.unsqueeze(-1), A, rounding_mode="floor")
                          == torch.div(i - o.unsqueeze(-1), A, rounding_mode="floor"))
    assert torch.equal(lo, seen.int().argmax(-1))


def test_plan_skips_tiles_outside_documents():
    """A chunk of a packed row visits only the prefix keys of the document it starts in, and each
    prefix tile serves only the rows that can see it: cost grows with the documents' sizes."""
    S, C = 96, 16
    # the chunk's queries: 4 rows of a document that began at key 80, then a new document at 100
    lo = torch.tensor([[80] * 4 + [100] * 12])
    tiles = _plan(S, C, C, 1024, lo)
    prefix = [t for t in tiles if not t.causal]
    assert [(t.offset + t.a, t.offset + t.b, t.rows, t.lo_shift) for t in prefix] == [(80, 96, 4, None)]
    # the diagonal is split where the new document starts: two square causal tiles, neither masked
    diag = [(t.r0, t.r1, t.a, t.b, t.lo_shift) for t in tiles if t.causal]
    assert diag == [(0, 4, 0, 4, None), (4, 16, 4, 16, None)]
    # no bounds: the whole prefix in blocks, every row
    assert [(t.a, t.b, t.rows) for t in _plan(S, C, C, 32, None)[:-1]] == [(0, 32, C), (32, 64, C), (64, 96, C)]
    # a window keeps C x (window + C) keys per chunk
    win = query_lower_bounds(torch.arange(S, S + C), None, 8)
    assert sum((t.b - t.a) for t in _plan(S, C, C, 4, win) if not t.causal) == 8 - 1


def test_diagonal_split_at_common_document_starts():
    """Square causal tiles per document on the diagonal: only at rows where every batch row starts a
    document, at least C / 32 rows apart; a merged cut leaves its tile masked; padding is found once."""
    C = 64
    own = torch.arange(C)
    lo = torch.zeros(2, C, dtype=torch.int64)
    for b, starts in enumerate(([10, 11, 40], [10, 30, 40])):
        for s in starts:
            lo[b, s:] = s
    assert lo.le(own).all()
    valid = torch.ones(2, C, dtype=torch.bool)
    valid[1, 45] = False
    diag = [(t.r0, t.r1, t.lo_shift, t.padded) for t in _plan(0, C, C, 1024, lo, valid) if t.causal]
    # 10 and 40 are common starts; 11 is 1 row after 10 (< 64 / 32 = 2): merged, so that tile is
    # masked (row 1 of the batch starts a document at 30 inside it as well)
    assert diag == [(0, 10, None, False), (10, 40, 10, False), (40, 64, None, True)]
    # no bounds: one diagonal tile
    assert [(t.r0, t.r1) for t in _plan(0, C, C, 1024, None) if t.causal] == [(0, C)]


def test_backward_makes_no_host_sync(monkeypatch):
    """The tile plan (document cuts, padded tiles) is made on the host once in forward; backward
    reuses it, so on CUDA it never waits for the device (no .cpu(), .item() or bool() of a tensor)."""
    torch.manual_seed(0)
    B, H, S, C, D = 1, 2, 12, 8, 8
    q = torch.randn(B, H, C, D, requires_grad=True)
    k = torch.randn(B, H, C, D, requires_grad=True)
    v = torch.randn(B, H, C, D, requires_grad=True)
    kp, vp = torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    valid = torch.ones(B, S + C, dtype=torch.bool)
    valid[0, 3] = False
    lo = doc_starts([[5, 9, 6]], S + C)[:, S:]
    sink = (torch.zeros(B, H, S, D), torch.zeros(B, H, S, D))
    out = chunk_causal_attention(q, k, v, scale=D**-0.5, k_prefix=kp, v_prefix=vp, key_valid=valid, kv_block_size=4,
                                 prefix_grad_sink=sink, query_lo=lo)
    calls = []

    def spy(name, real):
        def counted(self, *args, **kwargs):
            calls.append(name)
            return real(self, *args, **kwargs)
        return counted

    for name in ("cpu", "item", "__bool__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    out.backward(torch.randn_like(out))
    monkeypatch.undo()
    assert calls == []
    assert q.grad is not None and sink[0].abs().sum() > 0


@pytest.mark.parametrize(
    "lo, match",
    [
        (torch.tensor([[0, 3, 2, 4]]), "decreases"),
        (torch.tensor([[0, 0, 0, 9]]), r"\[0, the query's own key index\]"),
        (torch.tensor([[0, 0, 0]]), "expected"),
    ],
)
def test_bad_query_lo_is_refused(lo, match):
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=match):
        chunk_causal_attention(q, k, k, scale=1.0, query_lo=lo)


def test_explicit_fused_kernel_refuses_softcap():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcap"):
        chunk_causal_attention(q, q, q, scale=1.0, softcap=5.0, kernel="cpu_flash")
