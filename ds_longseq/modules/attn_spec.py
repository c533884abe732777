"""What travels from ds_longseq's forwards to its attention function through the layers' ``**kwargs``.

Holds:
    SPEC_KWARG: the keyword ("ds_longseq") under which an :class:`AttnSpec` is passed.
    AttnSpec: the attention settings of one call (a StreamBP chunk's KVStream, tile size) and the
        state of the whole forward (packed documents' starts, the sequence-parallel shard context).
    ShardContext: one forward's sequence-parallel state (Ulysses exchange, global padding mask).

The types live here, apart from the code that makes them (``sequence_parallel``, ``decoder_layer``,
``causal_lm``) and the code that reads them (``attention``), so that those import this module and
never each other.

Shape legend: B batch, T global sequence length, T_l tokens per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds_longseq.ops.streambp import GlobalKVStream, KVStream
from ds_longseq.ops.ulysses import UlyssesExchange

__all__ = ["SPEC_KWARG", "AttnSpec", "ShardContext"]

SPEC_KWARG = "ds_longseq"


@dataclass
class ShardContext:
    """One forward's sequence-parallel state, handed to every attention call (``AttnSpec.sp``)."""

    exchange: UlyssesExchange
    """The group's all-to-all exchanges."""
    local_len: int
    """T_l, tokens per rank."""
    key_valid: torch.Tensor | None
    """(B, T) bool padding mask of the global sequence (False = padding), or None if nothing is padded."""
    doc_start: torch.Tensor | None = None
    """(B, T) global index of each token's document start (packed rows; a document may span ranks),
    or None when no row is packed."""


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
    kv_block_size: int | None
    """Keys per attention tile; None: the device default (the whole prefix on CUDA, 1024 on CPU)."""
    sp: ShardContext | None = None
    """Sequence-parallel state of this forward (Ulysses exchange, global padding mask), or None."""
    doc_start: torch.Tensor | None = None
    """(B, T) index of each token's document start in a packed row (``ops.packing.find_documents``);
    None: one document per row. Under sequence parallelism the global one is ``sp.doc_start``."""
