"""StreamBP and MsT models on CUDA against the stock Hugging Face model.

Protocol: every run is compared with the float64 model on the CPU (loss, input-embedding gradient,
every parameter gradient); a half-precision run of ours must be no further from it than the stock
model's run in the same precision on the same GPU (1.5x, as the CPU bf16 tests), float32 within
1e-5 (the efficient kernel's float32 GEMMs emulate float32 with 3xTF32).
"""

import pytest
import torch

import ds_longseq
from ds_longseq.ops.tile_kernels import KERNELS
from tests.helpers import clone, compare, loss_and_grads, make_batch, make_model

CUDA = torch.device("cuda")


def _cfg(chunk=5, method="streambp"):
    head = {"enabled": True, "chunk_size": 9}
    if method == "mst":
        return {"mini_seq": {"enabled": True, "mlp_num_chunks": 4}, "lm_head": head}
    return {"streambp": {"enabled": True, "chunk_size": chunk}, "lm_head": head}


def _on(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def _run(model, batch, autocast=None):
    """(loss, grads, input grad) of one step on CUDA, returned on the CPU."""
    model = model.to(CUDA)
    with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        loss, grads, gin = loss_and_grads(model, _on(batch, CUDA))
    return loss.cpu(), {n: g.cpu() for n, g in grads.items()}, gin.cpu()


def _worst_mean(errs):
    return max(errs.values()), sum(errs.values()) / len(errs)


def _check_no_worse(ours, stock, label):
    (ow, om), (sw, sm) = _worst_mean(ours), _worst_mean(stock)
    assert ow <= 1.5 * sw and om <= 1.5 * sm, (label, ow, sw, om, sm)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_streambp_half_precision_no_worse_than_stock(arch, dtype):
    model = make_model(arch, torch.float64)
    batch = make_batch()  # left and right padding, masked prompt: padded and unpadded tiles
    exact = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    stock = compare(_run(clone(model).to(dtype), batch), exact)
    ours = compare(_run(ds_longseq.enable(clone(model).to(dtype), _cfg()), batch), exact)
    _check_no_worse(ours, stock, (arch, dtype))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_streambp_float32_on_cuda(arch):
    model = make_model(arch, torch.float64)
    batch = make_batch()
    exact = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    ours = compare(_run(ds_longseq.enable(clone(model).float(), _cfg()), batch), exact)
    assert max(ours.values()) < 1e-5, ours


@pytest.mark.parametrize("method", ["streambp", "mst"])
def test_autocast_on_cuda_no_worse_than_stock(method):
    model = make_model("llama", torch.float64)
    batch = make_batch()
    exact = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    stock = compare(_run(clone(model).float(), batch, autocast=torch.bfloat16), exact)
    ours_model = clone(model).float()
    if method == "mst":
        ours_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours = compare(_run(ds_longseq.enable(ours_model, _cfg(method=method)), batch, autocast=torch.bfloat16), exact)
    _check_no_worse(ours, stock, method)
    assert max(ours.values()) > 1e-4  # autocast really ran in bf16


def test_llama_shaped_heads_use_flash_and_stay_exact(monkeypatch):
    """Head dim 128, 8 query / 2 kv heads, T = 1000 in chunks of 256: the fused kernels do the work
    (cuDNN or flash for unpadded tiles, efficient for padded ones), with no fallback to the math tile."""
    calls = {name: 0 for name in KERNELS}
    for name, kernel in KERNELS.items():
        orig = kernel.forward

        def counted(*args, _orig=orig, _name=name, **kwargs):
            calls[_name] += 1
            return _orig(*args, **kwargs)

        monkeypatch.setattr(kernel, "forward", counted)
    model = make_model("llama", torch.float64, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                       num_key_value_heads=2, max_position_embeddings=2048)
    batch = make_batch(batch=2, seq_len=1000)
    exact = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    stock = compare(_run(clone(model).to(torch.bfloat16), batch), exact)
    ours = compare(_run(ds_longseq.enable(clone(model).to(torch.bfloat16), _cfg(chunk=256)), batch), exact)
    _check_no_worse(ours, stock, "llama-heads")
    assert calls["cuda_cudnn"] + calls["cuda_flash"] > 0 and calls["cuda_efficient"] > 0 and calls["math"] == 0, calls
