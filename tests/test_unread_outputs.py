"""StreamBP leaves uncomputed the linears whose output a pass never reads (forwards/unread_outputs.py): the query
projection in the K/V capture pass, the MLP's output projection in the backward's chunk re-forward, and there the
key and value projections of a chunk whose keys/values the capture pass computed (the attention reuses those).
Bitwise the same gradients as with them computed, on every BLAS: a skipped linear's backward is autograd's own, call
for call (tested below by the ops it dispatches), so the per-layer probe's bitwise comparison finds only whether
something reads the skipped values. A family where something does (a norm after the MLP, a norm on the keys) is
found by the probe and computes them; fewer FLOPs by exactly those products. The bitwise tests are marked
``kernel_paths``: tests/test_kernel_paths.py runs them again under two other MKL code paths."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import ds_longseq
from benchmarks.profile import count_flops
from tests.helpers import make_batch, make_model

CFG = {"streambp": {"enabled": True, "chunk_size": 10}, "lm_head": {"enabled": True, "chunk_size": 16}}


def _grads(model, batch, *, skip: bool | None = True, lora: bool = False, autocast: bool = False):
    """Every parameter's gradient after one StreamBP step; ``skip=False`` computes every linear (the probe's
    result overridden), ``None`` leaves the probe's decision."""
    model = copy.deepcopy(model)
    if lora:
        peft = pytest.importorskip("peft")
        torch.manual_seed(0)  # the adapters' initialisation
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                           target_modules=["q_proj", "down_proj", "k_proj"]))
        inner = model.base_model.model
    else:
        inner = model
    ds_longseq.enable(inner, CFG)
    layers = [layer.forward for layer in inner.model.layers]
    if skip is False:
        for f in layers:
            f.unread.query_unread = f.unread.output_unread = f.unread.kv_reused = False
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None], layers


@pytest.mark.kernel_paths
@pytest.mark.parametrize("arch,dtype,lora,autocast", [
    ("llama", torch.float64, False, False),
    ("qwen3", torch.float32, False, False),
    ("llama", torch.float32, True, False),
    ("mistral", torch.float32, False, True),
])
def test_skipped_linears_give_bitwise_the_same_gradients(arch, dtype, lora, autocast):
    model, batch = make_model(arch, dtype, num_layers=2), make_batch(seq_len=37)
    skipped, layers = _grads(model, batch, lora=lora, autocast=autocast)
    computed, _ = _grads(model, batch, skip=False, lora=lora, autocast=autocast)
    assert len(skipped) == len(computed) > 0
    assert all(torch.equal(a, b) for a, b in zip(skipped, computed, strict=True))
    for f in layers:
        # 37 tokens in chunks of 10: 3 captured chunks (+1 skipping run of the query probe, +2 captures of the K/V
        # reuse probe), 4 re-forwards (+1 skipping run of the output probe; the K/V reuse probe reads the output), 3
        # of them reusing captured K/V (+1 reusing run of its probe)
        assert f.unread.query_unread and f.unread.output_unread
        assert f.unread.query_proj.skipped == 3 + 1 + 2 and f.unread.output_proj.skipped == 4 + 1
        reused = arch != "qwen3"  # Qwen 3's key norm reads the key projection's values (see below)
        assert f.unread.kv_reused is reused
        assert [p.skipped for p in f.unread.kv_projs] == [3 + 1, 3 + 1] if reused else [1, 1]


@pytest.mark.kernel_paths
@pytest.mark.parametrize("arch,kept", [("olmo2", "output_unread"), ("qwen3", "kv_reused")])
def test_a_linear_whose_values_a_norm_reads_stays_computed(arch, kept):
    """OLMo 2 normalises the MLP's output before the residual add: its re-forward reads the down projection's
    values, so the probe keeps it. Qwen 3 (and OLMo 2) normalise the keys after their projection: the norm's
    backward reads the projection's values, so the probe keeps the key/value projections computed in the replay.
    The other skips still hold, the gradients are bitwise those with every linear computed, and forcing the kept
    skip (the mutation) changes them."""
    model, batch = make_model(arch, torch.float64, num_layers=2), make_batch(seq_len=37)
    probed, layers = _grads(model, batch, skip=None)
    computed, _ = _grads(model, batch, skip=False)
    expected = {"query_unread": True, "output_unread": arch != "olmo2", "kv_reused": False}
    assert all({name: getattr(f.unread, name) for name in expected} == expected for f in layers)
    assert all(torch.equal(a, b) for a, b in zip(probed, computed, strict=True))
    forced = copy.deepcopy(model)
    ds_longseq.enable(forced, CFG)
    forced(**batch)  # the first forward probes
    for layer in forced.model.layers:
        setattr(layer.forward.unread, kept, True)
    forced.zero_grad()
    forced(**batch).loss.backward()
    assert not all(torch.equal(p.grad, g) for p, g in zip(forced.parameters(), computed, strict=True))


@pytest.mark.kernel_paths
def test_reused_keys_values_match_stock_float64():
    """The reuse against the stock model (sdpa, loss from float64 logits) to 1e-10, with padding in rows."""
    from tests.helpers import compare, loss_and_grads

    model, batch = make_model("llama", torch.float64, num_layers=2), make_batch(seq_len=37)
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    ds_longseq.enable(model, CFG)
    errs = compare(loss_and_grads(model, batch), ref)
    assert all(layer.forward.unread.kv_reused for layer in model.model.layers)
    assert max(errs.values()) < 1e-10, errs


@pytest.mark.kernel_paths
def test_fewer_flops_by_exactly_the_skipped_products():
    """One step's matmul FLOPs drop by the query projection over every captured token, the MLP's output
    projection over every re-forwarded token and the key and value projections over the re-forwarded tokens whose
    K/V were captured (Llama, 2 layers, 37 tokens: chunks [0, 30) captured)."""
    model, batch = make_model("llama", torch.float32, num_layers=2), make_batch(seq_len=37)
    counts = {}
    for skip in (True, False):
        m = copy.deepcopy(model)
        ds_longseq.enable(m, CFG)
        m(**batch).loss.backward()  # the probes run on the first training forward
        if not skip:
            for layer in m.model.layers:
                unread = layer.forward.unread
                unread.query_unread = unread.output_unread = unread.kv_reused = False
        counts[skip] = sum(count_flops(lambda m=m: m(**batch).loss.backward()).values())
    c = model.config
    B, L, d = 2, c.num_hidden_layers, c.hidden_size
    head_dim = c.head_dim or d // c.num_attention_heads
    q_out, kv_out = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    # query over the 30 captured tokens; down projection over all 37 re-forwarded; key and value over the 30
    # re-forwarded tokens whose K/V were captured
    saved = 2 * B * L * (30 * d * q_out + 37 * c.intermediate_size * d + 30 * 2 * d * kv_out)
    assert round((counts[False] - counts[True]) * 1e9) == saved


def test_disable_restores_the_linears():
    model = make_model("llama", torch.float32, num_layers=1)
    q = model.model.layers[0].self_attn.q_proj
    ds_longseq.enable(model, CFG)
    assert "forward" in vars(q)
    ds_longseq.disable(model)
    assert "forward" not in vars(q)


@pytest.mark.kernel_paths
def test_a_skipped_float64_linear_under_autocast_keeps_its_dtype():
    """Autocast leaves float64 alone, and so does the skipped linear: zeros of its output's shape and dtype, with
    F.linear's gradients (bitwise)."""
    from ds_longseq.forwards.unread_outputs import UnreadLinear

    linear = torch.nn.Linear(6, 5, dtype=torch.float64)
    unread = UnreadLinear(linear, linear.forward)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, 5, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), unread.skipping("graph"):
        out = unread(x)
    assert out.dtype == torch.float64 and out.shape == (2, 3, 5) and not out.any()
    ref = torch.autograd.grad(linear(x), (x, linear.weight, linear.bias), g)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (x, linear.weight, linear.bias), g), ref,
                                                 strict=True))


def _backward_calls(out: torch.Tensor, inputs: tuple, grad: torch.Tensor) -> tuple[list[tuple], tuple]:
    """Each op the backward of ``out`` dispatches (its name and every tensor argument's shape, strides and dtype),
    and the gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = [(tuple(a.shape), a.stride(), a.dtype) for a in args if isinstance(a, torch.Tensor)]
            calls.append((str(func), tensors))
            return func(*args, **(kwargs or {}))

    with Record():
        grads = torch.autograd.grad(out, inputs, grad)
    return calls, grads


@pytest.mark.kernel_paths
@pytest.mark.parametrize("layout", ["3d", "3d_strided", "2d", "2d_transposed", "autocast", "float64_autocast"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_skipped_linear_backward_makes_autograd_s_own_calls(layout, bias):
    """What makes the skips exact on every BLAS: the skipped linear's backward dispatches exactly the ops autograd's
    F.linear backward does, on operands of the same shapes, strides and dtypes (so the same kernels, whatever the
    library picks by shape and layout), and gives bitwise its gradients. Layouts: a contiguous and a strided 3-D
    input (F.linear folds one into addmm, runs matmul + add on the other), 2-D row- and column-major inputs
    (autograd's mm backward branches on the operand's layout), bfloat16 autocast over float32 and over float64."""
    from ds_longseq.forwards.unread_outputs import UnreadLinear

    dtype = torch.float64 if layout == "float64_autocast" else torch.float32
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 10, bias=bias, dtype=dtype)
    unread = UnreadLinear(linear, linear.forward)
    x = {"3d_strided": torch.randn(7, 3, 12, dtype=dtype).transpose(0, 1), "2d": torch.randn(21, 12, dtype=dtype),
         "2d_transposed": torch.randn(12, 21, dtype=dtype).t()}.get(layout, torch.randn(3, 7, 12, dtype=dtype))
    x.requires_grad_()
    inputs = (x, linear.weight, *([linear.bias] if bias else []))
    results = {}
    for skip in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in layout), \
                unread.skipping("graph") if skip else contextlib.nullcontext():
            out = unread(x)
        g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
        results[skip] = _backward_calls(out, inputs, g)
    (stock_calls, stock_grads), (skipped_calls, skipped_grads) = results[False], results[True]
    assert unread.skipped == 1 and any("mm" in name for name, _ in stock_calls)
    assert skipped_calls == stock_calls
    assert all(torch.equal(a, b) for a, b in zip(skipped_grads, stock_grads, strict=True))
