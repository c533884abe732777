"""MsT mini-sequence MLP (+ chunked LM head), alone and with HF gradient checkpointing, against stock."""

import pytest
import torch

import ds_longseq
from tests.helpers import ARCHS, clone, compare, loss_and_grads, make_batch, make_model

MST = lambda n: {"mini_seq": {"enabled": True, "mlp_num_chunks": n}, "lm_head": {"enabled": True, "chunk_size": 9}}  # noqa: E731


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("num_chunks", [1, 4, 64])
def test_float64_exact(arch, num_chunks):
    model = make_model(arch, torch.float64)
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    ours = loss_and_grads(ds_longseq.enable(clone(model), MST(num_chunks)), batch)
    errs = compare(ours, ref)
    assert max(errs.values()) < 1e-10, errs


def test_with_gradient_checkpointing_float32():
    model = make_model("llama", torch.float32, tie=True)
    batch = make_batch()
    ref = loss_and_grads(model, batch)
    ours_model = ds_longseq.enable(clone(model), MST(5))
    ours_model.activation_checkpointing_enable()
    ours_model.train()
    errs = compare(loss_and_grads(ours_model, batch), ref)
    assert max(errs.values()) < 1e-5, errs


def test_mlp_saves_only_its_input():
    model = ds_longseq.enable(make_model("llama", torch.float32), MST(4))
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 37, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = mlp(x)
    assert len(saved) == 1 and saved[0] is x
    y.sum().backward()
    assert all(p.grad is not None for p in mlp.parameters())
