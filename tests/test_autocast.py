"""torch.autocast: StreamBP, MsT and the chunked LM head under CPU autocast, against the stock model
under the same autocast (the way HF Trainer with ``bf16=True`` and float32 weights trains).

Protocol (StreamBP paper App. B.1, as for pure bf16): the error of each run against the float64
model, ours relative to stock's own. Our replays re-enter the forward's autocast state, so they
compute the same function as the forward and as stock.
"""

import pytest
import torch

import ds_longseq
from ds_longseq.ops import chunked_lm_head_loss, mini_sequence_apply, shift_causal_labels
from ds_longseq.ops.chunk_grads import AutocastState
from tests.helpers import clone, compare, loss_and_grads, make_batch, make_model, rel_err

HEAD = {"enabled": True, "chunk_size": 9}
STREAMBP = {"streambp": {"enabled": True, "chunk_size": 5}, "attention": {"kv_block_size": 6}, "lm_head": HEAD}
MST = {"mini_seq": {"enabled": True, "mlp_num_chunks": 4}, "lm_head": HEAD}


def _autocast_run(model, batch, dtype):
    with torch.autocast("cpu", dtype=dtype):
        return loss_and_grads(model, batch)


def _worst_and_mean(errs):
    return max(errs.values()), sum(errs.values()) / len(errs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ["streambp", "mst"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_no_worse_than_stock_autocast(arch, method, dtype):
    model64 = make_model(arch, torch.float64)
    batch = make_batch()
    exact = loss_and_grads(model64, batch, use_reference=True, ref_dtype=torch.float64)
    model32 = clone(model64).float()
    stock = compare(_autocast_run(model32, batch, dtype), exact)
    ours_model = clone(model32)
    if method == "mst":
        ours_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ds_longseq.enable(ours_model, STREAMBP if method == "streambp" else MST)
    ours = compare(_autocast_run(ours_model, batch, dtype), exact)
    (stock_worst, stock_mean), (ours_worst, ours_mean) = _worst_and_mean(stock), _worst_and_mean(ours)
    # Autocast rounds every matmul input to 8 (bf16) or 11 (fp16) mantissa bits; the chunked paths
    # round the same operands, so they land at stock's error. 1.5x is the pure-bf16 tests' margin.
    assert ours_worst <= 1.5 * stock_worst, (ours_worst, stock_worst)
    assert ours_mean <= 1.5 * stock_mean, (ours_mean, stock_mean)
    # And the autocast really took effect: errors are far above float32's.
    assert stock_worst > 1e-4 and ours_worst > 1e-4, (stock_worst, ours_worst)


def test_streambp_replays_run_under_the_forwards_autocast():
    """The backward re-forward sees the forward's autocast state even when backward runs outside it."""
    seen = []
    model = make_model("llama", torch.float32)
    ds_longseq.enable(model, STREAMBP)
    layer = model.model.layers[0]
    orig = layer.mlp.forward

    def spy(x):
        seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")))
        return orig(x)

    layer.mlp.forward = spy
    batch = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
    forward_calls = len(seen)
    loss.backward()  # outside autocast, as recommended
    replays = seen[forward_calls:]
    assert forward_calls and replays and all(autocast for _, autocast in seen), seen
    assert all(grad for grad, _ in replays)


def test_autocast_state_capture_and_replay():
    with torch.autocast("cpu", dtype=torch.float16, cache_enabled=False):
        state = AutocastState.capture("cpu")
    assert state.enabled and state.dtype == torch.float16 and not state.cache_enabled
    assert not torch.is_autocast_enabled("cpu")
    with state.replay():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    off = AutocastState.capture("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), off.replay():
        assert not torch.is_autocast_enabled("cpu")


def test_mini_sequence_under_autocast_matches_plain_autocast():
    torch.manual_seed(0)  # unseeded, the gradient check below failed for ~16% of the seeds (elementwise tolerance)
    lin = torch.nn.Linear(16, 24)
    x = torch.randn(2, 13, 16, requires_grad=True)
    go = torch.randn(2, 13, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = lin(x)
        ours = mini_sequence_apply(lin, x, list(lin.parameters()), 3)
    assert ours.dtype == ref.dtype == torch.bfloat16
    # Not bitwise: the chunks' GEMMs (10 or 8 rows) and the whole one (26 rows) are different kernel calls, and the
    # kernel (oneDNN / MKL, chosen by shape and CPU) may sum a row's 16 products in float32 in another order; the
    # float32 sums then differ by ~1e-6 and may round to neighbouring bf16 values (1 seed in 200 here, by one ulp):
    # at most one bf16 ulp apart (rtol = bf16 eps), plus 1e-5 absolute for outputs near 0, where the float32 sums'
    # error (~1e-6, relative to the products' size) can exceed the output's own bf16 ulp.
    torch.testing.assert_close(ours, ref, rtol=torch.finfo(torch.bfloat16).eps, atol=1e-5)
    ref_grads = torch.autograd.grad(ref, (x, lin.weight, lin.bias), go)
    grads = torch.autograd.grad(ours, (x, lin.weight, lin.bias), go)
    eps = torch.finfo(torch.bfloat16).eps
    for g, r in zip(grads, ref_grads, strict=True):
        # The weight and bias gradients: a float32 sum of 3 chunk partials, each a bf16 GEMM / sum rounded to bf16
        # (eps / 2 of the partial each), against one such rounding of the whole. Element by element a small entry is
        # the difference of larger partials, so its error is not relative to it: compare norm-wise, where the bound is
        # eps / 2 (1 + sqrt(3)) ~ 1.4 eps for partials of ~1/sqrt(3) of the whole (measured over 1000 seeds: 0.5 eps;
        # the input gradient, one rounding per element on either side: 0.01 eps).
        assert rel_err(g, r) < 2 * eps, (g.shape, rel_err(g, r))


def test_lm_head_under_autocast_matches_stock_head_and_accumulates_in_float32():
    """float32 weights under bf16 autocast: logits in bf16 like the stock head, weight gradient
    summed in float32 over chunks: no further from float64 than the stock head's single GEMM."""
    torch.manual_seed(0)
    V, d, T = 211, 24, 301
    hidden = torch.randn(1, T, d, dtype=torch.float64)
    weight = torch.randn(V, d, dtype=torch.float64) * 0.3
    targets = shift_causal_labels(torch.randint(0, V, (1, T)))
    valid = targets != -100

    def exact():
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy((h @ w.t())[valid], targets[valid], reduction="sum")
        return (loss, *torch.autograd.grad(loss, (h, w)))

    def stock():
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = torch.nn.functional.linear(h, w)
        loss = torch.nn.functional.cross_entropy(logits.float()[valid], targets[valid], reduction="sum")
        return (loss, *torch.autograd.grad(loss, (h, w)))

    def ours():
        h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = chunked_lm_head_loss(h, w, targets, chunk_size=16)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    ref, st, us = exact(), stock(), ours()
    for name, r, s, u in zip(("loss", "dh", "dw"), ref, st, us, strict=True):
        err_s = ((s.double() - r).norm() / r.norm()).item()
        err_u = ((u.double() - r).norm() / r.norm()).item()
        assert u.dtype == torch.float32
        assert err_u <= 1.5 * err_s + 1e-7, (name, err_u, err_s)
