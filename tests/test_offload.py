"""long_seq.offload.layer_inputs on CPU: the same bookkeeping a GPU run does, checked for exactness.

Offloading only moves the saved layer inputs to other memory and back, so StreamBP with offload must
equal StreamBP without BITWISE; MsT with offload (our layer checkpoint) must equal MsT with Hugging
Face checkpointing and the stock model to float64 round-off. Plus: the host-memory check, the
errors, what the autograd graph holds, buffer reuse across steps, and ``disable``.
"""

from __future__ import annotations

import pytest
import torch

import ds_longseq
import ds_longseq.ops.host_store as offload_ops
from ds_longseq import LongSeqConfig, LongSeqConfigError
from ds_longseq.compat import set_activation_checkpointing
from ds_longseq.forwards.layer_input_offload import HostMemoryError
from ds_longseq.ops import HostBufferPool, LayerInputOffloader, checkpoint_apply
from tests.dist_utils import run_distributed
from tests.helpers import clone, compare, layer_input_offload, loss_and_grads, make_batch, make_model

OFFLOAD = {"offload": {"layer_inputs": "cpu"}}
STREAMBP = {
    "streambp": {"enabled": True, "chunk_size": 8}, "attention": {"kv_block_size": 6},
    "lm_head": {"enabled": True, "chunk_size": 7},
}
MST = {"mini_seq": {"enabled": True, "mlp_num_chunks": 4}, "lm_head": {"enabled": True, "chunk_size": 9}}


def _handle(model):
    return model.__dict__["_ds_longseq_handle"]


def _offload(model):
    """The model's LayerInputOffload (the object the base model's hooks belong to)."""
    return layer_input_offload(model)


def _assert_bitwise(ours, ref):
    # bitwise by construction: with and without offload the same kernels run on the same operands (offload only
    # copies the saved layer inputs to host memory and back)
    loss, grads, embed_grad = ours
    ref_loss, ref_grads, ref_embed_grad = ref
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert torch.equal(embed_grad, ref_embed_grad)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


# --- StreamBP ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.kernel_paths
def test_streambp_offload_is_bitwise_streambp(arch, dtype):
    """Two training steps (the second reuses the pooled host slabs), batch 2 with left padding."""
    model = make_model(arch, dtype)
    batch = make_batch()  # row 0 left-padded, row 1 right-padded with a masked prompt
    plain = ds_longseq.enable(clone(model), STREAMBP)
    offloaded = ds_longseq.enable(clone(model), {**STREAMBP, **OFFLOAD})
    pool = _offload(offloaded).pool
    owned = []
    for _ in range(2):
        _assert_bitwise(loss_and_grads(offloaded, batch), loss_and_grads(plain, batch))
        # every slab came back after the backward, and the second step allocated none
        assert pool.free_bytes == pool.num_bytes > 0
        owned.append(pool.num_bytes)
    assert owned[0] == owned[1]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_streambp_offload_float64_against_stock(arch):
    model = make_model(arch, torch.float64)
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    errs = compare(loss_and_grads(ds_longseq.enable(clone(model), {**STREAMBP, **OFFLOAD}), batch), ref)
    # float64 round-off over a 2-layer model is ~1e-15; 1e-10 leaves room only for summation order.
    assert max(errs.values()) < 1e-10, errs


# --- MsT with offload: our layer checkpoint --------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mst_offload_matches_hf_checkpointing_and_stock(arch):
    model = make_model(arch, torch.float64)
    batch = make_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    hf_gc = ds_longseq.enable(clone(model), MST)
    set_activation_checkpointing(hf_gc, True)
    hf_gc.train()
    offloaded = ds_longseq.enable(clone(model), {**MST, **OFFLOAD}).train()
    for _ in range(2):
        ours = loss_and_grads(offloaded, batch)
        # same float64 round-off argument as above
        assert max(compare(ours, ref).values()) < 1e-10
        assert max(compare(ours, loss_and_grads(hf_gc, batch)).values()) < 1e-10


def test_mst_offload_recompute_replays_dropout():
    """With attention dropout the recompute must see the forward's random stream: same masks, exact grads."""
    model = make_model("llama", torch.float64, attention_dropout=0.3).train()
    batch = make_batch()
    offloaded = ds_longseq.enable(clone(model), {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, **OFFLOAD})
    torch.manual_seed(7)
    ref = loss_and_grads(model, batch)  # the stock model draws the same dropout masks in the same order
    torch.manual_seed(7)
    ours = loss_and_grads(offloaded, batch)
    assert max(compare(ours, ref).values()) < 1e-10


@pytest.mark.kernel_paths
def test_checkpoint_apply_offloaded_is_bitwise_on_device():
    """The op alone, two stacked layers (the gradient reaching the first goes through the second). Bitwise by
    construction: both recompute each layer from the same input values, one kept on the device, one copied back."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.GELU(), torch.nn.Linear(12, 8)) for _ in range(2)]
    x = torch.randn(2, 5, 8, requires_grad=True)
    results = []
    for offloader in (None, LayerInputOffloader(HostBufferPool())):
        h = x
        for layer in layers:
            h = checkpoint_apply(layer, h, list(layer.parameters()), offloader)
        grads = torch.autograd.grad(h.square().sum(), [x, *(p for layer in layers for p in layer.parameters())])
        results.append((h.detach(), grads))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


# --- what is kept for backward ---------------------------------------------------------------------


def _layer_inputs_and_saved(model, batch):
    """(inputs each decoder layer got, tensors the autograd graph saved) over one training forward."""
    inputs, saved = [], []
    hooks = [
        layer.register_forward_pre_hook(lambda m, args, kwargs: inputs.append(args[0]), with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(**batch).loss
    finally:
        for h in hooks:
            h.remove()
    return loss, inputs, saved


@pytest.mark.parametrize("config", [STREAMBP, MST], ids=["streambp", "mini_seq"])
def test_graph_holds_no_layer_input_the_offloader_holds_them(config):
    model = make_model("llama", torch.float32)
    batch = make_batch()
    # without offload the graph keeps every layer's (B, T, d) input: the check below can see them
    _, inputs, saved = _layer_inputs_and_saved(ds_longseq.enable(clone(model), config), batch)
    assert {t.data_ptr() for t in inputs} <= {t.data_ptr() for t in saved}

    offloaded = ds_longseq.enable(clone(model), {**config, **OFFLOAD}).train()
    offload = _offload(offloaded)
    seen = []
    # prepended: runs before the offload's own forward hook resets `current`
    hook = offloaded.model.register_forward_hook(lambda *args: seen.append(offload.current), prepend=True)
    loss, inputs, saved = _layer_inputs_and_saved(offloaded, batch)
    hook.remove()
    (offloader,) = seen
    assert len(inputs) == 2 and all(t.shape == (2, 37, 64) for t in inputs)
    assert not {t.data_ptr() for t in inputs} & {t.data_ptr() for t in saved}
    # StreamBP also keeps each layer's attention outputs in the tier (keep_attention_output "auto"): per layer its
    # chunks' outputs (B, H, C, D) in one tensor and their log-sum-exps (B, H, C) in another, as many bytes as the
    # input plus one float per head
    kept = 2 * 2 if config is STREAMBP else 0
    kept_bytes = 2 * 2 * 37 * 4 * (16 + 1) * 4 if config is STREAMBP else 0
    assert offloader.num_saved == 2 + kept and offloader.saved_bytes == 2 * 2 * 37 * 64 * 4 + kept_bytes
    assert offload.current is None  # reset after the forward: the graph owns its offloader
    loss.backward()
    assert offloader.num_saved == 0


@pytest.mark.parametrize("config", [STREAMBP, MST], ids=["streambp", "mini_seq"])
def test_offloaded_layer_inputs_are_freed_after_the_forward(config):
    """Nothing keeps an offloaded layer input alive between forward and backward: no saved tensor and no
    closure the backward keeps (a StreamBP chunk function holding the layer input kept every input on the
    GPU with offload on, found on an H200: held memory equal with and without offload). The plain model is
    the control: there the graph keeps them."""
    import gc
    import weakref

    model = make_model("llama", torch.float32)
    batch = make_batch()
    for cfg, kept in ((config, True), ({**config, **OFFLOAD}, False)):
        m = ds_longseq.enable(clone(model), cfg).train()
        refs = []
        hooks = [layer.register_forward_pre_hook(
            lambda mod, args, kwargs, refs=refs: refs.append(
                weakref.ref(kwargs.get("hidden_states", args[0] if args else None))),
            with_kwargs=True) for layer in m.model.layers]
        loss = m(**batch).loss
        for h in hooks:
            h.remove()
        gc.collect()
        assert len(refs) == len(m.model.layers)
        assert [r() is not None for r in refs] == [kept] * len(refs), (cfg, kept)
        loss.backward()


@pytest.mark.kernel_paths
def test_no_grad_forward_between_forward_and_backward():
    """An eval forward under no_grad between a training forward and its backward saves nothing and
    leaves the pending backward exact."""
    model = make_model("qwen3", torch.float64)
    batch = make_batch()
    ref = loss_and_grads(ds_longseq.enable(clone(model), STREAMBP), batch)
    offloaded = ds_longseq.enable(clone(model), {**STREAMBP, **OFFLOAD})
    offloaded.zero_grad(set_to_none=True)
    loss = offloaded(**batch).loss
    pool = _offload(offloaded).pool
    owned = pool.num_bytes
    with torch.no_grad():
        offloaded.eval()(**make_batch(seq_len=23, seed=5))
    offloaded.train()
    assert pool.num_bytes == owned and pool.free_bytes == 0
    loss.backward()
    # bitwise by construction: the same StreamBP kernels as ref's, the offload only copies (the eval forward between
    # touches neither the saved inputs nor the parameters)
    assert torch.equal(loss.detach(), ref[0])
    for name, p in offloaded.named_parameters():
        assert torch.equal(p.grad, ref[1][name]), name


def test_second_backward_through_the_same_graph_is_refused():
    model = ds_longseq.enable(make_model("llama", torch.float32), {**STREAMBP, **OFFLOAD})
    loss = model(**make_batch()).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        loss.backward()


def test_generate_with_offload_matches_stock():
    model = make_model("llama", torch.float64).eval()
    batch = make_batch()
    prompt = {"input_ids": batch["input_ids"][:, :20], "attention_mask": batch["attention_mask"][:, :20].clone()}
    prompt["attention_mask"][1] = 1  # generation: left padding only
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = model.generate(**prompt, **kwargs)
    for config in (STREAMBP, MST):
        patched = ds_longseq.enable(clone(model), {**config, **OFFLOAD})
        # greedy token ids of two computations (ds_longseq's attention on the prompt, the stock SDPA): a token flips
        # only where the top two logits are within rounding (~1e-15); here they are >= 0.12 apart at every step
        assert torch.equal(patched.generate(**prompt, **kwargs), expected)


# --- errors ----------------------------------------------------------------------------------------


def test_hf_gradient_checkpointing_with_mst_offload_is_refused():
    model = ds_longseq.enable(make_model("llama", torch.float32), {**MST, **OFFLOAD})
    set_activation_checkpointing(model, True)
    model.train()
    with pytest.raises(RuntimeError, match="checkpoints each layer itself.*activation_checkpointing_disable"):
        model(**make_batch())
    set_activation_checkpointing(model, False)
    assert torch.isfinite(model(**make_batch()).loss)


@pytest.mark.parametrize("config", [STREAMBP, MST], ids=["streambp", "mini_seq"])
@pytest.mark.kernel_paths
def test_host_memory_error_before_any_layer_and_model_usable_after(config, monkeypatch):
    model = make_model("llama", torch.float32)
    batch = make_batch()
    ref = loss_and_grads(ds_longseq.enable(clone(model), config), batch)
    offloaded = ds_longseq.enable(clone(model), {**config, **OFFLOAD})
    calls = []
    for module in (offloaded.model.embed_tokens, *offloaded.model.layers):
        module.register_forward_pre_hook(lambda m, args: calls.append(m))
    needed = 2 * 2 * 37 * 64 * 4  # layers x batch x T x hidden x float32 bytes
    monkeypatch.setattr(offload_ops, "host_available_bytes", lambda: needed - 1)
    with pytest.raises(HostMemoryError) as info:
        offloaded(**batch)
    message = str(info.value)
    for needle in [f"needs {needed} bytes", f"only {needed - 1} bytes", "shorter", "smaller batch"]:
        assert needle in message, needle
    assert "sequence_parallel.size" in message and "remove long_seq.offload.layer_inputs" in message
    assert calls == [] and _offload(offloaded).current is None
    # the slabs of one step, rounded up to powers of two, fit: the model trains as if nothing happened
    monkeypatch.setattr(offload_ops, "host_available_bytes", lambda: 4 * needed)
    _assert_bitwise(loss_and_grads(offloaded, batch), ref)
    # from then on the pooled slabs are reused: no host memory needed for the same shape
    monkeypatch.setattr(offload_ops, "host_available_bytes", lambda: 0)
    _assert_bitwise(loss_and_grads(offloaded, batch), ref)
    # and every process on this host is counted: at T=100 each layer input needs a new 64 KiB slab
    to_allocate = 2 * 65536
    monkeypatch.setattr(offload_ops, "host_available_bytes", lambda: 2 * to_allocate)
    _offload(offloaded).check_host_memory(2, 100, torch.float32, pinned=False)  # one process: fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(HostMemoryError, match="x 4 processes on this host"):
        offloaded(**make_batch(seq_len=100))


def test_no_grad_forward_skips_the_host_memory_check(monkeypatch):
    model = ds_longseq.enable(make_model("llama", torch.float32), {**STREAMBP, **OFFLOAD})
    monkeypatch.setattr(offload_ops, "host_available_bytes", lambda: 0)
    with torch.no_grad():
        model(**make_batch())
    assert _offload(model).pool.num_bytes == 0


def test_config_validation():
    with pytest.raises(LongSeqConfigError) as info:
        LongSeqConfig.from_dict({"offload": {"layer_inputs": "cpu"}})
    assert "long_seq.offload.layer_inputs='cpu' needs long_seq.streambp or long_seq.mini_seq" in str(info.value)
    for bad in ["gpu", True, 1, "CPU"]:
        with pytest.raises(LongSeqConfigError, match="long_seq.offload.layer_inputs must be 'cpu' or 'disk' or null"):
            LongSeqConfig.from_dict({"streambp": {"enabled": True}, "offload": {"layer_inputs": bad}})
    with pytest.raises(LongSeqConfigError, match="unknown key long_seq.offload.'activations'"):
        LongSeqConfig.from_dict({"streambp": {"enabled": True}, "offload": {"activations": "cpu"}})
    cfg = LongSeqConfig.from_dict({"mini_seq": {"enabled": True}, "offload": {"layer_inputs": "cpu"}})
    assert cfg.offload.layer_inputs == "cpu" and LongSeqConfig.from_dict(cfg.to_dict()) == cfg
    off = LongSeqConfig.from_dict({"streambp": {"enabled": True}, "offload": {"layer_inputs": None}})
    assert off.offload.layer_inputs is None
    assert LongSeqConfig().offload.layer_inputs is None


# --- disable ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [STREAMBP, MST], ids=["streambp", "mini_seq"])
@pytest.mark.kernel_paths
def test_disable_undoes_everything(config):
    stock = make_model("llama", torch.float32)
    batch = make_batch()
    ref = loss_and_grads(stock, batch)
    model = ds_longseq.enable(clone(stock), {**config, **OFFLOAD}).train()
    loss_and_grads(model, batch)
    pool = _offload(model).pool
    assert pool.num_bytes > 0
    ds_longseq.disable(model)
    assert not model.model._forward_pre_hooks and not model.model._forward_hooks
    for module in [model, model.lm_head, *model.model.layers, *(layer.mlp for layer in model.model.layers)]:
        assert "forward" not in module.__dict__
    assert pool.closed and pool.num_bytes == 0
    _assert_bitwise(loss_and_grads(model, batch), ref)  # the stock model's own kernels again


def test_mark_zero3_leaves_marks_layers_and_mlps_under_mst_offload():
    model = ds_longseq.enable(make_model("llama", torch.float32), {**MST, **OFFLOAD})
    leaves = ds_longseq.patch.mark_zero3_leaves(model)
    layers = list(model.model.layers)
    assert leaves == [m for layer in layers for m in (layer, layer.mlp)]
    ds_longseq.disable(model)
    assert not any("_z3_leaf" in m.__dict__ for m in model.modules())


# --- the offloader alone ---------------------------------------------------------------------------


@pytest.mark.kernel_paths
def test_offloader_stack_prefetch_and_slab_reuse(monkeypatch):
    monkeypatch.setattr(offload_ops, "SLAB_BYTES", 64)  # a tensor of 3 x 7 float32 (84 bytes) spans two slabs
    pool = HostBufferPool()
    for step in range(2):
        offloader = LayerInputOffloader(pool)
        tensors = [torch.randn(3, 7) for _ in range(3)] + [torch.randn(2, 3, dtype=torch.float64)]
        handles = [offloader.save(t) for t in tensors]
        assert offloader.num_saved == 4 and [h.state for h in handles] == ["host"] * 4
        if step == 0:
            owned = pool.num_bytes
            assert owned == 3 * 2 * 64 + 64  # two 64-byte slabs each, and one for the 48-byte tensor
        assert pool.num_bytes == owned  # the second step reuses every slab
        # layers' backwards run in reverse: loading layer i's input prefetches layer i - 1's (copies: bitwise)
        assert torch.equal(handles[3].load(), tensors[3])
        assert [h.state for h in handles] == ["host", "host", "fetching", "consumed"]
        for i in (2, 1, 0):
            assert torch.equal(handles[i].load(), tensors[i])
        assert [h.state for h in handles] == ["consumed"] * 4
        assert pool.free_bytes == pool.num_bytes


@pytest.mark.kernel_paths
def test_shorter_sequences_reuse_larger_slabs():
    pool = HostBufferPool()
    long, short = 2 * 100 * 64 * 4, 2 * 37 * 64 * 4  # bytes of a (2, T, 64) float32 input: 64 and 32 KiB slabs
    offloader = LayerInputOffloader(pool)
    for handle in reversed([offloader.save(torch.randn(2, 100, 64)) for _ in range(2)]):
        handle.load()
    owned = pool.num_bytes
    assert owned == 2 * 65536 and pool.bytes_to_allocate([short] * 2, pinned=False) == 0
    offloader = LayerInputOffloader(pool)
    x = torch.randn(2, 37, 64)
    handles = [offloader.save(x) for _ in range(2)]
    assert pool.num_bytes == owned and pool.free_bytes == 0
    assert pool.bytes_to_allocate([short], pinned=False) == 32768 and pool.bytes_to_allocate([long], False) == 65536
    assert torch.equal(handles[1].load(), x) and torch.equal(handles[0].load(), x)  # copies: bitwise


def test_graph_freed_without_backward_returns_its_slabs():
    pool = HostBufferPool()
    offloader = LayerInputOffloader(pool)
    handle = offloader.save(torch.randn(4, 5))
    assert pool.free_bytes == 0 < pool.num_bytes
    del handle
    assert pool.free_bytes == pool.num_bytes and offloader.num_saved == 0


def test_host_available_bytes_is_positive():
    assert offload_ops.host_available_bytes() > 0


# --- sequence parallel (2 gloo ranks) ------------------------------------------------------------


def sp_offload_worker(rank: int, world: int):
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from tests.helpers import full_precision_norms
    from tests.test_sequence_parallel import SP_CASES, global_batch

    local = shard_batch(global_batch(), rank, world)
    out = {}
    for name in ("streambp", "mini_seq"):
        results = []
        for extra in ({}, OFFLOAD):
            model = full_precision_norms(make_model("llama", torch.float64))
            cfg = {**SP_CASES[name], **extra, "sequence_parallel": {"size": world}}
            ds_longseq.enable(model, cfg, sp_group=dist.group.WORLD).train()
            results.append(loss_and_grads(model, local))
        plain, offloaded = results
        out[name] = {
            "bitwise": name == "streambp",
            "loss": torch.equal(plain[0], offloaded[0]),
            "embed_grad": torch.equal(plain[2], offloaded[2]),
            "grads": all(torch.equal(plain[1][n], offloaded[1][n]) for n in plain[1]),
            "errs": compare(offloaded, plain),
        }
    return out


def test_sequence_parallel_with_offload_equals_without():
    """StreamBP under SP with offload is bitwise StreamBP under SP (by construction: the same kernels on the same
    operands, the offload only copies); MsT with offload (layer checkpoint) equals MsT without (no checkpoint at all)
    to float64 round-off."""
    for per_rank in run_distributed(sp_offload_worker, world_size=2, args=(2,)):
        for name, r in per_rank.items():
            if r["bitwise"]:
                assert r["loss"] and r["embed_grad"] and r["grads"], name
            assert max(r["errs"].values()) < 1e-10, (name, r["errs"])


# --- DeepSpeed ZeRO-3 (2 gloo ranks) ---------------------------------------------------------------


@pytest.mark.parametrize("long_seq", ["streambp", pytest.param("mini_seq", marks=pytest.mark.slow)])  # CI time
def test_zero3_with_offload_matches_single_process_reference(long_seq):
    """Through ds_longseq.engine.initialize: decoder layers (and, for mini_seq, their MLPs) are ZeRO-3
    leaves, so the weights are gathered for the whole layer while its saved input is on the host."""
    from tests.test_engine_dist import MST as ENGINE_MST
    from tests.test_engine_dist import STREAMBP as ENGINE_STREAMBP
    from tests.test_engine_dist import reference_run, train_worker

    config = {**(ENGINE_STREAMBP if long_seq == "streambp" else ENGINE_MST), **OFFLOAD}
    results = run_distributed(train_worker, 2, (3, 1, False, config))
    reference = reference_run(2, 1, False)
    for name, ref in reference.items():
        for rank, result in enumerate(results):
            # as in test_engine_dist: float32 round-off over 3 SGD steps
            err = ((result["params"][name] - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (name, rank, err)


def test_host_allocation_is_logged_once_with_its_size(caplog):
    """The first training step's host slabs are named with their size; later steps reuse them and say nothing."""
    import logging

    from ds_longseq.toolkit import tiny_llama

    model = tiny_llama(64, seed=0)
    ds_longseq.enable(model, {"streambp": {"enabled": True, "chunk_size": 32}, "offload": {"layer_inputs": "cpu"}})
    ids = torch.randint(0, 100, (1, 64))
    with caplog.at_level(logging.INFO, logger="ds_longseq"):
        for _ in range(2):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    lines = [r.getMessage() for r in caplog.records if "offload: allocating" in r.getMessage()]
    hidden = model.config.hidden_size
    per_layer = 64 * hidden * 4  # (1, 64, d) float32 in one power-of-two slab
    slab = 1 << (per_layer - 1).bit_length()
    assert lines == [f"offload: allocating {2 * slab} bytes ({2 * slab / 1024:.1f} KiB) of host memory for layer "
                     "inputs (2 layers x batch 1 x 64 tokens; kept and reused by later steps)"]
