"""Dropout under StreamBP and mini_seq on a CUDA device: the chunk replays draw from the CUDA generator
(``ops.draws`` sets the module's device's generator per region), exact against the stock model run whole with the
masks the forward drew (tests/mask_replay.py reads CUDA masks off the outputs: a batch without padding, so no
dropout input holds an exact zero), float64, 1e-10."""

from __future__ import annotations

import pytest
import torch

from ds_longseq.ops.draws import Draws
from tests.helpers import make_batch
from tests.mask_replay import against_mask_replay
from tests.test_dropout import check_chunk_attention_dropout, enabled, lora_model


@pytest.mark.parametrize("mode", ["streambp", "mini_seq", "streambp_offload"])
def test_lora_dropout_on_cuda_exact_by_mask_replay(mode):
    model = lora_model().cuda()
    batch = {k: v.cuda() for k, v in make_batch(seq_len=37, pad=False).items()}
    ours = enabled(model, mode)
    ours(**batch).loss.backward()
    errs, recorder = against_mask_replay(ours, model, batch)
    assert recorder.calls > 0 and max(errs.values()) < 1e-10, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def test_a_region_sets_and_restores_the_cuda_generator():
    device = torch.device("cuda")
    draws = Draws(1234, device)
    before = torch.cuda.get_rng_state(device)
    with draws.region(0):
        first = torch.rand(8, device=device)
    with draws.region(0):
        again = torch.rand(8, device=device)
    with draws.region(1):
        other = torch.rand(8, device=device)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(before, torch.cuda.get_rng_state(device)) and draws.drew


def test_chunk_attention_dropout_on_cuda_against_dense():
    """The attention-probability dropout of ops.chunk_attention on a CUDA device (the tiles' generators are the
    device's, the fused kernels refuse the tiles): tests/test_dropout.py's check, on CUDA."""
    check_chunk_attention_dropout(torch.device("cuda"))
