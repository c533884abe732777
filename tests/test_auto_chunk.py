"""``long_seq.streambp.chunk_size: "auto"``: the largest chunk whose work fits the memory budget, at every forward.

The choice (whole sequence when it fits, else the largest power of two, never below ``MIN_CHUNK``; smaller budgets
never give larger chunks), the budget from ``auto_budget_gib`` or from free memory less what the forward keeps,
exactness (float64 against the stock model, bitwise against the same chunk size set by hand) with one chunk and
streamed, the local shard's length under sequence parallelism, and refusals. Whether the analytic model holds
against measured memory is benchmarks/auto_chunk.py's question, not a test's.
"""

from __future__ import annotations

import pytest
import torch

import ds_longseq
from ds_longseq import LongSeqConfigError
from ds_longseq.families.dims import ModelDims
from ds_longseq.forwards import auto_chunk
from ds_longseq.forwards.auto_chunk import AutoChunkSettings, AutoChunkSize
from ds_longseq.ops.chunk_sizes import MIN_CHUNK, choose_chunk_size
from tests.helpers import clone, compare, loss_and_grads, make_batch, make_model

SEQ = 300  # above MIN_CHUNK: "auto" can stream (128 or 256) or take the whole sequence
HEAD = {"lm_head": {"enabled": True, "chunk_size": 64}}


def _auto(**extra) -> dict:
    return {"streambp": {"enabled": True, "chunk_size": "auto", **extra}, **HEAD}


def _fixed(chunk: int) -> dict:
    return {"streambp": {"enabled": True, "chunk_size": chunk}, **HEAD}


def _hook(model) -> AutoChunkSize:
    (auto,) = [h.__self__ for h in model.model._forward_pre_hooks.values()
               if isinstance(getattr(h, "__self__", None), AutoChunkSize)]
    return auto


def _bitwise(a, b):
    # by construction: "auto" only picks the chunk size; the same chunk size set by hand runs the same kernels
    (la, ga, ea), (lb, gb, eb) = a, b
    assert torch.equal(la, lb) and torch.equal(ea, eb)
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def test_choose_chunk_size():
    assert choose_chunk_size(300, 2, 10.0, 2 * 300 * 10) == 300  # fits whole: one chunk
    assert choose_chunk_size(300, 2, 10.0, 2 * 300 * 10 - 1) == 256  # the largest power of two below 300
    assert choose_chunk_size(300, 2, 10.0, 2 * 255 * 10) == 128
    assert choose_chunk_size(300, 2, 10.0, 1.0) == MIN_CHUNK  # nothing fits: the floor
    assert choose_chunk_size(100, 1, 10.0, 1.0) == 100  # shorter than the floor: one chunk
    assert choose_chunk_size(256, 1, 10.0, 2559) == 128  # a power of two itself: the next one down
    # the CPU's speed cap: a longer sequence streams in the largest power of two up to it, a shorter one is whole
    assert choose_chunk_size(16384, 1, 10.0, 1e12, max_chunk=4096) == 4096
    assert choose_chunk_size(6000, 1, 10.0, 1e12, max_chunk=5000) == 4096
    assert choose_chunk_size(3000, 1, 10.0, 1e12, max_chunk=4096) == 3000
    assert choose_chunk_size(16384, 1, 10.0, 1024 * 10.0, max_chunk=4096) == 1024  # memory still decides below
    chunks = [choose_chunk_size(1 << 17, 1, 1000.0, budget) for budget in (1e12, 1e8, 3e7, 1e6, 1e3)]
    assert chunks == sorted(chunks, reverse=True) and chunks[0] == 1 << 17 and chunks[-1] == MIN_CHUNK
    with pytest.raises(ValueError, match="seq_len must be positive"):
        choose_chunk_size(0, 1, 1.0, 1.0)


@pytest.mark.parametrize("budget_gib,expected", [(None, SEQ), (2e-4, 128)])
@pytest.mark.kernel_paths
def test_auto_is_exact_whole_and_streamed(budget_gib, expected):
    """Free memory on this machine takes the whole sequence; a budget of ~200 KiB streams it in 128-token chunks.
    float64 against the stock model, bitwise against setting that chunk size by hand."""
    model = make_model("llama", torch.float64, num_layers=3)
    batch = make_batch(seq_len=SEQ)
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    auto = ds_longseq.enable(clone(model), _auto(**({} if budget_gib is None else {"auto_budget_gib": budget_gib})))
    ours = loss_and_grads(auto, batch)
    assert _hook(auto).last["chunk_size"] == expected
    assert all(layer.forward.chunk_size == expected for layer in auto.model.layers)
    assert max(compare(ours, ref).values()) < 1e-10  # float64 round-off over 3 layers: ~1e-15
    _bitwise(ours, loss_and_grads(ds_longseq.enable(clone(model), _fixed(expected)), batch))


def test_the_budget_from_free_memory_counts_what_the_forward_keeps(monkeypatch):
    """No auto_budget_gib: auto_free_fraction x the available memory, less the kept part (layer inputs, a layer's
    K/V and gradients, the head's chunk, gradients still to be allocated); chunks follow the available memory down
    and come back up when it returns."""
    model = ds_longseq.enable(make_model("llama", torch.float32, num_layers=3), _auto(auto_free_fraction=0.5))
    batch = make_batch(seq_len=SEQ)
    auto = _hook(model)
    dims = ModelDims.from_config(model.config)
    work = dims.chunk_work_per_token(4)  # Llama: the fused CPU kernel, no score tile
    seen = []
    for available in (1 << 40, 0, None):
        if available is not None:
            monkeypatch.setattr(auto_chunk.offload_ops, "host_available_bytes", lambda a=available: a)
        else:
            monkeypatch.undo()
        model(**batch).loss.backward()
        last = auto.last
        if available is not None:
            assert last["budget_bytes"] == pytest.approx(0.5 * available - last["kept_bytes"])
        assert last["chunk_size"] == choose_chunk_size(SEQ, 2, work, last["budget_bytes"])
        seen.append(last["chunk_size"])
    assert seen[0] == SEQ and seen[1] == MIN_CHUNK and seen[2] == SEQ
    # kept: 3 layer inputs and (keep_attention_output "auto": kept with this much memory) their layers' attention
    # outputs, one layer's K and V and their gradients, the residual gradient in and out, the head's 64-token chunk
    # over the vocabulary (float32, x3); the parameter gradients exist after the first step
    d, kv, tokens = dims.hidden_size, dims.num_kv_heads * dims.head_dim, 2 * SEQ
    assert auto.keep.chosen
    assert auto.last["kept_bytes"] == 3 * tokens * d * 4 + 3 * tokens * dims.attention_output_bytes(4) + \
        4 * tokens * kv * 4 + 2 * tokens * d * 4 + 3 * 64 * dims.vocab_size * 4


def test_auto_reports_the_largest_micro_batch_the_free_memory_fits(monkeypatch, caplog):
    """With the budget from free memory, auto also says how many such sequences one step could take at the chosen
    chunk (kept + work of n sequences within the free fraction; n + 1 not), and logs it once as advice; with a
    fixed auto_budget_gib there is no free memory to spend and it reports none."""
    model = ds_longseq.enable(make_model("llama", torch.float32, num_layers=3), _auto(auto_free_fraction=0.5))
    auto = _hook(model)
    available = 2 << 30
    monkeypatch.setattr(auto_chunk.offload_ops, "host_available_bytes", lambda: available)
    with caplog.at_level("INFO", logger="ds_longseq.forwards.auto_chunk"):
        model(**make_batch(seq_len=SEQ)).loss.backward()
        model(**make_batch(seq_len=SEQ)).loss.backward()
    last = auto.last
    n, chunk = last["max_batch_size"], last["chunk_size"]
    work = ModelDims.from_config(model.config).chunk_work_per_token(4)
    free = 0.5 * available + auto.kept_bytes(2, SEQ, 4, 0)
    assert n > 2 and auto.kept_bytes(n, SEQ, 4, 0) + n * chunk * work <= free
    assert auto.kept_bytes(n + 1, SEQ, 4, 0) + (n + 1) * chunk * work > free
    # logged once per (length, chunk); the first step's count is lower (its gradients were still to come)
    advice = [r.getMessage() for r in caplog.records if "fits a micro-batch of up to" in r.getMessage()]
    assert len(advice) == 1 and "train_micro_batch_size_per_gpu" in advice[0], advice
    fixed = ds_longseq.enable(make_model("llama", torch.float32, num_layers=3), _auto(auto_budget_gib=1.0))
    fixed(**make_batch(seq_len=SEQ)).loss.backward()
    assert _hook(fixed).last["max_batch_size"] is None


def test_offload_and_keep_every_change_what_is_kept_on_the_device():
    dims = ModelDims(hidden_size=64, intermediate_size=128, num_layers=32, num_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=100)
    kwargs = dict(budget_gib=None, free_fraction=0.8, kv_block_size=None, lm_head_chunk_size=None)
    counts = {(off, k): AutoChunkSize(dims, AutoChunkSettings(offloaded=off, keep_every=k, **kwargs))
              .inputs_on_device() for off in (False, True) for k in (1, 4, 8)}
    assert counts == {(False, 1): 32, (False, 4): 8 + 3, (False, 8): 4 + 7, (True, 1): 0, (True, 4): 4, (True, 8): 8}


def test_generation_chooses_nothing_and_no_grad_counts_no_gradients():
    """Generation passes a cache (its layers run the stock forward): nothing is chosen. A no-grad forward without a
    cache chooses, counting no parameter gradient to come; a training forward counts every missing one."""
    model = ds_longseq.enable(make_model("llama", torch.float32, num_layers=2), _auto())
    auto = _hook(model)
    with torch.no_grad():
        model.generate(make_batch(batch=1, seq_len=5, pad=False)["input_ids"], max_new_tokens=2, do_sample=False)
    assert auto.last is None
    batch = make_batch(seq_len=SEQ)
    with torch.no_grad():
        model(**batch)
    no_grad_kept = auto.last["kept_bytes"]
    model(**batch)
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    # a training forward also keeps the attention outputs (keep_attention_output "auto"; none without a backward)
    outputs = 2 * 2 * SEQ * ModelDims.from_config(model.config).attention_output_bytes(4)
    assert auto.keep.chosen and auto.last["kept_bytes"] == no_grad_kept + grads + outputs


def test_bad_auto_settings_are_refused():
    model = make_model("llama", torch.float32, num_layers=2)
    for cfg, match in (
        ({"streambp": {"enabled": True, "chunk_size": "big"}}, "chunk_size must be a positive integer"),
        ({"streambp": {"enabled": True, "chunk_size": 0}}, "chunk_size must be a positive integer"),
        ({"streambp": {"enabled": True, "chunk_size": 512, "auto_budget_gib": 4}}, "only used with chunk_size='auto'"),
        (_auto(auto_budget_gib=-1), "auto_budget_gib must be a positive number"),
        (_auto(auto_free_fraction=1.5), r"auto_free_fraction must be a fraction in \(0, 1\]"),
    ):
        with pytest.raises(LongSeqConfigError, match=match):
            ds_longseq.enable(clone(model), cfg)


def sp_auto_worker(rank: int, world: int):
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from tests.helpers import full_precision_norms

    batch = make_batch(seq_len=2 * SEQ)
    local = shard_batch(batch, rank, world)
    results, chosen = [], []
    for cfg in (_auto(auto_budget_gib=2e-4), _fixed(128)):
        model = full_precision_norms(make_model("llama", torch.float64, num_layers=2))
        ds_longseq.enable(model, {**cfg, "sequence_parallel": {"size": world}}, sp_group=dist.group.WORLD).train()
        results.append(loss_and_grads(model, local))
        if cfg["streambp"]["chunk_size"] == "auto":
            chosen.append(_hook(model).last)
    (la, ga, ea), (lb, gb, eb) = results  # bitwise by construction: the same chunk size (see _bitwise)
    same = torch.equal(la, lb) and torch.equal(ea, eb) and all(torch.equal(ga[n], gb[n]) for n in ga)
    return {"same": same, "seq_len": chosen[0]["seq_len"], "chunk": chosen[0]["chunk_size"]}


@pytest.mark.kernel_paths
def test_under_sequence_parallelism_the_local_shard_is_chunked():
    """SP 2 over 600 tokens: each rank chooses for its 300-token shard (the hook runs after the shard is cut), and
    the result is bitwise the same chunk size set by hand."""
    from tests.dist_utils import run_distributed

    for r in run_distributed(sp_auto_worker, world_size=2, args=(2,)):
        assert r == {"same": True, "seq_len": SEQ, "chunk": 128}, r


def test_score_tiles_count_only_where_attention_runs_the_math_kernel():
    """A soft-capped model (Gemma 2) runs attention's math kernel, which holds the scores and probabilities of every
    head over a key tile; the fused kernels of every other model hold none."""
    from transformers import Gemma2Config

    dims = ModelDims(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=100)
    capped = ModelDims.from_config(Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                vocab_size=100))
    assert capped.attention_softcap and not dims.attention_softcap
    assert dims.chunk_work_per_token(4, 1024) == dims.chunk_work_per_token(4)
    assert capped.chunk_work_per_token(4, 1024) - capped.chunk_work_per_token(4) == 2 * 4 * 1024 * 4


def test_a_layer_asks_the_automatic_chunk_size_and_alone_is_told_to_call_the_model():
    """Under "auto" nothing writes into the layers: each asks the model's AutoChunkSize for this forward's choice.
    A layer called on its own before any model forward has none to ask for, and says so."""
    model = ds_longseq.enable(make_model("llama", torch.float32, num_layers=2), _auto(auto_budget_gib=1.0))
    layer = model.model.layers[0]
    assert layer.forward.chunks is _hook(model)
    with pytest.raises(RuntimeError, match="call the model, not this layer on its own"):
        layer.forward.chunk_size  # noqa: B018 (the read is the test)
    model(**make_batch(seq_len=SEQ)).loss.backward()
    assert layer.forward.chunk_size == _hook(model).chosen == _hook(model).last["chunk_size"]
