"""StreamBP keeps each layer's attention output for its backward (``streambp.keep_attention_output``, issue 61 item 1).

Kept, the backward's chunk replay runs the attention's backward alone: no attention forward in the replay. Checked:

- the replay's attention forwards are counted (none kept, one per chunk-attention call not kept), and the two
  settings give bitwise the same loss and gradients (the kept output is the very tensor the replay would compute);
- float64 exactness against the stock model (1e-10, the family sweep's tolerance) with the outputs kept and with
  them recomputed, on the families whose attention has each feature the kept path carries: GQA, a key norm (the
  replay reusing captured keys), logit softcaps and sliding windows (Gemma 2), attention sinks (gpt-oss), multi-head
  latent attention's whole-cache mode (DeepSeek-V3), chunked attention (Llama 4), cross-layer K/V sharing (Gemma 4);
  packed documents; a hybrid whose linear-attention layers keep replaying (Qwen3.5);
- "auto": kept when the tier has room, recomputed when it has not (the layers replay as before), and the log says so.

The rest of the suite runs StreamBP with the default "auto", which keeps on this machine: the family sweep (every
family, its published dropouts included), the offload tiers, sequence parallelism (Ulysses, Ulysses x ring) and the
dropout mask-replay tests all run the kept path.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch

import ds_longseq
import ds_longseq.ops.chunk_attention as chunk_attention
import ds_longseq.ops.streambp_autograd as streambp_autograd
from tests import model_sweep
from tests.helpers import make_batch, make_model

STREAMBP = {"streambp": {"enabled": True, "chunk_size": 10}, "lm_head": {"enabled": True, "chunk_size": 9}}


def _section(keep) -> dict:
    return {**STREAMBP, "streambp": {**STREAMBP["streambp"], "keep_attention_output": keep}}


@contextlib.contextmanager
def _replay_attention_forwards():
    """Within: ``counts["replay"]`` counts the chunk attention's forward computations run inside StreamBP's chunk
    replays (the backward), ``counts["all"]`` all of them."""
    counts = {"replay": 0, "all": 0}
    replaying = {"depth": 0}
    compute, phase = chunk_attention._attention_forward, streambp_autograd.phase

    def counted(*args, **kwargs):
        counts["all"] += 1
        counts["replay"] += replaying["depth"] > 0
        return compute(*args, **kwargs)

    @contextlib.contextmanager
    def tracked(name):
        with phase(name):
            replaying["depth"] += name == "streambp.replay"
            try:
                yield
            finally:
                replaying["depth"] -= name == "streambp.replay"

    chunk_attention._attention_forward, streambp_autograd.phase = counted, tracked
    try:
        yield counts
    finally:
        chunk_attention._attention_forward, streambp_autograd.phase = compute, phase


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_replay_runs_no_attention_forward_and_gives_the_same_bits():
    model, batch = make_model("llama", torch.float64), make_batch(seq_len=37)  # 4 chunks, the last one short
    results = {}
    for keep in (True, False):
        ours = ds_longseq.enable(copy.deepcopy(model), _section(keep))
        _step(ours, batch)  # the first forward's one-time probes
        with _replay_attention_forwards() as counts:
            results[keep] = _step(ours, batch)
        # 2 layers x 4 chunks: each chunk's attention runs once in the forward, and once more in the replay unless kept
        assert counts == ({"replay": 0, "all": 8} if keep else {"replay": 8, "all": 16}), (keep, counts)
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(results[True][1][n], results[False][1][n]) for n in results[False][1])


@pytest.mark.parametrize("model_type", [
    "llama", "qwen3", "gemma2", "gpt_oss", "deepseek_v3", "llama4_text", "gemma4_text", "qwen3_5_text"])
@pytest.mark.parametrize("keep", [True, False])
def test_exact_against_the_stock_model(model_type, keep, monkeypatch):
    monkeypatch.setitem(model_sweep.MODES, "streambp", {
        **model_sweep.MODES["streambp"],
        "streambp": {**model_sweep.MODES["streambp"]["streambp"], "keep_attention_output": keep}})
    with _replay_attention_forwards() as counts:
        result = model_sweep.check_family(model_type, "streambp")
    assert result.outcome == "exact", result
    if keep and model_type != "qwen3_5_text":  # every attention layer kept its outputs (one forward: no probe left)
        assert counts["replay"] == 0, counts
    if not keep:
        assert counts["replay"] > 0, counts


def test_packed_documents_kept_bitwise_as_recomputed():
    """Packed rows (restarting position_ids; documents crossing chunk boundaries, a one-token document): the kept
    outputs give the recomputing replay's loss and gradients bitwise (that path is checked against every document run
    alone through the stock model in tests/test_packing.py), with no attention forward in the replay."""
    from tests.test_packing import DOCS, packed_batch

    model = make_model("llama", torch.float64)
    batch = {**packed_batch(DOCS, "position_ids", collator_labels=True)[0], "use_cache": False}
    results = {}
    for keep in (True, False):
        ours = ds_longseq.enable(copy.deepcopy(model), _section(keep))
        _step(ours, batch)
        with _replay_attention_forwards() as counts:
            results[keep] = _step(ours, batch)
        assert (counts["replay"] == 0) == keep, counts
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(results[True][1][n], results[False][1][n]) for n in results[False][1])


def test_auto_keeps_where_the_tier_has_room(monkeypatch, caplog):
    """"auto" decides at each training forward from the free memory: kept with room to spare, recomputed (the replay
    runs the attention forward again, exactly as before) where the outputs would not fit, saying which in the log."""
    import ds_longseq.forwards.keep_attention as keep_attention

    model, batch = make_model("llama", torch.float64), make_batch(seq_len=37)
    ours = ds_longseq.enable(copy.deepcopy(model), _section("auto"))
    caplog.set_level(logging.INFO, logger="ds_longseq")
    _step(ours, batch)
    with _replay_attention_forwards() as counts:
        roomy = _step(ours, batch)
    assert counts["replay"] == 0
    monkeypatch.setattr(keep_attention, "free_bytes", lambda device: 1024)  # no room at all
    with _replay_attention_forwards() as counts:
        tight = _step(ours, batch)
    assert counts["replay"] == 8
    assert "keep_attention_output auto: not kept" in caplog.text and "keep_attention_output auto: kept" in caplog.text
    assert torch.equal(roomy[0], tight[0]) and all(torch.equal(roomy[1][n], tight[1][n]) for n in roomy[1])


def test_the_planner_and_the_automatic_chunk_count_the_kept_bytes():
    """Per token and kept layer: every head's output (heads x head dim) and a log-sum-exp per head; the automatic
    chunk size counts them as held on the device when they are kept there."""
    from ds_longseq.families.dims import ModelDims
    from ds_longseq.forwards.auto_chunk import AutoChunkSettings, AutoChunkSize
    from ds_longseq.forwards.keep_attention import KeepAttentionOutput

    dims = ModelDims.from_config(make_model("llama", torch.float64).config)
    assert dims.attention_output_bytes(8) == 4 * (16 * 8 + 8)  # 4 heads of 16, float64, float64 log-sum-exp
    assert dims.attention_output_bytes(2) == 4 * (16 * 2 + 4)  # bf16 outputs, float32 log-sum-exp
    # Qwen3-4B-shaped: the output is heads x head dim (4096), not the hidden size (2560)
    qwen = ModelDims.from_config({"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936})
    assert qwen.attention_output_bytes(2) == 32 * (128 * 2 + 4) > 2560 * 2
    from ds_longseq.config import LongSeqConfig

    estimator = AutoChunkSize(dims, AutoChunkSettings.of(LongSeqConfig.from_dict(_section("auto"))))
    keep = KeepAttentionOutput(True, dims, num_layers=2, estimator=estimator, chunk_size=10)
    estimator.keep = keep
    with_outputs = estimator.kept_bytes(2, 1000, 8, 0)
    assert with_outputs - estimator.kept_bytes(2, 1000, 8, 0, count_kept_outputs=False) == 2 * 2 * 1000 * (
        dims.attention_output_bytes(8))
    keep.chosen = False
    assert estimator.kept_bytes(2, 1000, 8, 0) == estimator.kept_bytes(2, 1000, 8, 0, count_kept_outputs=False)


def test_the_layer_inputs_kept_every_kth_keep_their_outputs_alone():
    """Under offload.keep_every = 2 a layer whose input is rebuilt in backward recomputes its attention too (its
    outputs would hold as much memory as the input keep_every saves): 3 of 5 layers replay without a forward."""
    model, batch = make_model("llama", torch.float64, num_layers=5), make_batch(seq_len=37)
    reference = model_sweep._loss_and_grads(model, batch)
    ours = ds_longseq.enable(copy.deepcopy(model), {**_section(True), "offload": {"keep_every": 2}})
    _step(ours, batch)
    with _replay_attention_forwards() as counts:
        result = model_sweep._loss_and_grads(ours, batch)
    assert model_sweep.worst_error(result, reference)[1] < model_sweep.TOLERANCE
    assert counts["replay"] == 2 * 4  # layers 1 and 3 (inputs rebuilt), 4 chunks each
