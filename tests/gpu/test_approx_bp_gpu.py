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
from ds_longseq.ops import approx_bp_triton
from ds_longseq.ops.approx_bp import REGELU2, RESILU2, pack_codes, step_backward, step_codes
from tests.helpers import make_batch, make_model, rel_err

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("step", [RESILU2, REGELU2], ids=["resilu2", "regelu2"])
@pytest.mark.parametrize("n", [1, 3, 4, 4097, 3_000_001])
def test_triton_kernels_equal_the_torch_path_bit_for_bit(dtype, step, n):
    assert approx_bp_triton.available()
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 5).to(dtype)
    at = torch.tensor(step.thresholds, dtype=torch.float64).to(dtype)
    x[: min(n, 3)] = at[: min(n, 3)]
    xc = x.to(CUDA)
    packed = approx_bp_triton.pack_step_codes(xc, step)
    assert torch.equal(packed.cpu(), pack_codes(step_codes(x, step)))
    grad = torch.randn(n, generator=g).to(dtype)
    got = approx_bp_triton.step_backward(packed, grad.to(CUDA), step).cpu()
    want = step_backward(packed.cpu(), grad, step)
    assert torch.equal(
        got.view(torch.int16 if dtype != torch.float32 else torch.int32),
        want.view(torch.int16 if dtype != torch.float32 else torch.int32),
    )


def test_bf16_model_step_on_cuda_matches_the_cpu_path():
    """StreamBP + chunked head + ReSiLU2 + MS-RMSNorm, bf16 weights: CUDA (Triton) against CPU (torch
    path); different kernels everywhere else, so judged against the stock bf16 model's own CUDA-vs-CPU
    difference."""
    model = make_model("llama", torch.bfloat16)
    cfg = {
        "streambp": {"enabled": True, "chunk_size": 16},
        "lm_head": {"enabled": True, "chunk_size": 16},
        "approx_bp": {"activation": "resilu2", "norm": "ms_rmsnorm"},
    }
    batch = make_batch(seq_len=64)

    def grads(m, device):
        m = m.to(device)
        loss = m(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        return {n: p.grad.float().cpu() for n, p in m.named_parameters() if p.grad is not None}

    stock_gpu, stock_cpu = grads(copy.deepcopy(model), CUDA), grads(copy.deepcopy(model), "cpu")
    ours = [copy.deepcopy(model), copy.deepcopy(model)]
    for m in ours:
        ds_longseq.enable(m, cfg)
    ours_gpu, ours_cpu = grads(ours[0], CUDA), grads(ours[1], "cpu")
    stock_diff = max(rel_err(stock_gpu[n], stock_cpu[n]) for n in stock_cpu)
    ours_diff = max(rel_err(ours_gpu[n], ours_cpu[n]) for n in ours_cpu)
    # the step derivative amplifies bf16 differences at its thresholds (docs/APPROX_BP.md): factor 3
    assert ours_diff < 3 * stock_diff + 1e-2, (ours_diff, stock_diff)
