"""Approx-BP on CUDA: the Triton kernels against the PyTorch path, bit for bit, and a model step.

The kernels were written and tested only in Triton's CPU interpreter (no GPU was lent then); these
are the first checks that need the real device: every dtype autocast or a bf16 model produces, sizes
with ragged tails, the thresholds themselves, and a whole StreamBP step of a bf16 Llama with both
approximations against the same model on the CPU path.
"""

import copy

import pytest
import torch

import ds_longseq
from ds_longseq.ops import approx_triton
from ds_longseq.ops.approx_autograd import REGELU2, RESILU2, pack_codes, step_backward, step_codes
from tests.helpers import make_batch, make_model, rel_err

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("step", [RESILU2, REGELU2], ids=["resilu2", "regelu2"])
@pytest.mark.parametrize("n", [1, 3, 4, 4097, 3_000_001])
def test_triton_kernels_equal_the_torch_path_bit_for_bit(dtype, step, n):
    assert approx_triton.available()
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 5).to(dtype)
    at = torch.tensor(step.thresholds, dtype=torch.float64).to(dtype)
    x[: min(n, 3)] = at[: min(n, 3)]
    xc = x.to(CUDA)
    packed = approx_triton.pack_step_codes(xc, step)
    # bitwise by construction: the codes are comparisons with the same thresholds, and the backward is one float32
    # multiply by the same slope, rounded once to the dtype, in both paths (IEEE: the same bits on any device)
    assert torch.equal(packed.cpu(), pack_codes(step_codes(x, step)))
    grad = torch.randn(n, generator=g).to(dtype)
    got = approx_triton.step_backward(packed, grad.to(CUDA), step).cpu()
    want = step_backward(packed.cpu(), grad, step)
    assert torch.equal(
        got.view(torch.int16 if dtype != torch.float32 else torch.int32),
        want.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


APPROX_CFG = {
    "streambp": {"enabled": True, "chunk_size": 16},
    "lm_head": {"enabled": True, "chunk_size": 16},
    "approx_bp": {"activation": "resilu2", "norm": "ms_rmsnorm"},
}


def _grads(model, batch, device):
    model = model.to(device)
    loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
    loss.backward()
    return loss.detach().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}


def test_bf16_model_step_triton_equals_the_torch_path_on_cuda(monkeypatch):
    """StreamBP + chunked head + ReSiLU2 + MS-RMSNorm, bf16 weights, on CUDA: the step with the Triton
    kernels is bitwise the step with Approx-BP's PyTorch path on the same device (every other kernel
    the same), under deterministic algorithms; skipped if the step is not bitwise reproducible here."""
    from ds_longseq.ops import approx_autograd as approx_bp

    model = make_model("llama", torch.bfloat16)
    batch = make_batch(seq_len=64)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = []
        for triton in (True, True, False):
            if not triton:
                monkeypatch.setattr(approx_bp, "_triton_ready", lambda t: False)
            m = copy.deepcopy(model)
            ds_longseq.enable(m, APPROX_CFG)
            runs.append(_grads(m, batch, CUDA))
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    (loss_a, grads_a), (loss_b, grads_b), (loss_t, grads_t) = runs
    if not (torch.equal(loss_a, loss_b) and all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)):
        pytest.skip("the step is not bitwise reproducible on this GPU: a bitwise comparison would test nothing")
    # by construction: only the activation's codes and step backward differ in implementation, and those are bitwise
    # the same (test above); every other kernel is the same call on the same operands
    assert torch.equal(loss_a, loss_t) and grads_a.keys() == grads_t.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_t[name]), name


def test_bf16_model_step_on_cuda_is_near_the_cpu_path():
    """The same step on CUDA and on the CPU (different kernels everywhere): finite, and within the
    difference measured on an H200 (2026-11-26, torch 2.11, transformers 5.24), where ReSiLU2's step
    derivative amplifies the devices' bf16 differences: a forward value on the other side of a threshold
    takes the other derivative (docs/APPROX_BP.md). Measured, largest parameter gradient error: exact
    StreamBP 0.014 (the stock eager model 0.008), MS-RMSNorm alone 0.014, ReSiLU2 alone 0.046, both 0.067;
    the bound is 0.1. The stock model runs eager attention: its sdpa on CUDA gives NaN gradients for
    this batch's fully masked (left-padded) query rows there."""
    model = make_model("llama", torch.bfloat16)
    batch = make_batch(seq_len=64)
    stock = copy.deepcopy(model)
    stock.set_attn_implementation("eager")
    (_, stock_gpu), (_, stock_cpu) = _grads(copy.deepcopy(stock), batch, CUDA), _grads(stock, batch, "cpu")
    ours = [ds_longseq.enable(copy.deepcopy(model), APPROX_CFG) for _ in range(2)]
    (_, ours_gpu), (_, ours_cpu) = _grads(ours[0], batch, CUDA), _grads(ours[1], batch, "cpu")
    assert all(torch.isfinite(g).all() for g in (*ours_gpu.values(), *stock_gpu.values(), *stock_cpu.values()))
    stock_diff = max(rel_err(stock_gpu[n], stock_cpu[n]) for n in stock_cpu)
    ours_diff = max(rel_err(ours_gpu[n], ours_cpu[n]) for n in ours_cpu)
    assert stock_diff < 0.05 and ours_diff < 0.1, (ours_diff, stock_diff)
