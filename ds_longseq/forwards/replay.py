"""What makes a module run in chunks and recomputed in backward (StreamBP layer replay, mini-sequence MLP)
compute the same function as run whole, once: its random draws replayed, and a check that it mixes no tokens.

Holds:
    replay_draws: the random draws (``ops.draws.Draws``) a module's chunked forward and its recompute share.
    check_token_wise: raise if a module's output at one token depends on the inputs at others.
"""

from __future__ import annotations

from typing import Callable

import torch

from ds_longseq.ops.draws import Draws, generators_kept

__all__ = ["replay_draws", "check_token_wise", "TOKEN_WISE_PROBE_TOKENS"]

TOKEN_WISE_PROBE_TOKENS = 64
"""How many leading tokens :func:`check_token_wise` runs the module on (cheap, whatever the sequence length)."""


def replay_draws(module: torch.nn.Module, device: torch.device) -> Draws | None:
    """The draws of one chunked forward of ``module`` that its recomputes in backward replay (``ops.draws``: each
    chunk from its own generator state, the seed read off the global generator), or None when the module is not
    training (no dropout draws). Also under no_grad: a checkpointed layer's forward runs without grad and its
    recompute (the global generators restored) with it, and both must take the same draws. The caller calls
    ``advance()`` once its forward ran."""
    return Draws.take(device) if module.training else None


def check_token_wise(what: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, feature: str) -> None:
    """Raise unless ``fn``'s output at each token is computed from that token's input alone.

    A module cut into token chunks (an MLP under mini_seq, a layer with no token mixer under StreamBP) that
    mixed tokens would silently see only its chunk. ``fn`` runs once on the first
    :data:`TOKEN_WISE_PROBE_TOKENS` tokens of ``x`` (B, T, ...) (a detached copy, under grad), and the gradient
    of a random weighting of its second half's outputs is taken with respect to the first half's inputs: a
    token-wise computation (matmuls, norms, activations, routing each token to its experts) puts exactly zero
    there, any mixing almost surely does not. ``fn`` returns (B, n, ...), or a tuple whose first entry is. The
    global random generators are left as they were (:func:`~ds_longseq.ops.draws.generators_kept`).
    """
    n = min(x.shape[1], TOKEN_WISE_PROBE_TOKENS)
    if n < 2:
        return
    half = n // 2
    # Identity hooks: what the probe saves for its own backward stays out of any enclosing saved-tensor hooks
    # (an activation checkpoint counting what its forward saves, offload to host memory); the generators kept: the
    # module's dropout draws here must not shift the masks of the forward that follows
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
            generators_kept(x.device):
        probe = x[:, :n].detach().clone().requires_grad_(True)
        out = fn(probe.clone())  # not the leaf itself: the module may write into its input (Mixtral's jitter)
        out = out[0] if isinstance(out, tuple) else out
        if not (isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[:2] == probe.shape[:2]):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise NotImplementedError(
                f"{feature}: {what} returns {got} on a ({probe.shape[0]}, {n}, ...) input, not one entry per token: "
                f"{feature} cannot cut it into token chunks"
            )
        later = out[:, half:]
        generator = torch.Generator(device=later.device).manual_seed(0)
        weights = torch.randn(later.shape, generator=generator, device=later.device, dtype=later.dtype)
        (grad,) = torch.autograd.grad((later * weights).sum(), probe, allow_unused=True)
    if grad is not None and bool(grad[:, :half].ne(0).any()):
        raise NotImplementedError(
            f"{feature}: {what} mixes tokens (its output at tokens [{half}, {n}) depends on its input at tokens "
            f"[0, {half})), so run on chunks of tokens it would see only its chunk; this model cannot run exactly "
            f"under {feature}"
        )
