"""Named profiler ranges around the phases of a training step, so a profile can say where the time goes.

Holds:
    phase: a ``torch.profiler.record_function`` range named ``ds_longseq.<name>``.
    PHASES: every name the package uses, with what it covers (``benchmarks/profile.py`` groups a step's
        operators by the innermost of these ranges that encloses them).

A range costs a few microseconds when no profiler runs (one per chunk per layer and phase: well under 1%
of a step); inside a profiler it becomes an event whose children are the phase's operators.
"""

from __future__ import annotations

import torch

__all__ = ["phase", "PHASES", "PREFIX"]

PREFIX = "ds_longseq."

PHASES = {
    "streambp.forward": "StreamBP's forward over a layer's chunks (under no_grad)",
    "streambp.capture": "StreamBP's backward, pass 1: every chunk's keys/values up to the cache update",
    "streambp.replay": "StreamBP's backward: one chunk re-run with grad (the chunk re-forward)",
    "streambp.grad": "StreamBP's backward: one chunk's torch.autograd.grad",
    "attention.forward": "ds_longseq's chunk attention, forward (every tile and the merge)",
    "attention.backward": "ds_longseq's chunk attention, backward",
    "attention.merge": "merging a chunk's attention tiles by log-sum-exp (what one kernel call per chunk would save)",
    "lm_head.forward": "the chunked LM head and loss, forward (and its gradient, when formed there)",
    "lm_head.backward": "the chunked LM head, backward",
    "offload.wait": "waiting for an offloaded layer input to come back from the host or disk",
    "sp.exchange": "a sequence-parallel all-to-all (keys/values, queries, outputs, their gradients)",
}
"""Every phase name, with what it covers."""


def phase(name: str) -> torch.profiler.record_function:
    """A profiler range for one of :data:`PHASES` (a context manager)."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}: add it to ds_longseq.ops.phases.PHASES")
    return torch.profiler.record_function(PREFIX + name)
