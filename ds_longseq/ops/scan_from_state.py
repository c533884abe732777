"""A selective scan (Mamba-1) that starts from a given state, built on one that always starts from zeros.

Holds:
    selective_scan_from: wraps a ``mamba_selective_scan``-style function (transformers' torch path, or the
        ``mamba_ssm`` kernel it falls through to) so that its scan continues from a state.

Why: Jamba's mixer reads its recurrent state from the cache but runs its multi-token scan from zeros (the fused
kernel takes no initial state), so StreamBP's chunks would each restart. The scan is linear in its initial state,
so the started scan is the zero-started one plus that state carried through the chunk's decays:

    h_t = dA_t * h_{t-1} + dB_t u_t,   dA_t = exp(A dt_t)  (dt_t after its bias and softplus)
    h_t = h_t|zero start + P_t * h0,   P_t = prod_{s <= t} dA_s = exp(A * sum_{s <= t} dt_s)
    y_t = (C_t . h_t + D u_t) * silu(z_t)  =  y_t|zero start + (C_t . (P_t * h0)) * silu(z_t)

The zero-started part is the stock function untouched (its own kernel and backward); the correction is plain
torch under autograd, so the gradient reaches ``h0`` (the previous chunk's state) and every input. Exact in real
arithmetic; in floating point ``exp`` of a cumulative sum rounds unlike a running product (float64: ~1e-15).

Shape legend (transformers' layout): B batch, D inner channels, L chunk length, N state size; hidden_states,
dt, z (B, D, L); A (D, N); B, C (B, N, L); the state (B, D, N). The decays P are (B, D, L, N), the size of the
torch path's own discretised A: beside the fused kernel, which never forms it, that is the correction's memory.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["selective_scan_from"]


def selective_scan_from(scan: Callable, state: torch.Tensor) -> Callable:
    """``scan`` (same signature as transformers' ``mamba_selective_scan``) continued from ``state`` (B, D, N)."""

    def started(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
                delta_softplus: bool = False, return_last_state: bool = False, **kwargs):
        result = scan(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                      return_last_state=return_last_state, **kwargs)
        out, last = result if return_last_state else (result, None)
        dtype = torch.promote_types(torch.promote_types(dt.dtype, A.dtype), state.dtype)
        delta = dt.to(dtype)
        if delta_bias is not None:
            delta = delta + delta_bias.to(dtype)[..., None]
        if delta_softplus:
            delta = F.softplus(delta)
        decays = torch.exp(A.to(dtype)[None, :, None, :] * delta.cumsum(-1)[..., None])  # P_t: (B, D, L, N)
        h0 = state.to(dtype)
        carried = torch.einsum("bdln,bdn,bnl->bdl", decays, h0, C.to(dtype))  # C_t . (P_t * h0)
        if z is not None:
            carried = carried * F.silu(z.to(dtype))
        out = out + carried.to(out.dtype)
        if last is None:
            return out
        return out, last + (decays[:, :, -1] * h0).to(last.dtype)

    return started
