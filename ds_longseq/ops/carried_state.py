"""The states a recurrent token mixer carries from one StreamBP chunk to the next, and their gradients.

Holds:
    CarriedState: the part of StreamBP's duck-typed cache that linear-attention, state-space and
        short-convolution mixers (Qwen3.5 / Qwen3-Next's Gated DeltaNet, Mamba-1/2, LFM2's short
        convolution, ...) read and write through transformers' linear-attention cache API
        (``get_conv_state`` / ``update_conv_state`` / ``get_recurrent_state`` / ``update_recurrent_state``,
        transformers >= 5.24; earlier releases' mixers ask ``has_previous_state`` and read the states from the
        cache's layer, ``forwards.layer_cache``): the mixer's own multi-token code continues from the state it is
        given, so a chunk computes exactly what the whole sequence would on its tokens.

Shape legend: B batch, C chunk, W the convolution window a layer keeps (its kernel size K), S a
recurrent state (e.g. (B, H, Dk, Dv) for the gated delta rule, (B, H, Dh, N) for Mamba-2).

Algorithm (StreamBP for a recurrence, the pattern of the K/V prefix in ``ops.streambp_autograd``):
- forward, under no_grad: chunks in order; chunk c starts from the states chunk c-1 wrote (none for
  c = 0: the mixer's own zero start) and writes its own; the states at every chunk's start are kept
  (:attr:`CarriedState.boundaries`): with the layer input, all that is kept for backward.
- backward: chunks in REVERSE order; chunk c is re-forwarded from its boundary states made leaves,
  and differentiated for [out_c, states it wrote] with [dOut_c, the gradient chunk c+1 sent back for
  them]; the leaves' gradients are what chunk c-1 sends back next. Chunk c+1 ran first, so the
  gradient of every state chunk c writes is complete when chunk c consumes it.

The convolution window is stored as transformers' ``LinearAttentionLayer`` stores it (the last K input
columns, K the ``conv_kernel_size`` the mixer passes, else the width of its first update), and
``update_conv_state`` returns the same concatenation, so the mixer's convolution sees the same left
context either way.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["CarriedState"]

StateKey = tuple[str, int]  # ("conv" | "recurrent", state index)


class CarriedState:
    """The linear-attention cache API of a StreamBP stream for one layer, over one pass of its chunks.

    Modes: ``"forward"`` (states carried chunk to chunk, each chunk's incoming ones kept in
    :attr:`boundaries`), ``"capture"`` (a backward pass that only needs the layer's keys/values: each chunk
    is served its boundary states, nothing is recorded), ``"replay"`` (each chunk's incoming states are
    leaves requiring grad, :attr:`leaves`, and what it writes keeps its autograd history, :attr:`written`).

    Per chunk (:meth:`enter`) it also records which states were read and written, for the runtime guard
    (:meth:`problem`).
    """

    def __init__(self, mode: str = "forward", boundaries: list[dict[StateKey, torch.Tensor]] | None = None,
                 initial: dict[StateKey, torch.Tensor] | None = None):
        """``initial``: the states the first chunk starts from (forward; under sequence parallelism the previous
        rank's final ones, ``ops.state_passing``), none for the sequence's start."""
        self.mode = mode
        self.initial = initial or {}
        # forward: chunk index -> the states it starts from instead of the previous chunk's (the first chunk of a run
        # of the sequence that continues another rank's, under Ulysses x ring: ops.state_passing)
        self.restarts: dict[int, dict[StateKey, torch.Tensor]] = {}
        self.boundaries: list[dict[StateKey, torch.Tensor]] = [] if boundaries is None else boundaries
        self.kernel: dict[int, int] = {}  # conv window width per state index (set by the first update)
        self.incoming: dict[StateKey, torch.Tensor] = {}  # the current chunk's starting states
        self.written: dict[StateKey, torch.Tensor] = {}  # what the current chunk wrote
        self.read: set[StateKey] = set()
        self.leaves: dict[StateKey, torch.Tensor] = {}  # replay: ``incoming`` as leaves
        self.index = 0
        self.first_written: frozenset[StateKey] | None = None  # what chunk 0 wrote: every chunk must write it

    @property
    def used(self) -> bool:
        """Whether the layer touched the state API in the current chunk (a recurrent mixer ran)."""
        return bool(self.read or self.written)

    def enter(self, index: int) -> None:
        """Start chunk ``index``: its incoming states are what the previous chunk wrote (forward) or its
        boundary (capture, replay: as leaves requiring grad)."""
        self.index = index
        if self.mode == "forward":
            if index in self.restarts:
                self.incoming = self.restarts.pop(index)
            else:
                self.incoming = self.written if index > 0 else self.initial
            self.boundaries.append(self.incoming)
        else:
            states = self.boundaries[index] if index < len(self.boundaries) else {}
            if self.mode == "replay":
                self.leaves = {k: t.detach().requires_grad_(True) for k, t in states.items()}
                states = self.leaves
            self.incoming = states
        self.written, self.read = {}, set()

    @property
    def used_any(self) -> bool:
        """Whether the layer carried a state through this pass (chunk 0 wrote one)."""
        return bool(self.first_written)

    def leave(self) -> None:
        """End the current chunk (forward: what it wrote becomes the next chunk's start)."""
        if self.index == 0 and self.first_written is None:
            self.first_written = frozenset(self.written)
        if self.mode == "forward":
            self.written = {k: t.detach() for k, t in self.written.items()}

    # --- transformers' linear-attention cache API (duck-typed on the stream) ---------------------------------

    def get_conv_state(self, layer_idx: int | None = None, state_idx: int = 0) -> torch.Tensor | None:
        """(B, conv channels, K) window of the inputs before the chunk, or None before the first chunk."""
        self.read.add(("conv", state_idx))
        return self.incoming.get(("conv", state_idx))

    def get_recurrent_state(self, layer_idx: int | None = None, state_idx: int = 0) -> torch.Tensor | None:
        """The recurrent state after the previous chunk, or None before the first chunk."""
        self.read.add(("recurrent", state_idx))
        return self.incoming.get(("recurrent", state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int | None = None, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """(B, channels, K + C) the previous window and the chunk's inputs (the chunk's alone, left-padded to K,
        before the first chunk), as transformers' ``LinearAttentionLayer.update_conv_state`` returns it; the
        window written for the next chunk is its last K columns."""
        key = ("conv", state_idx)
        self.read.add(key)
        if state_idx not in self.kernel:
            self.kernel[state_idx] = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
        width = self.kernel[state_idx]
        previous = self.incoming.get(key)
        if previous is None:
            full = conv_states
            if full.shape[-1] < width:
                full = torch.nn.functional.pad(full, (width - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        self.written[key] = full[..., -width:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int | None = None,
                               state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Record the recurrent state after the chunk; returned unchanged."""
        self.written[("recurrent", state_idx)] = recurrent_states
        return recurrent_states

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether the current chunk starts from carried states (all of them, or those of ``state_idx``): what the
        mixers of transformers before 5.24 ask before reading the states (``Cache.has_previous_state``); not a read."""
        if state_idx is None:
            return bool(self.incoming)
        return any(index == state_idx for _, index in self.incoming)

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        """True: a mixer then takes its general multi-token path even for a 1-token chunk, never the single-step
        decode kernels that update a cached state in place (StreamBP's states are tensors it keeps)."""
        return True

    @contextmanager
    def perturbed(self, key: StateKey):
        """Within: the current chunk starts from its ``key`` state plus one, and what it reads and writes is not
        kept (a probe: a mixer that computes the same output from it ignores that state)."""
        saved = self.incoming, self.written, self.read
        self.incoming = {**self.incoming, key: self.incoming[key] + 1}
        self.written, self.read = {}, set()
        try:
            yield
        finally:
            self.incoming, self.written, self.read = saved

    # --- backward -------------------------------------------------------------------------------------------

    def outputs_with_grads(self, grads: dict[StateKey, torch.Tensor]) -> tuple[list, list]:
        """([states this chunk wrote], [their gradients from the next chunk]) for those that have one."""
        outputs, grad_outputs = [], []
        for key, t in self.written.items():
            g = grads.get(key)
            if g is not None and t.requires_grad:
                outputs.append(t)
                grad_outputs.append(g.to(t.dtype))
        return outputs, grad_outputs

    def problem(self) -> str | None:
        """Why the current chunk did not carry its state (the runtime guard), or None: a chunk after the first
        must read every state it starts from and write again every state the first chunk wrote."""
        if self.index == 0 or self.first_written is None:
            return None
        unread = sorted(set(self.incoming) - self.read)
        if unread:
            return f"did not read its carried state(s) {unread} (it would start from zeros)"
        missing = sorted(self.first_written - set(self.written))
        if missing:
            return f"did not write its state(s) {missing} for the next chunk"
        return None
