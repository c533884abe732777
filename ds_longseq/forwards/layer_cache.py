"""The KV cache a stock decoder layer is called with inside a StreamBP chunk.

Holds:
    StreamCache: transformers' ``Cache`` as far as a decoder layer uses one, over a StreamBP stream: each call
        the layer makes on its cache (``update``, ``get_seq_length``, the linear-attention state API) turned
        into the stream's own (``ops.kv_stream``, ``ops.carried_state``).
    layer_cache: the cache a chunk's layer is called with for a stream.

The streams in ``ops`` are tensors and autograd only; this module is the one place that speaks transformers'
cache API to them. Shape legend: B batch, Hkv key/value heads, C chunk, D head dim.
"""

from __future__ import annotations

import torch

from ds_longseq.ops.head_sharding import MixerStream
from ds_longseq.ops.kv_stream import GlobalKVStream, KVStream

__all__ = ["StreamCache", "layer_cache"]


class StreamCache:
    """What a StreamBP chunk's stock layer gets as its KV cache (``past_key_values`` / ``cache``).

    transformers' layers write their post-RoPE keys and values through ``update`` and attend what it
    returns; Llama 4 positions its queries by ``get_seq_length()``; recurrent mixers (linear attention,
    state-space, short convolutions) read and write their states through the linear-attention half of the
    API. Each goes to the stream: :meth:`KVStream.write_kv`, :meth:`KVStream.tokens_before` and the stream's
    :class:`~ds_longseq.ops.carried_state.CarriedState` (``stream.state``; a :class:`GlobalKVStream` carries
    none: sequence parallelism runs a recurrent layer on a :class:`KVStream`).
    """

    def __init__(self, stream: KVStream | GlobalKVStream):
        self.stream = stream

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update``: the chunk's (B, Hkv, C, D) keys and values written to the stream; returns what the
        layer attends (the layer index and cache kwargs are the stream's own business: one stream per layer)."""
        return self.stream.write_kv(key_states, value_states)

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """``Cache.get_seq_length``: the tokens before the current chunk (the whole sequence's, under sequence
        parallelism)."""
        return self.stream.tokens_before()

    # transformers' linear-attention cache API (5.24): the recurrent mixers' states
    def get_conv_state(self, *args, **kwargs):
        return self.stream.state.get_conv_state(*args, **kwargs)

    def get_recurrent_state(self, *args, **kwargs):
        return self.stream.state.get_recurrent_state(*args, **kwargs)

    def update_conv_state(self, *args, **kwargs):
        return self.stream.state.update_conv_state(*args, **kwargs)

    def update_recurrent_state(self, *args, **kwargs):
        return self.stream.state.update_recurrent_state(*args, **kwargs)

    def is_recording_past(self, *args, **kwargs) -> bool:
        return self.stream.state.is_recording_past(*args, **kwargs)

    # the same states as transformers 5.16-5.23's mixers read them: they ask has_previous_state, then read the
    # cache's layer (cache.layers[i].conv_states[j], .recurrent_states[j], .record_past) directly
    def has_previous_state(self, *args, **kwargs) -> bool:
        return self.stream.state.has_previous_state(*args, **kwargs)

    @property
    def layers(self) -> _Layers:
        return _Layers(self.stream.state)


class _States:
    """``layers[i].conv_states`` / ``.recurrent_states``: index ``j`` reads state ``j`` through ``get``."""

    def __init__(self, get):
        self.get = get

    def __getitem__(self, state_idx: int) -> torch.Tensor | None:
        return self.get(state_idx=state_idx)


class _StateLayer:
    """A ``LinearAttentionLayer`` of transformers 5.16-5.23 as its mixers read it, over the stream's carried
    state (reads are recorded for the runtime guard as through ``get_conv_state``)."""

    record_past = True  # as is_recording_past: the general multi-token path, never the in-place decode step

    def __init__(self, state):
        self.conv_states = _States(state.get_conv_state)
        self.recurrent_states = _States(state.get_recurrent_state)


class _Layers:
    """``cache.layers``: every index is the chunk's own layer (one stream per layer)."""

    def __init__(self, state):
        self.state = state

    def __getitem__(self, layer_idx: int) -> _StateLayer:
        return _StateLayer(self.state)


def layer_cache(stream: KVStream | GlobalKVStream | MixerStream) -> StreamCache | MixerStream:
    """The cache a StreamBP chunk's layer is called with: a :class:`StreamCache` over a K/V stream; a head-sharded
    mixer's :class:`MixerStream` as itself (read by ds_longseq's mixer forward, ``forwards.head_sharding_forward``)."""
    return stream if isinstance(stream, MixerStream) else StreamCache(stream)
