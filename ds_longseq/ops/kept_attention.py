"""One StreamBP layer's attention outputs, kept from its forward for its backward instead of recomputed.

StreamBP's backward re-forwards each chunk of a layer to get the activations its backward needs. The chunk's
attention forward (its queries against every key before them) is the costliest part of that re-forward, and its
result is already known: the layer's forward computed it, with the same queries, keys and kernels. Kept (the
attention output O and each query's log-sum-exp, per chunk-attention call), the re-forward hands them to the
attention op, which then runs its backward alone (FlashAttention-style: Q, K, V, O, dO and the log-sum-exp) and
skips its forward; the rest of the layer (projections, norms, MLP) is re-run as before. One attention forward per
layer per step fewer: about 11% of an 8B step's FLOPs at 32K tokens, 17% at 128K.

Holds:
    KeptAttention: a layer's kept outputs for one forward: recorded chunk by chunk (each chunk's calls in order), put
        in the layer input's tier once the forward ran (:meth:`KeptAttention.stash`), taken back chunk by chunk in
        the backward's replay.
    ChunkSlot: one chunk's kept outputs, what the attention op reads or writes (:meth:`ChunkSlot.record`,
        :meth:`ChunkSlot.take`).

Shape legend: B batch, H query heads (this rank's under sequence parallelism), C a call's queries, Dv value head dim.
Per call: O (B, H, C, Dv) in the attention's dtype, log-sum-exp (B, H, C) in its compute dtype (float32 for half
precision): for most families the layer input's size plus 1/D of it.

Exact by construction: the backward receives the very tensors the forward produced (bitwise what the re-forward
would compute: the same queries, keys, kernels and, for attention dropout, the same replayed masks).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ds_longseq.ops.tile_kernels import KernelRngState

__all__ = ["KeptAttention", "ChunkSlot"]


class ChunkSlot:
    """One chunk's attention outputs: ``record`` appends each call's (O, log-sum-exp) in the forward, ``take`` hands
    them back in the same order in the replay (each once)."""

    def __init__(self, owner: "KeptAttention", start: int, replaying: bool):
        self._owner, self.start, self.replaying = owner, start, replaying

    def record(self, out: torch.Tensor, lse: torch.Tensor, rng: "KernelRngState") -> None:
        """Keep one call's (B, H, C, Dv) output and (B, H, C) log-sum-exp (the forward's, without autograd history),
        and what its fused kernels' forwards left for their backwards (``rng``: a few scalars, kept on the device)."""
        self._owner._calls.setdefault(self.start, []).append([out.detach(), lse.detach(), rng])

    def take(self) -> tuple[torch.Tensor, torch.Tensor, "KernelRngState"]:
        """The next call's kept (output, log-sum-exp, kernels' RNG state), the tensors on their device; each is handed
        back once."""
        owner = self._owner
        owner._load()
        calls = owner._calls.get(self.start)
        if not calls:
            raise RuntimeError(
                f"StreamBP: the chunk at token {self.start} calls its attention more often in the backward's replay "
                "than in its forward, so a kept attention output is missing: set "
                "long_seq.streambp.keep_attention_output to false for this model")
        out, lse, rng = calls.pop(0)
        return out, lse, rng


class KeptAttention:
    """The attention outputs of one layer's forward, by chunk, for its backward.

    Made before the layer's forward (recording), :meth:`stash`-ed once it ran (into the tier its input goes to), and
    read in the backward's replay (:meth:`slot` in replay mode), each output once.
    """

    def __init__(self):
        self._calls: dict[int, list[list]] = {}  # chunk start -> [[out, lse, rng] of each call, in order]
        self._stored: tuple | None = None  # in another tier: (handle of every output, of every log-sum-exp, shapes)
        self.replaying = False

    def slot(self, start: int) -> ChunkSlot | None:
        """The chunk starting at token ``start``: a slot to record into (forward), or its kept outputs (replay; None
        where the forward kept nothing for it)."""
        if self.replaying and start not in self._calls:
            return None
        return ChunkSlot(self, start, self.replaying)

    @property
    def empty(self) -> bool:
        """Whether the forward kept nothing (a layer whose chunks never reached the chunk attention)."""
        return not self._calls

    def stash(self, save: Callable[[torch.Tensor], object] | None) -> None:
        """After the forward, before the layer input is saved: put the kept tensors where the layer input goes and
        switch to replay. ``save``: an offload tier's ``save`` (returns a handle whose ``load()`` gives the tensor
        back); None: they stay on the device as they are.

        In another tier they go as two tensors per layer, every output and every log-sum-exp each in one (a handful
        of large copies, or files, instead of two per chunk), the log-sum-exps saved first: an offload tier
        prefetches the tensor saved just before the one loaded, so loading the layer input starts the outputs'
        copy back, and loading those the log-sum-exps'."""
        if save is not None and self._calls:
            pairs = [pair for start in sorted(self._calls) for pair in self._calls[start]]
            shapes = [(out.shape, lse.shape) for out, lse, _ in pairs]
            lses = torch.cat([lse.reshape(-1) for _, lse, _ in pairs])
            outs = torch.cat([out.reshape(-1) for out, _, _ in pairs])
            for pair in pairs:
                pair[0] = pair[1] = None  # the device copies go with the forward (the kernels' RNG state stays)
            lses_handle = save(lses)  # first: the outputs, loaded first, are the ones saved next to the input
            self._stored = (save(outs), lses_handle, shapes)
            del outs, lses
        self.replaying = True

    def _load(self) -> None:
        """Bring the outputs back from their tier (at the first take): every call's tensors are views of them."""
        if self._stored is None:
            return
        outs_handle, lses_handle, shapes = self._stored
        self._stored = None
        outs, lses = outs_handle.load(), lses_handle.load()
        pairs = [pair for start in sorted(self._calls) for pair in self._calls[start]]
        at_out = at_lse = 0
        for pair, (out_shape, lse_shape) in zip(pairs, shapes, strict=True):
            n_out, n_lse = math.prod(out_shape), math.prod(lse_shape)
            pair[0] = outs[at_out : at_out + n_out].view(out_shape)
            pair[1] = lses[at_lse : at_lse + n_lse].view(lse_shape)
            at_out, at_lse = at_out + n_out, at_lse + n_lse

    def drop(self) -> None:
        """Keep nothing after all (the layer input itself is not kept either: ``offload.keep_every``): the replay
        recomputes the attention, as without keeping."""
        self._calls.clear()
        self.replaying = True

    def nbytes(self) -> int:
        """Bytes of the kept tensors still on the device (none once stashed in another tier)."""
        return sum(t.numel() * t.element_size() for calls in self._calls.values() for pair in calls for t in pair
                   if isinstance(t, torch.Tensor))
