"""One-time probes leave the random generators as they found them (issue 62, item 11).

The first training forward after ``enable`` runs probes (the token-wise checks of a mini_seq MLP and of a StreamBP
layer with no token mixer, the carried-state check of a recurrent mixer, the unread-outputs probe of an attention
layer, the automatic chunk size, the head-sharded mixer's layout check under sequence parallelism). The token-wise
check ran the MLP, dropout included, on the global generator: the first forward then drew other dropout masks than
every later forward from the same seed, so re-seeding did not reproduce step 1 and a resumed run's first step
differed from the uninterrupted run's.

Each probe is checked the same way: from one seed, the first training forward (probes run) and a later one (probes
done) draw the same masks (the same loss and gradients, bitwise) and leave the global generator in the same state;
and with nothing drawing (no dropout) the first forward leaves the generator exactly as the stock model's does.
Without ``ops.draws.generators_kept`` around the probes, the mini_seq MLP's, the token-wise layer's and the
head-sharded mixer's cases fail; the unread-outputs and carried-state probes run their chunks inside the chunk's own
draws region (each pass from its own state), so they moved nothing before either, and these cases keep it so.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ds_longseq
from tests import model_zoo
from tests.dist_utils import run_distributed
from tests.helpers import lora_with_dropout, make_batch, make_model

DT = torch.float64
PROBES = {
    # probe: (model type, long_seq section, tokens)
    "mini_seq token-wise MLP": ("llama", {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}}, 37),
    "streambp unread outputs, auto chunk": ("llama", {"streambp": {"enabled": True, "chunk_size": "auto"}}, 37),
    "streambp unread outputs": ("llama", {"streambp": {"enabled": True, "chunk_size": 10}}, 37),
    "streambp token-wise layer, carried state": ("nemotron_h", {"streambp": {"enabled": True, "chunk_size": 11}}, 40),
}


def _model(model_type: str, dropout: float, targets: list[str] | None = None):
    """The family's tiny model with LoRA (PEFT) on every linear of its layers, ``lora_dropout`` on each: draws in
    every module a probe runs."""
    pytest.importorskip("peft")
    model = make_model("llama", DT) if model_type == "llama" else model_zoo.tiny_model(model_type, DT)
    # PEFT refuses LoRA on a Mamba mixer's out_proj and conv1d: every other linear of NemotronH's blocks
    if targets is None:
        targets = ["in_proj", "up_proj", "down_proj", "q_proj", "k_proj", "v_proj", "o_proj"] \
            if model_type == "nemotron_h" else "all-linear"
    model = lora_with_dropout(model, dropout, targets)
    model.train()
    return model


def _enabled(model, section: dict):
    ours = copy.deepcopy(model)
    ds_longseq.enable(ours.base_model.model, section)
    return ours


def _step(model, batch: dict, seed: int):
    """(loss, gradients, the CPU generator's state after) of one training forward and backward from ``seed``."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, torch.get_rng_state()


def _batch(model_type: str, seq_len: int) -> dict:
    return make_batch(seq_len=seq_len) if model_type == "llama" else model_zoo.tiny_batch(model_type, seq_len=seq_len)


@pytest.mark.parametrize("probe", list(PROBES))
def test_the_first_forward_draws_what_every_later_one_draws(probe):
    model_type, section, seq_len = PROBES[probe]
    ours, batch = _enabled(_model(model_type, dropout=0.3), section), _batch(model_type, seq_len)
    first = _step(ours, batch, seed=5)  # the probes run here
    later = _step(ours, batch, seed=5)
    assert torch.equal(first[2], later[2]), "the first forward left the generator elsewhere"
    assert torch.equal(first[0], later[0]), (first[0], later[0])
    assert first[1].keys() == later[1].keys() and all(torch.equal(first[1][k], later[1][k]) for k in first[1])


@pytest.mark.parametrize("probe", list(PROBES))
def test_without_draws_the_first_forward_leaves_the_generator_as_stock_does(probe):
    model_type, section, seq_len = PROBES[probe]
    stock, batch = _model(model_type, dropout=0.0), _batch(model_type, seq_len)
    ours = _enabled(stock, section)
    assert torch.equal(_step(ours, batch, seed=5)[2], _step(stock, batch, seed=5)[2])


def _head_sharded_mixer_steps(rank: int) -> list:
    """Qwen3.5 text under Ulysses SP 2 with its Gated DeltaNet layers sharded by heads (the layout check is the
    first forward's probe) and LoRA dropout: the generator state and loss after the first and a later forward."""
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch

    model = _model("qwen3_5_text", dropout=0.3, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"])
    # the mixer itself draws from the global generator, its output not depending on the draw (as zero-scale router
    # noise would: a mixer whose output did, a dropout, is refused by the layout check, whose shares would differ)
    for layer in model.base_model.model.model.layers:
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None:
            forward = mixer.forward
            mixer.forward = lambda *a, _forward=forward, **k: (torch.rand(()), _forward(*a, **k))[1]
    ds_longseq.enable(model.base_model.model, {"sequence_parallel": {"size": 2, "recurrent": "heads"}},
                      sp_group=dist.group.WORLD)
    local = shard_batch(model_zoo.tiny_batch("qwen3_5_text"), rank, 2)
    return [_step(model, local, seed=5)[::2] for _ in range(2)]


def test_the_head_sharded_mixers_layout_check_leaves_the_generator_alone():
    for first, later in run_distributed(_head_sharded_mixer_steps, world_size=2, timeout=300):
        assert torch.equal(first[1], later[1]) and torch.equal(first[0], later[0])
