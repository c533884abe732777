"""``benchmarks.comm_model`` against collectives counted on real CPU ranks (gloo, DeepSpeed 0.19.8).

Every configuration builds a tiny model, runs it through ``ds_longseq.engine.initialize``, takes
uncounted warm-up steps (at least two forward passes: ZeRO-3 records and checks its module trace
there) and then one counted optimizer step (``gas`` micro-steps), with every ``deepspeed.comm``
collective and every direct ``torch.distributed`` collective wrapped. A call is counted once, at
the outermost wrapper (``deepspeed.comm.allgather_fn`` calls ``all_gather_into_tensor``;
``deepspeed.comm`` calls ``torch.distributed``), with the bytes of its INPUT tensor only: the
model's unit. Counts are keyed by (API, phase, collective kind); the model's prediction, computed
from the formulas and the model's config only, must match every key exactly in bytes (and in calls
where the model claims a deterministic count) on every rank, and every counted call the model does
not predict must be a scalar (<= 8 bytes: DeepSpeed's bookkeeping all_reduce in the optimizer step).

Three spawns hold the default configurations (2 ranks without SP; 2 ranks with SP 2, Ulysses alone and, on a
3-head model, ring 2 alone; 4 ranks = SP 2 x DP 2), each building its engines one after the other in the same
processes (about 2 minutes on 2 busy cores); a fourth, slow, runs SP 4 as Ulysses 2 x ring 2. Ring traffic is
counted through ``torch.distributed``: ``all_gather_single`` / ``reduce_scatter_single`` (StreamBP's K/V over
the ring group) and ``batch_isend_irecv`` (ring attention's passes: bytes = the tensors of its isend ops), and a
2-rank bfloat16 ``ring_attention`` call checks the dK/dV passes in float32.
"""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from benchmarks.comm_model import METHODS, PRESETS, ModelShape, predict, sweep
from tests.dist_utils import run_distributed
from tests.helpers import ARCHS, make_model
from tests.test_engine_dist import COUNTED, LR, _nbytes, ds_config, rank_batches
from tests.test_sequence_parallel_engine import SEQ, replica_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 2  # rank_batches and replica_batch both use 2 sequences of SEQ = 40 tokens
FP32 = 4

# deepspeed.comm function -> (position, keyword) of its input tensor(s)
DS_INPUT = {
    "all_reduce": (0, "tensor"),
    "reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "tensor"),
    "allgather_fn": (1, "input_tensor"),
    "all_gather_coalesced": (1, "input_tensors"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_tensor": (1, "tensor"),
    "reduce_scatter_fn": (1, "tensor"),
    "all_reduce_coalesced": (0, "tensors"),
    "all_to_all_single": (1, "tensor"),
}
# torch.distributed functions ds_longseq (or anything else) may call directly
TORCH_INPUT = {
    "all_reduce": (0, "tensor"),
    "reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all_single": (1, "input"),
    "all_gather_single": (1, "input_tensor"),  # ops.ulysses.UlyssesRingExchange (StreamBP under a ring)
    "reduce_scatter_single": (1, "input"),
}
KIND = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_fn": "all_gather",
    "all_gather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "batch_isend_irecv": "send_recv",  # ops.ring: one call per K/V or dK/dV pass; bytes = its isends' tensors
}
SCALAR_BYTES = 8  # the largest call the model may leave out
WARMUP_PASSES = 2

# -------------------------------------------------------------------------------- configurations


def case(name, stage, method, *, sp=1, ring=None, arch="llama", tie=False, gas=1, chunk=7, persist=0, **overrides):
    return dict(name=name, stage=stage, method=method, sp=sp, ring=ring, arch=arch, tie=tie, gas=gas, chunk=chunk,
                persist=persist, overrides=overrides)


# 3 query heads, 1 kv head (head dim 16): SP 2 runs as Ulysses 1 x ring 2, the ring chosen from the heads
THREE_HEADS = dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=48)


# 40 tokens per sequence: StreamBP chunk 3 -> 14 chunks; under SP 2 (20 local tokens) chunk 7 -> 3, 6 -> 4.
DP_CASES = [
    case("z2-streambp", 2, "streambp", chunk=3),
    case("z2-mst_gc-tied-gas2", 2, "mst_gc", tie=True, gas=2),
    case("z3-streambp-tied", 3, "streambp", tie=True, chunk=3),
    case("z3-mst_gc", 3, "mst_gc"),
    case("z3-gc", 3, "gc"),
    # Qwen3 (explicit head_dim 16) with hidden 63: the embedding, LM head and norms have an odd number of
    # elements, which ZeRO-3 pads per tensor at W=2; N = 73585 is odd, so ZeRO-2 pads its flat group (to 4k)
    case("z3-streambp-padded-qwen3", 3, "streambp", arch="qwen3", hidden_size=63),
    case("z2-stock-padded-qwen3", 2, "stock", arch="qwen3", hidden_size=63),
    # norms (64 elements) persistent: gathered once after the optimizer step, not per pass (steady state:
    # during DeepSpeed's first two forward passes, its trace recording, they are gathered like the others)
    case("z3-streambp-persist-gas2", 3, "streambp", persist=100, gas=2),
]
SP_CASES = [
    case("sp2-z2-streambp", 2, "streambp", sp=2, chunk=7),
    case("sp2-z3-streambp-gas2", 3, "streambp", sp=2, chunk=6, gas=2),
    case("sp2-z2-mst_gc", 2, "mst_gc", sp=2),
    case("sp2-z3-mst_gc", 3, "mst_gc", sp=2),
    case("sp2-z3-streambp-kv1", 3, "streambp", sp=2, chunk=7, num_key_value_heads=1),  # kv heads replicated
    case("sp2-z2-stock", 2, "stock", sp=2),  # plain Ulysses, no checkpointing: 2 rounds
    # ring 2 alone (u = 1: no all-to-all): StreamBP's K/V gathers and dK/dV reduce-scatters over the ring;
    # ring attention's point-to-point K/V and dK/dV passes (stock; mst_gc runs the ring forward again)
    case("sp2-ring2-z3-streambp", 3, "streambp", sp=2, chunk=7, **THREE_HEADS),
    case("sp2-ring2-z2-stock", 2, "stock", sp=2, **THREE_HEADS),
    case("sp2-ring2-z3-mst_gc", 3, "mst_gc", sp=2, **THREE_HEADS),
]
# 4 ranks = 2 data-parallel replicas x SP 2: ZeRO partitions over all 4, all-to-all within each pair
SPDP_CASES = [
    case("sp2xdp2-z3-streambp", 3, "streambp", sp=2, chunk=7),
]
# 4 ranks = SP 4 run as Ulysses 2 x ring 2 (ring forced on 4 heads; 1 kv head, replicated to 2 by the Ulysses
# exchange, so the ring passes the replicas): the all-to-all within each Ulysses pair (ranks 0-1, 2-3), ring
# traffic within each ring pair (ranks 0-2, 1-3); 10 local tokens. Slow (its own 4-rank spawn, ~35 s on 2 busy
# cores: DeepSpeed builds its sequence-parallel groups for one size per process, so it cannot join SPDP_CASES').
RING4_CASES = [
    case("sp4-u2xring2-z3-streambp-kv1", 3, "streambp", sp=4, ring=2, chunk=4, num_key_value_heads=1),
    case("sp4-u2xring2-z2-stock-kv1", 2, "stock", sp=4, ring=2, num_key_value_heads=1),
]


def long_seq_section(c) -> dict | None:
    section = {}
    if c["method"] == "streambp":
        section = {"streambp": {"enabled": True, "chunk_size": c["chunk"]},
                   "lm_head": {"enabled": True, "chunk_size": 9}}
    elif c["method"] == "mst_gc":
        section = {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 9}}
    if c["sp"] > 1:
        section["sequence_parallel"] = {"size": c["sp"]} if c["ring"] is None else {"size": c["sp"], "ring": c["ring"]}
    return section or None


def build_model(c):
    model = make_model(c["arch"], torch.float32, tie=c["tie"], **c["overrides"])
    if c["method"] in ("mst_gc", "gc"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def prediction(c, world: int):
    """The model's prediction from the formulas: the HF config's shape and the run's settings only."""
    config = make_model(c["arch"], torch.float32, tie=c["tie"], **c["overrides"]).config
    return predict(
        ModelShape.from_hf_config(config), SEQ, world=world, sp=c["sp"], zero=c["stage"], method=c["method"],
        micro_batch=BATCH, gas=c["gas"], chunk_size=c["chunk"], param_bytes=FP32,
        persistence_threshold=c["persist"], ring=c["ring"],
    )


# ------------------------------------------------------------------------------------ the ranks


class CollectiveCounter:
    """While entered: every ``deepspeed.comm`` / ``torch.distributed`` collective of :data:`DS_INPUT` /
    :data:`TORCH_INPUT` is counted once, at the outermost wrapper, with its input bytes.

    ``counts[(api, phase, kind)] = [calls, bytes, largest call]``; set ``phase`` as the step proceeds.
    """

    def __init__(self):
        self.counts = collections.defaultdict(lambda: [0, 0, 0])
        self.phase = "forward"
        self._depth = 0
        self._saved = []

    def _wrap(self, module, fname, input_bytes, api):
        """``input_bytes(args, kwargs)``: the bytes the call is counted with."""
        orig = getattr(module, fname)

        def counted_call(*args, **kwargs):
            if self._depth == 0:
                nbytes = input_bytes(args, kwargs)
                entry = self.counts[(api, self.phase, KIND[fname])]
                entry[0] += 1
                entry[1] += nbytes
                entry[2] = max(entry[2], nbytes)
            self._depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._depth -= 1

        setattr(module, fname, counted_call)
        self._saved.append((module, fname, orig))

    def __enter__(self):
        import deepspeed.comm as dscomm
        import torch.distributed as tdist

        def argument(pos, name):
            return lambda args, kwargs: _nbytes(args[pos] if len(args) > pos else kwargs.get(name))

        def isend_bytes(args, kwargs):  # the tensors this rank sends (its irecv buffers are outputs)
            ops = args[0] if args else kwargs["p2p_op_list"]
            return sum(_nbytes(op.tensor) for op in ops if op.op is isend)

        isend = tdist.isend
        for fname, where in DS_INPUT.items():
            if hasattr(dscomm, fname):
                self._wrap(dscomm, fname, argument(*where), "ds")
        for fname, where in TORCH_INPUT.items():
            self._wrap(tdist, fname, argument(*where), "torch")
        self._wrap(tdist, "batch_isend_irecv", isend_bytes, "torch")
        return self

    def __exit__(self, *exc):
        for module, fname, orig in reversed(self._saved):
            setattr(module, fname, orig)
        self._saved.clear()


def count_worker(rank: int, cases: list[dict]):
    """Run every case (one counted optimizer step each); return {(api, phase, kind): (calls, bytes, largest)}."""
    import ds_longseq
    import ds_longseq.engine
    from ds_longseq.engine import sequence_parallel_rank_and_size, shard_batch

    results = []
    for c in cases:
        model = build_model(c)
        config = ds_config(c["stage"], c["gas"], long_seq_section(c), batch=BATCH)
        if c["stage"] == 3:
            config["zero_optimization"]["stage3_param_persistence_threshold"] = c["persist"]
        engine, *_ = ds_longseq.engine.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config
        )
        if c["sp"] > 1:  # cut by the engine's model's layout (Ulysses alone, or its ring's zigzag)
            sp_rank, sp_size = sequence_parallel_rank_and_size()
            batches = [shard_batch(replica_batch(rank // c["sp"], m), sp_rank, sp_size, layout=engine)
                       for m in range(c["gas"])]
        else:
            batches = rank_batches(rank, c["gas"])
        # Steady state: DeepSpeed ZeRO-3 records its module trace over the first forward passes (checked
        # with broadcasts in passes 1 and 2; persistent parameters are gathered like the others until
        # then). Uncounted warm-up steps, at least 2 forward passes, on the same batches.
        for batch in batches * -(-WARMUP_PASSES // c["gas"]):
            engine.backward(engine(**batch).loss)
            engine.step()
        with CollectiveCounter() as counter:
            for batch in batches:
                counter.phase = "forward"
                loss = engine(**batch).loss
                counter.phase = "backward"
                engine.backward(loss)
                counter.phase = "step"
                engine.step()
        results.append({k: tuple(v) for k, v in counter.counts.items()})
        ds_longseq.disable(engine.module)  # frees its SP layout (the next case may have another ring degree)
        del engine, model
    return results


_CACHE: dict[str, list] = {}


def counted(group: str):
    """Counts per rank and case of DP_CASES / SP_CASES / SPDP_CASES, from one spawn each (cached)."""
    if group not in _CACHE:
        cases, world = {"dp": (DP_CASES, 2), "sp": (SP_CASES, 2), "spdp": (SPDP_CASES, 4),
                        "ring4": (RING4_CASES, 4)}[group]
        _CACHE[group] = run_distributed(count_worker, world, (cases,))
    return _CACHE[group]


def compare(c, counts, world: int = 2):
    """Assert the counts of one rank equal the model's prediction (see the module docstring)."""
    model = prediction(c, world)
    expected = collections.defaultdict(lambda: [0, 0])  # (api, phase, kind) -> [calls or None, bytes]
    for f in model.flows:
        api = "torch" if f.source.startswith("sp_") or f.source == "ring" else "ds"
        entry = expected[(api, f.phase, f.kind)]
        entry[0] = None if f.calls is None or entry[0] is None else entry[0] + f.calls
        entry[1] += f.bytes
    for key, (calls, nbytes) in expected.items():
        assert key in counts, f"{c['name']}: predicted {key} ({nbytes} bytes) was never called; counted {counts}"
        got_calls, got_bytes, _ = counts[key]
        assert got_bytes == nbytes, f"{c['name']}: {key}: counted {got_bytes} bytes, model {nbytes}"
        if calls is not None:
            assert got_calls == calls, f"{c['name']}: {key}: counted {got_calls} calls, model {calls}"
    for key, (got_calls, got_bytes, largest) in counts.items():
        if key not in expected:
            assert largest <= SCALAR_BYTES, f"{c['name']}: unpredicted traffic {key}: {got_calls} calls, {got_bytes} B"
    return model


# ------------------------------------------------------------------------------- counted tests


@pytest.mark.parametrize("index", range(len(DP_CASES)), ids=[c["name"] for c in DP_CASES])
def test_zero_without_sp_matches_counted_collectives(index):
    c = DP_CASES[index]
    for rank_counts in counted("dp"):
        compare(c, rank_counts[index])


@pytest.mark.parametrize("index", range(len(SP_CASES)), ids=[c["name"] for c in SP_CASES])
def test_zero_with_sp2_matches_counted_collectives(index):
    c = SP_CASES[index]
    for rank_counts in counted("sp"):
        compare(c, rank_counts[index])


@pytest.mark.slow  # 4 ranks on 2 cores (CI time): SP 2 and DP 2 are counted apart by default
@pytest.mark.parametrize("index", range(len(SPDP_CASES)), ids=[c["name"] for c in SPDP_CASES])
def test_sp2_times_dp2_matches_counted_collectives(index):
    c = SPDP_CASES[index]
    for rank_counts in counted("spdp"):
        compare(c, rank_counts[index], world=4)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(RING4_CASES)), ids=[c["name"] for c in RING4_CASES])
def test_ulysses_x_ring_2x2_matches_counted_collectives(index):
    c = RING4_CASES[index]
    for rank_counts in counted("ring4"):
        compare(c, rank_counts[index], world=4)


def half_precision_ring_worker(rank: int):
    """One bfloat16 ring_attention forward + backward on 2 ranks (no DeepSpeed engine): the counts."""
    import torch.distributed as dist

    from ds_longseq.ops.ring import ring_attention

    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, h, 8, 16, generator=g).bfloat16().requires_grad_() for h in (4, 2, 2))
    with CollectiveCounter() as counter:
        out = ring_attention(q, k, v, dist.group.WORLD)
        counter.phase = "backward"
        out.float().sum().backward()
    return {key: tuple(v) for key, v in counter.counts.items()}


def test_ring_attention_sends_half_precision_gradients_in_float32():
    """The model's ring send_recv flows of one layer (4 heads, 2 kv heads, D 16, 16 tokens on ring 2) in
    bfloat16: K/V passed in bfloat16, dK/dV in float32 (ring attention's compute dtype), counted on the op."""
    shape = ModelShape("one layer", 1, 64, 96, 4, 2, 16, 101)
    model = predict(shape, 16, world=2, sp=2, ring=2, zero=2, method="stock", param_bytes=2)
    expected = {("torch", f.phase, f.kind): (f.calls, f.bytes) for f in model.flows if f.source == "ring"}
    for counts in run_distributed(half_precision_ring_worker, 2):
        assert {key: v[:2] for key, v in counts.items()} == expected
    # bfloat16 K and V, 512 bytes each, sent once forward and once backward; dK and dV in float32 sent twice
    assert expected[("torch", "backward", "send_recv")] == (3, 1024 + 2 * 2 * 1024)


def test_counted_traffic_confirms_the_readme_claims():
    """docs/SEQUENCE_PARALLEL.md's claims (once in the README), directly on the counts (not through the
    model): StreamBP under SP moves the all-to-all bytes of Ulysses + checkpointing; ZeRO-3 + StreamBP
    gathers every parameter partition once per pass."""
    sp = counted("sp")
    names = [c["name"] for c in SP_CASES]
    for rank_counts in sp:
        streambp, mst_gc = rank_counts[names.index("sp2-z2-streambp")], rank_counts[names.index("sp2-z2-mst_gc")]

        def a2a(counts):
            return sum(v[1] for (api, _, kind), v in counts.items() if kind == "all_to_all")

        assert a2a(streambp) == a2a(mst_gc) > 0
        assert streambp[("ds", "forward", "all_to_all")][0] > mst_gc[("ds", "forward", "all_to_all")][0]
    dp = counted("dp")
    z3 = dp[0][[c["name"] for c in DP_CASES].index("z3-streambp-tied")]
    one_pass = sum(math.ceil(p.numel() / 2) for p in build_model(DP_CASES[2]).parameters()) * FP32
    tied = 101 * 64 * FP32 // 2  # the tied weight is gathered by the embedding and by the LM head
    assert z3[("ds", "forward", "all_gather")][1] == z3[("ds", "backward", "all_gather")][1] == one_pass + tied


# --------------------------------------------------------------------- fast tests of the formulas


@pytest.mark.parametrize("arch,tie,overrides", [(a, False, {}) for a in ARCHS] + [
    ("llama", True, {}), ("qwen3", False, {"hidden_size": 63}), ("qwen3", True, {"num_layers": 3}),
    ("llama", False, {"attention_bias": True, "mlp_bias": True}),
])
def test_parameter_list_matches_hugging_face(arch, tie, overrides):
    model = make_model(arch, torch.float32, tie=tie, **overrides)
    shape = ModelShape.from_hf_config(model.config)
    assert shape.param_numels() == {n: p.numel() for n, p in model.named_parameters()}
    assert shape.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset,published", [("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9), ("qwen3-8b", 8.19e9)])
def test_presets_match_the_hugging_face_classes(preset, published):
    """The preset shapes build real HF models (on the meta device) with exactly these tensors."""
    import transformers

    shape = PRESETS[preset]
    cls = "Qwen3" if shape.qk_norm else "Llama"
    config = getattr(transformers, f"{cls}Config")(
        num_hidden_layers=shape.num_layers, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        vocab_size=shape.vocab, tie_word_embeddings=shape.tied,
    )
    with torch.device("meta"):
        model = getattr(transformers, f"{cls}ForCausalLM")(config)
    assert ModelShape.from_hf_config(config).param_numels() == shape.param_numels()
    assert shape.param_numels() == {n: p.numel() for n, p in model.named_parameters()}
    assert abs(shape.num_params - published) < 0.005e9


def test_formula_properties_at_scale():
    """Closed forms at thousands of ranks: StreamBP under SP moves Ulysses+checkpointing's bytes in
    more calls; chunking changes only all-to-all call counts; ZeRO bytes are N/W up to the stated
    padding bound; the all-to-all does not depend on W; kv heads fewer than P are replicated."""
    kw = dict(seq_len=1 << 20, sp=8, zero=3, param_bytes=2)
    s8b = PRESETS["llama3-8b"]
    for world in (8, 64, 1024, 4096):
        sb = predict("llama3-8b", world=world, method="streambp", chunk_size=4096, **kw)
        sb2 = predict("llama3-8b", world=world, method="streambp", chunk_size=1024, **kw)
        gc = predict("llama3-8b", world=world, method="mst_gc", **kw)
        assert sb.bytes_by_kind() == sb2.bytes_by_kind()
        assert sb.calls_by_kind()["all_to_all"] < sb2.calls_by_kind()["all_to_all"]
        assert sb.bytes_by_kind()["all_to_all"] == gc.bytes_by_kind()["all_to_all"]
        T_l = (1 << 20) // 8
        assert sb.bytes_by_kind()["all_to_all"] == 3 * 32 * (2 * 32 + 2 * 8) * T_l * 128 * 2
        assert sb.calls_by_kind()["all_to_all"] == 32 * (6 + 6 * (T_l // 4096))
        gathers = sb.by_source_phase_kind()
        num_tensors = len(s8b.param_numels())
        for phase in ("forward", "backward"):
            got = gathers[("zero_params", phase, "all_gather")].bytes
            assert 0 <= got - s8b.num_params * 2 / world < num_tensors * 2  # < 1 element per tensor
        rs = gathers[("zero_grads", "backward", "reduce_scatter")].bytes
        assert 0 <= rs - s8b.num_params * 2 < num_tensors * world * 2  # < W elements per tensor
        z2 = predict("llama3-8b", world=world, method="streambp", chunk_size=4096, **{**kw, "zero": 2})
        z2_gather = z2.by_source_phase_kind()[("zero_params", "step", "all_gather")].bytes
        assert 0 <= z2_gather - s8b.num_params * 2 / world < 4  # < 2 elements
    assert predict("llama3-8b", world=8, **kw).bytes_by_kind()["all_to_all"] == \
        predict("llama3-8b", world=4096, **kw).bytes_by_kind()["all_to_all"]
    replicated = predict("llama3-70b", world=1024, method="gc", **{**kw, "sp": 16})
    assert replicated.bytes_by_kind()["all_to_all"] == 3 * 80 * (2 * 64 + 2 * 16) * (1 << 16) * 128 * 2
    start = time.perf_counter()
    for method in METHODS:
        sweep(shape="llama3-70b", seq_len=1 << 22, sp=8, zero=3, method=method, chunk_size=4096)
    assert time.perf_counter() - start < 1.0


def test_model_needs_no_torch_and_the_cli_runs():
    code = ("import sys, benchmarks.comm_model as m; m.predict('qwen3-8b', 4096, world=16); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    args = ["--preset", "llama3-8b", "--seq-len", "1048576", "--world", "1024", "--sp", "8", "--zero", "3",
            "--method", "streambp", "--chunk-size", "4096"]
    table = subprocess.run([sys.executable, "-m", "benchmarks.comm_model", *args], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout
    assert "all_to_all" in table and "128 data-parallel replicas x SP 8" in table
    swept = subprocess.run([sys.executable, "-m", "benchmarks.comm_model", *args, "--sweep"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout
    assert swept.count("\n") >= 10 and "  4096 " in swept
    ring = subprocess.run([sys.executable, "-m", "benchmarks.comm_model", *args[:6], "--sp", "64", "--ring", "4"],
                          cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert "SP 64 = Ulysses 16 x ring 4" in ring and "send_recv" not in ring and "ring         all_gather" in ring


def test_sp_degrees_match_ds_longseq():
    """The model's torch-free Ulysses x ring split is ds_longseq's (``ops.sp_layout.sp_degrees``), errors included."""
    from benchmarks.comm_model import sp_degrees
    from ds_longseq.ops.sp_layout import sp_degrees as built

    for size in range(1, 17):
        for heads, kv in ((1, 1), (2, 1), (3, 3), (4, 2), (6, 3), (8, 8), (9, 3), (12, 2), (14, 2), (28, 4), (32, 8),
                          (40, 8), (64, 8)):
            for ring in (None, *range(1, size + 1)):
                try:
                    want = built(size, heads, ring, kv)
                except ValueError:
                    with pytest.raises(ValueError):
                        sp_degrees(size, heads, ring, kv)
                    continue
                assert sp_degrees(size, heads, ring, kv) == want, (size, heads, kv, ring)


def test_ring_formulas_at_scale():
    """Ring alone at P = 64 on Llama-3-8B (32 heads: ring forced), hand-computed; Ulysses x ring chosen from the
    heads at P = 64; a forced ring the heads do not allow is refused; r = 1 is Ulysses alone, unchanged."""
    T, L, D = 1 << 17, 32, 128
    T_l = T // 64
    block = 8 * T_l * D  # one rank's K: its 8 kv heads x T_l tokens (u = 1: no replication)
    stock = predict("llama3-8b", T, world=64, sp=64, ring=64, method="stock", param_bytes=2)
    flows = stock.by_source_phase_kind()
    assert (stock.ulysses, stock.ring) == (1, 64) and stock.bytes_by_kind()["all_to_all"] == 0
    assert flows[("ring", "forward", "send_recv")].bytes == L * 63 * 2 * block * 2
    assert flows[("ring", "backward", "send_recv")].bytes == L * (63 * 2 * block * 2 + 64 * 2 * block * 4)
    assert flows[("ring", "backward", "send_recv")].calls == L * (63 + 64)
    sb = predict("llama3-8b", T, world=64, sp=64, ring=64, method="streambp", chunk_size=1024, param_bytes=2)
    flows = sb.by_source_phase_kind()
    assert flows[("ring", "forward", "all_gather")].bytes == flows[("ring", "backward", "all_gather")].bytes \
        == L * 2 * block * 2
    assert flows[("ring", "backward", "reduce_scatter")].bytes == L * 2 * 64 * block * 2
    chosen = predict("llama3-8b", T, world=64, sp=64, method="streambp", param_bytes=2)
    assert (chosen.ulysses, chosen.ring) == (32, 2)
    with pytest.raises(ValueError, match="cannot shard 32 query and 8 key/value heads"):
        predict("llama3-8b", T, world=64, sp=64, ring=1)
    for method in METHODS:
        assert predict("llama3-8b", T, world=64, sp=8, ring=1, method=method).flows == \
            predict("llama3-8b", T, world=64, sp=8, method=method).flows


def test_counted_names_cover_the_existing_test_list():
    """Every collective tests/test_engine_dist.py wraps is counted here too."""
    assert set(COUNTED) <= set(DS_INPUT)
