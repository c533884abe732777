"""Families under Ulysses x ring, on CPU gloo ranks, against one process (float64, 1e-10): attention of other kinds
(multi-head latent attention's value head dim, sinks) and hybrid models (recurrent layers).

Under a ring each rank's tokens are two runs of the sequence (``ops.sp_layout``). With
``sequence_parallel.recurrent="pass_state"`` (inside StreamBP) a recurrent layer carries its states from each run
to the rank holding the next one (``ops.state_passing.StateRing``), and StreamBP's chunks never cross a run's end.
With ``"heads"`` each rank runs the mixer on the whole sequence for its share of the heads: the gathered tokens
are put in the sequence's order first (``forwards.head_sharding_forward``). The ranks hold different numbers of valid
tokens (``model_zoo.tiny_batch``: one row right-padded, one prompt masked); the loss, this rank's input gradient
and every parameter gradient (summed over the ranks) must equal the stock model on the whole batch.
"""

from __future__ import annotations

import pytest
import torch

from tests import model_sweep, model_zoo
from tests.dist_utils import run_distributed

STREAMBP = {"streambp": {"enabled": True, "chunk_size": 3}, "attention": {"kv_block_size": 4},
            "lm_head": {"enabled": True, "chunk_size": 9}}
# case -> (long_seq sections besides sequence_parallel, sequence_parallel.recurrent, mutation)
CASES = {
    "whole": ({}, "heads", None),  # ring attention on whole shards (recurrent applies to hybrids only)
    "streambp": (STREAMBP, "heads", None),
    "pass_state": (STREAMBP, "pass_state", None),
    "heads": ({}, "heads", None),
    "heads_streambp": (STREAMBP, "heads", None),
    # controls, each must fail: every run starts from zeros (the received states dropped); the chain of runs
    # replaced by Ulysses' rank-to-rank one; the head-sharded mixer run on the tokens in rank order
    "state_not_passed": (STREAMBP, "pass_state", "state_not_passed"),
    "run_order_ignored": (STREAMBP, "pass_state", "run_order_ignored"),
    "heads_rank_order": ({}, "heads", "heads_rank_order"),
}


def _mutated(mutation: str | None):
    """Patches for ``mutation`` as [(owner, name, replacement)]."""
    from ds_longseq.forwards import head_sharding_forward
    from ds_longseq.ops import state_passing

    recv, init = state_passing.StateRing.from_previous, state_passing.StateRing.__init__
    return {
        None: [],
        "state_not_passed": [(state_passing.StateRing, "from_previous",
                              lambda self, device, segment=0: (recv(self, device, segment), {})[1])],
        "run_order_ignored": [(state_passing.StateRing, "__init__",
                               lambda self, group, positions=None: init(self, group, None))],
        "heads_rank_order": [(head_sharding_forward, "sp_positions", lambda T, u, r: torch.arange(T))],
    }[mutation]


def ring_hybrid_worker(rank: int, world: int, ring: int, families: dict[str, list[str]]):
    """{family: {"positions": this rank's, case: (loss, grads summed over the group, input grads)}}."""
    import torch.distributed as dist

    import ds_longseq
    from tests.sp_harness import rank_step

    out = {}
    for model_type, cases in families.items():
        batch = model_zoo.tiny_batch(model_type)
        out[model_type] = {}
        for case in cases:
            sections, recurrent, mutation = CASES[case]
            patches = [(owner, name, getattr(owner, name), new) for owner, name, new in _mutated(mutation)]
            for owner, name, _, new in patches:
                setattr(owner, name, new)
            try:
                model = ds_longseq.enable(
                    model_zoo.tiny_model(model_type, torch.float64).train(),
                    {**sections, "sequence_parallel": {"size": world, "ring": ring, "recurrent": recurrent}},
                    sp_group=dist.group.WORLD)
                loss, grads, embeds, out[model_type]["positions"] = rank_step(
                    model, batch, rank, world, ring, model_sweep._loss_and_grads)
            finally:
                for owner, name, old, _ in patches:
                    setattr(owner, name, old)
            out[model_type][case] = (loss, grads, embeds)
    return out


def _worst(results, model_type: str, case: str) -> tuple[str, float]:
    batch = model_zoo.tiny_batch(model_type)
    loss, grads, embeds = model_sweep._loss_and_grads(model_zoo.tiny_model(model_type, torch.float64).train(), batch)
    errors = [model_sweep.worst_error(r[model_type][case], (loss, grads, embeds[:, r[model_type]["positions"]]))
              for r in results]
    return max(errors, key=lambda e: e[1])


def _check(results, families: dict[str, list[str]]) -> None:
    for model_type, cases in families.items():
        for case in cases:
            worst, error = _worst(results, model_type, case)
            if CASES[case][2] is None:
                assert error < 1e-10, (model_type, case, worst, error)
            else:
                assert error > 1e-3, (model_type, case, worst, error)


def test_hybrids_under_a_ring_match_one_process():
    """At SP 2 with the ring forced (1 x 2: rank 0 holds tokens [0, 10) and [30, 40), rank 1 [10, 30)), StreamBP
    chunks of 3. Qwen3.5 (Gated DeltaNet): states passed 0 -> 1 -> 0 along the runs and their gradients back, and
    sharded by heads over the group (whole shards and StreamBP); LFM2 (short convolution: its window is the state)
    and Bamba (Mamba-2: convolution and SSM states) passing state. Exact at 1e-10; each control fails by > 1e-3."""
    families = {
        "qwen3_5_text": ["pass_state", "heads", "heads_streambp", "state_not_passed", "run_order_ignored",
                         "heads_rank_order"],
        "lfm2": ["pass_state"],
        "bamba": ["pass_state"],
    }
    _check(run_distributed(ring_hybrid_worker, 2, (2, 2, families)), families)


def test_attention_kinds_under_a_ring_match_one_process():
    """At SP 2 with the ring forced (1 x 2), whole shards and StreamBP: DeepSeek-V3's multi-head latent attention
    (values of another head dim than queries and keys, under StreamBP taken at the attention call), gpt-oss's
    attention sinks (each query's extra logit merged once, not per ring step) and sliding windows."""
    families = {"deepseek_v3": ["whole", "streambp"], "gpt_oss": ["whole", "streambp"]}
    _check(run_distributed(ring_hybrid_worker, 2, (2, 2, families)), families)


DENSE_UNDER_A_RING = {
    "qwen3": ["whole", "streambp"],  # per-head query / key norms, GQA
    "olmo2": ["whole", "streambp"],  # query / key norms over every head together (before the heads split)
    "gemma3_text": ["whole", "streambp"],  # sliding and full layers, query / key norms, final softcap
    "phi3": ["whole", "streambp"],  # fused qkv projection, partial rotary
    "qwen3_moe": ["whole", "streambp"],  # mixture-of-experts MLPs beside a dense one
    "mixtral": ["whole", "streambp"],  # mixture of experts with a sliding window
    "gemma4_text": ["whole", "streambp"],  # keys / values shared across layers, per-layer head dims
    "mistral": ["whole"],
    "qwen2": ["whole"],  # attention bias
}


@pytest.mark.slow
def test_dense_families_under_a_ring_match_one_process():
    """The dense families whose sequence-parallel tests ran Ulysses alone, at SP 2 with the ring forced (1 x 2),
    whole shards and StreamBP: one parity test per attention kind (:data:`DENSE_UNDER_A_RING`)."""
    _check(run_distributed(ring_hybrid_worker, 2, (2, 2, DENSE_UNDER_A_RING)), DENSE_UNDER_A_RING)


@pytest.mark.slow
def test_hybrids_under_a_ring_of_4_match_one_process():
    """SP 4 as a ring of 4 (1 x 4) and as 2 x 2: each rank's runs chained through the group in sequence order."""
    families = {"qwen3_5_text": ["pass_state"], "lfm2": ["pass_state"], "nemotron_h": ["pass_state", "heads"]}
    for ring in (4, 2):
        _check(run_distributed(ring_hybrid_worker, 4, (4, ring, families)), families)
