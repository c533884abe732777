"""Hybrid stacks under StreamBP: linear-attention, state-space and short-convolution layers carried exactly
across chunks (``ops.carried_state``), beyond what the family sweep checks at its one chunk size.

Qwen3.5 text (Gated DeltaNet layers with a 4-wide short convolution and the stock torch scan in chunks of 64,
beside full-attention layers) is the representative; LFM2 (short convolutions only) and Kimi Linear (three
convolution states per layer) cover the other state layouts. References are the stock model on the whole
sequence, both sides in full float64 (``tests/model_sweep.py``: stock float32 casts such as Qwen3.5's
``A_log.float()`` kept at float64, so the comparison holds at 1e-10).
"""

from __future__ import annotations

import types

import pytest
import torch

import ds_longseq
from ds_longseq.families.decoder import decoder_adapter
from tests import model_sweep, model_zoo
from tests.dist_utils import run_distributed


def _streambp(chunk_size: int) -> dict:
    return {"streambp": {"enabled": True, "chunk_size": chunk_size}, "attention": {"kv_block_size": 16},
            "lm_head": {"enabled": True, "chunk_size": 23}}


def _worst_error(model_type: str, config: dict, seq_len: int) -> tuple[str, float]:
    """(name, relative error) of the worst of loss, input gradient and every parameter gradient, ds_longseq
    under ``config`` against the stock model on a batch of 2 rows of ``seq_len`` (row 0 padded, row 1's first
    labels masked)."""
    torch.manual_seed(0)
    model = model_zoo.tiny_model(model_type, torch.float64).train()
    batch = model_zoo.tiny_batch(model_type, seq_len=seq_len)
    reference = model_sweep._loss_and_grads(model, batch)
    ours = ds_longseq.enable(model, config)
    try:
        return model_sweep.worst_error(model_sweep._loss_and_grads(ours, batch), reference)
    finally:
        ds_longseq.disable(model)


@pytest.mark.parametrize("chunk_size", [1, 5, 13, 64, 100])
def test_qwen3_5_chunk_boundaries_anywhere(chunk_size):
    """150 tokens in chunks that are not multiples of the convolution width (4) nor of the stock scan's 64-token
    blocks, shorter than the window (1 runs as 2, the fewest a recurrent layer's chunk takes: every chunk continues
    the previous one's window; a 1-token last chunk joins the one before), and one chunk spanning several scan
    blocks: exact."""
    worst, error = _worst_error("qwen3_5_text", _streambp(chunk_size), 150)
    assert error < 1e-10, (worst, error)


@pytest.mark.parametrize("model_type", ["lfm2", "kimi_linear"])
def test_other_state_layouts_over_many_chunks(model_type):
    """LFM2's short convolution (a conv state only) and Kimi Linear's three convolution states plus a recurrent
    one, over 9 chunks of 11 tokens: exact."""
    worst, error = _worst_error(model_type, _streambp(11), 99)
    assert error < 1e-10, (worst, error)


def test_mixer_layer_keeps_its_input_and_the_boundary_states_only():
    """What a Gated DeltaNet layer under StreamBP keeps from forward to backward: its input (the only tensor saved
    through autograd) and the states at each chunk's start, none with a token dim (nothing of T x inner dim)."""
    model = ds_longseq.enable(model_zoo.tiny_model("qwen3_5_text", torch.float64), _streambp(13))
    layer = model.model.layers[0]
    assert model.config.layer_types[0] == "linear_attention"
    T = 40
    h = torch.randn(2, T, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(T).unsqueeze(0)
    cos_sin = model.model.rotary_emb(h, pos.expand(3, 1, -1))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(h, position_embeddings=cos_sin, position_ids=pos)
    assert len(saved) == 1 and saved[0] is h
    boundaries = out.grad_fn.boundaries
    assert len(boundaries) == 3 and boundaries[0] == {}  # chunks 13, 13, 13, 1: the last joins, 13, 13, 14
    attn = layer.linear_attn
    for states in boundaries[1:]:
        assert set(states) == {("conv", 0), ("recurrent", 0)}
        assert states[("conv", 0)].shape == (2, attn.conv_dim, attn.conv_kernel_size)
        assert states[("recurrent", 0)].shape == (2, attn.num_v_heads, attn.head_k_dim, attn.head_v_dim)
    out.square().sum().backward()
    assert h.grad is not None and all(p.grad is not None for p in layer.parameters())


def test_mutation_state_gradient_not_sent_back_is_caught(monkeypatch):
    """A carried state whose gradient never reaches the previous chunk (detached between chunks) must be reported
    as a difference."""
    from ds_longseq.ops.carried_state import CarriedState

    monkeypatch.setattr(CarriedState, "outputs_with_grads", lambda self, grads: ([], []))
    result = model_sweep.check_family("qwen3_5_text", "streambp")
    assert result.outcome == "different", result


@pytest.mark.parametrize("chunk_size", [pytest.param(2, marks=pytest.mark.slow), 13,
                                        pytest.param(64, marks=pytest.mark.slow)])  # heavy: 13 runs by default
def test_jamba_scan_continued_across_chunks(chunk_size):
    """Jamba's Mamba mixer reads its recurrent state but scans from zeros (its fused kernel takes no initial state):
    under StreamBP its scan is continued from the carried state (``ops.scan_from_state``: the zero-started scan plus
    the state carried through the chunk's decays). 99 tokens in chunks of 2 (49 continuations), 13 and 64, beside
    its attention and MoE layers: exact against the stock model on the whole sequence."""
    worst, error = _worst_error("jamba", _streambp(chunk_size), 99)
    assert error < 1e-10, (worst, error)


def test_state_read_but_ignored_is_refused_at_the_first_forward(monkeypatch):
    """Mutation: without the continued scan (Jamba's override dropped), its Mamba layers read their state but
    restart from zeros; the first forward over two chunks perturbs the state, sees the output unchanged and refuses
    the layer, naming it and the state."""
    from ds_longseq.families import discovery

    monkeypatch.setitem(discovery.OVERRIDES, "jamba", {})
    result = model_sweep.check_family("jamba", "streambp")
    assert result.outcome == "refused" and "JambaMambaDecoderLayer) reads its carried state(s) [('recurrent', 0)]" in (
        result.detail), result


@pytest.mark.parametrize("model_type", ["zamba", "zamba2"])
def test_zamba_refused_in_every_mode_naming_the_shared_block(model_type):
    """Zamba / Zamba2 call one shared transformer block (holding the attention, a level below the hybrid layer) from
    several layers: refused at enable in every mode, before compute, naming the layer attribute, the block and its
    attention."""
    names = {"zamba": ("shared_transf", "ZambaAttentionDecoderLayer", "ZambaAttention"),
             "zamba2": ("shared_transformer", "Zamba2AttentionDecoderLayer", "Zamba2Attention")}[model_type]
    for mode, config in model_sweep.MODES.items():
        with pytest.raises(ds_longseq.UnsupportedModelError) as refusal:
            ds_longseq.patch.check_model(model_zoo.tiny_model(model_type, torch.float64), config)
        message = str(refusal.value)
        assert all(name in message for name in names) and "a level further down" in message, (mode, message)


def test_mixer_that_does_not_carry_its_state_is_refused(monkeypatch):
    """A recurrent mixer that writes no state for the next chunk in its second chunk is refused by the runtime
    guard, naming the layer."""
    from ds_longseq.ops.carried_state import CarriedState

    update = CarriedState.update_recurrent_state

    def forgetful(self, states, *args, **kwargs):
        return states if self.index > 0 else update(self, states, *args, **kwargs)

    monkeypatch.setattr(CarriedState, "update_recurrent_state", forgetful)
    result = model_sweep.check_family("qwen3_5_text", "streambp")
    assert result.outcome == "refused" and "did not write its state(s) [('recurrent', 0)]" in result.detail, result


def test_older_cache_protocol_reads_the_carried_states():
    """transformers 5.16's mixers ask ``has_previous_state`` and then read ``cache.layers[i].conv_states[j]``,
    ``.recurrent_states[j]`` and ``.record_past`` (5.24's: ``get_conv_state`` ...): a StreamBP chunk's cache serves
    the same carried states that way, each read recorded for the runtime guard (the floor's sweep runs the hybrids
    through it)."""
    from ds_longseq.forwards.layer_cache import StreamCache
    from ds_longseq.ops.carried_state import CarriedState

    state = CarriedState()
    cache = StreamCache(types.SimpleNamespace(state=state))
    state.enter(0)
    assert not cache.has_previous_state(3) and not cache.has_previous_state()
    cache.update_conv_state(torch.ones(2, 4, 5), 3, conv_kernel_size=4)
    cache.update_recurrent_state(torch.full((2, 3), 2.0), 3)
    state.leave()
    state.enter(1)
    assert cache.has_previous_state(3) and cache.has_previous_state(3, state_idx=0)
    assert not cache.has_previous_state(3, state_idx=1) and not state.read  # asking is not reading
    layer = cache.layers[3]
    assert layer.record_past  # the multi-token path, never the in-place decode step
    assert torch.equal(layer.conv_states[0], torch.ones(2, 4, 4))
    assert torch.equal(layer.recurrent_states[0], torch.full((2, 3), 2.0))
    assert state.read == {("conv", 0), ("recurrent", 0)}


@pytest.mark.parametrize("mode", sorted(model_sweep.MODES))
def test_packed_rows_are_refused_on_hybrids(mode):
    """transformers' torch path carries a linear-attention state across packed documents' starts: refused before
    compute in both modes, naming the fix."""
    model = ds_longseq.enable(model_zoo.tiny_model("qwen3_5_text", torch.float64), model_sweep.MODES[mode])
    batch = model_zoo.tiny_batch("qwen3_5_text")
    del batch["attention_mask"]
    batch["position_ids"] = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, -1)
    with pytest.raises(NotImplementedError, match="packed documents on Qwen3_5ForCausalLM: its linear-attention"):
        model(**batch)


def _sp_results(recurrent: str, mutation: str | None = None, modes=("ulysses_only", "mini_seq", "streambp")):
    """[(rank, mode, result)] of Qwen3.5 text under Ulysses SP=2 with ``recurrent`` (the ranks' gradients summed),
    and the one-process reference cut to each rank's tokens."""
    from tests.test_feature_families import _sp_worker

    batch = model_zoo.tiny_batch("qwen3_5_text")
    reference = model_sweep._loss_and_grads(model_zoo.tiny_model("qwen3_5_text", torch.float64).train(), batch)
    half = batch["input_ids"].shape[1] // 2
    results = run_distributed(_sp_worker, 2, ("qwen3_5_text", modes, mutation, {"recurrent": recurrent}))
    return [
        (rank, mode, result[mode], (reference[0], reference[1], reference[2][:, rank * half:(rank + 1) * half]))
        for rank, result in enumerate(results) for mode in modes
    ]


ALL_SP_MODES = ("ulysses_only", "mini_seq", "streambp")
Case = tuple[str, str, tuple[str, ...], "str | None"]
"""(model type, recurrent, modes, mutation): one family's run in a multi-family sequence-parallel launch."""


def _hybrids_sp_worker(rank: int, cases: list[Case]) -> dict:
    """Every case on this rank, one process group for all: {case: ``_sp_worker``'s result}."""
    from tests.test_feature_families import _sp_worker

    return {case: _sp_worker(rank, case[0], case[2], case[3], {"recurrent": case[1]}) for case in cases}


def _mixers_get_layer_kwargs(model_type: str) -> bool:
    """Whether the installed transformers' layers of ``model_type`` hand their keyword arguments to their recurrent
    mixers (5.24's do; 5.16's Falcon-H1, LFM2, LFM2-MoE and NemotronH do not: sharding by heads is refused there)."""
    from ds_longseq.families.discovery import mixer_gets_layer_kwargs

    adapter = decoder_adapter(model_zoo.tiny_model(model_type, torch.float64))
    return all(mixer_gets_layer_kwargs(type(layer), adapter.spec.mixer_attr) for layer in adapter.layers
               if adapter.mixer(layer) is not None)


def _check_hybrids(size: int, cases: list[Case]) -> dict:
    """Each case under Ulysses SP ``size`` (one launch for all): loss, this rank's input gradient and every parameter
    gradient as one process on the whole sequence at 1e-10 (float64; 40 tokens, the ranks hold different numbers of
    valid tokens: row 0's padding falls on the last rank, row 1's masked prompt on the first). "pass_state" runs
    under StreamBP only: without it refused at enable, naming why; "heads" where the layers do not hand the mixer
    their keyword arguments (transformers 5.16's Falcon-H1, LFM2, NemotronH) likewise. A case with a mutation must
    differ (> 1e-3).
    Returns {(case, mode): (worst, its relative error over the ranks)}; a family the installed transformers does not
    ship (the floor's 5.16 has no Kimi Linear) is left out."""
    cases = [case for case in cases if case[0] in model_zoo.CONFIG_MAPPING]
    results = run_distributed(_hybrids_sp_worker, size, (cases,))
    found = {}
    for model_type in dict.fromkeys(case[0] for case in cases):
        batch = model_zoo.tiny_batch(model_type)
        loss, grads, embeds = model_sweep._loss_and_grads(model_zoo.tiny_model(model_type, torch.float64).train(),
                                                          batch)
        width = batch["input_ids"].shape[1] // size
        for case in (case for case in cases if case[0] == model_type):
            _, recurrent, modes, mutation = case
            for mode in modes:
                errors = []
                for rank, result in enumerate(results):
                    outcome = result[case][mode]
                    if recurrent == "pass_state" and mode != "streambp":
                        assert isinstance(outcome, str) and "Enable long_seq.streambp" in outcome, outcome
                        continue
                    if recurrent == "heads" and not _mixers_get_layer_kwargs(model_type):  # transformers 5.16
                        assert isinstance(outcome, str) and "without passing on its keyword arguments" in outcome, (
                            case, mode, outcome)
                        continue
                    assert not isinstance(outcome, str), (case, mode, outcome)
                    errors.append((*model_sweep.worst_error(outcome, (loss, grads, embeds[:, rank * width:(rank + 1)
                                                                                          * width])), rank))
                if errors:
                    worst, error, rank = max(errors, key=lambda e: e[1])
                    assert error > 1e-3 if mutation else error < 1e-10, (case, mode, rank, worst, error)
                    found[case, mode] = (worst, error)
    return found


def test_sequence_parallel_heads_matches_one_process():
    """Qwen3.5 text under Ulysses SP=2, its Gated DeltaNet layers sharded by heads (recurrent="heads", the
    default: each rank runs the whole sequence's recurrence for half the heads), with Ulysses alone, with mini_seq
    and with StreamBP (the mixer's input captured chunk by chunk, the mixer run once per layer): loss, this rank's
    input gradient and every parameter gradient as one process at 1e-10 (float64; the ranks hold different numbers
    of valid tokens)."""
    for rank, mode, result, reference in _sp_results("heads"):
        worst, error = model_sweep.worst_error(result, reference)
        assert error < 1e-10, (rank, mode, worst, error)


def test_sequence_parallel_pass_state_matches_one_process():
    """recurrent="pass_state": with StreamBP the Gated DeltaNet layers continue from the previous rank's states
    (and send their gradient back): exact at 1e-10. Without StreamBP a recurrent layer has no state to start from:
    refused at enable, naming why."""
    for rank, mode, result, reference in _sp_results("pass_state"):
        if mode != "streambp":
            assert "carry a recurrent state" in result and "Enable long_seq.streambp" in result, result
            continue
        worst, error = model_sweep.worst_error(result, reference)
        assert error < 1e-10, (rank, worst, error)


def test_mutation_state_not_passed_between_ranks_is_caught():
    """If the second rank's recurrent layers started from zeros (no state from the first rank), the parity check
    must see it."""
    (_, _, result, reference), = [r for r in _sp_results("pass_state", "state_not_passed", ("streambp",)) if r[0] == 1]
    _, error = model_sweep.worst_error(result, reference)
    assert error > 1e-3, error


def test_mutation_head_sharded_mixer_input_gradient_dropped_is_caught():
    """Under StreamBP with head-sharded mixers, the mixer's input gradient must go back through each chunk's part
    of the layer before the mixer (its input norm): dropping it must fail the parity check."""
    for rank, _, result, reference in _sp_results("heads", "mixer_input_grad_dropped", ("streambp",)):
        worst, error = model_sweep.worst_error(result, reference)
        assert error > 1e-3 and "input_layernorm" in worst, (rank, worst, error)


HEAD_SHARDED = {
    # model type -> a parameter whose slice the mutation control takes from the next rank's heads (one per layout
    # kind: Qwen3.5's and OLMo-hybrid's split projections, Qwen3-Next's fused interleaved ones, Kimi's per-head
    # decays beside shared low-rank factors, LFM2's channels)
    "qwen3_5_text": "in_proj_z.weight",
    "qwen3_5_moe_text": "in_proj_qkv.weight",
    "qwen3_next": "in_proj_qkvz.weight",
    "olmo_hybrid": "g_proj.weight",
    "kimi_linear": "forget_gate.A_log",
    "lfm2": "in_proj.weight",
    # Mamba-2 in 8 groups (NemotronH's tiny, as NemotronH-8B): B / C rows shared within a group, a norm per group
    "nemotron_h": "conv1d.weight",
    # Mamba-2 in one group without a gated norm (each rank's heads inside it; its mup_vector buffer, constant per
    # segment of in_proj's rows, is cut with them: a wrong cut would not change it, a missing one its shape)
    "falcon_h1": "A_log",
}


def _first_mixer(model_type: str):
    adapter = decoder_adapter(model_zoo.tiny_model(model_type, torch.float64))
    return adapter, next(m for m in map(adapter.mixer, adapter.layers) if m is not None)


@pytest.mark.parametrize(("model_type", "size"), [
    (model_type, size) for model_type in sorted(HEAD_SHARDED) for size in (2, 4)
    if size == 2 or not model_type.startswith("qwen3_5")])  # the tiny Qwen3.5s have 2 key heads
def test_head_layout_shares_add_up_to_the_mixer(model_type, size):
    """The check every head-sharded mixer runs on its first call, run here for 2 and 4 ranks on one process: the
    ranks' shares (parameters cut by families.mixer_heads, the mixer's own forward) add up to the whole mixer's
    output (float64, 1e-12 relative), also with padding. Mutation control: a layout that gives one parameter the
    next rank's heads (wrong rows) is refused by the check."""
    from ds_longseq.families import mixer_heads
    from ds_longseq.forwards import head_sharding_forward

    adapter, mixer = _first_mixer(model_type)
    # the layout check runs on one rank: an exchange's rank and size, no collective
    exchange = types.SimpleNamespace(rank=0, world_size=size)
    forward = head_sharding_forward.HeadShardedMixerForward(mixer, mixer.forward, exchange, "layers[0].mixer")
    x = torch.randn(2, 20, adapter.model.config.get_text_config().hidden_size, dtype=torch.float64)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[0, :3] = False
    for mask in (None, valid):
        whole = mixer(x, attention_mask=mask)
        shares = sum(forward._share(x, mask, mixer_heads.head_layout(mixer, r, size)) for r in range(size))
        assert model_sweep._rel(shares, whole) < 1e-12
        forward._check_layout(x, mask)

    mutated = HEAD_SHARDED[model_type]

    def wrong_heads(module, rank, size):
        layout, other = (mixer_heads.head_layout(module, r, size) for r in (rank, (rank + 1) % size))
        return mixer_heads.HeadLayout({**layout.slices, mutated: other.slices[mutated]}, layout.attrs)

    head_sharding_forward.head_layout, original = wrong_heads, head_sharding_forward.head_layout
    try:
        with pytest.raises(NotImplementedError, match=r"heads' shares add up to a different output"):
            forward._check_layout(x, None)
    finally:
        head_sharding_forward.head_layout = original


def test_head_sharding_refused_where_heads_do_not_divide():
    """A sequence-parallel size that does not divide the mixer's heads (LFM2: its channels), a Mamba-2 share that
    would split a group (Falcon-H1), or a mixer whose layout ds_longseq does not know (Jamba's Mamba), has no head
    layout (naming the way out). A size the attention heads
    do not take either runs a ring: the mixer's heads are checked against the whole size as without one, and
    recurrent="pass_state" passes the states along the ring's runs instead (tests/test_ring_families.py)."""
    from ds_longseq.families import mixer_heads

    mixer = model_zoo.tiny_model("qwen3_5_text", torch.float64).model.layers[0].linear_attn
    assert "not both divisible by sequence_parallel size 3" in mixer_heads.head_layout(mixer, 0, 3)
    assert "64 channels, not divisible by sequence_parallel size 3" in mixer_heads.head_layout(
        _first_mixer("lfm2")[1], 0, 3)
    assert "knows which parameters of" in mixer_heads.head_layout(_first_mixer("jamba")[1], 0, 2)
    # Falcon-H1's Mamba-2 with 12 heads in 3 groups: at 2 ranks each rank's 6 heads would split a group
    falcon = model_zoo.tiny_model("falcon_h1", torch.float64, mamba_n_heads=12, mamba_d_ssm=192, mamba_n_groups=3)
    assert "would span parts of several groups" in mixer_heads.head_layout(falcon.model.layers[0].mamba, 0, 2)
    # SP 3 on 4 attention heads runs a ring (1 x 3): by heads the mixer's 2 key heads refuse 3; passing state runs
    refusal = r"recurrent='heads'.*layers \[0\] carry a recurrent state.*not both divisible by sequence_parallel size 3"
    with pytest.raises(ds_longseq.UnsupportedModelError, match=refusal):
        ds_longseq.patch.check_model(model_zoo.tiny_model("qwen3_5_text", torch.float64),
                                     {"sequence_parallel": {"size": 3}, "streambp": {"enabled": True}})
    ds_longseq.patch.check_model(model_zoo.tiny_model("qwen3_5_text", torch.float64), {
        "sequence_parallel": {"size": 3, "recurrent": "pass_state"}, "streambp": {"enabled": True}})


def test_sequence_parallelism_is_refused_where_not_verified():
    with pytest.raises(ds_longseq.UnsupportedModelError, match=r"sequence_parallel on .*without such a test"):
        ds_longseq.patch.check_model(model_zoo.tiny_model("qwen3_5_moe_text", torch.float64),
                                     {"sequence_parallel": {"size": 2}, "streambp": {"enabled": True}})


# --- hybrids under Ulysses SP 2 and 4, float64: one launch per world size covers several families ---------------

HYBRIDS_SP2: list[Case] = [
    # the fused, interleaved Gated DeltaNet layout sharded by heads, in every mode
    ("qwen3_next", "heads", ALL_SP_MODES, None),
    # per-channel decays and shared low-rank gate factors under StreamBP
    ("kimi_linear", "heads", ("streambp",), None),
    # Mamba-2 by heads, whole groups per rank (NemotronH's 8 groups)
    ("nemotron_h", "heads", ("streambp",), None),
    # a short convolution's window, then a Mamba-2 state passed rank to rank under StreamBP (without it: refused)
    ("lfm2", "pass_state", ("ulysses_only", "streambp"), None),
    # LFM2-MoE: LFM2's short convolution by channels beside mixture-of-experts MLPs
    ("lfm2_moe", "heads", ("streambp",), None),
    ("bamba", "pass_state", ("streambp",), None),
    # mutation control: the last rank's Mamba-2 layers starting from zeros must fail the parity check
    ("bamba", "pass_state", ("streambp",), "state_not_passed"),
]
HYBRIDS_SP2_REST: list[Case] = [
    ("olmo_hybrid", "heads", ALL_SP_MODES, None),
    ("kimi_linear", "heads", ("ulysses_only", "mini_seq"), None),
    ("lfm2", "heads", ALL_SP_MODES, None),
    ("lfm2_moe", "heads", ("ulysses_only", "mini_seq"), None),
    ("lfm2_moe", "pass_state", ("streambp",), None),
    ("nemotron_h", "heads", ("ulysses_only", "mini_seq"), None),
    ("nemotron_h", "pass_state", ALL_SP_MODES, None),
    ("granitemoehybrid", "pass_state", ("streambp",), None),
    *[(model_type, "pass_state", ("streambp",), None) for model_type in ("qwen3_next", "olmo_hybrid", "kimi_linear")],
]
HYBRIDS_SP4: list[Case] = [
    ("qwen3_next", "heads", ALL_SP_MODES, None),
    *[(model_type, "heads", ALL_SP_MODES, None)
      for model_type in ("olmo_hybrid", "kimi_linear", "lfm2", "nemotron_h")],
    *[(model_type, "pass_state", ("streambp",), None)
      for model_type in ("qwen3_next", "olmo_hybrid", "kimi_linear", "lfm2", "bamba", "nemotron_h",
                         "granitemoehybrid")],
]


def test_hybrids_under_sequence_parallelism():
    """SP 2, one launch: Qwen3-Next's Gated DeltaNet sharded by heads (Ulysses alone, mini_seq, StreamBP), Kimi
    Linear's KDA, NemotronH's Mamba-2 and LFM2-MoE's short convolution by heads under StreamBP, LFM2's short
    convolution and Bamba's Mamba-2 passing their states rank to rank under StreamBP: exact at 1e-10
    (``_check_hybrids``); Bamba with its state not passed differs."""
    _check_hybrids(2, HYBRIDS_SP2)


@pytest.mark.slow
def test_hybrids_under_sequence_parallelism_rest():
    """SP 2, the other families and modes: OLMo-hybrid's Gated DeltaNet and LFM2's short convolution (by channels)
    sharded by heads in every mode, Kimi Linear's, NemotronH's and LFM2-MoE's without StreamBP; NemotronH,
    Granite-hybrid, LFM2-MoE and the families sharded by heads above, passing state under StreamBP."""
    _check_hybrids(2, HYBRIDS_SP2_REST)


@pytest.mark.slow
def test_hybrids_under_sequence_parallelism_4():
    """SP 4 (Ulysses alone: 4 attention heads), one launch: every hybrid by heads where it has a layout, in every
    mode (Ulysses alone, mini_seq, StreamBP), and the state-passing ones under StreamBP (states through three rank
    boundaries)."""
    _check_hybrids(4, HYBRIDS_SP4)


FALCON_H1_SP2: list[Case] = [
    ("falcon_h1", "heads", ALL_SP_MODES, None),
    # mutation control: the mixer's input gradient not pushed back through the layer's norm must fail
    ("falcon_h1", "heads", ("streambp",), "mixer_input_grad_dropped"),
]


def test_falcon_h1_under_sequence_parallelism():
    """Falcon-H1 runs attention and Mamba-2 side by side in every layer (mup multipliers on both). At SP 2, one
    launch: its mixer sharded by heads (8 heads in one group, no gated norm: each rank's 4 heads read the group's
    B / C rows; the ``mup_vector`` buffer cut as ``in_proj``'s rows) and its attention under Ulysses, with Ulysses
    alone, mini_seq and StreamBP (``ops.head_sharding.streambp_mixer_sp_apply``: the mixer's input captured and
    the mixer run once, then the keys/values captured and exchanged once per pass): exact at 1e-10 against one
    process (``_check_hybrids``); with the mixer's input gradient dropped, different. Passing the mixer's state
    rank to rank is refused at enable, naming 'heads'."""
    if _mixers_get_layer_kwargs("falcon_h1"):
        _check_hybrids(2, FALCON_H1_SP2)
    else:  # transformers 5.16: its layer keeps its keyword arguments from the mixer, so sharding it is refused
        with pytest.raises(ds_longseq.UnsupportedModelError, match="FalconH1DecoderLayer.forward calls its mamba "
                                                                   "without passing on its keyword arguments"):
            ds_longseq.patch.check_model(model_zoo.tiny_model("falcon_h1", torch.float64), {
                "sequence_parallel": {"size": 2}, "streambp": {"enabled": True}})
    with pytest.raises(ds_longseq.UnsupportedModelError, match="layers .* run an attention beside their recurrent"):
        ds_longseq.patch.check_model(model_zoo.tiny_model("falcon_h1", torch.float64), {
            "sequence_parallel": {"size": 2, "recurrent": "pass_state"}, "streambp": {"enabled": True}})


QWEN3_5_WIDE = {"linear_num_key_heads": 4, "linear_num_value_heads": 8}
"""Qwen3.5 with 4 key heads (8 value heads) in its Gated DeltaNet: sharded by heads at SP 4 (the tiny default has 2)."""


def _qwen3_5_wide_worker(rank: int, size: int) -> dict:
    """Qwen3.5 (:data:`QWEN3_5_WIDE`) at SP ``size``: {(recurrent, mode): (loss, summed grads, input grad)}."""
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from tests.test_feature_families import SP_MODES

    local = shard_batch(model_zoo.tiny_batch("qwen3_5_text"), rank, size)
    out = {}
    for recurrent, modes in (("heads", ALL_SP_MODES), ("pass_state", ("streambp",))):
        for mode in modes:
            model = ds_longseq.enable(model_zoo.tiny_model("qwen3_5_text", torch.float64, **QWEN3_5_WIDE).train(),
                                      {**SP_MODES[mode], "sequence_parallel": {"size": size, "recurrent": recurrent}},
                                      sp_group=dist.group.WORLD)
            loss, grads, embeds = model_sweep._loss_and_grads(model, local)
            for g in grads.values():
                dist.all_reduce(g)
            out[recurrent, mode] = (loss, grads, embeds)
    return out


@pytest.mark.slow
def test_qwen3_5_with_4_key_heads_at_sp_4():
    """Qwen3.5 with 4 key heads at SP 4 (Ulysses alone: 4 attention heads): its Gated DeltaNet sharded by heads (one
    key head a rank) in every mode, and passing its state under StreamBP; exact at 1e-10 against one process."""
    size = 4
    results = run_distributed(_qwen3_5_wide_worker, size, (size,))
    batch = model_zoo.tiny_batch("qwen3_5_text")
    loss, grads, embeds = model_sweep._loss_and_grads(
        model_zoo.tiny_model("qwen3_5_text", torch.float64, **QWEN3_5_WIDE).train(), batch)
    width = batch["input_ids"].shape[1] // size
    for rank, result in enumerate(results):
        assert len(result) == 4
        for case, outcome in result.items():
            worst, error = model_sweep.worst_error(outcome, (loss, grads, embeds[:, rank * width:(rank + 1) * width]))
            assert error < 1e-10, (case, rank, worst, error)


@pytest.mark.parametrize("model_type", ["bamba", "granitemoehybrid"])
def test_mamba2_in_one_group_refused_naming_pass_state(model_type):
    """A Mamba-2 mixer with n_groups=1 (Bamba-9B, Granite-4.0-H) normalises over all its heads at once: under
    recurrent="heads" (the default) refused before compute, in one line naming the layers, the mixer, the norm and
    pass_state."""
    refusal = (r"recurrent='heads' on \w+ForCausalLM: layers \[\d+\] carry a recurrent state and cannot be sharded "
               r"by heads \(\w+ has n_groups=1, .* its gated RMSNorm normalises over each group's 8 heads together.*"
               r"set recurrent='pass_state'")
    with pytest.raises(ds_longseq.UnsupportedModelError, match=refusal):
        ds_longseq.patch.check_model(model_zoo.tiny_model(model_type, torch.float64),
                                     {"sequence_parallel": {"size": 2}, "streambp": {"enabled": True}})


# --- ZeRO-3 on 2 CPU ranks, float32 -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [m if m == "streambp" else pytest.param(m, marks=pytest.mark.slow)
                                  for m in sorted(model_sweep.MODES)])  # CI time: StreamBP's by default
def test_zero3_two_ranks_match_one_process(mode):
    """Qwen3.5 text under ZeRO-3 with StreamBP or mini_seq: every parameter after 2 steps as one process with the
    stock model (1e-5 relative: float32 rounding over two steps)."""
    from tests.test_feature_families import _one_process, _zero3_worker

    results = run_distributed(_zero3_worker, 2, ("qwen3_5_text", mode))
    reference = _one_process("qwen3_5_text", 2)
    for name, ref in reference.items():
        for rank, result in enumerate(results):
            err = model_sweep._rel(result["params"][name], ref)
            assert err < 1e-5, (name, rank, err)
    assert results[0]["losses"] != results[1]["losses"]


def test_bamba_z_loss_is_refused_unless_zero():
    """Bamba's head adds a z-loss over every position's logits when z_loss_coefficient > 0 (the chunked head does
    not compute it): refused then, naming the setting; at its default 0 the head is plain (the sweep: exact)."""
    model = model_zoo.tiny_model("bamba", torch.float64)
    assert ds_longseq.patch.check_model(model, model_sweep.MODES["streambp"]).spec.head_kind == "z_loss"
    model.z_loss_coefficient = 1e-4
    with pytest.raises(ds_longseq.UnsupportedModelError, match=r"z_loss_coefficient=0.0001.*set config.z_loss_coeff"):
        ds_longseq.enable(model, model_sweep.MODES["streambp"])


def test_mutation_falcon_h1_head_multiplier_dropped_is_caught(monkeypatch):
    """Falcon-H1 multiplies its logits by model.model.lm_head_multiplier (0.6 in the zoo); a chunked head without
    it must be reported as a difference."""
    from ds_longseq.families import decoder

    scale = decoder.logit_scale
    monkeypatch.setattr(decoder, "logit_scale", lambda model, kind: 1.0 if kind == "lm_head_multiplier" else (
        scale(model, kind)))
    assert model_sweep.check_family("falcon_h1", "streambp").outcome == "different"


def test_layer_inputs_offloaded_to_host_memory():
    """StreamBP with the layer inputs in host memory (the boundary states stay on the device): exact."""
    config = {**_streambp(13), "offload": {"layer_inputs": "cpu"}}
    worst, error = _worst_error("qwen3_5_text", config, 40)
    assert error < 1e-10, (worst, error)


@pytest.mark.parametrize("mode", sorted(model_sweep.MODES))
def test_lora_matches_peft(mode):
    """LoRA on every linear layer (the Gated DeltaNet projections included) through PEFT: as PEFT's own model."""
    from tests.test_feature_families import test_lora_matches_peft as lora_parity

    lora_parity("qwen3_5_text", mode)


def test_nemotron_h_token_wise_blocks_over_many_chunks():
    """NemotronH's blocks hold one mixer each: Mamba-2, attention, an MLP or an MoE block. The MLP and MoE blocks
    mix no tokens: StreamBP runs them chunk by chunk with nothing carried, mini_seq chunks them as the layers'
    MLPs and leaves the Mamba-2 and attention blocks stock. Exact over 9 chunks of 11 tokens, and in mini_seq."""
    model = model_zoo.tiny_model("nemotron_h", torch.float64)
    adapter = ds_longseq.patch.check_model(model, model_sweep.MODES["streambp"])
    assert [model.config.layers_block_type[i] for i in adapter.spec.token_wise_layers] == ["moe", "mlp"]
    assert [model.config.layers_block_type[i] for i in adapter.spec.mlp_free_layers] == [
        "linear_attention", "full_attention"]
    worst, error = _worst_error("nemotron_h", _streambp(11), 99)
    assert error < 1e-10, (worst, error)
    result = model_sweep.check_family("nemotron_h", "mini_seq")
    assert result.outcome == "exact", result


@pytest.mark.parametrize("mode", sorted(model_sweep.MODES))
def test_token_wise_block_that_mixes_tokens_is_refused(mode, monkeypatch):
    """Mutation: NemotronH's MLP made to mix tokens (a running sum over the sequence; the MoE block's shared
    experts are one too). StreamBP would run those blocks on one chunk at a time, mini_seq would chunk them as
    MLPs: both refuse at the first forward, naming the layer, instead of training on chunks."""
    from transformers.models.nemotron_h import modeling_nemotron_h

    original = modeling_nemotron_h.NemotronHMLP.forward
    monkeypatch.setattr(modeling_nemotron_h.NemotronHMLP, "forward",
                        lambda self, x: original(self, x) + 1e-3 * x.cumsum(dim=1))
    result = model_sweep.check_family("nemotron_h", mode)
    assert result.outcome == "refused", result
    assert "model.layers[1]" in result.detail and "mixes tokens" in result.detail, result.detail


def test_granite_hybrid_mlp_parts_each_chunked_under_mini_seq():
    """Granite-MoE-hybrid has no single MLP module: each layer sums its MoE block and its shared MLP. mini_seq
    chunks each part on its own, the router tap on the MoE block alone (the sweep's mini_seq column checks the
    result exact against stock with the load-balancing loss on and counts every part as chunked); OPT's bare
    fc1 / fc2 stay refused (chunked one by one they would still hold the whole intermediate activation)."""
    from ds_longseq.forwards.mlp import MiniSeqMLPForward

    model = model_zoo.tiny_model("granitemoehybrid", torch.float64)
    model.config.output_router_logits = True
    ds_longseq.enable(model, model_sweep.MODES["mini_seq"])
    try:
        for layer in decoder_adapter(model).layers:
            moe, shared = layer.block_sparse_moe.forward, layer.shared_mlp.forward
            assert isinstance(moe, MiniSeqMLPForward) and isinstance(shared, MiniSeqMLPForward)
            assert moe.router_tap is not None and shared.router_tap is None
            assert moe.name.endswith(".block_sparse_moe") and shared.name.endswith(".shared_mlp")
    finally:
        ds_longseq.disable(model)
    assert model_sweep.cached_check("granitemoehybrid", "mini_seq").outcome == "exact"
    refused = model_sweep.cached_check("opt", "mini_seq")
    assert refused.outcome == "refused" and "nor a sum of MLP blocks" in refused.detail, refused
