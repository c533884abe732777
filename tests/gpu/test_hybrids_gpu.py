"""Hybrid stacks (Qwen3.5 text: Gated DeltaNet + gated attention) under StreamBP on CUDA, against the stock model.

On CUDA transformers runs each mixer through the fused kernels it finds (flash-linear-attention's gated delta
rule, causal-conv1d) and else its torch fallback; StreamBP calls the same code chunk by chunk with the carried
states, so whichever runs, ours must be no further from the float64 CPU model than the stock model is in the
same precision on the same GPU (1.5x, the protocol of ``test_models_gpu.py``). Which implementation ran is
printed (``-s``) and asserted where the packages are installed.

Not yet run on a GPU (written in a session without one).
"""

import importlib.util

import pytest
import torch

import ds_longseq
from tests import model_sweep, model_zoo
from tests.helpers import compare

CUDA = torch.device("cuda")


def _kernels() -> str:
    found = [name for name in ("fla", "causal_conv1d") if importlib.util.find_spec(name) is not None]
    return ", ".join(found) or "torch fallback"


def _run(model, batch, dtype):
    model = model.to(CUDA, dtype)
    batch = {k: v.to(CUDA) for k, v in batch.items()}
    loss, grads, gin = model_sweep._loss_and_grads(model, batch) if dtype == torch.float64 else _plain(model, batch)
    return loss.cpu().double(), {n: g.cpu().double() for n, g in grads.items()}, gin.cpu().double()


def _plain(model, batch):
    from tests.helpers import grads_of

    loss, grads, gin = grads_of(model, lambda: model(**batch).loss)
    return loss, {n: grads[n] if n in grads else torch.zeros_like(p) for n, p in model.named_parameters()}, gin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_qwen3_5_streambp_no_worse_than_stock(dtype):
    print(f"mixer kernels: {_kernels()}")
    base = model_zoo.tiny_model("qwen3_5_text", torch.float64).train()
    batch = model_zoo.tiny_batch("qwen3_5_text", seq_len=150)
    reference = model_sweep._loss_and_grads(base, batch)  # float64 on the CPU
    stock = _run(model_zoo.tiny_model("qwen3_5_text", torch.float64).train(), batch, dtype)
    ours_model = ds_longseq.enable(model_zoo.tiny_model("qwen3_5_text", torch.float64).train(),
                                   {"streambp": {"enabled": True, "chunk_size": 37},
                                    "lm_head": {"enabled": True, "chunk_size": 64}})
    ours = _run(ours_model, batch, dtype)
    errs_stock, errs_ours = compare(stock, reference), compare(ours, reference)
    worst_stock, worst_ours = max(errs_stock.values()), max(errs_ours.values())
    mean_stock = sum(errs_stock.values()) / len(errs_stock)
    mean_ours = sum(errs_ours.values()) / len(errs_ours)
    assert worst_ours <= 1.5 * worst_stock and mean_ours <= 1.5 * mean_stock, (worst_ours, worst_stock)
