"""What travels from ds_longseq's forwards to its attention function through the layers' ``**kwargs``.

Holds:
    SPEC_KWARG: the keyword ("ds_longseq") under which an :class:`AttnSpec` is passed.
    AttentionSettings: the ``long_seq.attention`` section (key-tile size, one kernel call per chunk), built once
        from the config and handed as one value to the forwards that make specs.
    AttnSpec: what one attention call gets: a StreamBP chunk's KVStream, the :class:`AttentionSettings`, and
        the state of the whole forward (packed documents' starts, the sequence-parallel shard context).
    ShardContext: one forward's sequence-parallel state (Ulysses exchange, global padding mask).
    chunk_spec / spec_of: the spec of the StreamBP chunk being run, for attention modules that do not
        pass their ``**kwargs`` on to the attention function (StableLM's).

The types live here, apart from the code that makes them (``sequence_parallel``, ``streambp_layer``,
``causal_lm``) and the code that reads them (``attention``), so that those import this module and
never each other.

Shape legend: B batch, T global sequence length, T_l tokens per rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ds_longseq.config import AttentionConfig
from ds_longseq.ops.kv_stream import GlobalKVStream, KVStream
from ds_longseq.ops.ulysses import UlyssesExchange

__all__ = ["SPEC_KWARG", "AttentionSettings", "AttnSpec", "ShardContext", "chunk_spec", "spec_of"]

SPEC_KWARG = "ds_longseq"


@dataclass(frozen=True)
class AttentionSettings:
    """The ``long_seq.attention`` section as the attention function reads it (``config.AttentionConfig``).

    One frozen value, built once per forward that makes specs (:meth:`from_config`) and carried in every
    :class:`AttnSpec`: the StreamBP layers, the sequence-parallel forward hook and ``CausalLMForward`` pass it
    on whole instead of each field. The defaults are the config's (a call with no spec runs with them).
    """

    kv_block_size: int | None = None
    """Keys per attention tile; None: the device default (the whole prefix on CUDA, 1024 on CPU)."""
    single_call: bool | None = None
    """One kernel call per chunk (prefix and diagonal together) where a kernel takes the bottom-right mask
    (``ops.chunk_attention.chunk_causal_attention``); None: where that kernel takes it itself, never on CPU."""

    @classmethod
    def from_config(cls, config: AttentionConfig) -> "AttentionSettings":
        """The settings of a parsed ``long_seq.attention`` section."""
        return cls(kv_block_size=config.kv_block_size, single_call=config.single_call)


@dataclass
class ShardContext:
    """One forward's sequence-parallel state, handed to every attention call (``AttnSpec.sp``)."""

    exchange: UlyssesExchange | None
    """The (Ulysses) group's all-to-all exchanges; None under a ring alone (u = 1)."""
    local_len: int
    """T_l, tokens per rank."""
    key_valid: torch.Tensor | None
    """(B, T) bool padding mask of the global sequence (False = padding), or None if nothing is padded."""
    doc_start: torch.Tensor | None = None
    """(B, T) global index of each token's document start (packed rows; a document may span ranks),
    or None when no row is packed."""
    ring_group: object | None = None
    """Under Ulysses x ring (``ops.sp_layout``): the ring's process group (``exchange`` is then the Ulysses
    group's, or None when u = 1); None: Ulysses alone."""
    seq_len: int | None = None
    """T, the whole sequence's tokens (P x T_l)."""
    kv_exchange: object | None = None
    """What a StreamBP layer's K/V go through (``ops.kv_stream.GlobalKVStream``): ``exchange`` under Ulysses alone,
    an ``ops.ulysses.UlyssesRingExchange`` under a ring."""
    state_ring: object | None = None
    """The ``ops.state_passing.StateRing`` a recurrent layer passes its states along (rank to rank under Ulysses,
    run to run under a ring)."""


@dataclass
class AttnSpec:
    """Attention settings passed through a layer's ``**kwargs`` as ``ds_longseq=``.

    Two levels use it. Above the layers (``stream`` None), the sequence-parallel forward hook and
    ``CausalLMForward`` pass one spec to every layer with the state of the whole forward, resolved
    once: ``sp``, or ``doc_start``. A StreamBP layer that receives such a spec takes that state from
    it; without one (a caller that bypasses ``CausalLMForward``) it finds the documents itself.
    Inside a StreamBP layer, each chunk's attention call gets a spec with the chunk's ``stream``.
    """

    stream: KVStream | GlobalKVStream | None
    """The chunk's stream (prefix keys and their gradient sink); None outside a StreamBP chunk loop."""
    attention: AttentionSettings
    """``long_seq.attention``: the key-tile size and whether a chunk attends in one kernel call."""
    sp: ShardContext | None = None
    """Sequence-parallel state of this forward (Ulysses exchange, global padding mask), or None."""
    doc_start: torch.Tensor | None = None
    """(B, T) index of each token's document start in a packed row (``ops.documents.find_documents``);
    None: one document per row. Under sequence parallelism the global one is ``sp.doc_start``."""


_CHUNK_SPEC: ContextVar["AttnSpec | None"] = ContextVar("ds_longseq_chunk_spec", default=None)


@contextmanager
def chunk_spec(spec: AttnSpec):
    """Make ``spec`` (a StreamBP chunk's) what :func:`spec_of` returns inside, when the call has none.

    The layer also passes it in its ``**kwargs``; this covers the attention modules that drop those
    before calling the attention function. The StreamBP layer checks every chunk reached the attention
    with its stream, so a layer whose attention is not reached either way is refused, not run wrongly.
    """
    token = _CHUNK_SPEC.set(spec)
    try:
        yield
    finally:
        _CHUNK_SPEC.reset(token)


def spec_of(kwargs: dict) -> AttnSpec | None:
    """The spec an attention call got: its ``ds_longseq=`` keyword, else the running StreamBP chunk's."""
    spec = kwargs.get(SPEC_KWARG)
    return spec if spec is not None else _CHUNK_SPEC.get()
