"""TRL's fused-LM-head call (``model(..., labels=, fused_lm_head=True)``) served by ds_longseq.

ds_longseq answers it with its chunked head (``FusedLMHeadOutput``). Checked against per-token
quantities computed here from the stock model's float64 logits (values and every gradient, 1e-10),
and, for the protocol (shapes, masking, loss normalisation), against TRL's own fused head on the
stock model in float32.
"""

from __future__ import annotations

import pytest
import torch

import ds_longseq
from ds_longseq.modules.causal_lm import FusedLMHeadOutput
from ds_longseq.ops import chunked_token_logprobs
from tests.helpers import clone, grads_of, make_batch, make_model

CONFIGS = {
    "streambp+lm_head": {
        "streambp": {"enabled": True, "chunk_size": 5, "kv_block_size": 4},
        "lm_head": {"enabled": True, "chunk_size": 7},
    },
    "streambp, stock head": {"streambp": {"enabled": True, "chunk_size": 5, "kv_block_size": 4}},
}


def _stock_per_token(model, batch):
    """(log_probs, entropy, is_top1, label_mask), (B, T - 1) each, from the stock float64 logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    log_p = torch.log_softmax(logits, dim=-1)
    index = targets.clamp_min(0).unsqueeze(-1)
    log_probs = log_p.gather(-1, index).squeeze(-1) * mask
    entropy = -(log_p.exp() * log_p).sum(-1) * mask
    top1 = (logits.gather(-1, index).squeeze(-1) >= logits.amax(-1)) & mask
    return log_probs, entropy, top1, mask


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_head_call_is_exact(name):
    model = make_model("llama", torch.float64)
    ours = ds_longseq.enable(clone(model), CONFIGS[name])
    batch = make_batch()
    g = torch.Generator().manual_seed(5)
    w_lp, w_h = (torch.randn(batch["labels"][:, 1:].shape, generator=g, dtype=torch.float64) for _ in range(2))

    def objective(log_probs, entropy):  # any function of the per-token outputs, as TRL's losses are
        return (log_probs * w_lp).sum() + (entropy * w_h).sum()

    ref_out = {}

    def reference():
        lp, ent, top1, mask = _stock_per_token(model, batch)
        ref_out.update(lp=lp.detach(), ent=ent.detach(), top1=top1, mask=mask)
        return objective(lp, ent)

    got = {}

    def fused():
        out = ours(**batch, fused_lm_head=True)
        got["out"] = out
        return objective(out.log_probs, out.entropy)

    _, ref_grads, ref_gin = grads_of(model, reference)
    _, grads, gin = grads_of(ours, fused)
    out = got["out"]
    assert isinstance(out, FusedLMHeadOutput) and out.log_probs.shape == ref_out["lp"].shape
    torch.testing.assert_close(out.log_probs.detach(), ref_out["lp"], rtol=0, atol=1e-10)
    torch.testing.assert_close(out.entropy.detach(), ref_out["ent"], rtol=0, atol=1e-10)
    assert torch.equal(out.is_top1, ref_out["top1"]) and torch.equal(out.label_mask, ref_out["mask"])
    count = ref_out["mask"].sum()
    torch.testing.assert_close(out.loss.detach(), -ref_out["lp"].sum() / count, rtol=1e-12, atol=0)
    torch.testing.assert_close(gin, ref_gin, rtol=1e-10, atol=1e-12)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")


def test_fused_head_matches_trl_protocol():
    """Same fields, shapes and values as TRL's own fused head on the stock model (float32), with
    ``num_items_in_batch`` as the Trainer passes it."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = make_model("llama", torch.float32)
    theirs = clone(model)
    trl_utils.add_fused_lm_head(theirs, outputs=("log_probs", "entropy", "is_top1"))
    ours = ds_longseq.enable(clone(model), CONFIGS["streambp+lm_head"])
    batch = make_batch()
    with torch.no_grad():
        a = ours(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(50.0))
        b = theirs(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(50.0))
    for field in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-5, atol=1e-5)
    assert torch.equal(a.label_mask, b.label_mask)
    assert torch.equal(a.is_top1, b.is_top1)


def test_token_logprobs_top1_flags():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 9, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64)
    logits = hidden @ weight.t()
    targets = torch.randint(0, 11, (2, 9), generator=g)
    targets[0, :4] = logits[0, :4].argmax(-1)  # some hits for sure
    targets[1, 2] = -100
    _, mask, _, top1 = chunked_token_logprobs(hidden, weight, targets, chunk_size=4, top1=True)
    expected = (logits.argmax(-1) == targets) & mask
    assert torch.equal(top1, expected) and bool(top1[0, :4].all()) and not bool(top1[1, 2])
