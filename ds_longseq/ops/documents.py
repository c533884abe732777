"""Packed documents: several documents in one row, recognised from the two forms collators send.

Holds:
    find_documents: the one entry point every caller uses (the model forward, a decoder layer called
        directly, the sequence-parallel hook on the gathered positions, ``engine.shard_batch``): (B, T)
        index of each token's document start, from restarting ``position_ids`` (TRL's
        ``padding_free`` / ``packing``) or from ``cu_seq_lens_q/k`` (transformers'
        ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), validated, and the position ids to
        run with.
    doc_starts: the same without the position ids (kept for callers of the public ``ops`` name).
    mask_document_starts: labels with ``ignore_index`` at every document's first token, so no
        token is trained to predict the next document's first token.

Conventions (those of transformers): a new document starts wherever ``position_ids`` do not go up
by exactly one (``find_packed_sequence_indices``); a document never spans two rows. The shift: the
target of token t is token t + 1, so the last token of a document would be trained to predict the
next document's first token; putting ``ignore_index`` on each document's first label (what
``DataCollatorWithFlattening`` already does) removes exactly those targets.

Shape legend: B batch, T tokens per row.
"""

from __future__ import annotations

import torch

__all__ = ["find_documents", "doc_starts", "mask_document_starts", "PACKED_KWARGS"]

PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The flash-attention varlen kwargs of transformers' flattening collator."""


def _starts_to_doc_start(is_start: torch.Tensor) -> torch.Tensor:
    """(B, T) bool document starts -> (B, T) index of each token's document start."""
    T = is_start.shape[-1]
    idx = torch.arange(T, device=is_start.device).expand_as(is_start)
    return torch.where(is_start, idx, torch.zeros_like(idx)).cummax(-1).values


def _starts_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    first = position_ids[..., :1] - 1
    return torch.diff(position_ids, prepend=first, dim=-1) != 1


def _starts_from_cu_seqlens(cu_q, cu_k, B: int, T: int, device) -> torch.Tensor:
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if cu is None:
            raise ValueError(f"{name} is missing: pass both cu_seq_lens_q and cu_seq_lens_k (the flattening "
                             "collator's return_flash_attn_kwargs=True gives both)")
    cu_q, cu_k = (torch.as_tensor(c).detach().to("cpu", torch.int64).flatten() for c in (cu_q, cu_k))
    if not torch.equal(cu_q, cu_k):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: for training (no cache) queries and keys are the "
                         "same tokens, so the two must be equal")
    if cu_q.numel() < 2 or int(cu_q[0]) != 0 or int(cu_q[-1]) != B * T:
        raise ValueError(
            f"cu_seq_lens_q = {cu_q.tolist()[:8]}{'...' if cu_q.numel() > 8 else ''} does not cover the batch: it must "
            f"start at 0 and end at batch x tokens = {B} x {T} = {B * T} (document boundaries over the flattened "
            "rows). Rebuild it from the packed rows, or pass restarting position_ids instead"
        )
    if bool((cu_q[1:] <= cu_q[:-1]).any()):
        raise ValueError(f"cu_seq_lens_q must increase strictly (no empty or reversed documents), got "
                         f"{cu_q.tolist()[:16]}: rebuild it as the cumulative document lengths with a leading 0")
    starts = torch.zeros(B * T, dtype=torch.bool)
    starts[cu_q[:-1]] = True
    starts = starts.view(B, T)
    starts[:, 0] = True  # a row boundary always ends a document
    return starts.to(device)


def find_documents(
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    batch_size: int,
    seq_len: int,
    cu_seq_lens_q=None,
    cu_seq_lens_k=None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(doc_start, position ids to run with) of a batch: doc_start (B, T) is the index of the first token
    of each token's document, or None when no row is packed.

    Without ``position_ids``, restarting ones are derived from ``cu_seq_lens_*``: transformers' own
    attention recognises documents only from them, sequence parallelism carries them across ranks, and
    RoPE is relative, so a document's attention is the same at any offset. Otherwise ``position_ids`` are
    returned as given.

    Args:
        position_ids: (B or 1, T), or None.
        attention_mask: (B, T) 2D padding mask, or None.
        batch_size, seq_len: B, T of the batch.
        cu_seq_lens_q, cu_seq_lens_k: cumulative document lengths over the flattened (B * T) rows.

    Raises:
        ValueError: cu_seq_lens that do not cover the batch or do not increase; cu_seq_lens and
            restarting position_ids that disagree; position_ids that restart between two real tokens
            while a 2D attention_mask is given (transformers would then ignore the documents and attend
            across them; ds_longseq refuses to guess).
    """
    doc_start = _doc_start(position_ids, attention_mask, batch_size, seq_len, cu_seq_lens_q, cu_seq_lens_k)
    if doc_start is not None and position_ids is None:
        position_ids = torch.arange(seq_len, device=doc_start.device) - doc_start
    return doc_start, position_ids


def doc_starts(*args, **kwargs) -> torch.Tensor | None:
    """The doc_start of :func:`find_documents` (same arguments), without the position ids."""
    return find_documents(*args, **kwargs)[0]


def _doc_start(position_ids, attention_mask, batch_size: int, seq_len: int, cu_seq_lens_q, cu_seq_lens_k):
    varlen = cu_seq_lens_q is not None or cu_seq_lens_k is not None
    device = position_ids.device if position_ids is not None else None
    pos_starts = None
    if position_ids is not None and seq_len > 1:
        pos_starts = _starts_from_positions(position_ids.to(torch.int64)).expand(batch_size, seq_len)
    if varlen:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("cu_seq_lens_q/k come with an attention_mask that has padding: the packed (varlen) form "
                             "has no padding. Drop the attention_mask (a padding tail then is one more document "
                             "whose labels are -100), or drop cu_seq_lens_* and pad one document per row")
        starts = _starts_from_cu_seqlens(cu_seq_lens_q, cu_seq_lens_k, batch_size, seq_len,
                                         device if device is not None else attention_mask.device
                                         if attention_mask is not None else "cpu")
        if pos_starts is not None and bool(pos_starts[:, 1:].any()):
            if not torch.equal(pos_starts.to(starts.device)[:, 1:], starts[:, 1:]):
                raise ValueError("cu_seq_lens_q and the restarting position_ids mark different document boundaries: "
                                 "pass position_ids that restart at 0 at every cu_seq_lens boundary (the flattening "
                                 "collator's return_position_ids=True), or only one of the two")
        return _starts_to_doc_start(starts)
    if pos_starts is None:
        return None
    restarts = pos_starts[:, 1:]
    if attention_mask is not None:
        if bool(attention_mask.all()):
            # An all-ones mask beside restarting positions: transformers would ignore the documents.
            if bool(restarts.any()):
                raise ValueError(
                    "position_ids restart inside a row (packed documents) but an attention_mask without padding is "
                    "also given: with a mask, transformers ignores the documents and attends across them. Drop "
                    "attention_mask for packed rows (ds_longseq then keeps every document separate)"
                )
            return None
        valid = attention_mask.to(device=restarts.device, dtype=torch.bool)
        if bool((restarts & valid[:, 1:] & valid[:, :-1]).any()):
            raise ValueError(
                "position_ids restart between two real tokens of a padded row (packed documents together with a "
                "padding attention_mask): drop attention_mask for packed rows (pad the tail as one more document "
                "with labels -100), or put one document per row"
            )
        return None  # restarts only next to padding: positions of a left/right-padded row
    if not bool(restarts.any()):
        return None
    return _starts_to_doc_start(pos_starts)


def mask_document_starts(labels: torch.Tensor, doc_start: torch.Tensor | None, ignore_index: int = -100):
    """``labels`` (B, T) with ``ignore_index`` at every document's first token (a copy; unchanged when
    ``doc_start`` is None), so that after the causal shift no token predicts across a boundary."""
    if doc_start is None:
        return labels
    T = labels.shape[-1]
    is_start = doc_start.to(labels.device) == torch.arange(T, device=labels.device)
    return labels.masked_fill(is_start.expand_as(labels), ignore_index)
