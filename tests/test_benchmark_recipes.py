"""``benchmarks.recipes``: the model builders and what each method's recipe does, on tiny models.

ALST's own checkpoint offload (DeepSpeed's context, alst_offload) is checked by what it marks and,
with DeepSpeed's CPU skip lifted, by a real round trip through its buffers (each layer's input but the
last offloaded and restored, gradients equal to the plain model's); the synchronous imitation
(alst_offload_sync) by what it moves (each decoder layer's input, during the forward only); the LoRA
path by gradients reaching the adapters through both checkpointings.
"""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from benchmarks import recipes
from benchmarks.recipes import (
    LLAMA_TINY,
    QWEN3_TINY,
    build_model,
    compute_loss,
    get_recipe,
    prepare,
    random_tokens,
    step_context,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 96  # several ALST loss tiles and MLP shards at the chunk sizes below
# float32 on CPU: recomputation and tiling change only the summation order (~1e-7 relative)
RTOL, ATOL = 1e-4, 1e-6


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_build_model_gives_the_committed_cpu_weights_and_restores_the_default_dtype():
    """Same seed -> the weights of ``LlamaForCausalLM(config)`` built under it, as the committed CPU runs were."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(recipes.SEED)
    reference = LlamaForCausalLM(LLAMA_TINY.config(max_position_embeddings=4096)).to(torch.float32)
    model = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ)
    # bitwise by construction: the same initialisation draws from the same seed
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters(), strict=True))
    bf16 = build_model(QWEN3_TINY, dtype="bfloat16", device="cpu", seq_len=SEQ)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16} and torch.get_default_dtype() == torch.float32
    assert bf16.lm_head.weight is bf16.get_input_embeddings().weight  # tied, as Qwen3-4B
    assert bf16.config.rope_parameters["rope_theta"] == 1e6 or QWEN3_TINY.rope_theta is None


def test_long_seq_config_per_recipe():
    cfg = recipes.long_seq_config(get_recipe("streambp_offload"), LLAMA_TINY, 4096, chunk_size=512, loss_chunk_size=256)
    assert cfg["offload"] == {"layer_inputs": "cpu"} and cfg["streambp"]["chunk_size"] == 512
    assert "offload" not in recipes.long_seq_config(get_recipe("streambp"), LLAMA_TINY, 4096, chunk_size=512,
                                                    loss_chunk_size=256)
    mst = recipes.long_seq_config(get_recipe("mst"), LLAMA_TINY, 1000, chunk_size=512, loss_chunk_size=256)
    assert mst["mini_seq"]["mlp_num_chunks"] == 16  # ceil(1000 / 64): ALST's TiledMLP tile count
    sp = recipes.long_seq_config(get_recipe("mst_sp"), LLAMA_TINY, 1024, chunk_size=512, loss_chunk_size=256, sp=2)
    assert sp["mini_seq"]["mlp_num_chunks"] == 8 and sp["sequence_parallel"] == {"size": 2}
    assert recipes.long_seq_config(get_recipe("alst_offload"), LLAMA_TINY, 1024, chunk_size=1, loss_chunk_size=1) == {}
    with pytest.raises(ValueError, match="unknown method"):
        get_recipe("gpu")


def test_approx_recipes_add_the_approx_bp_section_and_train():
    """The *_approx methods: the approx_bp section on top of their method's (alone for stock / hf_gc);
    the _2x methods double StreamBP's chunk; a stock_approx step runs and its loss is the stock one
    (same forward)."""
    approx = {"activation": "resilu2", "norm": "ms_rmsnorm"}
    cfg = recipes.long_seq_config(get_recipe("stock_approx"), LLAMA_TINY, 256, chunk_size=64, loss_chunk_size=64)
    assert cfg == {"approx_bp": approx}
    cfg = recipes.long_seq_config(get_recipe("streambp_approx_2x"), LLAMA_TINY, 256, chunk_size=64, loss_chunk_size=64)
    assert cfg["approx_bp"] == approx and cfg["streambp"]["chunk_size"] == 128
    cfg = recipes.long_seq_config(get_recipe("streambp_2x"), LLAMA_TINY, 256, chunk_size=64, loss_chunk_size=64)
    assert "approx_bp" not in cfg and cfg["streambp"]["chunk_size"] == 128
    assert "approx_bp" in recipes.long_seq_config(get_recipe("mst_approx"), LLAMA_TINY, 256, chunk_size=64,
                                                  loss_chunk_size=64)
    import ds_longseq

    ids = random_tokens(LLAMA_TINY, SEQ)
    stock = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ)
    model = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ)
    ds_longseq.enable(model, recipes.long_seq_config(get_recipe("stock_approx"), LLAMA_TINY, SEQ, chunk_size=64,
                                                     loss_chunk_size=64))
    with torch.no_grad():
        torch.testing.assert_close(compute_loss(get_recipe("stock_approx"), model, ids),
                                   compute_loss(get_recipe("stock"), stock, ids), rtol=RTOL, atol=ATOL)


class _Recorder:
    """Stands in for ``save_on_cpu``: keeps what is packed while it is open."""

    def __init__(self, pin_memory=False):
        self.packed = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self.packed.append(t)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def test_alst_offload_sync_moves_each_layer_input_in_the_forward_only(monkeypatch):
    """The imitation: the reentrant checkpoints (each layer's input, saved with save_for_backward) go
    to the host in the forward; the backward's recomputations keep their saved tensors on the device."""
    opened = []
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", lambda pin_memory: opened.append(_Recorder()) or opened[0])
    recipe = get_recipe("alst_offload_sync")
    model = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ)
    prepare(model, recipe)
    layer_inputs = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda mod, args, kwargs: layer_inputs.append(
            kwargs.get("hidden_states", args[0] if args else None)), with_kwargs=True)
    ids = random_tokens(LLAMA_TINY, SEQ)
    with _Recorder() as around_backward:  # what a context kept open through the backward would see
        loss = compute_loss(recipe, model, ids, loss_chunk_size=32)
        (forward,) = opened
        assert around_backward.packed == []  # the recipe's own context is the innermost in the forward
        in_forward = len(forward.packed)
        loss.backward()
    packed = {t.data_ptr() for t in forward.packed}
    assert len(layer_inputs) == LLAMA_TINY.num_hidden_layers and all(x.data_ptr() in packed for x in layer_inputs)
    assert len(forward.packed) == in_forward  # nothing saved in the backward reached the recipe's context
    # the defect this guards against: the old recipe kept save_on_cpu open through the backward, and
    # every recomputed layer's saved tensors went to the host and straight back
    assert len(around_backward.packed) > 0


def _alst_offload_step(model, ids, monkeypatch, *, lift_cpu_skip):
    """One alst_offload forward + backward inside the recipe's context; returns (loss, the context)."""
    from deepspeed.runtime.activation_checkpointing import offload_activations

    if lift_cpu_skip:  # DeepSpeed skips every tensor on a CPU accelerator; let it copy CPU -> CPU buffers
        monkeypatch.setattr(offload_activations._ActivationOffloadEngine, "_should_skip",
                            lambda self, t: isinstance(t, torch.nn.Parameter) or t.numel() < 2)
    recipe = get_recipe("alst_offload")
    ctx = step_context(recipe, pin_memory=False)
    with ctx:
        loss = compute_loss(recipe, model, ids, loss_chunk_size=32)
        loss.backward()
        stats = dataclasses.replace(ctx.stats)  # a copy: the next entry resets the counts
    return loss, stats


@pytest.mark.parametrize("lift_cpu_skip", [False, True])
def test_alst_offload_is_deepspeeds_own_context_and_round_trips_each_layer_input(monkeypatch, lift_cpu_skip):
    """alst_offload runs DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager``: each
    decoder layer's hidden_states is marked once; on CPU DeepSpeed skips them all (what this recipe
    does on CPU: wiring only). With that skip lifted, its engine copies every layer input but the
    last (kept on the device, ``keep_last_count=1``) into its buffers in the forward and restores each
    in the backward, and the gradients are the plain model's: the restore hands back the same values."""
    n_layers = LLAMA_TINY.num_hidden_layers
    ids = random_tokens(LLAMA_TINY, SEQ)
    reference = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ)
    ref_loss = compute_loss(get_recipe("stock"), reference, ids)
    ref_loss.backward()
    model = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ)
    prepare(model, get_recipe("alst_offload"))
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # what DeepSpeed marks
    loss, stats = _alst_offload_step(model, ids, monkeypatch, lift_cpu_skip=lift_cpu_skip)
    assert stats.marked_tensors == n_layers
    if lift_cpu_skip:
        assert (stats.offloaded_tensors, stats.kept_last_tensors) == (n_layers - 1, 1)
        assert stats.restored_tensors == n_layers - 1 and stats.offloaded_bytes == (n_layers - 1) * SEQ * 4 * (
            LLAMA_TINY.hidden_size)
    else:
        assert stats.skipped_marked_tensors == n_layers and stats.offloaded_tensors == 0
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    got, want = _grads(model), _grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("method", ["hf_gc", "alst", "alst_offload", "alst_offload_sync"])
def test_checkpointing_recipes_give_the_plain_gradients(method):
    reference = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ)
    ids = random_tokens(LLAMA_TINY, SEQ)
    ref_loss = compute_loss(get_recipe("stock"), reference, ids)
    ref_loss.backward()
    model = build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ)
    prepare(model, get_recipe(method))
    with step_context(get_recipe(method), pin_memory=False):
        loss = compute_loss(get_recipe(method), model, ids, loss_chunk_size=32)
        loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    got, want = _grads(model), _grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("method", ["hf_gc", "alst_offload", "alst_offload_sync", "mst", "streambp"])
def test_lora_recipes_train_the_adapters(method):
    """LoRA on the inner model: every recipe gives the adapters the gradients of the plain LoRA model
    (alst_offload_sync's reentrant checkpointing needs ``enable_input_require_grads`` for that)."""
    pytest.importorskip("peft")
    import ds_longseq

    ids = random_tokens(LLAMA_TINY, SEQ)
    grads = {}
    for name in ("stock", method):
        recipe = get_recipe(name)
        _, inner = recipes.apply_lora(build_model(LLAMA_TINY, dtype="float32", device="cpu", seq_len=SEQ))
        for p_name, p in inner.named_parameters():
            if "lora_B" in p_name:  # PEFT starts B at zero, which would leave A's gradient zero
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(p_name)))
        prepare(inner, recipe, frozen_inputs=True)
        cfg = recipes.long_seq_config(recipe, LLAMA_TINY, SEQ, chunk_size=32, loss_chunk_size=32)
        if cfg:
            ds_longseq.enable(inner, cfg)
        with step_context(recipe, pin_memory=False):
            compute_loss(recipe, inner, ids, loss_chunk_size=32).backward()
        grads[name] = _grads(inner)
    assert grads[method].keys() == grads["stock"].keys() and grads["stock"]
    assert all("lora_" in n for n in grads["stock"])  # the base is frozen
    for name, want in grads["stock"].items():
        assert want.abs().max() > 0, name
        torch.testing.assert_close(grads[method][name], want, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.slow
def test_alst_with_tied_embeddings_under_zero3_gives_the_plain_gradients():
    """Qwen3-4B ties its embeddings: the ALST loss holds the tied weight "not ready" so DeepSpeed's
    ZeRO-3 reduces its gradient once (0.19.8 asserts on a duplicate otherwise) and completely."""
    script = textwrap.dedent(
        """
        import os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
        import deepspeed, torch
        from deepspeed.utils import safe_get_full_grad
        import ds_longseq.engine
        from benchmarks.recipes import (QWEN3_TINY, build_model, compute_loss, get_recipe, prepare, random_tokens,
                                        step_context)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        grads = {}
        for method in ("stock", "alst", "alst_offload", "alst_offload_sync"):
            model = build_model(QWEN3_TINY, dtype="float32", device="cpu", seq_len=128)
            recipe = get_recipe(method)
            prepare(model, recipe)
            config = {"train_micro_batch_size_per_gpu": 1, "zero_force_ds_cpu_optimizer": False,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                      "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "long_seq": {}}
            engine, *_ = ds_longseq.engine.initialize(model=model, model_parameters=model.parameters(), config=config)
            ids = random_tokens(QWEN3_TINY, 128)
            with step_context(recipe, pin_memory=False):
                engine.backward(compute_loss(recipe, engine.module, ids, call=engine, loss_chunk_size=32))
            grads[method] = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
        for method in ("alst", "alst_offload", "alst_offload_sync"):
            for name, want in grads["stock"].items():
                torch.testing.assert_close(grads[method][name], want, rtol=1e-4, atol=1e-6, msg=name)
        print("GRADS MATCH", sorted(grads["stock"])[0])
        """
    )
    from benchmarks.harness import free_port

    env = dict(os.environ, PORT=str(free_port()), PYTHONPATH=REPO_ROOT)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "GRADS MATCH" in proc.stdout, proc.stderr[-3000:]


def test_approx_convergence_summary():
    from benchmarks.approx_convergence import _smooth, summarise

    assert _smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    exact = [4.0] * 10 + [2.0] * 10
    later = [4.0] * 14 + [2.0] * 6
    rows, level = summarise({"exact": exact, "approx": later}, window=4)
    by = {r["run"]: r for r in rows}
    assert level == 3.0 and by["exact"]["below_step"] == 13 and by["approx"]["below_step"] == 17
    assert by["exact"]["max_diff"] == 0.0 and by["approx"]["max_diff"] == 2.0 and by["approx"]["final"] == 2.0


def test_exact_counterpart_pairs_each_approx_method_with_its_exact_method():
    """Every *_approx method maps to the method that differs only by approx_bp (the approx_cpu report's
    pairing); a method without Approx-BP has none."""
    from dataclasses import replace

    approx = [name for name, r in recipes.METHODS.items() if r.approx_bp]
    assert {"stock_approx", "streambp_approx", "streambp_approx_2x"} <= set(approx)
    for name in approx:
        exact = recipes.exact_counterpart(name)
        assert exact is not None and not get_recipe(exact).approx_bp, name
        assert replace(get_recipe(exact), name=name, approx_bp=True) == get_recipe(name)
    assert recipes.exact_counterpart("streambp_approx_2x") == "streambp_2x"
    assert recipes.exact_counterpart("stock_approx") == "stock"
    assert recipes.exact_counterpart("streambp") is None


def test_reset_peak_rss_forgets_a_freed_transient():
    from benchmarks import harness

    big = torch.ones(64 * 2**20 // 4 * 4)  # 256 MiB, touched
    del big
    if not harness.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs is not available: the peak stays cumulative")
    assert harness.maxrss_mib() < harness.rss_mib() + 64, (harness.maxrss_mib(), harness.rss_mib())
