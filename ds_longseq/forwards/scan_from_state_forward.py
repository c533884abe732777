"""The forward of a recurrent mixer whose multi-token scan restarts from zeros, run from its carried state.

Holds:
    ScanFromStateForward: the callable installed as such a mixer instance's ``forward`` under StreamBP.

Jamba's Mamba mixer reads its recurrent state from the cache but uses it only in its 1-token decode step; its
multi-token scan (``mamba_selective_scan``, the fused kernel or transformers' torch path) starts from zeros. Under
StreamBP each chunk must continue from the state the previous one wrote, so for the duration of this mixer's call
its module's scan function is the one continued from that state (``ops.scan_from_state``); the rest of the stock
forward (projections, convolution with its carried window, norms, gating) runs unchanged. The scan function is
replaced for this call only (``compat.module_function_replaced``), so other instances and other models are
untouched. Which function, per family: ``FamilySpec.mixer_scan_function``.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch

from ds_longseq import compat
from ds_longseq.ops.scan_from_state import selective_scan_from

__all__ = ["ScanFromStateForward"]


class ScanFromStateForward:
    """Replacement ``forward`` of one mixer instance: the stock forward, its scan continued from the carried state.

    Without a cache, without a state yet (the first chunk) or on a 1-token call (the stock decode step, which
    reads the state itself) it is the stock forward unchanged.
    """

    def __init__(self, mixer: torch.nn.Module, orig_forward: Callable, function: str):
        """``function``: the name of the scan function in the mixer's modeling module (``mamba_selective_scan``)."""
        self.mixer = mixer
        self.orig_forward = orig_forward
        self.function = function
        self.module_name = type(mixer).__module__
        self.signature = inspect.signature(orig_forward)
        self.cache_names = (*compat.CACHE_KWARGS, "cache_params")

    def __call__(self, *args, **kwargs):
        state = self._state(args, kwargs)
        if state is None:
            return self.orig_forward(*args, **kwargs)
        with compat.module_function_replaced(self.module_name, self.function,
                                             lambda scan: selective_scan_from(scan, state)):
            return self.orig_forward(*args, **kwargs)

    def _state(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """The recurrent state the call continues from (B, D, N), or None."""
        try:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # a keyword the signature does not name (a deprecated cache name): read kwargs as given
            bound = dict(kwargs)
        cache = next((bound[name] for name in self.cache_names if bound.get(name) is not None), None)
        hidden = bound.get("hidden_states", args[0] if args else None)
        if cache is None or not isinstance(hidden, torch.Tensor) or hidden.shape[1] < 2:
            return None
        return cache.get_recurrent_state(getattr(self.mixer, "layer_idx", None), state_idx=0)
