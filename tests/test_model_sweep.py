"""Every causal-LM family transformers ships, in both sweep modes: exact against the stock model, or refused.

A crash or a silent difference fails (``tests/model_sweep.py`` says what "exact" checks and why it holds
at 1e-10). ``docs/SUPPORTED_MODELS.md`` must be what the sweep gives now. The mutation controls break
ds_longseq on purpose and check the sweep notices: a check that cannot fail proves nothing.
"""

import pytest
import torch

from ds_longseq.modules.causal_lm import CausalLMForward
from ds_longseq.ops.streambp import KVStream
from tests import model_sweep, model_zoo

FAMILIES = model_zoo.causal_lm_model_types()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_is_exact_or_refused(model_type):
    results = [model_sweep.cached_check(model_type, mode) for mode in model_sweep.MODES]
    failed = [r for r in results if not r.ok]
    assert not failed, failed


def test_supported_models_doc_is_current():
    """docs/SUPPORTED_MODELS.md is the sweep's table (regenerate: python -m tests.model_sweep --write)."""
    expected = model_sweep.render_markdown(model_sweep.sweep())
    assert model_sweep.DOC.read_text() == expected, "run: python -m tests.model_sweep --write"


def test_sweep_coverage_target():
    """Issue 27's floor: at least 70 families exact in both modes (the doc test pins the exact list)."""
    results = model_sweep.sweep()
    exact = {r.model_type for r in results if r.outcome == "exact"}
    both = [t for t in exact if all(model_sweep.cached_check(t, m).outcome == "exact" for m in model_sweep.MODES)]
    assert len(both) >= 70, sorted(both)


# --- mutation controls: each breaks one exactness ingredient, on a family the sweep runs exactly --------


def test_mutation_dropped_prefix_keys_is_caught(monkeypatch):
    """StreamBP's chunks attending only their own keys (no prefix) must be reported as a difference."""
    monkeypatch.setattr(KVStream, "prefix", lambda self: (None, None))
    assert model_sweep.check_family("llama", "streambp").outcome == "different"


def test_mutation_skipped_router_aux_loss_is_caught(monkeypatch):
    """A mixture of experts without its load-balancing term must be reported as a difference."""
    monkeypatch.setattr(CausalLMForward, "_router_aux_loss_wanted", lambda self, kwargs: False)
    assert model_sweep.check_family("mixtral", "streambp").outcome == "different"


def test_mutation_dropped_attention_sinks_is_caught(monkeypatch):
    """gpt-oss without its attention sinks (s_aux) must be reported as a difference."""
    import ds_longseq.ops.attention as attention

    monkeypatch.setattr(attention, "_with_sink_logits", lambda out, lse, sinks: (out, lse))
    assert model_sweep.check_family("gpt_oss", "streambp").outcome == "different"


def test_mutation_stock_fallback_is_caught(monkeypatch):
    """A layer that quietly runs its stock forward instead of the chunked one is not exact."""
    from ds_longseq.modules.decoder_layer import StreamBPLayerForward

    monkeypatch.setattr(StreamBPLayerForward, "__call__", lambda self, *a, **k: self.orig_forward(*a, **k))
    result = model_sweep.check_family("llama", "streambp")
    assert result.outcome == "different" and "chunked path ran on 0" in result.detail, result


def test_float64_context_restores_torch():
    """The full-float64 patch is undone on exit (later tests see stock torch)."""
    x = torch.ones(2, dtype=torch.float64)
    with model_sweep.full_float64():
        assert x.float().dtype == torch.float64 and x.to(torch.float32).dtype == torch.float64
    assert x.float().dtype == torch.float32 and x.to(torch.float32).dtype == torch.float32
