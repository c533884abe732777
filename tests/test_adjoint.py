"""Adjoint sharding (paper 002) in one process: the scans, one layer, the whole SSM language model.

References are independent of the code under test: the recurrence is a Python loop over tokens
under plain autograd (``loop_scan``), truncation is the same loop with the state detached T-bar
steps back (``windowed_scan``); only the per-token maps ``pre``/``post`` of the layer are shared.
float64 to 1e-10 (relative, norm-wise), float32 to 1e-5, bf16 judged against plain autograd's own
bf16 error.
"""

from __future__ import annotations

import pytest
import torch

import ds_longseq
from ds_longseq.adjoint import ResidualSSMForCausalLM, SSMConfig, adjoint_layer_backward, make_plan, split_layers
from ds_longseq.config import LongSeqConfigError
from ds_longseq.families.residual_ssm import causal_lm_loss
from ds_longseq.ops.linear_scan import LinearScan, adjoint_scan, linear_scan, truncated_adjoint
from tests.helpers import full_precision_norms, make_model, rel_err

V = 61


def loop_scan(a, b):
    """h_t = a_t h_{t-1} + b_t, one token at a time (autograd-differentiable)."""
    h, out = torch.zeros_like(b[:, 0]), []
    for t in range(a.shape[1]):
        h = a[:, t] * h + b[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


def windowed_scan(a, b, window):
    """h_t with the state T-bar = ``window`` steps back detached: the truncated gradient's model."""
    full = loop_scan(a, b).detach()
    out = []
    for t in range(a.shape[1]):
        start = t - window  # h_start is a constant; steps start+1..t are differentiated
        h = full[:, start] if start >= 0 else torch.zeros_like(b[:, 0])
        for i in range(max(start + 1, 0), t + 1):
            h = a[:, i] * h + b[:, i]
        out.append(h)
    return torch.stack(out, dim=1)


def reference_loss(model, ids, labels, window=None):
    """The model's loss with the recurrence as a token loop (windowed: truncated)."""
    y = model.embed(ids)
    for layer in model.layers:
        a, b, ctx = layer.pre(y)
        h = loop_scan(a, b) if window is None else windowed_scan(a, b, window)
        y = y + layer.post(h, ctx)
    return causal_lm_loss(model.lm_head(model.norm_f(y)), labels)


def batch(seq_len=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, seq_len), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt
    labels[1, seq_len - 9 :] = -100  # right padding
    return ids, labels


def tiny(dtype=torch.float64, conv_kernel=4, tie=False, num_layers=3, seed=0):
    torch.manual_seed(seed)
    config = SSMConfig(vocab_size=V, hidden_size=12, state_size=4, num_layers=num_layers, conv_kernel=conv_kernel,
                       tie_word_embeddings=tie)
    model = ResidualSSMForCausalLM(config).to(dtype)
    with torch.no_grad():  # larger steps than the init's so every state carries far
        for layer in model.layers:
            layer.dt_proj.bias.add_(1.0)
            layer.out_proj.weight.mul_(4.0)
    return model


def grads(model, loss_fn):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = loss_fn()
    return loss.detach(), torch.autograd.grad(loss, params)


def adjoint(model, chunk_size, truncation=None):
    model.adjoint_plan = make_plan(len(model.layers), chunk_size=chunk_size, truncation=truncation, layer_split=None,
                                   world_size=1, rank=0, grad_scale=1.0)
    return model


def assert_close(result, reference, tol):
    (loss, gs), (rloss, rgs) = result, reference
    assert rel_err(loss, rloss) < tol, (loss, rloss)
    errs = [rel_err(g, r) for g, r in zip(gs, rgs, strict=True)]
    assert max(errs) < tol, errs


# ---- scans --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1, 2, 37, 64])
@pytest.mark.kernel_paths
def test_scans_equal_the_token_loop(seq_len):
    torch.manual_seed(seq_len)
    a = torch.rand(2, seq_len, 3, 4, dtype=torch.float64)
    b, c = torch.randn(2, 2, seq_len, 3, 4, dtype=torch.float64)
    assert rel_err(linear_scan(a, b), loop_scan(a, b)) < 1e-14
    mu = torch.zeros_like(c)
    for t in reversed(range(seq_len)):
        mu[:, t] = c[:, t] + (a[:, t + 1] * mu[:, t + 1] if t + 1 < seq_len else 0)
    assert rel_err(adjoint_scan(a, c), mu) < 1e-14
    for window in (1, 3, seq_len, seq_len + 5):
        trunc = torch.zeros_like(c)
        for t in range(seq_len):
            decay = torch.ones_like(c[:, 0])
            for d in range(min(window, seq_len - t)):
                if d:
                    decay = decay * a[:, t + d]
                trunc[:, t] += c[:, t + d] * decay
        assert rel_err(truncated_adjoint(a, c, window), trunc) < 1e-14
    assert torch.equal(truncated_adjoint(a, c, 1), c)  # a window of 1 adds nothing to c: a copy


def test_scans_carried_across_chunks_equal_one_scan():
    """The carries the streamed backward uses: a chunk's initial state, and a_e * mu_e from the next chunk."""
    torch.manual_seed(3)
    a = torch.rand(2, 30, 3, dtype=torch.float64)
    b, c = torch.randn(2, 2, 30, 3, dtype=torch.float64)
    whole_h, whole_mu = linear_scan(a, b), adjoint_scan(a, c)
    h_parts, carry = [], None
    for s, e in [(0, 7), (7, 8), (8, 30)]:
        h_parts.append(linear_scan(a[:, s:e], b[:, s:e], carry))
        carry = h_parts[-1][:, -1]
    assert rel_err(torch.cat(h_parts, 1), whole_h) < 1e-14
    mu_parts, carry = [], None
    for s, e in [(8, 30), (7, 8), (0, 7)]:
        mu_parts.insert(0, adjoint_scan(a[:, s:e], c[:, s:e], carry))
        carry = a[:, s] * mu_parts[0][:, 0]
    assert rel_err(torch.cat(mu_parts, 1), whole_mu) < 1e-14


def test_linear_scan_function_gradients_equal_the_token_loop():
    torch.manual_seed(0)
    a = torch.rand(2, 29, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 29, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 29, 5, dtype=torch.float64)
    got = torch.autograd.grad((LinearScan.apply(a, b) * w).sum(), [a, b])
    ref = torch.autograd.grad((loop_scan(a, b) * w).sum(), [a, b])
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) < 1e-13


def test_truncated_adjoint_rejects_a_non_positive_window():
    a = torch.rand(1, 4, 2)
    with pytest.raises(ValueError, match="T-bar >= 1"):
        truncated_adjoint(a, a, 0)


# ---- one layer: input gradient and parameter gradients --------------------------------------------


@pytest.mark.parametrize(
    "conv_kernel,chunk_size", [(1, 1), (4, 5), (4, 64)], ids=["paper-chunk1", "conv-chunk5", "conv-1chunk"]
)
def test_layer_stack_input_and_parameter_gradients(conv_kernel, chunk_size):
    """Two layers by hand: dL/dx reaching the first layer goes through the second's adjoint VJP."""
    model = tiny(conv_kernel=conv_kernel, num_layers=2)
    torch.manual_seed(1)
    x = torch.randn(2, 37, 12, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 37, 12, dtype=torch.float64)
    params = [list(layer.parameters()) for layer in model.layers]
    y = x
    for layer in model.layers:
        a, b, ctx = layer.pre(y)
        y = y + layer.post(loop_scan(a, b), ctx)
    ref = torch.autograd.grad(y, [x, *params[0], *params[1]], upstream)
    with torch.no_grad():
        y1 = model.layers[0](x)
    g1, p1 = adjoint_layer_backward(model.layers[1], y1, upstream, params[1], chunk_size=chunk_size)
    g0, p0 = adjoint_layer_backward(model.layers[0], x.detach(), g1, params[0], chunk_size=chunk_size)
    assert rel_err(g0, ref[0]) < 1e-10
    for g, r in zip(p0 + p1, ref[1:], strict=True):
        assert rel_err(g, r) < 1e-10


# ---- the whole model --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conv_kernel,chunk_size,tie",
    [(1, 7, False), (4, 5, True), (4, 1, False), (4, 100, False)],
    ids=["paper-chunk7", "conv-chunk5-tied", "conv-chunk1", "conv-one-chunk"],
)
def test_model_float64_equals_autograd(conv_kernel, chunk_size, tie):
    model = tiny(conv_kernel=conv_kernel, tie=tie)
    ids, labels = batch()
    reference = grads(model, lambda: reference_loss(model, ids, labels))
    plain = grads(model, lambda: model(ids, labels=labels).loss)  # the model's own autograd path
    assert_close(plain, reference, 1e-10)
    adjoint(model, chunk_size)
    assert_close(grads(model, lambda: model(ids, labels=labels).loss), reference, 1e-10)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_truncated_equals_the_windowed_reference(window):
    model = tiny()
    ids, labels = batch(seq_len=23)
    reference = grads(model, lambda: reference_loss(model, ids, labels, window=window))
    exact = grads(model, lambda: reference_loss(model, ids, labels))
    adjoint(model, chunk_size=6, truncation=window)
    got = grads(model, lambda: model(ids, labels=labels).loss)
    assert_close(got, reference, 1e-10)
    # truncation changes the gradient (the test would pass vacuously if the states did not carry)
    assert max(rel_err(g, r) for g, r in zip(got[1], exact[1], strict=True)) > 1e-4


@pytest.mark.parametrize("window", [23, 24, 1000])
def test_truncation_at_least_the_length_is_exact(window):
    model = tiny()
    ids, labels = batch(seq_len=23)
    reference = grads(model, lambda: reference_loss(model, ids, labels))
    adjoint(model, chunk_size=4, truncation=window)
    assert_close(grads(model, lambda: model(ids, labels=labels).loss), reference, 1e-10)


def test_float32_equals_autograd():
    model = tiny(torch.float32)
    ids, labels = batch(seq_len=64)
    plain = grads(model, lambda: model(ids, labels=labels).loss)
    adjoint(model, chunk_size=16)
    assert_close(grads(model, lambda: model(ids, labels=labels).loss), plain, 1e-5)


def test_bf16_no_worse_than_autograd_in_bf16():
    """bf16 weights, float32 scan state (both paths): judged against the float64 gradient."""
    truth_model = tiny(torch.float64)
    ids, labels = batch(seq_len=64)
    truth = grads(truth_model, lambda: truth_model(ids, labels=labels).loss)
    model = tiny(torch.float64).to(torch.bfloat16)
    plain = grads(model, lambda: model(ids, labels=labels).loss)
    adjoint(model, chunk_size=16)
    got = grads(model, lambda: model(ids, labels=labels).loss)
    ours = [rel_err(g, r) for g, r in zip(got[1], truth[1], strict=True)]
    baseline = [rel_err(p, r) for p, r in zip(plain[1], truth[1], strict=True)]
    # Summed over the parameters the two paths' bf16 errors agree to ~5% (they round in different
    # places: chunked sums, float32 accumulation here); one parameter alone can differ by ~2.5x
    # either way (dt_proj.bias: 0.0094 vs 0.0038), hence 3x per parameter.
    assert sum(ours) <= 1.2 * sum(baseline), (sum(ours), sum(baseline))
    for mine, theirs in zip(ours, baseline, strict=True):
        assert mine <= 3 * theirs + 1e-3, (mine, theirs)


# ---- enable / disable, bad input ----------------------------------------------------------------------


def test_enable_and_disable():
    model = tiny()
    ids, labels = batch()
    reference = grads(model, lambda: model(ids, labels=labels).loss)
    ds_longseq.enable(model, {"adjoint": {"enabled": True, "chunk_size": 8}})
    assert model.adjoint_plan is not None and model.adjoint_plan.layers == range(3)
    assert model(ids, labels=labels).logits is None  # never materialised on the adjoint path
    assert_close(grads(model, lambda: model(ids, labels=labels).loss), reference, 1e-10)
    with torch.no_grad():  # evaluation: the plain forward with logits
        assert model(ids, labels=labels).logits is not None
    ds_longseq.disable(model)
    assert model.adjoint_plan is None and not ds_longseq.is_enabled(model)


def test_not_an_ssm_stack_is_refused():
    llama = make_model("llama", torch.float32)
    with pytest.raises(ds_longseq.UnsupportedModelError, match="residual state-space model stack"):
        ds_longseq.enable(llama, {"adjoint": {"enabled": True}})
    assert not ds_longseq.is_enabled(llama)


@pytest.mark.parametrize(
    "section,message",
    [
        ({"adjoint": {"enabled": True, "truncation": 0}}, "truncation must be a positive integer"),
        ({"adjoint": {"enabled": True, "truncation": -5}}, "T-bar >= 1"),
        ({"adjoint": {"enabled": True, "layer_split": [2, 0]}}, "list of positive layer counts"),
        ({"adjoint": {"enabled": True}, "streambp": {"enabled": True}}, "patch transformer layers"),
        ({"adjoint": {"enabled": True}, "lm_head": {"enabled": True}}, "already chunks the LM head"),
    ],
)
def test_bad_config_is_refused_before_any_compute(section, message):
    model = tiny()
    with pytest.raises(LongSeqConfigError, match=message):
        ds_longseq.enable(model, section)
    assert model.adjoint_plan is None


def test_layer_split_must_match_world_and_model():
    assert split_layers(5, 2) == [(0, 3), (3, 5)]
    assert split_layers(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="world size is 3"):
        split_layers(4, 3, [2, 2])
    with pytest.raises(ValueError, match="summing to the model's 4 layers"):
        split_layers(4, 2, [2, 3])
    with pytest.raises(ValueError, match="launch at most 2 processes"):
        split_layers(2, 4)
    with pytest.raises(ValueError, match="4 entries but the world size is 1"):  # one process owns all layers
        ds_longseq.enable(tiny(), {"adjoint": {"enabled": True, "layer_split": [1, 1, 1, 1]}})


def test_left_padding_is_refused():
    model = tiny()
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    model(ids, labels=labels, attention_mask=mask)  # right padding is fine
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="pad on the right"):
        model(ids, labels=labels, attention_mask=mask)


def test_ssm_config_validation():
    with pytest.raises(ValueError, match="state_size must be a positive integer"):
        SSMConfig(state_size=0)
    assert SSMConfig(hidden_size=8).inner_size == 16


# ---- transformers' Mamba-1 --------------------------------------------------------------------------------


def tiny_mamba(dtype=torch.float64, residual_in_fp32=False, family="mamba"):
    """transformers' Mamba-1, or Mamba-2 (4 heads of 8 channels in 2 groups, SSD chunks of 8 tokens)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=3, expand=2, conv_kernel=4,
                  residual_in_fp32=residual_in_fp32)
    if family == "mamba2":
        config = transformers.Mamba2Config(num_heads=4, head_dim=8, n_groups=2, chunk_size=8, **common)
        model = transformers.Mamba2ForCausalLM(config)
    else:
        model = transformers.MambaForCausalLM(transformers.MambaConfig(time_step_rank=4, **common))
    return model.to(dtype)


def float64_gated_norms(model):
    """Mamba-2's gated RMSNorm in the input dtype (transformers' rounds to float32 even in float64)."""
    import types

    def forward(self, x, gate=None):
        if gate is not None:
            x = x * torch.nn.functional.silu(gate)
        g = x.view(*x.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * g.view(x.shape)

    for module in model.modules():
        if type(module).__name__ == "MambaRMSNormGated":
            module.forward = types.MethodType(forward, module)
    return model


def mamba_reference_loss(model, ids, labels):
    from ds_longseq.adjoint import ssm_stack

    stack = ssm_stack(model)
    y = stack.embed(ids)
    for layer in stack.layers:
        a, b, ctx = layer.pre(y)
        y = layer.residual(y) + layer.post(loop_scan(a, b), ctx)
    return causal_lm_loss(stack.lm_head(stack.norm_f(y)), labels)


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_mamba_maps_reproduce_transformers(family):
    """Our maps compute transformers' function (its torch path: token loop / SSD chunks), float32."""
    model = tiny_mamba(torch.float32, residual_in_fp32=True, family=family)
    ids, labels = batch()
    hf = grads(model, lambda: model(ids, labels=labels).loss)
    ours = grads(model, lambda: mamba_reference_loss(model, ids, labels))
    assert_close(ours, hf, 1e-5)  # float32 round-off of two scan orders


@pytest.mark.parametrize("family,chunk_size", [("mamba", 5), ("mamba", 64), ("mamba2", 6)])
def test_mamba_adjoint_float64_equals_autograd(family, chunk_size):
    """float64 with transformers' float32 RMSNorms made float64 (tests.helpers.full_precision_norms)."""
    model = float64_gated_norms(full_precision_norms(tiny_mamba(family=family)))
    tied = model.lm_head.weight is model.backbone.embeddings.weight
    assert tied == (family == "mamba")  # the configs' defaults: Mamba-1 ties, Mamba-2 does not
    ids, labels = batch()
    reference = grads(model, lambda: mamba_reference_loss(model, ids, labels))
    ds_longseq.enable(model, {"adjoint": {"enabled": True, "chunk_size": chunk_size}})
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    assert_close(grads(model, lambda: model(input_ids=ids, labels=labels).loss), reference, 1e-10)
    with torch.no_grad():  # evaluation goes to transformers' forward
        assert model(input_ids=ids, labels=labels).logits.shape == (2, 37, V)
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(2, 37, 16, dtype=torch.float64), labels=labels)
    ds_longseq.disable(model)
    assert "forward" not in model.__dict__


def test_other_ssm_families_are_refused_naming_the_term():
    import transformers

    config = transformers.FalconMambaConfig(vocab_size=V, hidden_size=16, state_size=4, num_hidden_layers=1)
    with pytest.raises(ds_longseq.UnsupportedModelError, match="Falcon-Mamba adds RMS norms on B, C and dt"):
        ds_longseq.enable(transformers.FalconMambaForCausalLM(config), {"adjoint": {"enabled": True}})
