"""Diagonal linear recurrences along the sequence dimension, without a Python loop over tokens.

Holds:
    linear_scan: h_t = a_t * h_{t-1} + b_t (h_{-1} = 0 or a given carry), all t at once.
    adjoint_scan: mu_t = c_t + a_{t+1} * mu_{t+1} (mu_T = 0 or a given carry), the backward (adjoint)
        recurrence.
    truncated_adjoint: mu_t = sum_{d < window} c_{t+d} * prod_{j=t+1}^{t+d} a_j, the adjoint that
        only looks ``window`` states ahead (truncated adjoint sharding, paper 002 Sec. 4.3).
    LinearScan: ``linear_scan`` as an autograd Function that saves a and h only (the reference
        SSM's memory-fair plain-autograd path, the way fused selective-scan kernels save).

Shape legend: B batch, T sequence, S... any state shape (for example D channels x N states).
Tensors are (B, T, *S); the recurrence is elementwise in the state (a diagonal A_t).

The scans are Hillis-Steele doubling: ceil(log2 T) steps of elementwise multiply-adds, each over
the whole (B, T, *S) tensor. In exact arithmetic they equal the sequential loop; in floating point
they re-associate the sums (float64 agrees with the loop to ~1e-15 relative).
"""

from __future__ import annotations

import torch

__all__ = ["linear_scan", "adjoint_scan", "truncated_adjoint", "LinearScan"]


def linear_scan(a: torch.Tensor, b: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
    """h_t = a_t * h_{t-1} + b_t for t = 0..T-1 with h_{-1} = ``initial`` (default 0).

    Args:
        a: (B, T, *S) per-step decay (the diagonal of A_t).
        b: (B, T, *S) per-step input (B_t x_t).
        initial: (B, *S) the state before the first step (a chunk's carry), or None.

    Returns:
        h: (B, T, *S).
    """
    if a.shape != b.shape:
        raise ValueError(f"linear_scan: a {tuple(a.shape)} and b {tuple(b.shape)} differ in shape")
    if initial is not None:
        b = torch.cat([torch.addcmul(b[:, :1], a[:, :1], initial.unsqueeze(1)), b[:, 1:]], dim=1)
    num_steps = a.shape[1]
    h, coef = b, a
    offset = 1
    while offset < num_steps:
        # after this step, h_t sums the inputs of the last 2 * offset steps and coef_t their decay
        h = torch.cat([h[:, :offset], torch.addcmul(h[:, offset:], coef[:, offset:], h[:, :-offset])], dim=1)
        if 2 * offset < num_steps:
            coef = torch.cat([coef[:, :offset], coef[:, offset:] * coef[:, :-offset]], dim=1)
        offset *= 2
    return h if h is not b else b.clone()


def _next(a: torch.Tensor) -> torch.Tensor:
    """(B, T, *S) a -> a_{t+1} with a_T = 0 (the coefficient of the backward recurrence)."""
    return torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], dim=1)


def adjoint_scan(a: torch.Tensor, c: torch.Tensor, final: torch.Tensor | None = None) -> torch.Tensor:
    """mu_t = c_t + a_{t+1} * mu_{t+1}, mu_{T-1} = c_{T-1} (+ ``final``): the adjoint of :func:`linear_scan`.

    mu_t = dL/dh_t when c_t = the direct gradient of the loss with respect to h_t; in paper 002's
    notation mu_i = sum_{t >= i} lambda^{t,i}, the sum of the adjoint states of every later output.

    Args:
        a: (B, T, *S) the forward decays.
        c: (B, T, *S) the direct gradients.
        final: (B, *S) what the steps after the last reach back with, a_T * mu_T (a chunk's carry), or None.

    Returns:
        mu: (B, T, *S).
    """
    if final is not None:
        c = torch.cat([c[:, :-1], c[:, -1:] + final.unsqueeze(1)], dim=1)
    return linear_scan(_next(a).flip(1), c.flip(1)).flip(1)


def truncated_adjoint(a: torch.Tensor, c: torch.Tensor, window: int) -> torch.Tensor:
    """mu_t = sum_{d=0}^{window-1} c_{t+d} * prod_{j=t+1}^{t+d} a_j: the adjoint that keeps, for each
    output at t + d, only the ``window`` most recent state transitions (paper 002 Sec. 4.3).

    Equals :func:`adjoint_scan` when ``window >= T``. Cost: min(window, T) - 1 multiply-adds over
    (B, T, *S), a loop over the offset d (not over tokens). Every term is a product of the forward
    decays, so there is no cancellation: float64 results are exact to rounding.

    Args:
        a: (B, T, *S) the forward decays.
        c: (B, T, *S) the direct gradients.
        window: T-bar >= 1.

    Returns:
        mu: (B, T, *S).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"truncated_adjoint: window must be a positive integer (T-bar >= 1), got {window!r}")
    num_steps = a.shape[1]
    mu = c.clone()
    decay = None  # decay[:, i] = prod_{j=i+1}^{i+d} a_j for i < T - d
    for d in range(1, min(window, num_steps)):
        decay = a[:, d:] if decay is None else decay[:, :-1] * a[:, d:]
        mu[:, : num_steps - d].addcmul_(c[:, d:], decay)
    return mu


class LinearScan(torch.autograd.Function):
    """``linear_scan`` with a backward that saves only a and h: dL/db = mu, dL/da_t = mu_t * h_{t-1}."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = linear_scan(a, b)
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        a, h = ctx.saved_tensors
        mu = adjoint_scan(a, grad_h)
        h_prev = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        return mu * h_prev, mu
