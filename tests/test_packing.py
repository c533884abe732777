"""Packed documents and sliding windows through whole models, against the stock Hugging Face model.

Packed rows are compared with every document run ALONE through the stock model: the losses summed
over the same tokens, and every gradient (the input gradient of each document's tokens, every
parameter), in float64 to 1e-10. Both packed forms are covered: restarting ``position_ids``
(TRL's padding_free) and ``cu_seq_lens_q/k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``).
"""

import sys

import pytest
import torch
import torch.nn.functional as F

import ds_longseq
from tests.helpers import VOCAB, clone, compare, loss_and_grads, make_model

STREAMBP = {
    "streambp": {"enabled": True, "chunk_size": 5}, "attention": {"kv_block_size": 3},
    "lm_head": {"enabled": True, "chunk_size": 7},
}
CONFIGS = {
    "streambp+lm_head": STREAMBP,
    "streambp": {"streambp": {"enabled": True, "chunk_size": 8}, "attention": {"kv_block_size": 6}},
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}},
    "lm_head": {"lm_head": {"enabled": True, "chunk_size": 6}},
}
# Per row: a 1-token document, documents crossing chunk (5) and key-tile (3) boundaries.
DOCS = [[1, 9, 7, 12, 8], [14, 1, 22]]


def packed_batch(docs_per_row, form: str, collator_labels: bool, seed: int = 3):
    """(batch, documents): rows of concatenated documents in one of the packed forms."""
    g = torch.Generator().manual_seed(seed)
    rows, positions, labels, documents = [], [], [], []
    for lengths in docs_per_row:
        ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
        documents += ids
        rows.append(torch.cat(ids))
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        lab = [d.clone() for d in ids]
        if collator_labels:  # DataCollatorWithFlattening: -100 on every document's first label
            for d in lab:
                d[0] = -100
        labels.append(torch.cat(lab))
    batch = {"input_ids": torch.stack(rows), "labels": torch.stack(labels)}
    if form in ("position_ids", "cu_seq_lens+position_ids"):
        batch["position_ids"] = torch.stack(positions)
    if form in ("cu_seq_lens", "cu_seq_lens+position_ids"):
        lengths = torch.tensor([n for row in docs_per_row for n in row])
        cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=int(lengths.max()),
                     max_length_k=int(lengths.max()))
    return batch, documents


def documents_alone(model, documents, labels=None):
    """Loss and gradients of every document run alone through the stock model, summed over the same
    targets (each document's tokens but its first, or the given per-document ``labels`` but the first
    of each), in float64."""
    model.zero_grad(set_to_none=True)
    embeds = []

    def keep(module, inputs, output):
        output.retain_grad()
        embeds.append(output)

    h = model.get_input_embeddings().register_forward_hook(keep)
    total, count = 0.0, 0
    try:
        for i, ids in enumerate(documents):
            logits = model(input_ids=ids.unsqueeze(0), use_cache=False).logits.double()[0]
            targets = (ids if labels is None else labels[i])[1:]
            if (targets != -100).any():
                total = total + F.cross_entropy(logits[:-1], targets, reduction="sum", ignore_index=-100)
                count += int((targets != -100).sum())
        loss = total / count
        loss.backward()
    finally:
        h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    # a 1-token document predicts nothing: its input gradient is zero (no grad at all here)
    return loss.detach(), grads, torch.cat([torch.zeros_like(e[0]) if e.grad is None else e.grad[0] for e in embeds])


def packed_run(model, batch, own_loss: bool = True):
    """Loss and gradients of the packed batch. ``own_loss=False`` (paths that keep the stock loss,
    which transformers computes in float32): the float64 loss from the returned logits instead, with
    the collator's labels (-100 at each document's first token)."""
    if own_loss:
        loss, grads, gin = loss_and_grads(model, batch)
    else:
        loss, grads, gin = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    return loss, grads, gin.reshape(-1, gin.shape[-1])  # rows flattened: the documents in order


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("form", ["position_ids", "cu_seq_lens+position_ids", "cu_seq_lens"])
def test_packed_rows_match_documents_alone_float64(config, form):
    model = make_model("qwen3", torch.float64)
    batch, documents = packed_batch(DOCS, form, collator_labels=True)
    ref = documents_alone(model, documents)
    own_loss = "lm_head" in CONFIGS[config]
    errs = compare(packed_run(ds_longseq.enable(clone(model), CONFIGS[config]), batch, own_loss), ref)
    assert max(errs.values()) < 1e-10, errs


@pytest.mark.parametrize("collator_labels", [True, False])
def test_no_target_crosses_a_document_boundary(collator_labels):
    """Labels with or without the collator's -100 on each document's first token train the same
    targets: the last token of a document never predicts the next document's first token."""
    model = make_model("llama", torch.float64)
    batch, documents = packed_batch(DOCS[:1], "position_ids", collator_labels)
    ref = documents_alone(model, documents)
    errs = compare(packed_run(ds_longseq.enable(clone(model), STREAMBP), batch), ref)
    assert max(errs.values()) < 1e-10, errs


def test_packed_row_float32_against_stock_packed():
    """The stock model itself (SDPA) keeps documents apart for restarting position_ids without a
    mask, but only without a cache (with config.use_cache, its default, it attends across them);
    ds_longseq agrees with it (float32), on the mistral family (GQA)."""
    model = make_model("mistral", torch.float32)
    batch, _ = packed_batch(DOCS, "position_ids", collator_labels=True)
    ref = loss_and_grads(model, dict(batch, use_cache=False))
    ours = loss_and_grads(ds_longseq.enable(clone(model), STREAMBP), batch)
    assert max(compare(ours, ref).values()) < 1e-5


@pytest.mark.parametrize("chunk", [4, 6, 9])
def test_sliding_window_shorter_than_sequence_matches_stock_float64(chunk):
    """Mistral with a window of 6 on 37 tokens: chunks of 4 and 9 straddle it, 6 equals it."""
    model = make_model("mistral", torch.float64, sliding_window=6)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 37), generator=g)
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, 33:] = 0  # padding as well
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    config = {"streambp": {"enabled": True, "chunk_size": chunk}, "attention": {"kv_block_size": 4},
              "lm_head": {"enabled": True, "chunk_size": 10}}
    errs = compare(loss_and_grads(ds_longseq.enable(clone(model), config), batch), ref)
    assert max(errs.values()) < 1e-10, errs


def test_sliding_window_on_packed_documents_float64():
    model = make_model("mistral", torch.float64, sliding_window=5)
    batch, documents = packed_batch(DOCS, "position_ids", collator_labels=True)
    ref = documents_alone(model, documents)
    errs = compare(packed_run(ds_longseq.enable(clone(model), STREAMBP), batch), ref)
    assert max(errs.values()) < 1e-10, errs


def _bad(batch, **changes):
    batch = dict(batch)
    batch.update(changes)
    return batch


@pytest.mark.parametrize("config", ["streambp+lm_head", "mini_seq"])
@pytest.mark.parametrize(
    "case, match",
    [
        ("short_cu", "does not cover the batch"),
        ("decreasing_cu", "increase strictly"),
        ("cu_q_ne_k", "differ"),
        ("cu_vs_positions", "different document boundaries"),
        ("ones_mask_with_restarts", "transformers ignores the documents"),
        ("padding_mask_with_restarts", "between two real tokens"),
        ("cu_with_padding", "has no padding"),
    ],
)
def test_bad_packed_input_is_refused_before_compute(config, case, match):
    model = ds_longseq.enable(make_model("llama", torch.float32), CONFIGS[config])
    batch, _ = packed_batch(DOCS[:1], "cu_seq_lens+position_ids", collator_labels=True)
    T = batch["input_ids"].shape[1]
    cu = batch["cu_seq_lens_q"]
    decreasing = torch.tensor([0, 9, 3, T])
    plain = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    bad = {
        "short_cu": _bad(batch, cu_seq_lens_q=cu[:-1], cu_seq_lens_k=cu[:-1]),
        "decreasing_cu": _bad(batch, cu_seq_lens_q=decreasing, cu_seq_lens_k=decreasing),
        "cu_q_ne_k": _bad(batch, cu_seq_lens_k=torch.tensor([0, T])),
        "cu_vs_positions": _bad(batch, position_ids=torch.cat([torch.arange(4), torch.arange(T - 4)]).unsqueeze(0)),
        "ones_mask_with_restarts": _bad(plain, attention_mask=torch.ones(1, T, dtype=torch.long)),
        "padding_mask_with_restarts": _bad(
            plain, attention_mask=torch.cat([torch.ones(1, T - 2), torch.zeros(1, 2)], 1).long()
        ),
        "cu_with_padding": _bad(batch, attention_mask=torch.cat([torch.ones(1, T - 2), torch.zeros(1, 2)], 1).long()),
    }[case]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        model(**bad)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # untouched: bitwise


def test_qwen2_sliding_layers_mixed_with_full_layers_float64():
    """Qwen2 with use_sliding_window: layer 0 full attention, layer 1 a window of 5 (straddled by
    chunks of 4), on padded rows, against the stock model."""
    model = make_model("qwen2", torch.float64, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, 29), generator=g)
    mask = torch.ones(2, 29, dtype=torch.long)
    mask[0, :3] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    config = {"streambp": {"enabled": True, "chunk_size": 4}, "attention": {"kv_block_size": 3},
              "lm_head": {"enabled": True, "chunk_size": 10}}
    errs = compare(loss_and_grads(ds_longseq.enable(clone(model), config), batch), ref)
    assert max(errs.values()) < 1e-10, errs


def _count_document_finds(monkeypatch) -> list[int]:
    """Count the calls of ``ops.documents.find_documents`` (the one entry point that finds packed documents)
    from every ds_longseq module that imported it."""
    from ds_longseq.ops import documents as packing

    original, calls = packing.find_documents, []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("ds_longseq") and getattr(module, "find_documents", None) is original:
            monkeypatch.setattr(module, "find_documents", counting)
            patched.append(name)
    assert {"ds_longseq.forwards.causal_lm", "ds_longseq.forwards.streambp_layer"} <= set(patched), patched
    return calls


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("form", ["position_ids", "cu_seq_lens", "not_packed"])
def test_documents_are_found_once_per_forward(monkeypatch, config, form):
    """One forward + backward of a 2-layer model finds the documents once (in the model forward),
    not again in every StreamBP layer: ``find_documents`` validates with host syncs. Rows that are not
    packed too (the layers would otherwise look for documents in their arange positions)."""
    model = ds_longseq.enable(make_model("llama", torch.float32, num_layers=2), CONFIGS[config])
    if form == "not_packed":
        batch = {k: v for k, v in packed_batch(DOCS, "position_ids", collator_labels=True)[0].items()
                 if k in ("input_ids", "labels")}
    else:
        batch, _ = packed_batch(DOCS, form, collator_labels=True)
    calls = _count_document_finds(monkeypatch)
    model(**batch).loss.backward()
    assert len(calls) == 1


def test_base_model_called_directly_finds_documents_in_each_layer(monkeypatch):
    """Without CausalLMForward (``model.model(...)`` directly) each StreamBP layer finds the documents
    itself, and they stay apart: the hidden states match the stock base model's (which keeps
    documents apart for restarting position_ids without a mask and without a cache)."""
    model = make_model("llama", torch.float64, num_layers=2)
    batch, _ = packed_batch(DOCS, "position_ids", collator_labels=True)
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    ref = model.model(**inputs).last_hidden_state
    ours = ds_longseq.enable(clone(model), STREAMBP)
    calls = _count_document_finds(monkeypatch)
    out = ours.model(**inputs).last_hidden_state
    assert len(calls) == 2  # one per layer
    assert (out - ref).abs().max() < 1e-10
