"""TRL's fused-LM-head call (``model(..., labels=, fused_lm_head=True)``) served by ds_longseq.

ds_longseq answers it with its chunked head (``FusedLMHeadOutput``). Checked against per-token
quantities computed here from the stock model's float64 logits (values and every gradient, 1e-10),
including TRL's ``mean_logits`` and ``log_sum_sq_probs`` and a temperature (the logits, after the
family's final-logit softcap, divided by it), and, for the protocol (shapes, masking, loss
normalisation, which fields are None), against TRL's own fused head on the stock model in float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ds_longseq
from ds_longseq.forwards.token_outputs import FUSED_HEAD_OUTPUTS, FusedHeadSettings, FusedLMHeadOutput
from ds_longseq.ops import chunked_token_logprobs, chunked_token_outputs
from ds_longseq.patch import configure_fused_lm_head, configure_loss_statistics
from tests.helpers import clone, grads_of, make_batch, make_model, reference_loss, rel_err
from tests.test_families import exact, right_padded_batch

CONFIGS = {
    "streambp+lm_head": {
        "streambp": {"enabled": True, "chunk_size": 5}, "attention": {"kv_block_size": 4},
        "lm_head": {"enabled": True, "chunk_size": 7},
    },
    "streambp, stock head": {"streambp": {"enabled": True, "chunk_size": 5}, "attention": {"kv_block_size": 4}},
}


def _stock_per_token(model, batch):
    """(log_probs, entropy, is_top1, label_mask), (B, T - 1) each, from the stock float64 logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    log_p = torch.log_softmax(logits, dim=-1)
    index = targets.clamp_min(0).unsqueeze(-1)
    log_probs = log_p.gather(-1, index).squeeze(-1) * mask
    entropy = -(log_p.exp() * log_p).sum(-1) * mask
    top1 = (logits.gather(-1, index).squeeze(-1) >= logits.amax(-1)) & mask
    return log_probs, entropy, top1, mask


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_head_call_is_exact(name):
    model = make_model("llama", torch.float64)
    ours = ds_longseq.enable(clone(model), CONFIGS[name])
    batch = make_batch()
    g = torch.Generator().manual_seed(5)
    w_lp, w_h = (torch.randn(batch["labels"][:, 1:].shape, generator=g, dtype=torch.float64) for _ in range(2))

    def objective(log_probs, entropy):  # any function of the per-token outputs, as TRL's losses are
        return (log_probs * w_lp).sum() + (entropy * w_h).sum()

    ref_out = {}

    def reference():
        lp, ent, top1, mask = _stock_per_token(model, batch)
        ref_out.update(lp=lp.detach(), ent=ent.detach(), top1=top1, mask=mask)
        return objective(lp, ent)

    got = {}

    def fused():
        out = ours(**batch, fused_lm_head=True)
        got["out"] = out
        return objective(out.log_probs, out.entropy)

    _, ref_grads, ref_gin = grads_of(model, reference)
    _, grads, gin = grads_of(ours, fused)
    out = got["out"]
    assert isinstance(out, FusedLMHeadOutput) and out.log_probs.shape == ref_out["lp"].shape
    torch.testing.assert_close(out.log_probs.detach(), ref_out["lp"], rtol=0, atol=1e-10)
    torch.testing.assert_close(out.entropy.detach(), ref_out["ent"], rtol=0, atol=1e-10)
    # is_top1 from two computations: it could differ only where the target logit and the largest other one are within
    # float64 rounding (~1e-15); the smallest such gap here is 0.69 (label_mask: from the labels alone)
    assert torch.equal(out.is_top1, ref_out["top1"]) and torch.equal(out.label_mask, ref_out["mask"])
    count = ref_out["mask"].sum()
    torch.testing.assert_close(out.loss.detach(), -ref_out["lp"].sum() / count, rtol=1e-12, atol=0)
    torch.testing.assert_close(gin, ref_gin, rtol=1e-10, atol=1e-12)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")


def _trl_fused_head_utils():
    """``trl.trainer.utils`` where it has ``add_fused_lm_head`` (TRL 1.16); skips on TRL 1.9, which has no fused-LM-head
    protocol (its trainers' calls are served otherwise: ds_longseq/trainer/trl.py)."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(trl_utils, "add_fused_lm_head"):
        import trl

        pytest.skip(f"TRL {trl.__version__} has no add_fused_lm_head (TRL 1.16's fused-LM-head protocol)")
    return trl_utils


def test_fused_head_matches_trl_protocol():
    """Same fields, shapes and values as TRL's own fused head on the stock model (float32), with
    ``num_items_in_batch`` as the Trainer passes it."""
    trl_utils = _trl_fused_head_utils()
    model = make_model("llama", torch.float32)
    theirs = clone(model)
    trl_utils.add_fused_lm_head(theirs, outputs=("log_probs", "entropy", "is_top1"))
    ours = ds_longseq.enable(clone(model), CONFIGS["streambp+lm_head"])
    batch = make_batch()
    with torch.no_grad():
        a = ours(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(50.0))
        b = theirs(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(50.0))
    for field in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-5, atol=1e-5)
    assert torch.equal(a.label_mask, b.label_mask)
    assert torch.equal(a.is_top1, b.is_top1)  # float32, two heads: the top two logits are >= 0.5 apart (rounding 1e-6)


def test_token_logprobs_top1_flags():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 9, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=g, dtype=torch.float64)
    logits = hidden @ weight.t()
    targets = torch.randint(0, 11, (2, 9), generator=g)
    targets[0, :4] = logits[0, :4].argmax(-1)  # some hits for sure
    targets[1, 2] = -100
    _, mask, _, top1 = chunked_token_logprobs(hidden, weight, targets, chunk_size=4, top1=True)
    expected = (logits.argmax(-1) == targets) & mask
    # chunked logits vs the whole product: the flags could differ only at a float64 near-tie (the gaps here >= 0.012)
    assert torch.equal(top1, expected) and bool(top1[0, :4].all()) and not bool(top1[1, 2])


def _stock_fields(model, batch, temperature: float = 1.0) -> dict[str, torch.Tensor]:
    """Every field of TRL's fused head, (B, T - 1) each, from the stock float64 logits (after the
    family's final-logit softcap, which the stock forward applies) divided by the temperature,
    by the definitions: p = softmax, log sum_v p_v^2, the plain mean over the vocabulary."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1] / temperature
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    index = targets.clamp_min(0).unsqueeze(-1)
    return {
        "log_probs": log_p.gather(-1, index).squeeze(-1) * mask,
        "entropy": -(p * log_p).sum(-1) * mask,
        "mean_logits": logits.mean(-1) * mask,
        "log_sum_sq_probs": torch.log((p * p).sum(-1)) * mask,
        "is_top1": (logits.gather(-1, index).squeeze(-1) >= logits.amax(-1)) & mask,
        "label_mask": mask,
    }


# (family, long_seq config, temperature): Gemma 2 has a final-logit softcap (3.0 in the test model)
FIELD_CASES = {
    "llama-chunked-T0.7": ("llama", "streambp+lm_head", 0.7),
    "llama-stock-head-T0.7": ("llama", "streambp, stock head", 0.7),
    "llama-chunked-T1": ("llama", "streambp+lm_head", 1.0),
    "gemma2-softcap-chunked-T1.3": ("gemma2", "streambp+lm_head", 1.3),
    "gemma2-softcap-stock-head-T1.3": ("gemma2", "streambp, stock head", 1.3),
}


@pytest.mark.parametrize("case", list(FIELD_CASES))
def test_fused_head_all_fields_and_temperature_exact(case):
    """mean_logits, log_sum_sq_probs and the temperature: values against the stock float64 logits,
    and the gradients of log_probs and entropy, to 1e-10."""
    arch, config, temperature = FIELD_CASES[case]
    if arch == "gemma2":  # float64 norms and attention in the reference (see tests/test_families.py)
        model, batch = exact(make_model(arch, torch.float64)), right_padded_batch()
    else:
        model, batch = make_model(arch, torch.float64), make_batch()
    ours = ds_longseq.enable(clone(model), CONFIGS[config])
    configure_fused_lm_head(ours, temperature=temperature, outputs=FUSED_HEAD_OUTPUTS)
    g = torch.Generator().manual_seed(5)
    w_lp, w_h = (torch.randn(batch["labels"][:, 1:].shape, generator=g, dtype=torch.float64) for _ in range(2))

    def objective(log_probs, entropy):
        return (log_probs * w_lp).sum() + (entropy * w_h).sum()

    ref = {}

    def reference():
        ref.update(_stock_fields(model, batch, temperature))
        return objective(ref["log_probs"], ref["entropy"])

    got = {}

    def fused():
        got["out"] = ours(**batch, fused_lm_head=True)
        return objective(got["out"].log_probs, got["out"].entropy)

    _, ref_grads, ref_gin = grads_of(model, reference)
    _, grads, gin = grads_of(ours, fused)
    out = got["out"]
    for field in ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(getattr(out, field).detach(), ref[field].detach(), rtol=0, atol=1e-10,
                                   msg=lambda m, f=field: f"{f}: {m}")
    assert torch.equal(out.is_top1, ref["is_top1"]) and torch.equal(out.label_mask, ref["label_mask"])  # gaps >= 0.012
    assert not out.mean_logits.requires_grad and not out.log_sum_sq_probs.requires_grad  # statistics, as TRL's
    torch.testing.assert_close(out.loss.detach(), -ref["log_probs"].detach().sum() / ref["label_mask"].sum(),
                               rtol=1e-12, atol=0)
    torch.testing.assert_close(gin, ref_gin, rtol=1e-10, atol=1e-12)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")
    if temperature != 1.0:  # the temperature bites: the T = 1 values are far off
        plain = _stock_fields(model, batch)
        assert (plain["log_probs"] - ref["log_probs"]).abs().max() > 1e-3


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_head_matches_trl_with_every_field(temperature):
    """TRL's own fused head on the stock float32 model, every output requested, with a temperature:
    the same fields (values and the gradients of log_probs and entropy) as ds_longseq's."""
    trl_utils = _trl_fused_head_utils()
    model = make_model("llama", torch.float32)
    theirs = clone(model)
    trl_utils.add_fused_lm_head(theirs, temperature=temperature, outputs=FUSED_HEAD_OUTPUTS)
    ours = ds_longseq.enable(clone(model), CONFIGS["streambp+lm_head"])
    configure_fused_lm_head(ours, temperature=temperature, outputs=FUSED_HEAD_OUTPUTS)
    batch = make_batch()
    w = torch.randn(batch["labels"][:, 1:].shape, generator=torch.Generator().manual_seed(3))
    outs = {}

    def run(name, m):
        def loss():
            outs[name] = m(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(50.0))
            return (outs[name].log_probs * w).sum() + outs[name].entropy.sum() + outs[name].loss
        return grads_of(m, loss)

    _, g_ours, gin_ours = run("ours", ours)
    _, g_theirs, gin_theirs = run("theirs", theirs)
    a, b = outs["ours"], outs["theirs"]
    for field in ("loss", "log_probs", "entropy", "mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(getattr(a, field).detach(), getattr(b, field).detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, f=field: f"{f}: {m}")
    assert torch.equal(a.label_mask, b.label_mask) and torch.equal(a.is_top1, b.is_top1)  # gaps >= 0.5 (float32 1e-6)
    # norm-wise: float32 roundings of two different kernels (and StreamBP's chunked layers) sum differently
    errs = {"input": rel_err(gin_ours, gin_theirs), **{n: rel_err(g_ours[n], g_theirs[n]) for n in g_theirs}}
    assert set(g_ours) == set(g_theirs) and max(errs.values()) < 1e-5, errs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_statistics_are_exact(name):
    """With configure_loss_statistics (TRL 1.9's SFTTrainer under loss_type="chunked_nll"), a loss call returns the
    loss and the sums TRL reads (valid targets, their entropies, their top-1 hits), float64 against the stock logits:
    the loss and every gradient as the stock loss's (1e-10: float64 rounding of two summation orders), the counts
    exactly; over num_items_in_batch when given."""
    model = make_model("llama", torch.float64)
    ours = ds_longseq.enable(clone(model), CONFIGS[name])
    configure_loss_statistics(ours)
    batch = make_batch()
    got = {}

    def statistics():
        got["out"] = ours(**batch)
        return got["out"].loss

    _, ref_grads, ref_gin = grads_of(model, lambda: reference_loss(model, batch))
    _, grads, gin = grads_of(ours, statistics)
    out = got["out"]
    lp, ent, top1, mask = _stock_per_token(model, batch)
    assert out.logits is None and out.aux_loss is None
    torch.testing.assert_close(out.loss.detach(), -lp.sum().detach() / mask.sum(), rtol=1e-12, atol=0)
    assert int(out.num_valid_tokens) == int(mask.sum()) and float(out.num_correct_tokens) == float(top1.sum())
    torch.testing.assert_close(out.entropy_sum, ent.sum().detach(), rtol=1e-12, atol=0)
    assert not out.entropy_sum.requires_grad and not out.num_correct_tokens.requires_grad  # metrics only
    torch.testing.assert_close(gin, ref_gin, rtol=1e-10, atol=1e-12)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-10, atol=1e-12, msg=lambda m, n=n: f"{n}: {m}")
    with torch.no_grad():
        assert ours(**batch, num_items_in_batch=torch.tensor(50.0)).loss == pytest.approx(-lp.sum().item() / 50.0)
        configure_loss_statistics(ours, False)  # back to the plain loss output
        assert not hasattr(ours(**batch), "num_valid_tokens")


def test_loss_statistics_match_trl_chunked_nll():
    """TRL 1.9's own chunked-NLL forward (what its SFTTrainer patches in for loss_type="chunked_nll") on the stock
    float32 model, and ds_longseq's forward with configure_loss_statistics: the same loss and sums (1e-5: float32
    rounding of two summation orders; the counts exactly). Skips where TRL has no such forward (TRL 1.16 reads
    "chunked_nll" as "nll" and makes fused-LM-head calls)."""
    sft = pytest.importorskip("trl.trainer.sft_trainer")
    patch_chunked = getattr(sft, "_patch_chunked_ce_lm_head", None)
    if patch_chunked is None:
        import trl

        pytest.skip(f"TRL {trl.__version__} has no chunked_nll forward (TRL 1.9's protocol)")
    model = make_model("llama", torch.float32)
    theirs = clone(model)
    patch_chunked(theirs, chunk_size=7)
    ours = ds_longseq.enable(clone(model), CONFIGS["streambp+lm_head"])
    configure_loss_statistics(ours)
    batch = make_batch()
    with torch.no_grad():
        for count in (None, torch.tensor(50.0)):
            a, b = ours(**batch, num_items_in_batch=count), theirs(**batch, num_items_in_batch=count)
            torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a.entropy_sum, b.entropy_sum, rtol=1e-5, atol=1e-5)
            assert int(a.num_valid_tokens) == int(b.num_valid_tokens)
            assert float(a.num_correct_tokens) == float(b.num_correct_tokens)


def test_fused_head_unrequested_fields_are_none():
    """As TRL's head: fields not requested are None (and not computed); the default request is
    what TRL's SFTTrainer reads."""
    ours = ds_longseq.enable(make_model("llama", torch.float32), CONFIGS["streambp+lm_head"])
    batch = make_batch()
    with torch.no_grad():
        out = ours(**batch, fused_lm_head=True)
        assert out.entropy is not None and out.is_top1 is not None
        assert out.mean_logits is None and out.log_sum_sq_probs is None
        configure_fused_lm_head(ours, outputs=("log_probs", "log_sum_sq_probs"))
        out = ours(**batch, fused_lm_head=True)
    assert out.log_sum_sq_probs is not None
    assert out.entropy is None and out.is_top1 is None and out.mean_logits is None
    hidden = torch.randn(2, 5, 8, dtype=torch.float64)
    none = chunked_token_outputs(hidden, torch.randn(11, 8, dtype=torch.float64), torch.zeros(2, 5, dtype=torch.long),
                                 chunk_size=4)
    assert none[2:] == (None, None, None, None)


def test_fused_head_cast_lm_head_to_fp32_under_autocast():
    """GRPO's cast_lm_head_to_fp32: under bfloat16 autocast the head projects the hidden states it
    is given in float32 (the log-probs equal a float64 projection of them to a few float32 bits); without it, in
    bfloat16 (far off: the test would otherwise pass vacuously)."""
    ours = ds_longseq.enable(make_model("llama", torch.float32), CONFIGS["streambp+lm_head"])
    batch = make_batch()
    seen = {}
    ours.lm_head.register_forward_hook(lambda m, args, kwargs, out: seen.update(h=args[0]), with_kwargs=True)
    targets = batch["labels"][:, 1:]
    mask = targets != -100

    def run(cast: bool):
        configure_fused_lm_head(ours, temperature=0.7, cast_lm_head_to_fp32=cast)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = ours(**batch, fused_lm_head=True)
        logits = F.linear(seen["h"].double(), ours.lm_head.weight.double()) / 0.7
        ref = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask
        # in units of one float32 bit of the largest log-prob: what a float32 projection can hold
        return ((out.log_probs.double() - ref).abs().max() / (ref.abs().max() * torch.finfo(torch.float32).eps)).item()

    # a few bits (measured 1.04e-6 with the largest |log-prob| 9.7: 0.9 of a bit); without the cast ~2e4 bits
    assert run(True) < 4
    assert run(False) > 1000


def test_fused_head_settings_refused():
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        FusedHeadSettings(temperature=0.0)
    with pytest.raises(ValueError, match=r"outputs \['logits'\] not computed by ds_longseq"):
        FusedHeadSettings(outputs=("log_probs", "logits"))
    with pytest.raises(RuntimeError, match="needs ds_longseq.enable"):
        configure_fused_lm_head(make_model("llama", torch.float32), temperature=0.7)
    with pytest.raises(RuntimeError, match="configure_loss_statistics needs ds_longseq.enable"):
        configure_loss_statistics(make_model("llama", torch.float32))
    hidden, weight = torch.randn(1, 3, 4), torch.randn(5, 4)
    targets = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        chunked_token_outputs(hidden, weight, targets, chunk_size=2, temperature=-1.0)
    with pytest.raises(ValueError, match=r"unknown per-token outputs \['is_top1'\]"):
        chunked_token_outputs(hidden, weight, targets, chunk_size=2, outputs=("is_top1",))
