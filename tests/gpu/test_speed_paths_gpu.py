"""The speed issue's paths on CUDA (issue 40): linears left uncomputed where a StreamBP pass never reads them,
and the per-token head's gradient formed in forward. Written on a CPU-only machine, first to run on a GPU.

- The unread linears (forwards/unread_outputs.py): the per-layer probe must find the skip bitwise exact on CUDA
  too (bf16 under autocast, LoRA adapters on the skipped projections) and the gradients must then equal those
  with every linear computed, bitwise (cuBLAS is deterministic here: conftest sets CUBLAS_WORKSPACE_CONFIG). Bitwise
  by construction: a skipped linear runs the stock linear with only its product left uncomputed, so autograd's own
  backward makes the same calls on the same operands with the same shapes.
  If the probe declines on CUDA the step is still exact, only slower: the first assertion says so.
- The per-token log-probs through a frozen float32 head on CUDA, formed in forward, against the recomputing
  path (a trainable copy of the head) to float32 precision.
"""

import copy

import pytest
import torch

import ds_longseq
from ds_longseq.ops import chunked_token_outputs
from tests.helpers import make_batch, make_model, rel_err

CUDA = torch.device("cuda")
CFG = {"streambp": {"enabled": True, "chunk_size": 10}, "lm_head": {"enabled": True, "chunk_size": 16}}


def _step(model, batch, skip: bool):
    model = copy.deepcopy(model).to(CUDA)
    ds_longseq.enable(model, CFG)
    layers = [layer.forward for layer in model.model.layers]
    batch = {k: v.to(CUDA) for k, v in batch.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(**batch)  # the first training forward probes each layer
    if not skip:
        for f in layers:
            f.unread.query_unread = f.unread.output_unread = False
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], layers


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_unread_linears_skip_bitwise_on_cuda(arch):
    model, batch = make_model(arch, torch.float32, num_layers=2), make_batch(seq_len=37)
    skipped, layers = _step(model, batch, skip=True)
    assert all(f.unread.query_unread and f.unread.output_unread for f in layers), "the probe declined the skip on CUDA"
    computed, _ = _step(model, batch, skip=False)
    assert all(torch.equal(a, b) for a, b in zip(skipped, computed, strict=True))


def test_frozen_head_token_logprobs_formed_in_forward_on_cuda():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 300, 64, generator=g).to(CUDA).requires_grad_()
    weight = torch.randn(1000, 64, generator=g).to(CUDA)
    targets = torch.randint(0, 1000, (2, 300), generator=g).to(CUDA)
    targets[0, :20] = -100
    w = torch.randn(2, 300, generator=g).to(CUDA)
    formed = chunked_token_outputs(hidden, weight, targets, chunk_size=128, temperature=0.8)
    (g_formed,) = torch.autograd.grad((formed.log_probs * w).sum(), [hidden])
    recomputed = chunked_token_outputs(hidden, weight.clone().requires_grad_(), targets, chunk_size=128,
                                       temperature=0.8)
    (g_recomputed,) = torch.autograd.grad((recomputed.log_probs * w).sum(), [hidden])
    # bitwise by construction: both paths compute the log-probs with the same chunking, the same GEMM into a buffer of
    # the same shape and the same statistics code (only the input gradient is formed differently: tolerance below)
    torch.testing.assert_close(formed.log_probs, recomputed.log_probs, rtol=0, atol=0)
    # The input gradient is a float32 sum over the 1000-entry vocabulary, formed in forward chunk by chunk in one path
    # and by autograd's GEMM in the other: cuBLAS orders the two reductions differently, so elements whose terms
    # cancel differ in their last bits (H200, 2026-11-28: 113 of 38400 elements off by up to 1.1e-5 absolute, where
    # the gradient's entries are O(1)). The norm-wise relative error is the float32 claim (the brief's ~1e-5).
    err = rel_err(g_formed, g_recomputed)
    print(f"frozen head, formed vs recomputed input gradient: norm-wise relative error {err:.2e}")
    assert err < 1e-5, err
