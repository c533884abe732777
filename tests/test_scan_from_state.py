"""``ops.scan_from_state``: a zero-started selective scan continued from a state equals the scan run whole.

The scan is transformers' own ``mamba_selective_scan`` as Jamba's modeling module holds it (its torch path here;
the ``mamba_ssm`` kernel on a GPU with it installed), float64: run over 40 tokens at once, and in two parts where
the second starts from the state the first returned, the outputs, the final state and the gradients of every input
agree to rounding.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.jamba.modeling_jamba import mamba_selective_scan as scan

from ds_longseq.ops.scan_from_state import selective_scan_from


def _inputs(seed: int = 0, Bn: int = 2, D: int = 6, L: int = 40, N: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_(True)

    return dict(hidden_states=rand(Bn, D, L), dt=rand(Bn, D, L, scale=0.5), A=-torch.rand(D, N, generator=g,
                dtype=torch.float64).add(0.2).requires_grad_(True), B=rand(Bn, N, L), C=rand(Bn, N, L), D=rand(D),
                z=rand(Bn, D, L), delta_bias=rand(D, scale=0.3))


@pytest.mark.parametrize("split", [1, 17, 39])
def test_two_parts_equal_the_whole(split):
    """Whole against first part (zero start) + second part started from the first's last state: outputs and
    final state at 1e-12, and the gradient of a loss on both through every input (the state's included)."""
    x = _inputs()
    kw = dict(delta_softplus=True, return_last_state=True)
    whole, whole_last = scan(**x, **kw)

    def part(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return t[..., lo:hi] if t.dim() == 3 else t

    cut = {k: part(v, 0, split) for k, v in x.items()}
    first, state = scan(**cut, **kw)
    rest = {k: part(v, split, 40) for k, v in x.items()}
    second, last = selective_scan_from(scan, state)(**rest, **kw)
    ours = torch.cat([first, second], dim=-1)
    torch.testing.assert_close(ours, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, whole_last, rtol=1e-12, atol=1e-12)
    weights = torch.randn(whole.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g_whole = torch.autograd.grad((whole * weights).sum() + whole_last.sum(), list(x.values()))
    g_ours = torch.autograd.grad((ours * weights).sum() + last.sum(), list(x.values()))
    for name, a, b in zip(x, g_ours, g_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_mutation_state_ignored_is_caught():
    """Control: the second part from zeros (the stock multi-token behaviour) is far from the whole."""
    x = _inputs()
    whole = scan(**x, delta_softplus=True)
    second = scan(**{k: v[..., 17:] if v.dim() == 3 else v for k, v in x.items()}, delta_softplus=True)
    assert (second - whole[..., 17:]).abs().max() > 1e-3
