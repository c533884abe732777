"""The chunked per-token log-probability op against full logits, float64 to 1e-12: values, and
gradients for arbitrary upstream gradients on the log-probs and the entropies."""

import pytest
import torch
import torch.nn.functional as F

from ds_longseq.ops import chunked_token_logprobs

DT = torch.float64


def _naive(hidden, weight, bias, targets, softcap, ignore_index=-100):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logp_all = torch.log_softmax(logits, -1)
    mask = targets != ignore_index
    logps = logp_all.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logps, mask, entropy


def _inputs(seed=0, B=2, T=23, d=16, V=37, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, d, generator=g, dtype=DT, requires_grad=True)
    weight = torch.randn(V, d, generator=g, dtype=DT, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=DT, requires_grad=True) if bias else None
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :5] = -100  # a prompt
    targets[1, -3:] = -100  # padding
    return hidden, weight, b, targets


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("use", ["logps", "entropy", "both"])
@pytest.mark.kernel_paths  # bitwise: the integer mask only
def test_token_logprobs_match_full_logits(chunk, softcap, use):
    hidden, weight, bias, targets = _inputs()
    params = [hidden, weight, bias]
    g = torch.Generator().manual_seed(9)
    w_lp, w_h = torch.randn(targets.shape, generator=g, dtype=DT), torch.randn(targets.shape, generator=g, dtype=DT)

    def objective(lp, h):
        terms = {"logps": (lp * w_lp).sum(), "entropy": (h * w_h).sum()}
        return terms["logps"] + terms["entropy"] if use == "both" else terms[use]

    ref_lp, ref_mask, ref_h = _naive(hidden, weight, bias, targets, softcap)
    ref_grads = torch.autograd.grad(objective(ref_lp, ref_h), params)
    lp, mask, h, _ = chunked_token_logprobs(
        hidden, weight, targets, chunk_size=chunk, bias=bias, softcap=softcap, entropy=True
    )
    assert torch.equal(mask, ref_mask)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=1e-12)
    for got, ref in zip(torch.autograd.grad(objective(lp, h), params), ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_token_logprobs_without_entropy_and_masked_rows():
    """entropy=False returns None; a row with no valid target gets zeros and no gradient."""
    hidden, weight, _, targets = _inputs(bias=False)
    targets[1] = -100
    lp, mask, h, _ = chunked_token_logprobs(hidden, weight, targets, chunk_size=5)
    assert h is None and not mask[1].any() and not lp[1].any()
    (grad_h,) = torch.autograd.grad(lp.sum(), [hidden])
    assert not grad_h[1].any() and grad_h[0].abs().sum() > 0
    ref_lp, _, _ = _naive(hidden, weight, None, targets, None)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)


def test_token_logprobs_bad_input():
    hidden, weight, _, targets = _inputs(bias=False)
    with pytest.raises(ValueError, match="do not match hidden states"):
        chunked_token_logprobs(hidden, weight, targets[:, :-1], chunk_size=4)
    with pytest.raises(ValueError, match="softcap must be a positive"):
        chunked_token_logprobs(hidden, weight, targets, chunk_size=4, softcap=0.0)


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("softcap,temperature,logit_scale", [(None, 1.0, 1.0), (3.0, 0.7, 0.5)])
@pytest.mark.kernel_paths
def test_frozen_head_forms_the_input_gradient_in_forward(chunk, softcap, temperature, logit_scale):
    """A frozen head (LoRA's), no entropy: the forward forms each token's d logp / dh and the backward scales it
    (two GEMMs per step, not three: no logits recomputed). The same log-probs, statistics and input gradient
    as the full logits (float64, 1e-12), for an arbitrary upstream gradient; a second backward is refused."""
    from benchmarks.profile import count_flops
    from ds_longseq.ops import chunked_token_outputs

    hidden, weight, bias, targets = _inputs()
    weight, bias = weight.detach(), bias.detach()
    w_lp = torch.randn(targets.shape, generator=torch.Generator().manual_seed(9), dtype=DT)
    logits = F.linear(hidden, weight, bias) * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    logp_all = torch.log_softmax(logits, -1)
    mask = targets != -100
    ref_lp = logp_all.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp).sum(), [hidden])
    kwargs = dict(chunk_size=chunk, bias=bias, softcap=softcap, temperature=temperature, logit_scale=logit_scale,
                  outputs=("top1", "mean_logits", "log_sum_sq_probs"))
    flops = {}

    def step():
        out = chunked_token_outputs(hidden, weight, targets, **kwargs)
        (grad,) = torch.autograd.grad((out.log_probs * w_lp).sum(), [hidden], retain_graph=True)
        flops["out"], flops["grad"] = out, grad

    gemms = sum(count_flops(step).values()) * 1e9 / (2 * int(mask.sum()) * weight.shape[0] * weight.shape[1])
    assert round(gemms, 6) == 2.0
    out, grad = flops["out"], flops["grad"]
    torch.testing.assert_close(out.log_probs, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    recomputed = chunked_token_outputs(hidden, weight.requires_grad_(), targets, **kwargs)  # the backward's path
    # the same chunks' logits and statistics code in both paths: bitwise by construction (top1 is compared exactly)
    for name in ("top1", "mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(getattr(out, name), getattr(recomputed, name), rtol=0, atol=1e-12)
    weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="second backward through ds_longseq's chunked per-token log-probs"):
        torch.autograd.grad((out.log_probs * w_lp).sum(), [hidden])


def test_the_gradient_is_recomputed_where_it_cannot_be_formed_in_forward():
    """A trainable head, the entropy, or half precision: the backward recomputes the logits (three GEMMs: logits,
    recomputed logits, input gradient; four with the weight's gradient)."""
    from benchmarks.profile import count_flops
    from ds_longseq.ops import chunked_token_outputs

    for case in ("trainable head", "entropy", "bf16"):
        hidden, weight, _, targets = _inputs(bias=False)
        weight = weight.detach().requires_grad_(case == "trainable head")
        if case == "bf16":
            hidden = hidden.detach().to(torch.bfloat16).requires_grad_()
            weight = weight.to(torch.bfloat16)
        outputs = ("entropy",) if case == "entropy" else ()

        def step(hidden=hidden, weight=weight, targets=targets, outputs=outputs):
            out = chunked_token_outputs(hidden, weight, targets, chunk_size=5, outputs=outputs)
            torch.autograd.grad(out.log_probs.sum(), [hidden])

        n = int((targets != -100).sum())
        gemms = sum(count_flops(step).values()) * 1e9 / (2 * n * weight.shape[0] * weight.shape[1])
        assert round(gemms, 6) == (4.0 if case == "trainable head" else 3.0), case
