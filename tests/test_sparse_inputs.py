"""``long_seq.offload.keep_every``: keep every k-th layer's input, rebuild the others in backward.

Exact: float64 against the stock model at 1e-10 and bitwise against StreamBP keeping every input, for k dividing
the layer count and not, k = L, with the kept inputs on the device and in host memory, with packed documents and
padding, over two steps. What is stored: ceil(L / k) inputs kept, the others freed after the forward (weak
references die), rebuilt once per block in backward; mini_seq's per-layer checkpoints likewise, dropout masks
replayed. Under DeepSpeed ZeRO-2 and ZeRO-3 (2 ranks) against plain autograd; under sequence parallelism bitwise
against StreamBP. Refusals: k < 1, k > L, without StreamBP or mini_seq, a second backward.
"""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

import ds_longseq
from ds_longseq import LongSeqConfigError
from ds_longseq.ops import SparseInputs
from tests.helpers import clone, compare, layer_input_offload, loss_and_grads, make_batch, make_model

STREAMBP = {
    "streambp": {"enabled": True, "chunk_size": 8}, "attention": {"kv_block_size": 6},
    "lm_head": {"enabled": True, "chunk_size": 7},
}
LAYERS = 5


def count_reforwards(setattr_fn=setattr) -> list:
    """Patch ``ops.sparse_inputs.recompute`` (through ``setattr_fn``: monkeypatch.setattr in a test) so every
    re-forward that rebuilds a dropped input appends to the returned list."""
    from ds_longseq.ops import sparse_inputs

    counts, orig = [], sparse_inputs.recompute

    def counted(*args, **kwargs):
        r = orig(*args, **kwargs)
        return sparse_inputs.Recompute(lambda x: counts.append(1) or r.forward(x))

    setattr_fn(sparse_inputs, "recompute", counted)
    return counts


def _sparse(k: int, host: bool = False) -> dict:
    return {**STREAMBP, "offload": {"keep_every": k, **({"layer_inputs": "cpu"} if host else {})}}


def _bitwise(a, b):
    # by construction: a dropped input is rebuilt by re-running the same layer forwards on the same kept input, so
    # every kernel, the rebuilt layers' included, sees the same operands as with every input kept
    (la, ga, ea), (lb, gb, eb) = a, b
    assert torch.equal(la, lb) and torch.equal(ea, eb) and set(ga) == set(gb)
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def _packed_batch(seq_len: int = 37):
    """One row of three documents: position_ids restart at each document's start, no attention_mask."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (1, seq_len), generator=g)
    lengths = (11, 17, seq_len - 28)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}


@pytest.mark.parametrize("k,host", [(2, False), (3, True), (LAYERS, False), (2, True)])
@pytest.mark.kernel_paths
def test_keep_every_is_exact(k, host):
    model = make_model("llama", torch.float64, num_layers=LAYERS)
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    every = ds_longseq.enable(clone(model), STREAMBP)
    sparse = ds_longseq.enable(clone(model), _sparse(k, host))
    for _ in range(2):  # the second step: fresh storage, pooled host slabs reused
        ours = loss_and_grads(sparse, batch)
        assert max(compare(ours, ref).values()) < 1e-10  # float64 round-off over 5 layers: ~1e-15
        _bitwise(ours, loss_and_grads(every, batch))  # the same kernels on the same values


@pytest.mark.kernel_paths
def test_keep_every_with_packed_documents_and_float32():
    model = make_model("qwen3", torch.float32, num_layers=4)
    batch = _packed_batch()
    _bitwise(loss_and_grads(ds_longseq.enable(clone(model), _sparse(3)), batch),
             loss_and_grads(ds_longseq.enable(clone(model), STREAMBP), batch))


def _storage_after_forward(model, batch):
    """(the forward's SparseInputs, whether each layer's input is still alive after the forward, loss)."""
    offload = layer_input_offload(model)
    store = []
    grab = model.model.register_forward_hook(lambda *a: store.append(offload.current), prepend=True)
    refs = []
    pre = [layer.register_forward_pre_hook(
        lambda mod, args, kwargs, refs=refs: refs.append(weakref.ref(kwargs.get("hidden_states", args[0] if args
                                                                                else None))), with_kwargs=True)
        for layer in model.model.layers]
    loss = model(**batch).loss
    for h in (grab, *pre):
        h.remove()
    gc.collect()
    return store[0], [r() is not None for r in refs], loss


@pytest.mark.parametrize("k", [2, 3])
def test_only_every_kth_input_is_kept_and_the_rest_freed(k, monkeypatch):
    reforwards = count_reforwards(monkeypatch.setattr)
    model = ds_longseq.enable(make_model("llama", torch.float32, num_layers=LAYERS), _sparse(k)).train()
    store, alive, loss = _storage_after_forward(model, make_batch())
    kept = math.ceil(LAYERS / k)
    assert isinstance(store, SparseInputs) and (store.num_kept, store.num_dropped) == (kept, LAYERS - kept)
    assert alive == [i % k == 0 for i in range(LAYERS)]  # the dropped inputs' memory is free
    assert reforwards == []
    loss.backward()
    assert store.num_kept == store.num_dropped == 0  # every input handed back
    assert len(reforwards) == LAYERS - kept  # each dropped input rebuilt once: one block re-run per block


def test_a_changed_input_between_layers_is_kept():
    """Only an input that IS the previous layer's output may be dropped."""
    store = SparseInputs(2)
    x0, y0 = torch.ones(2), torch.full((2,), 2.0)
    h0 = store.save(x0)
    store.produced(y0, None)
    h1 = store.save(y0 * 1)  # another tensor with the same values: kept
    assert h0.kept and h1.kept and store.num_kept == 2
    store.produced(torch.zeros(2), None)
    y2 = torch.zeros(2)
    store.produced(y2, None)
    with pytest.raises(ValueError, match="keep_every must be >= 1"):
        SparseInputs(0)


def test_second_backward_is_refused():
    # without the chunked head, which refuses a second backward itself (its gradient is formed in forward)
    config = {**_sparse(2), "lm_head": {"enabled": False}}
    model = ds_longseq.enable(make_model("llama", torch.float32, num_layers=4), config).train()
    loss = model(**make_batch()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="keep_every was already used"):
        loss.backward()


def test_bad_keep_every_is_refused():
    model = make_model("llama", torch.float32, num_layers=4)
    with pytest.raises(LongSeqConfigError, match="keep_every must be a positive integer"):
        ds_longseq.enable(clone(model), _sparse(0))
    with pytest.raises(LongSeqConfigError, match="larger than the model's 4 decoder layers"):
        ds_longseq.enable(clone(model), _sparse(5))
    with pytest.raises(LongSeqConfigError, match="needs long_seq.streambp or long_seq.mini_seq"):
        ds_longseq.enable(clone(model), {"lm_head": {"enabled": True}, "offload": {"keep_every": 2}})
    assert ds_longseq.enable(clone(model), _sparse(1)) is not None  # 1: today's behaviour


def sparse_train_worker(rank: int, stage: int, config: dict):
    """test_engine_dist's training worker, counting the re-forwards that rebuild dropped inputs."""
    from tests.test_engine_dist import train_worker

    reforwards = count_reforwards()
    return {**train_worker(rank, stage, 1, False, config), "reforwards": len(reforwards)}


@pytest.mark.parametrize("stage,host", [(3, True), pytest.param(2, False, marks=pytest.mark.slow)],
                         ids=["zero3-offloaded", "zero2-device"])
def test_under_deepspeed_matches_the_single_process_reference(stage, host):
    """2 gloo ranks through ds_longseq.engine.initialize, different data per rank: the dropped input is rebuilt
    (counted: once per step; under ZeRO-3 the next layer gets a detached alias of the output, which counts as the
    output) with the rebuilt layer's partitioned parameters gathered for the re-run; 3 SGD steps equal plain
    autograd."""
    from tests.dist_utils import run_distributed
    from tests.test_engine_dist import STREAMBP as ENGINE_STREAMBP
    from tests.test_engine_dist import reference_run

    config = {**ENGINE_STREAMBP, "offload": {"keep_every": 2, **({"layer_inputs": "cpu"} if host else {})}}
    results = run_distributed(sparse_train_worker, 2, (stage, config))
    reference = reference_run(2, 1, False)
    assert [r["reforwards"] for r in results] == [3, 3]  # 2 layers, k = 2: layer 1's input rebuilt each step
    for name, ref in reference.items():
        for rank, result in enumerate(results):
            err = ((result["params"][name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (name, rank, err)  # float32 round-off over 3 SGD steps, as test_engine_dist


def sp_sparse_worker(rank: int, world: int):
    """Per head count: 4 heads (Ulysses alone), 3 heads (a ring of ``world``, the batch cut by its layout)."""
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from tests.helpers import full_precision_norms
    from tests.test_sequence_parallel import SP_CASES, global_batch

    reforwards = count_reforwards()
    out = {}
    for heads in (4, 3):
        shape = {} if heads == 4 else {"hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
        local = shard_batch(global_batch(), rank, world, ring=1 if heads == 4 else world)
        before, results = len(reforwards), []
        for extra in ({}, {"offload": {"keep_every": 2}}, {"offload": {"keep_every": 3, "layer_inputs": "cpu"}}):
            model = full_precision_norms(make_model("llama", torch.float64, num_layers=4, **shape))
            cfg = {**SP_CASES["streambp"], **extra, "sequence_parallel": {"size": world}}
            ds_longseq.enable(model, cfg, sp_group=dist.group.WORLD).train()
            results.append(loss_and_grads(model, local))
            ds_longseq.disable(model)  # the next head count's layout is another one (a ring)
        plain = results[0]
        same = []  # bitwise by construction (see _bitwise): rebuilt inputs are the same kernels on the same values
        for r in results[1:]:
            same.append(torch.equal(r[0], plain[0]) and torch.equal(r[2], plain[2])
                        and all(torch.equal(r[1][n], plain[1][n]) for n in plain[1]))
        out[heads] = {"bitwise": same, "reforwards": len(reforwards) - before}
    return out


def test_under_sequence_parallelism_is_bitwise_streambp():
    """SP 2 (the ranks exchange keys/values again when a dropped input is rebuilt), Ulysses alone (4 heads) and a ring
    of 2 (3 heads: the K/V gathered over the ring again): bitwise StreamBP under SP keeping every input, k = 2 on the
    device and k = 3 offloaded, 4 layers (2 inputs rebuilt per run, counted)."""
    from tests.dist_utils import run_distributed

    for r in run_distributed(sp_sparse_worker, world_size=2, args=(2,)):
        assert all(v["bitwise"] == [True, True] and v["reforwards"] == 4 for v in r.values()), r


@pytest.mark.kernel_paths
def test_a_hybrid_stack_rebuilds_through_its_recurrent_layers(monkeypatch):
    """Qwen3.5's Gated DeltaNet layers carry states from chunk to chunk: a rebuilt input passes through them
    (k = L: every input but the first rebuilt, counted), and the result is bitwise StreamBP keeping every input."""
    from tests import model_zoo

    reforwards = count_reforwards(monkeypatch.setattr)
    model = model_zoo.tiny_model("qwen3_5_text", torch.float64)
    assert "linear_attention" in model.config.layer_types
    batch = make_batch(seq_len=40, pad=False)
    layers = len(model.model.layers)
    _bitwise(loss_and_grads(ds_longseq.enable(clone(model), {**_sparse(layers), "streambp": {
        "enabled": True, "chunk_size": 13}}), batch),
        loss_and_grads(ds_longseq.enable(clone(model), {**STREAMBP, "streambp": {"enabled": True, "chunk_size": 13}}),
                       batch))
    assert len(reforwards) == layers - 1


MST = {"mini_seq": {"enabled": True, "mlp_num_chunks": 4}, "lm_head": {"enabled": True, "chunk_size": 9}}


@pytest.mark.parametrize("k,host", [(2, True), (3, False)])
@pytest.mark.kernel_paths
def test_mini_seq_layer_checkpoints_keep_every(k, host, monkeypatch):
    """mini_seq's per-layer checkpoints (as with layer_inputs): float64-exact against stock, bitwise against keeping
    every checkpoint input, the dropped ones rebuilt once each (counted)."""
    reforwards = count_reforwards(monkeypatch.setattr)
    model = make_model("llama", torch.float64, num_layers=LAYERS)
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    offload = {"layer_inputs": "cpu"} if host else {}
    every = ds_longseq.enable(clone(model), {**MST, "offload": {"layer_inputs": "cpu"}}).train()
    sparse = ds_longseq.enable(clone(model), {**MST, "offload": {"keep_every": k, **offload}}).train()
    ours = loss_and_grads(sparse, batch)
    assert max(compare(ours, ref).values()) < 1e-10
    _bitwise(ours, loss_and_grads(every, batch))
    assert len(reforwards) == LAYERS - math.ceil(LAYERS / k)


def test_mini_seq_rebuild_replays_dropout(monkeypatch):
    """Attention dropout: the rebuilt layer draws the forward's masks again (its RNG state replayed), so the
    gradients equal the stock model's drawing the same masks. No lm_head section: keep_every alone makes a training
    call cache-free, as layer_inputs does (else the layers would run their stock forward and keep everything)."""
    reforwards = count_reforwards(monkeypatch.setattr)
    model = make_model("llama", torch.float64, num_layers=4, attention_dropout=0.3).train()
    batch = make_batch()
    sparse = ds_longseq.enable(clone(model), {"mini_seq": {"enabled": True, "mlp_num_chunks": 3},
                                              "offload": {"keep_every": 2}})
    torch.manual_seed(7)
    ref = loss_and_grads(model, batch)
    torch.manual_seed(7)
    assert max(compare(loss_and_grads(sparse, batch), ref).values()) < 1e-10
    assert len(reforwards) == 2


def test_offloaded_keep_every_pools_one_kth_of_the_inputs():
    """benchmarks.sparse_host's measurement: the pinned pool holds ceil(L / k) inputs (1 MiB each here)."""
    from benchmarks.sparse_host import measure

    assert [measure(512, k)["pool_mib"] for k in (1, 2, 4)] == [4.0, 2.0, 1.0]
