"""StreamBP's kept attention outputs on CUDA (``streambp.keep_attention_output``, issue 61): the backward's replay
hands the fused kernels' backwards (cuDNN, FlashAttention-2, the memory-efficient one) the output and log-sum-exp the
forward returned instead of running their forward again.

Kept or recomputed, the same kernels run their backward on the same operands, so with deterministic algorithms the
results are bitwise equal wherever the recomputing run is bitwise reproducible (checked first, else skipped: a bitwise
comparison would test nothing); and the replay runs no attention forward. Also with the outputs in host memory
(offloaded with the layer inputs) and at float32 (the memory-efficient kernel).
"""

from __future__ import annotations

import pytest
import torch

import ds_longseq
import ds_longseq.ops.chunk_attention as chunk_attention
from tests.gpu.test_offload_gpu import _batch, _bitwise, _deterministic, _model, _require_reproducible  # noqa: F401
from tests.helpers import clone, loss_and_grads

STREAMBP = {"streambp": {"enabled": True, "chunk_size": 512}, "lm_head": {"enabled": True, "chunk_size": 1024}}


def _section(keep: bool, offload: bool = False) -> dict:
    section = {**STREAMBP, "streambp": {**STREAMBP["streambp"], "keep_attention_output": keep}}
    return {**section, "offload": {"layer_inputs": "cpu"}} if offload else section


@pytest.mark.parametrize("offload", [False, True], ids=["device", "host"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_outputs_bitwise_as_recomputed_on_cuda(dtype, offload, monkeypatch):
    model, batch = _model(dtype), _batch(2048)
    recomputed = _require_reproducible(ds_longseq.enable(clone(model), _section(False, offload)), batch)
    kept = ds_longseq.enable(clone(model), _section(True, offload))
    loss_and_grads(kept, batch)  # the first forward's probes
    calls = []
    compute = chunk_attention._attention_forward
    monkeypatch.setattr(chunk_attention, "_attention_forward", lambda *a, **k: calls.append(1) or compute(*a, **k))
    assert _bitwise(loss_and_grads(kept, batch), recomputed)
    # forward only: 4 layers x 4 chunks of 512 tokens, none in the replay
    assert len(calls) == 4 * 4, len(calls)
