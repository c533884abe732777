"""``forwards.replay.check_token_wise``: the first-forward probe that a module cut into token chunks (an MLP under
mini_seq, a layer with no token mixer under StreamBP) computes each token from its own input alone."""

from __future__ import annotations

import pytest
import torch

from ds_longseq.forwards.replay import TOKEN_WISE_PROBE_TOKENS, check_token_wise


def _routed(x: torch.Tensor) -> torch.Tensor:
    """Top-1 routing to one of two experts per token (the expert groups change with the other tokens' inputs)."""
    torch.manual_seed(0)
    experts, router = torch.randn(2, 6, 6, dtype=x.dtype), torch.randn(6, 2, dtype=x.dtype)
    choice = (x @ router).argmax(-1)
    out = torch.zeros_like(x)
    for e in range(2):
        rows = choice == e
        out[rows] = x[rows] @ experts[e]
    return out


@pytest.mark.parametrize("fn", [
    lambda x: torch.nn.functional.gelu(x @ torch.ones(6, 6, dtype=x.dtype)),
    lambda x: torch.nn.functional.layer_norm(x, (6,)),
    _routed,
    lambda x: (x * 2, x.sum(-1)),  # a tuple whose first entry is per token
])
def test_token_wise_modules_pass(fn):
    check_token_wise("m", fn, torch.randn(2, 100, 6, dtype=torch.float64), "long_seq.mini_seq")


@pytest.mark.parametrize("fn", [
    lambda x: x.cumsum(dim=1),  # a running sum
    lambda x: x + 1e-6 * torch.roll(x, 1, dims=1),  # a faint neighbour
    lambda x: x + x.mean(dim=1, keepdim=True),  # every token
    lambda x: x + 1e-3 * torch.nn.functional.pad(x, (0, 0, 25, 0))[:, : x.shape[1]],  # 25 tokens back only
])
def test_token_mixing_modules_are_refused(fn):
    with pytest.raises(NotImplementedError, match=r"m mixes tokens .* under long_seq.streambp"):
        check_token_wise("m", fn, torch.randn(2, 100, 6, dtype=torch.float64), "long_seq.streambp")


def test_probe_is_bounded_and_leaves_the_input_alone():
    """The probe runs on the first TOKEN_WISE_PROBE_TOKENS tokens only, on a detached copy."""
    seen = []
    x = torch.randn(1, 10_000, 4, requires_grad=True)
    check_token_wise("m", lambda h: seen.append(h.shape) or h * 3, x, "long_seq.mini_seq")
    assert seen == [torch.Size([1, TOKEN_WISE_PROBE_TOKENS, 4])] and x.grad is None


def test_output_not_per_token_is_refused():
    with pytest.raises(NotImplementedError, match="not one entry per token"):
        check_token_wise("m", lambda x: x.sum(1), torch.randn(2, 8, 4), "long_seq.mini_seq")
