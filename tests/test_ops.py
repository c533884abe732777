"""The autograd ops on their own, against plain autograd in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from ds_longseq.ops import chunk_causal_attention, chunked_lm_head_loss, mini_sequence_apply, shift_causal_labels
from ds_longseq.ops.tile_kernels import KERNELS, TileMask, attention_kernel_for, kernel_chain

DT = torch.float64


def reference_attention(q, k, v, key_valid):
    """Dense reference: repeat K/V for GQA, bottom-right causal mask, padding; empty rows give 0."""
    H, Hkv, C, K = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = torch.ones(C, K, dtype=torch.bool).tril(K - C)[None, None]
    if key_valid is not None:
        keep = keep & key_valid[:, None, None, :]
    return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0) @ v


def _qkv(B=2, H=4, Hkv=2, C=37, K=37, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *s: torch.randn(*s, generator=g, dtype=DT).mul_(1.5).requires_grad_()  # noqa: E731
    return make(B, H, C, D), make(B, Hkv, K, D), make(B, Hkv, K, D)


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("block", [1, 5, 37, 1024])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("C,K", [(37, 37), (7, 37), (1, 20)])
def test_attention_matches_dense_reference(kernel, block, padded, C, K):
    """K > C is generation with a cache: the queries are the LAST C positions."""
    q, k, v = _qkv(C=C, K=K)
    valid = None
    if padded:
        valid = torch.ones(2, K, dtype=torch.bool)
        valid[0, :5] = False  # left padding: early query rows may see no key at all
        valid[1, -3:] = False
    go = torch.randn_like(q)
    ref = reference_attention(q, k, v, valid)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    out = chunk_causal_attention(q, k, v, scale=8**-0.5, key_valid=valid, kv_block_size=block, kernel=kernel)
    grads = torch.autograd.grad(out, (q, k, v), go)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("chunk,block", [(6, 4), (1, 3), (37, 5)])
def test_attention_with_prefix_and_grad_sink_streams_exactly(kernel, chunk, block):
    """Reverse-order chunks with the prefix as constants and its gradient added into a sink."""
    q, k, v = _qkv()
    valid = torch.ones(2, 37, dtype=torch.bool)
    valid[0, :4] = False
    go = torch.randn_like(q)
    ref_grads = torch.autograd.grad(reference_attention(q, k, v, valid), (q, k, v), go)
    K, V = k.detach(), v.detach()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(K), torch.zeros_like(V)
    for s in reversed(range(0, 37, chunk)):
        e = min(s + chunk, 37)
        qc = q.detach()[:, :, s:e].requires_grad_()
        kc, vc = K[:, :, s:e].clone().requires_grad_(), V[:, :, s:e].clone().requires_grad_()
        out = chunk_causal_attention(
            qc, kc, vc, scale=8**-0.5, k_prefix=K[:, :, :s], v_prefix=V[:, :, :s], key_valid=valid[:, :e],
            kv_block_size=block, prefix_grad_sink=(dk, dv), kernel=kernel,
        )
        gq, gk, gv = torch.autograd.grad(out, (qc, kc, vc), go[:, :, s:e])
        dq[:, :, s:e], dk[:, :, s:e], dv[:, :, s:e] = gq, dk[:, :, s:e] + gk, dv[:, :, s:e] + gv
    for g, r in zip((dq, dk, dv), ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_attention_rejects_bad_shapes():
    q, k, v = _qkv(H=3, Hkv=2)
    with pytest.raises(ValueError, match="not a multiple"):
        chunk_causal_attention(q, k, v, scale=1.0)
    q, k, v = _qkv(C=10, K=5)
    with pytest.raises(ValueError, match="at least as many own keys"):
        chunk_causal_attention(q, k, v, scale=1.0)


@pytest.mark.parametrize("num_chunks", [1, 4, 7, 50])
def test_mini_sequence_matches_plain_autograd(num_chunks):
    """T=37 in 4 and 7 uneven chunks, and 50 chunks (more chunks than tokens: empty ones skipped)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.SiLU(), torch.nn.Linear(40, 16)).to(DT)
    x = torch.randn(2, 37, 16, dtype=DT, requires_grad=True)
    go = torch.randn(2, 37, 16, dtype=DT)
    params = list(mlp.parameters())
    ref = torch.autograd.grad(mlp(x), [x, *params], go)
    out = mini_sequence_apply(mlp, x, params, num_chunks)
    torch.testing.assert_close(out, mlp(x), rtol=0, atol=1e-14)
    for g, r in zip(torch.autograd.grad(out, [x, *params], go), ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("used", ["both", "main_only", "aux_only"])
def test_mini_sequence_auxiliary_output_is_differentiable(used):
    """A chunk function returning (out, aux) (an MoE block and its router logits): both come back
    whole, and a loss on either or both gets plain autograd's gradients."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.SiLU(), torch.nn.Linear(40, 16)).to(DT)
    router = torch.nn.Linear(16, 5, bias=False).to(DT)

    def fn(x):
        return mlp(x), router(x)

    x = torch.randn(2, 37, 16, dtype=DT, requires_grad=True)
    params = [*mlp.parameters(), *router.parameters()]
    w_out, w_aux = torch.randn(2, 37, 16, dtype=DT), torch.randn(2, 37, 5, dtype=DT)

    def loss(out, aux):
        terms = {"main_only": [(out * w_out).sum()], "aux_only": [(aux.softmax(-1) * w_aux).sum()]}
        terms["both"] = terms["main_only"] + terms["aux_only"]
        return sum(terms[used])

    ref = torch.autograd.grad(loss(*fn(x)), [x, *params], allow_unused=True)
    out, aux = mini_sequence_apply(fn, x, params, 4)
    torch.testing.assert_close(aux, router(x), rtol=0, atol=1e-14)
    got = torch.autograd.grad(loss(out, aux), [x, *params], allow_unused=True)
    for g, r in zip(got, ref, strict=True):
        if r is None:
            assert g is None or not g.any()
        else:
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("chunk", [1, 3, 16, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_lm_head_loss_matches_cross_entropy(chunk, bias):
    torch.manual_seed(0)
    V, d = 53, 12
    hidden = torch.randn(2, 19, d, dtype=DT, requires_grad=True)
    weight = torch.randn(V, d, dtype=DT, requires_grad=True)
    b = torch.randn(V, dtype=DT, requires_grad=True) if bias else None
    labels = torch.randint(0, V, (2, 19))
    labels[0, :6] = -100
    targets = shift_causal_labels(labels)
    assert targets[0, -1] == -100 and torch.equal(targets[1, :-1], labels[1, 1:])
    inputs = [hidden, weight] + ([b] if bias else [])
    ref = F.cross_entropy(F.linear(hidden, weight, b).reshape(-1, V), targets.reshape(-1), reduction="sum")
    ref_grads = torch.autograd.grad(ref, inputs)
    loss_sum, count = chunked_lm_head_loss(hidden, weight, targets, chunk_size=chunk, bias=b)
    assert count.item() == int((targets != -100).sum())
    torch.testing.assert_close(loss_sum, ref, rtol=1e-13, atol=0)
    for g, r in zip(torch.autograd.grad(loss_sum * 0.5, inputs), ref_grads, strict=True):
        torch.testing.assert_close(g, 0.5 * r, rtol=1e-12, atol=1e-13)


def test_chunked_lm_head_saves_no_logits():
    """Training: the forward forms the gradient, keeping only the (1, T, d) input gradient and the (V, d) weight
    gradient (nothing through autograd's saved tensors, no (N x V) tensor, not even one chunk). Evaluation (no
    grad): nothing at all. Both give the same loss; a second backward is refused (the gradient is handed out
    once)."""
    V, d, T = 997, 8, 300
    hidden = torch.randn(1, T, d, requires_grad=True)
    weight = torch.randn(V, d, requires_grad=True)
    targets = shift_causal_labels(torch.randint(0, V, (1, T)))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss, _ = chunked_lm_head_loss(hidden, weight, targets, chunk_size=64)
    assert saved == []
    kept = sorted(tuple(g.shape) for g, _ in loss.grad_fn.grads if g is not None)
    assert kept == sorted([(1, T, d), (V, d)]), kept
    with torch.no_grad():
        eval_loss, _ = chunked_lm_head_loss(hidden, weight, targets, chunk_size=64)
    torch.testing.assert_close(eval_loss, loss.detach(), rtol=1e-6, atol=0)  # float32: summation order
    loss.backward(retain_graph=True)
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    with pytest.raises(RuntimeError, match="second backward through ds_longseq's chunked LM-head loss"):
        loss.backward()


def test_chunked_lm_head_holds_one_chunk_of_logits_at_a_time():
    """Forward and backward never allocate a tensor larger than chunk_size x V, and never hold two
    logits-sized tensors alive at once (softmax and log-sum-exp are done in place)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    V, d, T, chunk = 997, 8, 300, 64

    class Tracker(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = self.max_live = 0
            self.live = set()  # storage addresses of live logits-sized tensors

        def _gone(self, ptr):
            self.live.discard(ptr)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
                    ptr = t.untyped_storage().data_ptr()
                    # In-place results and views share a storage already counted.
                    if t.numel() >= chunk * V // 2 and ptr not in self.live:
                        self.live.add(ptr)
                        self.max_live = max(self.max_live, len(self.live))
                        weakref.finalize(t.untyped_storage(), self._gone, ptr)
            return out

    hidden = torch.randn(1, T, d, requires_grad=True)
    weight = torch.randn(V, d, requires_grad=True)
    targets = shift_causal_labels(torch.randint(0, V, (1, T)))
    for phase in ("forward", "backward", "forward without grad"):
        tracker = Tracker()
        with tracker:
            if phase == "forward":
                loss, _ = chunked_lm_head_loss(hidden, weight, targets, chunk_size=chunk)
            elif phase == "backward":  # the gradient was formed in the forward: a scaling, no logits
                loss.backward()
            else:
                with torch.no_grad():
                    chunked_lm_head_loss(hidden, weight, targets, chunk_size=chunk)
        if phase == "backward":
            assert tracker.largest <= V * d and tracker.max_live == 0, (phase, tracker.largest)
            continue
        assert chunk * V // 2 <= tracker.largest <= chunk * V, (phase, tracker.largest)  # the check sees the chunks
        assert tracker.max_live == 1, (phase, tracker.max_live)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_lm_head_weight_grad_has_no_per_chunk_temporaries(dtype):
    """The (V x d) weight gradient is accumulated in place in float32: backward allocates the
    accumulator and (for half precision) its final cast, whatever the number of chunks; no chunk's
    share is rounded through a half-precision (V x d) temporary."""
    from torch.utils._python_dispatch import TorchDispatchMode

    V, d, T, chunk = 97, 8, 300, 16

    class Sizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.weight_sized = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = torch.utils._pytree.tree_leaves((args, kwargs))
            inputs = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                # new storage only: views and in-place results of an input allocate nothing
                if isinstance(t, torch.Tensor) and t.numel() == V * d and t.untyped_storage().data_ptr() not in inputs:
                    self.weight_sized.append((str(func), t.dtype))
            return out

    hidden = torch.randn(1, T, d, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, d, dtype=dtype, requires_grad=True)
    targets = shift_causal_labels(torch.randint(0, V, (1, T)))
    sizes = Sizes()
    with sizes:  # forward (which forms the gradient) and backward (which scales it in place)
        loss, _ = chunked_lm_head_loss(hidden, weight, targets, chunk_size=chunk)
        (loss * 0.5).backward()
    expected = 1 if dtype == torch.float32 else 2  # the float32 accumulator (+ its cast to bf16)
    assert len(sizes.weight_sized) == expected, sizes.weight_sized
    # and the float32 sum over chunks is what one float32 GEMM of the rounded chunk gradients gives
    h32, w32 = hidden.detach().float(), weight.detach().float()
    logits = (h32 @ w32.t()).to(dtype).float()[0, :-1]
    dl = (torch.softmax(logits, -1) - F.one_hot(targets[0, :-1], V)).to(dtype).float()
    torch.testing.assert_close(weight.grad.float(), (0.5 * dl.t() @ h32[0, :-1]).to(dtype).float(), rtol=2e-2,
                               atol=1e-2)


def test_attention_kernel_choice_and_clear_refusals():
    q, k, v = _qkv()
    assert attention_kernel_for(q) == "cpu_flash" and kernel_chain("cpu") == ("cpu_flash", "math")
    assert kernel_chain("cuda") == ("cuda_cudnn", "cuda_flash", "cuda_efficient", "math")
    assert KERNELS["cuda_flash"].refuses(q, TileMask(False)) == "tensors on cpu, not CUDA"
    # a kernel named explicitly that cannot take the tile is an error naming why and the fallback
    with pytest.raises(ValueError, match="'cuda_efficient' cannot take this tile: tensors on cpu"):
        chunk_causal_attention(q, k, v, scale=0.3, kernel="cuda_efficient")
    with pytest.raises(ValueError, match="unknown attention kernel 'flash3'"):
        chunk_causal_attention(q, k, v, scale=0.3, kernel="flash3")
    with pytest.raises(ValueError, match="different dtypes"):
        chunk_causal_attention(q.float(), k.float(), v.to(torch.bfloat16), scale=0.3)


def test_attention_under_autocast_runs_in_the_autocast_dtype_like_sdpa():
    q, k, v = (t.detach().float().requires_grad_() for t in _qkv(C=37, K=37))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # float32 q with a bf16 k, as a layer under autocast produces (RoPE promotes, projections don't)
        ours = chunk_causal_attention(q, k.to(torch.bfloat16), v, scale=8**-0.5, kv_block_size=5)
        ref = F.scaled_dot_product_attention(
            q, k.to(torch.bfloat16), v, is_causal=True, enable_gqa=True, scale=8**-0.5
        )
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)  # bf16 rounding of merged tiles
    go = torch.randn_like(ref)
    for g, r in zip(torch.autograd.grad(ours, (q, v), go), torch.autograd.grad(ref, (q, v), go), strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_chunked_lm_head_final_logit_softcap_float64(softcap):
    """Gemma 2's final-logit softcap inside the chunked head: loss and every gradient against
    autograd through cap * tanh(logits / cap), with ignored targets and an uneven last chunk."""
    from ds_longseq.ops.lm_head_loss import chunked_lm_head_loss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(11, 8, generator=g, dtype=torch.float64) * 2).requires_grad_()
    b = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (2, 7), generator=g)
    t[0, 3] = -100
    loss, count = chunked_lm_head_loss(h, w, t, chunk_size=3, bias=b, softcap=softcap)
    z = h @ w.t() + b
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ref = torch.nn.functional.cross_entropy(z.flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum")
    assert int(count) == 13
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for a, r in zip(torch.autograd.grad(loss, (h, w, b)), torch.autograd.grad(ref, (h, w, b)), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.kernel_paths
def test_softcap_logits_is_the_stock_formula_bit_for_bit(dtype):
    """``softcap_logits`` (used by the chunked head and by the sequence-parallel stock head) gives
    Gemma 2's own ``tanh(logits / cap) * cap`` exactly, in place (same storage, no new buffer) or not
    (input untouched, gradient through it)."""
    from ds_longseq.ops.lm_head_loss import softcap_logits

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 11, generator=g) * 20).to(dtype)
    cap = 7.5
    # transformers' Gemma2ForCausalLM.forward, op by op: softcap_logits runs the same elementwise ops, so bitwise
    stock = torch.tanh(logits / cap) * cap
    assert stock.abs().max() <= cap < logits.abs().max()  # the cap bites
    x = logits.clone().requires_grad_()
    out = softcap_logits(x, cap)
    assert torch.equal(out, stock) and torch.equal(x.detach(), logits)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad.float(), (1 - torch.tanh(logits.float() / cap) ** 2), rtol=2e-2, atol=1e-2)
    y = logits.clone()
    ptr = y.data_ptr()
    res = softcap_logits(y, cap, inplace=True)
    assert res.data_ptr() == ptr and torch.equal(res, stock)
