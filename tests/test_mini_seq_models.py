"""MsT mini-sequence MLP (+ chunked LM head), alone and with HF gradient checkpointing, against stock."""

import pytest
import torch

import ds_longseq
from ds_longseq.compat import set_activation_checkpointing
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
    set_activation_checkpointing(ours_model, True)
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


class _TupleMLP(torch.nn.Module):
    """Returns (output, per-token scores), each flat (B * T, ...) or (B, T, ...), as Llama 4's and gpt-oss's MoE
    blocks do; ``extra`` appends a part that is not per token."""

    def __init__(self, flat: bool, extra: bool = False):
        super().__init__()
        self.flat, self.extra = flat, extra
        self.up, self.gate = torch.nn.Linear(8, 8, dtype=torch.float64), torch.nn.Linear(8, 3, dtype=torch.float64)

    def forward(self, x):
        out, scores = torch.tanh(self.up(x)), torch.softmax(self.gate(x), -1)
        if self.flat:
            out, scores = out.reshape(-1, 8), scores.reshape(-1, 3)
        return (out, scores, scores.sum()) if self.extra else (out, scores)


@pytest.mark.parametrize("flat", [True, False])
def test_tuple_outputs_are_assembled_per_token(flat):
    """Every part of a tuple an MLP returns comes back whole, in its own layout, with exact gradients through
    each of them (uneven chunks of a batch of 2)."""
    from ds_longseq.forwards.mlp import MiniSeqMLPForward

    mlp = _TupleMLP(flat)
    x = torch.randn(2, 11, 8, dtype=torch.float64, requires_grad=True)
    # weights per entry: an assembly that put tokens in another order would change the loss
    w_out, w_scores = (torch.randn(t.shape, dtype=torch.float64) for t in mlp(x))

    def loss_and_grads(fn):
        out, scores = fn(x)
        loss = (out**2 * w_out).sum() + (scores * w_scores).sum()
        return [loss, *torch.autograd.grad(loss, [x, *mlp.parameters()])], (out.shape, scores.shape)

    ref, ref_shapes = loss_and_grads(mlp)
    ours, shapes = loss_and_grads(MiniSeqMLPForward(mlp, mlp.forward, num_chunks=4))
    assert shapes == ref_shapes
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_an_output_part_that_is_not_per_token_is_refused():
    from ds_longseq.forwards.mlp import MiniSeqMLPForward

    mlp = _TupleMLP(flat=False, extra=True)
    with pytest.raises(NotImplementedError, match=r"_TupleMLP returns a tensor of shape \(\) \(element 2 of its tup"):
        MiniSeqMLPForward(mlp, mlp.forward, num_chunks=4)(torch.randn(2, 11, 8, dtype=torch.float64))
