"""The attention and mask functions ds_longseq registers with transformers under one new name.

Holds:
    ATTN_IMPLEMENTATION: the name ("ds_longseq") a StreamBP model's ``config._attn_implementation`` gets.
    longseq_attention: an ``AttentionInterface`` function (bottom-right causal, 2D padding mask).
    longseq_mask: an ``AttentionMaskInterface`` function that keeps the mask 2D (never (T x T)).
    mask_audit: the check, around one model forward, that every sliding window the model asked a mask
        for reached the attention function as ``sliding_window=`` (a window kept in the mask only would
        be lost, since the mask stays 2D).

What the callers pass down (``ds_longseq=AttnSpec(...)``) is defined in ``forwards.attn_spec``.

Shape legend: B batch, H heads, Hkv kv-heads, C query length, K key length, D head dim.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch

from ds_longseq.compat import CACHE_KWARGS, packed_chunks_count_from_documents
from ds_longseq.forwards.attn_spec import SPEC_KWARG, AttentionSettings, AttnSpec, spec_of
from ds_longseq.ops.chunk_attention import KeyLimits, chunk_causal_attention
from ds_longseq.ops.documents import PACKED_KWARGS
from ds_longseq.ops.ulysses import ulysses_attention, ulysses_chunk_attention, ulysses_ring_attention

__all__ = ["ATTN_IMPLEMENTATION", "WINDOW_ATTR", "CHUNK_ATTR", "longseq_attention", "longseq_mask", "mask_audit"]

ATTN_IMPLEMENTATION = "ds_longseq"
WINDOW_ATTR = "_ds_longseq_sliding_window"
"""Attribute set on an attention module whose family keeps its sliding window in the mask only (written per
family in ``families.discovery``): :func:`longseq_attention` uses it when the call passes no window."""
CHUNK_ATTR = "_ds_longseq_attention_chunk"
"""Attribute set on the attention module of each chunked-attention layer (``config.layer_types[i] ==
"chunked_attention"``, Llama 4): its ``config.attention_chunk_size``. transformers applies chunked attention
through the mask only, which ds_longseq keeps 2D, so :func:`longseq_attention` reads it from here."""

_KNOWN_KWARGS = frozenset(
    {SPEC_KWARG, "softcap", "s_aux", *PACKED_KWARGS}
    # passed through by the decoder layers, with no effect on the attention itself (transformers' own
    # sdpa and eager functions ignore them too)
    | {"position_ids", "use_cache", "cache_position", "output_attentions", "output_hidden_states", "return_dict"}
    | {*CACHE_KWARGS, "position_embeddings"}
    | {"output_router_logits"}
)
"""Keyword arguments :func:`longseq_attention` understands; any other one raises (an attention
feature it would silently ignore, e.g. attention sinks)."""


class _Keys(NamedTuple):
    """The keys and values one attention call attends, as :func:`_attended_keys` resolves them."""

    key: torch.Tensor
    """(B, Hkv, K, D): the chunk's own keys (under sequence parallelism this rank's shard's)."""
    value: torch.Tensor
    """(B, Hkv, K, Dv): their values."""
    k_prefix: torch.Tensor | None
    """(B, Hkv, S, D) keys before the chunk (a StreamBP stream's), or None (none, or under sequence parallelism)."""
    v_prefix: torch.Tensor | None
    """(B, Hkv, S, Dv) their values, or None."""
    num_keys: int
    """S + K, the keys the queries are the last C of; under sequence parallelism the global sequence length."""


class _Masking(NamedTuple):
    """Which keys each query sees and how its logits are shaped, beyond causality and padding."""

    scale: float
    """Softmax scale."""
    sliding_window: int | None
    """Keys each query attends at most (itself included), or None (no window, or one holding every key)."""
    attention_chunk: int | None
    """Chunked attention's chunk size (Llama 4's ``attention_chunk_size``), or None."""
    chunk_origin: torch.Tensor | None
    """(B, 1) or (B, num_keys) token the attention chunks are counted from, or None (from token 0)."""
    softcap: float | None
    """Logit softcapping (Gemma 2), or None."""
    sink_logits: torch.Tensor | None
    """(H,) attention-sink logits (gpt-oss's ``s_aux``), or None."""
    dropout: float = 0.0
    """Dropout probability on the attention probabilities (the family's ``attention_dropout`` in training)."""

    def limits(self, doc_start: torch.Tensor | None) -> KeyLimits:
        """The keys each query may see, by global key index, with packed documents' starts ``doc_start``."""
        return KeyLimits(doc_start, self.sliding_window, self.attention_chunk, self.chunk_origin)


def longseq_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function: causal attention of ``query`` on prefix + ``key``.

    Args:
        module: the attention module (unused but for error messages).
        query: (B, H, C, D). key, value: (B, Hkv, K, D), K >= C; the queries are the last C keys.
        attention_mask: None or a (B, S + K) bool/int padding mask (True/1 = real token).
        dropout: dropout probability on the attention probabilities, applied by the math tiles from a seed drawn
            from the global generator: inside a StreamBP chunk that draw is the chunk's region's (``ops.draws``), so
            every pass of the chunk draws the same masks. Not under sequence parallelism (refused).
        scaling: softmax scale, default D ** -0.5.
        sliding_window: each query attends at most this many keys, itself included (transformers'
            convention), or None.
        kwargs: ``ds_longseq=AttnSpec`` from a StreamBP layer or the sequence-parallel forward hook
            (carrying packed documents' boundaries); ``softcap`` (Gemma 2's logit softcapping); the
            bookkeeping kwargs decoder layers pass through. Any other kwarg raises
            ``NotImplementedError`` naming it: it would change the attention and be ignored. Under
            sequence parallelism (``AttnSpec.sp``) the attention is Ulysses: a whole shard
            (:func:`ulysses_attention`) or, inside a StreamBP chunk loop, one chunk against the
            exchanged K/V (:func:`ulysses_chunk_attention`).

    Returns:
        ((B, C, H, D) output, None): the layout transformers' attention modules expect.
    """
    _check_kwargs(module, kwargs)
    spec: AttnSpec | None = spec_of(kwargs)
    keys = _attended_keys(spec, query, key, value)
    _check_call(spec, kwargs)
    window = _sliding_window(module, sliding_window, keys.num_keys)
    attention_chunk, chunk_origin = _attention_chunk(module, spec, attention_mask, keys.num_keys, query.device)
    masking = _Masking(
        scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        sliding_window=window,
        attention_chunk=attention_chunk,
        chunk_origin=chunk_origin,
        softcap=kwargs.get("softcap"),
        sink_logits=kwargs.get("s_aux"),  # attention sinks (gpt-oss): (H,) logits
        dropout=float(dropout or 0.0),
    )
    if spec is not None and spec.sp is not None:
        out = _sequence_parallel_attention(query, keys, spec, masking)
    else:
        out = _local_attention(query, keys, attention_mask, spec, masking)
    return out.transpose(1, 2).contiguous(), None  # contiguous like transformers' sdpa (callers .view() it)


def _check_kwargs(module: torch.nn.Module, kwargs: dict) -> None:
    """Raise ``NotImplementedError`` naming every keyword :func:`longseq_attention` does not implement."""
    unknown = sorted(set(kwargs) - _KNOWN_KWARGS)
    if unknown:
        raise NotImplementedError(
            f"{type(module).__name__} passes {unknown} to its attention function, which ds_longseq's attention does "
            "not implement (ignoring it could change the result): this model family is not supported with "
            "long_seq.streambp or sequence parallelism"
        )


def _attended_keys(spec: AttnSpec | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> _Keys:
    """The keys a call attends (:class:`_Keys`), recording the call on a StreamBP chunk's stream.

    Args:
        spec: the call's spec, or None (a call outside ds_longseq's forwards).
        query: (B, H, C, D). key, value: (B, Hkv, K, D) as the layer passed them.
    """
    stream = spec.stream if spec is not None else None
    sp = spec.sp if spec is not None else None
    if stream is not None:  # the StreamBP layer checks that each chunk reached here once, with its own keys
        # A layer attending something other than it cached (multi-head latent attention expands the cached
        # latent): without sequence parallelism the cache gives it every token so far, as a DynamicCache would,
        # and the layer attends them all; under it the expanded keys/values are captured here and exchanged
        # like any layer's (in the capture passes this call stops the layer). See the streams' attends().
        same = stream.attends(key, value)
        stream.attended.append((query.shape[2], key.shape[2]) if same else ("not the cached keys/values",))
    if sp is not None:
        return _Keys(key, value, None, None, sp.seq_len)
    k_prefix, v_prefix = stream.prefix() if stream is not None else (None, None)
    num_keys = key.shape[2] + (0 if k_prefix is None else k_prefix.shape[2])
    if stream is not None:  # a replay reusing the captured keys/values (KVStream.own_kv)
        key, value = stream.own_kv(key, value)
    return _Keys(key, value, k_prefix, v_prefix, num_keys)


def _check_call(spec: AttnSpec | None, kwargs: dict) -> None:
    """Raise ``ValueError`` for varlen packed rows under sequence parallelism."""
    sp = spec.sp if spec is not None else None
    if sp is not None and any(kwargs.get(name) is not None for name in PACKED_KWARGS):
        raise ValueError(
            "cu_seq_lens_q/k under sequence parallelism: pass packed rows as restarting position_ids instead "
            "(ds_longseq.engine.shard_batch carries them, with each document's global boundaries)"
        )


def _sliding_window(module: torch.nn.Module, sliding_window: int | None, num_keys: int) -> int | None:
    """The window the call applies: the call's, else the one the family keeps in the mask only
    (:data:`WINDOW_ATTR`); recorded for :func:`mask_audit`; None where it holds all ``num_keys`` keys."""
    if sliding_window is None:
        # set per family (families.discovery): a module's own `sliding_window` attribute is no substitute
        # in general (EXAONE 4 holds the window on its full-attention layers too and passes None for them)
        sliding_window = getattr(module, WINDOW_ATTR, None)
    audit = _AUDIT.get()
    if audit is not None:
        audit.received.add(sliding_window)
    if sliding_window is not None and num_keys <= sliding_window:
        sliding_window = None  # the window holds the whole sequence
    return sliding_window


def _attention_chunk(module: torch.nn.Module, spec: AttnSpec | None, attention_mask: torch.Tensor | None,
                     num_keys: int, device: torch.device) -> tuple[int | None, torch.Tensor | None]:
    """(chunk size, chunk origin) of a chunked-attention layer (:data:`CHUNK_ATTR`, recorded for
    :func:`mask_audit`), else (None, None).

    The origin is (B, num_keys) packed documents' starts, or (B, 1) each row's first real token (past its
    left padding), or None (token 0), on ``device``.
    """
    attention_chunk = getattr(module, CHUNK_ATTR, None)
    audit = _AUDIT.get()
    if audit is not None and attention_chunk is not None:
        audit.received_chunks.add(attention_chunk)
    chunk_origin = None
    if attention_chunk is not None:
        sp = spec.sp if spec is not None else None
        # transformers counts the chunks from the query's document's first token in packed rows (5.24 compares
        # position ids; 5.16 counts them from the row's key 0, the documents cutting the mask only), else from
        # the row's first real token (its number of left-padding tokens); under sequence parallelism from the
        # global ones
        doc_start = (sp.doc_start if sp is not None else spec.doc_start) if spec is not None else None
        key_valid = sp.key_valid if sp is not None else (
            None if attention_mask is None else attention_mask[:, -num_keys:].to(torch.bool))
        if doc_start is not None and packed_chunks_count_from_documents():
            chunk_origin = doc_start.to(device)  # (B, keys): sliced to the queries by the local path
        elif key_valid is not None:
            chunk_origin = (key_valid.to(torch.int64).cumsum(-1) == 0).sum(-1, keepdim=True).to(device)
    return attention_chunk, chunk_origin


def _dropout_seed(masking: _Masking) -> int:
    """The call's attention-dropout seed, drawn from the global generator (0 without dropout: nothing drawn, so
    a model without attention dropout consumes no draw here)."""
    return int(torch.randint(0, (1 << 63) - 1, ())) if masking.dropout else 0


def _sequence_parallel_attention(query: torch.Tensor, keys: _Keys, spec: AttnSpec, masking: _Masking
                                 ) -> torch.Tensor:
    """Ulysses attention: a whole shard, or inside a StreamBP chunk loop the chunk against the stream's
    exchanged keys. The padding mask the call got is this rank's slice: ``spec.sp.key_valid`` is the global one.

    Args:
        query: (B, H, C, D) this rank's queries (C = T_l for a whole shard).
        keys: this rank's (B, Hkv, C, D) keys and values (unused inside a chunk loop: the stream's are read).
        spec: the call's spec, with its shard context ``sp``.
        masking: the call's window, attention chunks, softcap and sinks.

    Returns:
        (B, H, C, D) output.
    """
    sp, stream, settings = spec.sp, spec.stream, spec.attention
    # this rank's call seed: drawn inside its own region (the sequence-parallel forward hook's, and a StreamBP chunk's
    # within it: ops.draws), so ranks draw unlike masks, and a chunk's forward, re-forward and backward the same
    dropout_seed = _dropout_seed(masking)
    limits = masking.limits(sp.doc_start)
    if sp.ring_group is not None and stream is None:  # Ulysses x ring, a whole shard
        return ulysses_ring_attention(
            query, keys.key, keys.value, sp.exchange, sp.ring_group, scale=masking.scale, key_valid=sp.key_valid,
            limits=limits, softcap=masking.softcap, sink_logits=masking.sink_logits, dropout=masking.dropout,
            dropout_seed=dropout_seed,
        )
    common = dict(
        scale=masking.scale, key_valid=sp.key_valid, kv_block_size=settings.kv_block_size,
        single_call=settings.single_call, limits=limits, softcap=masking.softcap, sink_logits=masking.sink_logits,
        dropout=masking.dropout, dropout_seed=dropout_seed,
    )
    if stream is not None:
        return ulysses_chunk_attention(query, stream.exchange, stream.k_heads, stream.v_heads, stream.start, stream.end,
                                       grad_sink=stream.grad_sink, kept=stream.kept_slot(), **common)
    return ulysses_attention(query, keys.key, keys.value, sp.exchange, **common)


def _local_attention(query: torch.Tensor, keys: _Keys, attention_mask: torch.Tensor | None, spec: AttnSpec | None,
                     masking: _Masking) -> torch.Tensor:
    """One process's attention of the last C of ``keys.num_keys`` positions: a StreamBP chunk against its
    stream's prefix and its own keys, or a whole sequence.

    Args:
        query: (B, H, C, D).
        keys: the call's keys: its own (B, Hkv, K, D) and a stream's (B, Hkv, S, D) prefix.
        attention_mask: None or the (B, >= S + K) 2D padding mask (True/1 = real token); else ``ValueError``.
        spec: the call's spec (its stream, packed documents' starts, attention settings), or None.
        masking: the call's window, attention chunks, softcap and sinks.

    Returns:
        (B, H, C, D) output.
    """
    num_keys, C = keys.num_keys, query.shape[2]
    key_valid = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"ds_longseq streambp takes a 2D (batch, seq) padding attention_mask, got shape "
                f"{tuple(attention_mask.shape)}: pass the tokenizer's 2D mask instead of a prepared 4D one"
            )
        key_valid = attention_mask[:, -num_keys:].to(device=query.device, dtype=torch.bool)
    limits = masking.limits(spec.doc_start if spec is not None else None)
    # the queries are the last C of the num_keys tokens of the row
    query_lo = limits.query_lo(torch.arange(num_keys - C, num_keys, device=query.device),
                               slice(num_keys - C, num_keys))
    stream = spec.stream if spec is not None else None
    settings = spec.attention if spec is not None else AttentionSettings()
    # a StreamBP chunk's region (ops.draws) gives each of its passes the same seed, so its forward and its
    # re-forward draw the same masks
    dropout_seed = _dropout_seed(masking)
    return chunk_causal_attention(
        query,
        keys.key,
        keys.value,
        scale=masking.scale,
        k_prefix=keys.k_prefix,
        v_prefix=keys.v_prefix,
        key_valid=key_valid,
        kv_block_size=settings.kv_block_size,
        prefix_grad_sink=stream.prefix_grad_sink if stream is not None else None,
        query_lo=query_lo,
        softcap=masking.softcap,
        sink_logits=masking.sink_logits,
        joined_kv=stream.joined() if stream is not None else None,
        single_call=settings.single_call,
        dropout=masking.dropout,
        dropout_seed=dropout_seed,
        kept=stream.kept_slot() if stream is not None else None,
    )


def _mask_parts(fn, depth: int = 0) -> set[str]:
    """Names of the functions a transformers mask function is composed of (``and_masks`` / ``or_masks`` keep
    their parts in closures): e.g. {"sliding_window_overlay", "causal_mask_function", ...}."""
    if fn is None or depth > 8:
        return set()
    parts = {fn.__qualname__.split(".<locals>")[0]} if hasattr(fn, "__qualname__") else set()
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if callable(item) and hasattr(item, "__code__"):
                parts |= _mask_parts(item, depth + 1)
    return parts


def longseq_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers mask-interface function: the 2D padding mask itself, or None when nothing is padded.

    Causality is applied inside :func:`longseq_attention` by index, so no (q x kv) tensor is built;
    packed documents, sliding windows and attention chunks too (per-query key lower bounds), the window from
    the attention call's ``sliding_window``, the chunk from the module's :data:`CHUNK_ATTR`: the sliding-window
    and chunked-attention masks asked for here (``local_size``) are recorded for :func:`mask_audit`.
    """
    audit = _AUDIT.get()
    if audit is not None:
        audit.requested_any = True
    local = kwargs.get("local_size")
    if local is not None:
        # transformers passes local_size for its sliding-window and its chunked masks; which one this is
        # shows in the overlays the mask function is composed of
        chunked = "chunked_overlay" in _mask_parts(mask_function)
        if audit is not None:
            (audit.requested_chunks if chunked else audit.requested).add(int(local))
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if bool(attention_mask.all()):
        return None
    return attention_mask


class _MaskAudit:
    def __init__(self):
        self.requested: set[int] = set()  # sliding windows the model built masks for
        self.requested_any = False  # whether the model built any mask through longseq_mask
        self.received: set[int | None] = set()  # sliding_window values the attention function got
        self.requested_chunks: set[int] = set()  # attention chunk sizes the model built chunked masks for
        self.received_chunks: set[int] = set()  # attention chunk sizes the attention function applied


_AUDIT: ContextVar[_MaskAudit | None] = ContextVar("ds_longseq_mask_audit", default=None)


@contextmanager
def mask_audit(sliding_masks_read: bool = True):
    """Around one model forward: raise if the model asked for a sliding-window mask whose window never
    reached :func:`longseq_attention` as ``sliding_window=``, or for a chunked-attention mask whose chunk size
    no attention module applied (:data:`CHUNK_ATTR`), or the other way round.

    Some families put the window only into the mask (Qwen2-MoE's attention never passes it on); ds_longseq's
    mask stays 2D, so such a window would be silently dropped. The check runs after the forward, before
    any loss is returned, so nothing is trained on the result.

    Args:
        sliding_masks_read: False when no layer of the model reads a sliding-window mask (no sliding type in
            ``config.layer_types``): the stock forward may still build one (Qwen2-MoE builds a window-0 mask when
            ``use_sliding_window`` is false), which stock attention never applies, so it is not a lost window.
    """
    audit = _MaskAudit()
    token = _AUDIT.set(audit)
    try:
        yield audit
    finally:
        _AUDIT.reset(token)
    lost = sorted(w for w in audit.requested if w not in audit.received) if sliding_masks_read else []
    if lost:
        raise NotImplementedError(
            f"the model builds sliding-window masks of {lost} tokens but its attention modules never pass "
            "sliding_window to the attention function (the window lives in the mask only, which ds_longseq's "
            "attention does not read): this model cannot run under long_seq.streambp or sequence parallelism; "
            "use mini_seq"
        )
    extra = sorted(w for w in audit.received if w is not None and w not in audit.requested)
    if audit.requested_any and extra:
        raise NotImplementedError(
            f"the attention was given sliding windows of {extra} tokens that no mask of this forward has (its "
            f"masks: {sorted(audit.requested) or 'causal only'}): this model cannot run under long_seq.streambp "
            "or sequence parallelism; use mini_seq"
        )
    if audit.requested_any and audit.received_chunks != audit.requested_chunks:
        raise NotImplementedError(
            f"the model builds chunked-attention masks of {sorted(audit.requested_chunks) or 'no'} tokens but "
            f"ds_longseq's attention applied chunks of {sorted(audit.received_chunks) or 'none'} (it reads them from "
            "config.layer_types and config.attention_chunk_size): this model cannot run under long_seq.streambp "
            "or sequence parallelism; use mini_seq"
        )
