"""Sparse layer-input storage (``long_seq.offload.keep_every = k``): keep every k-th layer's input, rebuild the rest.

StreamBP keeps one tensor per decoder layer from forward to backward: the layer's input (B, T, d). With
``keep_every = k`` only layers 0, k, 2k, ... keep theirs (on the device, or in host memory through a
:class:`~ds_longseq.ops.host_store.LayerInputOffloader`); the input of any other layer i is dropped in the forward and
rebuilt in backward from the nearest kept input j < i by running layers j .. i-1 forward again (no grad, chunk by
chunk, with the forward's autocast state). Running the same kernels on the same values gives the same bits, so the
gradients are exactly those of keeping every input. One rebuild serves a whole block: the inputs j+1 .. i-1 it
passes through wait on the device for their own layer's backward, which comes next (backward runs the layers in
reverse), so at most k inputs of one block are on the device at a time, and each block is re-run once: about one
extra forward of (k-1)/k of the layers per step.

A layer input is dropped only when it is exactly the previous StreamBP layer's output (the same tensor, or an alias
of all of it that nothing wrote to since, as DeepSpeed's ZeRO-3 hooks pass it on): whatever a model computes between
two layers (a scaling, per-layer inputs joined to the hidden states, stacked streams) makes the next input another
tensor, and that input is kept. The first input of each forward is kept.

Holds:
    Recompute / recompute: one layer's forward, to run again as the forward ran it (no grad, its autocast state and,
        for a layer with dropout under mini_seq's checkpoint, its RNG state; under ZeRO-3 its parameters gathered).
    SparseInputs: one training forward's storage: ``save`` (a layer's input, from ``ops.host_store.save_input``),
        ``produced`` (the layer's output and how to recompute it, from the StreamBP Function), handles whose
        ``load`` gives the input back once in backward.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ds_longseq.compat import gathered_parameters, is_zero3_partitioned, tensor_version
from ds_longseq.ops.chunk_grads import AutocastState
from ds_longseq.ops.host_store import LayerInputOffloader

__all__ = ["Recompute", "recompute", "SparseInputs"]


@dataclass
class Recompute:
    """How to run one layer's forward again: ``forward(x)`` returns the layer's output for input ``x``."""

    forward: Callable[[torch.Tensor], torch.Tensor]


def recompute(layer: Callable[[torch.Tensor], torch.Tensor], autocast: AutocastState,
              params: Sequence[torch.nn.Parameter], rng: tuple | None = None) -> Recompute:
    """``layer`` (a Function's forward computation, input -> output) to run again as the Function ran it: no grad,
    the same autocast state, the forward's RNG state when ``rng`` = (cpu state, cuda state or None) is given. Under
    ZeRO-3 the layer's partitioned parameters are gathered around it: in backward no hook of DeepSpeed's does, the
    layer not being called as a module here (every rank gathers the same layers in the same order)."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        with _gathered(params), torch.no_grad(), autocast.replay(), _replayed_rng(rng, hidden.device):
            return layer(hidden)

    return Recompute(forward)


def _gathered(params: Sequence[torch.nn.Parameter]):
    partitioned = [p for p in params if is_zero3_partitioned(p)]
    if not partitioned:
        return contextlib.nullcontext()
    return gathered_parameters(partitioned)


@contextlib.contextmanager
def _replayed_rng(rng: tuple | None, device: torch.device):
    if rng is None:
        yield
        return
    cpu, cuda = rng
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


class _Handle:
    """One layer's input: kept (a device tensor or an offloaded one) or rebuilt from the layer before it."""

    def __init__(self, kept: Any = None, source: "_Handle | None" = None, recompute: Recompute | None = None):
        self._kept = kept
        self._source = source  # the previous layer's input handle (None when this input is kept)
        self._recompute = recompute  # the previous layer's forward: turns the source's input into this one
        self._value: torch.Tensor | None = None
        self.consumed = False

    @property
    def kept(self) -> bool:
        return self._source is None

    def _materialise(self) -> torch.Tensor:
        """This input on its device, held until :meth:`load`: kept ones are loaded, dropped ones rebuilt."""
        if self._value is not None:
            return self._value
        if self.consumed:
            raise RuntimeError(
                "a layer input kept by long_seq.offload.keep_every was already used by an earlier backward through "
                "this graph: it is handed back once, so backward(retain_graph=True) followed by a second backward is "
                "not supported; run a new forward"
            )
        if self.kept:
            # a device tensor, or the handle of an offloaded one
            self._value = self._kept if isinstance(self._kept, torch.Tensor) else self._kept.load()
            self._kept = None
            return self._value
        chain, handle = [], self
        while handle._value is None and not handle.kept:  # back to the nearest input that is there
            chain.append(handle)
            handle = handle._source
        x = handle._materialise()
        with torch.no_grad():
            for h in reversed(chain):  # forward through the block, keeping each input for its own backward
                x = h._recompute.forward(x)
                h._value = x
        return self._value

    def load(self) -> torch.Tensor:
        """The input, once (this layer's backward); rebuilds it and the dropped inputs below it if needed."""
        x = self._materialise()
        self._value, self._source, self._recompute, self.consumed = None, None, None, True
        return x


def _same_values(output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``x`` is ``output`` or an alias of all of it no one has written since (DeepSpeed's ZeRO-3 module
    hooks hand the next layer a detached alias of a layer's output, not the object): then rebuilding ``output``
    rebuilds ``x``."""
    if x is output:
        return True
    return (x.data_ptr() == output.data_ptr() and x.shape == output.shape and x.stride() == output.stride()
            and x.dtype == output.dtype and x.device == output.device and tensor_version(x) == tensor_version(output))


class SparseInputs:
    """One training forward's layer inputs under ``keep_every = k``.

    Args:
        keep_every: k >= 1; layers whose position in this forward is a multiple of k keep their input.
        offloader: where kept inputs go (host memory); None keeps them on the device.
    """

    def __init__(self, keep_every: int, offloader: LayerInputOffloader | None = None):
        if keep_every < 1:
            raise ValueError(f"keep_every must be >= 1, got {keep_every}")
        self.keep_every = keep_every
        self.offloader = offloader
        self._count = 0
        # the previous layer's output (held until the next save: the next layer holds it then anyway) and forward
        self._last: tuple[torch.Tensor, Recompute, _Handle] | None = None
        self._pending: _Handle | None = None  # the handle of the layer whose forward is running
        self.handles: list[weakref.ref[_Handle]] = []

    def will_keep(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`save` will keep ``tensor`` (this forward's next layer input) rather than drop it to be
        rebuilt in backward; changes nothing (what else the layer keeps beside its input follows it)."""
        link = self._last
        return not (self._count % self.keep_every and link is not None and _same_values(link[0], tensor))

    def save(self, tensor: torch.Tensor) -> _Handle:
        """Keep or drop one layer's input (called once per StreamBP layer, after its forward ran)."""
        position, self._count = self._count, self._count + 1
        link = self._last
        self._last = None
        if position % self.keep_every and link is not None and _same_values(link[0], tensor):
            handle = _Handle(source=link[2], recompute=link[1])
        else:
            handle = _Handle(kept=self.offloader.save(tensor) if self.offloader is not None else tensor)
        self._pending = handle
        self.handles.append(weakref.ref(handle))
        return handle

    def produced(self, output: torch.Tensor, recompute: Recompute) -> None:
        """The layer whose input was just saved returned ``output``; ``recompute`` runs that forward again."""
        if self._pending is not None:
            self._last = (output, recompute, self._pending)
        self._pending = None

    @property
    def num_kept(self) -> int:
        """Inputs of this forward that are kept (on the device or offloaded) and not yet loaded."""
        return sum(1 for ref in self.handles if (h := ref()) is not None and h.kept and not h.consumed)

    @property
    def num_dropped(self) -> int:
        """Inputs of this forward that were dropped, to be rebuilt in backward, and not yet loaded."""
        return sum(1 for ref in self.handles if (h := ref()) is not None and not h.kept and not h.consumed)
