"""A recurrent token mixer (Gated DeltaNet, Kimi delta attention, Mamba-2, a short convolution) sharded by heads
under sequence parallelism.

Holds:
    HeadShardedMixerForward: the callable installed as a mixer instance's ``forward`` under
        ``long_seq.sequence_parallel`` with ``recurrent="heads"``.

Each rank runs the mixer's own forward on the whole sequence (gathered from the ranks) with its parameters
cut to its share of the heads (``families.mixer_heads``); the ranks' outputs, each a partial sum over heads,
are summed and scattered back to tokens (``ops.head_sharding``). The first call checks the layout: on the
first tokens, the P shares run on one rank must add up to the whole mixer's output.

Shape legend: B batch, P ranks, T_l tokens per rank, T = P * T_l, d hidden size.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ds_longseq.compat import parameters_replaced
from ds_longseq.families.mixer_heads import HeadLayout, head_layout
from ds_longseq.forwards.attn_spec import SPEC_KWARG, spec_of
from ds_longseq.ops.draws import generators_kept
from ds_longseq.ops.head_sharding import MixedStream, MixerStream, gather_tokens, reduce_scatter_tokens
from ds_longseq.ops.sp_positions import sp_positions
from ds_longseq.ops.ulysses import UlyssesExchange

__all__ = ["HeadShardedMixerForward", "LAYOUT_CHECK_TOKENS"]

LAYOUT_CHECK_TOKENS = 16
"""Tokens the first call's layout check runs the mixer on."""


class HeadShardedMixerForward:
    """Replacement ``forward`` of one recurrent mixer instance under sequence parallelism.

    - Inside a StreamBP chunk (its cache a :class:`MixerStream`, or a ``StreamCache`` over a :class:`MixedStream`
      where an attention runs beside it): hands the chunk to the stream, which captures its input or serves the
      whole shard's output (``ops.head_sharding.streambp_mixer_sp_apply``).
    - Under sequence parallelism otherwise (``ds_longseq=`` spec with a shard context): :meth:`sharded`.
    - With the group paused (evaluation, generation on whole sequences) or a real cache: the stock forward.

    Args:
        mixer: the mixer module.
        orig_forward: its forward before this one was installed.
        exchange: an exchange over the whole sequence-parallel group (its rank and size, its all-to-all).
        name: how errors name the layer (e.g. ``Qwen3_5ForCausalLM.model.layers[0].linear_attn``).
        ring: (u, r), the group's Ulysses x ring degrees: the ranks' tokens, gathered in rank order, are put in the
            sequence's order for the mixer (``ops.sp_layout``) and its output back; None: Ulysses' contiguous shards.
    """

    def __init__(self, mixer: torch.nn.Module, orig_forward: Callable, exchange: UlyssesExchange, name: str,
                 ring: tuple[int, int] | None = None):
        self.exchange, self.size = exchange, exchange.world_size
        layout = head_layout(mixer, exchange.rank, self.size)
        if isinstance(layout, str):
            raise ValueError(f"{name}: {layout}")
        self.mixer, self.orig_forward, self.name = mixer, orig_forward, name
        self.layout = layout
        self.ring = ring
        self._orders: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.checked = False

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        cache = next((kwargs[k] for k in ("cache", "cache_params", "past_key_values") if k in kwargs), None)
        # a StreamBP chunk: the mixer's own stream, or the K/V stream of a layer with an attention beside it
        stream = cache if isinstance(cache, MixerStream) else getattr(cache, "stream", None)
        if isinstance(stream, (MixerStream, MixedStream)):
            return stream.mixer_call(hidden_states)
        spec = spec_of(kwargs)
        context = None if spec is None else spec.sp
        if context is None or cache is not None or args:
            kwargs.pop(SPEC_KWARG, None)
            return self.orig_forward(hidden_states, *args, **kwargs)
        return self.sharded(hidden_states, context.key_valid)

    def sharded(self, x: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor:
        """(B, T_l, d) this rank's mixer input -> (B, T_l, d) its output; every rank of the group calls it at once.

        ``key_valid``: (B, T) the global padding mask (None: nothing padded), which the mixer zeroes padded
        tokens with, as on one process."""
        full = gather_tokens(x, self.exchange)
        order = None
        if self.ring is not None:  # rank order -> sequence order (row k of the rank order is position order[k])
            order, to_sequence = self._order(full.shape[1], full.device)
            full = full.index_select(1, to_sequence)
        if not self.checked:
            self.checked = True
            self._check_layout(full, key_valid)
        out = self._share(full, key_valid, self.layout)
        return reduce_scatter_tokens(out if order is None else out.index_select(1, order), self.exchange)

    def _order(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(order, its inverse) for ``seq_len`` tokens under the ring, built once per length (every forward of every
        head-sharded layer uses them)."""
        key = (seq_len, device)
        if key not in self._orders:
            order = sp_positions(seq_len, *self.ring).flatten().to(device)
            self._orders[key] = order, torch.argsort(order)
        return self._orders[key]

    def _share(self, full: torch.Tensor, key_valid: torch.Tensor | None, layout: HeadLayout) -> torch.Tensor:
        """The mixer's forward on ``full`` (B, T, d) with the parameters and head counts of ``layout``."""
        params = {**dict(self.mixer.named_buffers()), **dict(self.mixer.named_parameters())}  # Falcon-H1's mup_vector
        sliced = {path: params[path].index_select(dim, index) for path, (dim, index) in layout.slices.items()}
        with parameters_replaced(self.mixer, sliced), _attributes(self.mixer, layout.attrs):
            return self.orig_forward(full, attention_mask=key_valid)

    def _check_layout(self, full: torch.Tensor, key_valid: torch.Tensor | None) -> None:
        """The P shares' outputs on the first tokens, run here, must add up to the whole mixer's."""
        n = min(full.shape[1], LAYOUT_CHECK_TOKENS)
        x = full[:, :n].detach()
        mask = None if key_valid is None else key_valid[:, :n]
        with torch.no_grad(), generators_kept(x.device):  # a probe: its draws must not shift the forward's
            whole = self.orig_forward(x, attention_mask=mask)
            shares = sum(self._share(x, mask, head_layout(self.mixer, r, self.size)) for r in range(self.size))
        error = ((shares - whole).norm() / whole.norm().clamp_min(torch.finfo(whole.dtype).tiny)).item()
        if not error <= torch.finfo(whole.dtype).eps ** 0.5:
            raise NotImplementedError(
                f"{self.name} ({type(self.mixer).__name__}): its heads' shares add up to a different output than the "
                f"whole mixer (relative error {error:.1e}): ds_longseq's head layout of this class "
                "(families.mixer_heads) does not match the installed transformers' code; set "
                "long_seq.sequence_parallel.recurrent='pass_state'"
            )


@contextlib.contextmanager
def _attributes(module: torch.nn.Module, values: dict):
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
