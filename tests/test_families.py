"""Model families beyond the Llama-like four (OLMo2, Gemma 2, Gemma 3, Phi-3) against the stock
model: float64 to 1e-10 on the loss, the input gradient and every parameter gradient, with padding,
GQA, tied and untied heads, and each family's features on (Gemma 2: attention-logit and final-logit
softcaps, a sliding window shorter than the sequence on alternating layers; Gemma 3: sliding and
full layers with their own RoPE bases, q/k norms, final-logit softcap; OLMo2: q/k norms over all
heads; Phi-3: fused qkv and gate/up projections, partial rotary).

The float64 references compute in float64 throughout: ``full_precision_norms`` (Gemma's stock
norm computes ``1 + weight`` in float32 even in a float64 model, so its weight gradient is a float32
sum over tokens, which a chunked backward sums in a different order) and ``float64_eager_attention``
(transformers' eager attention, the only stock one with a softcap, takes its softmax in float32).
Both are applied to the model before it is cloned, so ours runs the same norms; the float32 test
runs the unmodified stock model."""

import pytest
import torch

import ds_longseq
from ds_longseq import UnsupportedModelError
from tests.helpers import (
    EXTRA_ARCHS,
    clone,
    compare,
    float64_eager_attention,
    float64_load_balancing_loss,
    float64_routers,
    full_precision_norms,
    loss_and_grads,
    make_batch,
    make_model,
    rel_err,
)
from tests.test_packing import documents_alone, packed_batch, packed_run


def exact(model):
    """The model with float64 norms, attention and routers (see the module docstring)."""
    return float64_routers(float64_eager_attention(full_precision_norms(model)))


@pytest.fixture(autouse=True)
def float64_load_balancing(monkeypatch):
    """The MoE families' load-balancing loss in the logits' dtype (stock: float32 accumulators), in
    their modeling modules, where the stock forward and ds_longseq's both look it up."""
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers.models.qwen3_moe.modeling_qwen3_moe as qwen3_moe

    for module in (mixtral, qwen3_moe):
        monkeypatch.setattr(module, "load_balancing_loss_func", float64_load_balancing_loss)


def right_padded_batch():
    """Right padding and a masked prompt. No left padding: stock Gemma 2 (eager) returns NaN for
    rows that see no key (left-padded positions), which would poison the reference's gradients."""
    batch = make_batch()
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    mask[0] = 1
    mask[0, -2:] = 0
    labels[0] = ids[0].masked_fill(mask[0] == 0, -100)
    return batch


CONFIGS = {
    "streambp": {"streambp": {"enabled": True, "chunk_size": 5}, "attention": {"kv_block_size": 4},
                 "lm_head": {"enabled": True, "chunk_size": 7}},
    "streambp_stock_head": {"streambp": {"enabled": True, "chunk_size": 8}},
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 6}},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", sorted(EXTRA_ARCHS))
def test_family_float64_exact(arch, tie, config):
    model = exact(make_model(arch, torch.float64, tie=tie))
    batch = right_padded_batch()
    ref = loss_and_grads(model, batch, use_reference=True, ref_dtype=torch.float64)
    own_loss = "lm_head" in CONFIGS[config]
    ours = loss_and_grads(ds_longseq.enable(clone(model), CONFIGS[config]), batch,
                          use_reference=not own_loss, ref_dtype=torch.float64)
    errs = compare(ours, ref)
    assert max(errs.values()) < 1e-10, errs


@pytest.mark.parametrize("arch", sorted(EXTRA_ARCHS))
def test_family_float32_against_stock(arch):
    model = make_model(arch, torch.float32)
    batch = right_padded_batch()
    ref = loss_and_grads(model, batch)
    ours = loss_and_grads(ds_longseq.enable(clone(model), CONFIGS["streambp"]), batch)
    assert max(compare(ours, ref).values()) < 1e-5


# Each family's special settings in the test models, and the value that switches each off: the
# tests above would pass vacuously if a setting did not change the model.
FEATURES = {
    "gemma2": {"final_logit_softcapping": None, "attn_logit_softcapping": None, "sliding_window": 4096},
    # (Gemma 3's attention ignores attn_logit_softcapping in transformers: not a feature to test)
    "gemma3_text": {"final_logit_softcapping": None, "sliding_window": 4096},
    "phi3": {"partial_rotary_factor": 1.0},
}


@pytest.mark.parametrize("arch,field", [(a, f) for a in sorted(FEATURES) for f in FEATURES[a]])
def test_family_features_actually_bite(arch, field):
    """Switching one feature off changes the stock model's loss."""
    batch = right_padded_batch()
    with torch.no_grad():
        on = make_model(arch, torch.float64)(**batch).loss.item()
        off = make_model(arch, torch.float64, **{field: FEATURES[arch][field]})(**batch).loss.item()
    assert abs(on - off) > 1e-4, (arch, field)


def test_gemma2_packed_documents_float64():
    """Documents, sliding windows and both softcaps at once, against each document alone."""
    model = exact(make_model("gemma2", torch.float64))
    batch, documents = packed_batch([[1, 9, 7, 12, 8], [14, 1, 22]], "position_ids", collator_labels=True)
    ref = documents_alone(model, documents)
    errs = compare(packed_run(ds_longseq.enable(clone(model), CONFIGS["streambp"]), batch), ref)
    assert max(errs.values()) < 1e-10, errs


@pytest.mark.parametrize("config", ["streambp", "mini_seq"])
def test_residual_dropout_exact_by_mask_replay(config):
    """Phi-3's residual dropouts (config.resid_pdrop, nn.Dropout modules after its attention and its MLP) are drawn
    again, the same, in each chunk's recompute: against the stock model run whole with the masks ds_longseq's
    forward drew (tests/mask_replay.py), float64, 1e-10."""
    from tests.mask_replay import against_mask_replay

    model = exact(make_model("phi3", torch.float64, resid_pdrop=0.1))
    ours = ds_longseq.enable(clone(model), CONFIGS[config])
    batch = right_padded_batch()
    ours(**batch).loss.backward()  # the first training forward's one-time checks
    errs, recorder = against_mask_replay(ours, model, batch)
    assert len(recorder.masks) == 4 and max(errs.values()) < 1e-10, errs  # 2 layers x (attention, MLP)


def test_bidirectional_attention_is_refused():
    """Gemma 3 can be configured with bidirectional attention; every ds_longseq attention is causal."""
    model = make_model("gemma3_text", torch.float32, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match=r"is_causal=False.*use_bidirectional_attention"):
        ds_longseq.enable(model, CONFIGS["streambp"])


def test_missing_parts_are_named_at_enable():
    """A model whose LM head is not a Linear or whose layer list is empty is refused at enable(),
    naming the attribute, every problem at once."""
    model = make_model("olmo2", torch.float32)
    model.lm_head = torch.nn.Identity()
    model.model.layers = torch.nn.ModuleList()
    with pytest.raises(UnsupportedModelError, match=r"(?s)Olmo2ForCausalLM.model.layers is not a non-empty.*"
                       r"Olmo2ForCausalLM.lm_head is not a plain torch.nn.Linear"):
        ds_longseq.enable(model, CONFIGS["streambp"])


def test_unknown_attention_kwarg_is_refused_not_ignored():
    """An attention feature ds_longseq does not implement (here: an ALiBi bias, as Falcon passes it)
    raises, naming it, instead of being silently dropped."""
    from ds_longseq.forwards.attention_interface import longseq_attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=r"\['alibi'\]"):
        longseq_attention(torch.nn.Module(), q, q, q, None, alibi=torch.zeros(1, 2, 1, 4))


# --- sequence parallelism (Ulysses, 2 CPU ranks) --------------------------------------------------

SP_FAMILIES = ["olmo2", "gemma2", "gemma3_text", "phi3", "qwen3_moe", "mixtral"]


def sp_batch():
    """The sequence-parallel tests' batch without its left padding (the last padded position would
    predict the first real token, from a row that sees no key: stock eager gives NaN there, see
    ``right_padded_batch``); row 1 keeps its masked prompt (rank 0) and right padding (rank 1)."""
    from tests.test_sequence_parallel import global_batch

    batch = global_batch()
    batch["attention_mask"][0] = 1
    batch["labels"][0] = batch["input_ids"][0]
    return batch


def families_sp_worker(rank: int, archs: list[str], cases: list[str]):
    """Each family under SP=2 (StreamBP and mini_seq), float64, ranks' gradients summed; MoE
    families without router logits, then with them (refused under SP)."""
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from tests.test_sequence_parallel import SP_CASES

    local = shard_batch(sp_batch(), rank, 2)
    out = {}
    for arch in archs:
        for name in cases:
            model = exact(make_model(arch, torch.float64, output_router_logits=False))
            ds_longseq.enable(model, {**SP_CASES[name], "sequence_parallel": {"size": 2}}, sp_group=dist.group.WORLD)
            loss, grads, embed_grad = loss_and_grads(model, local)
            for g in grads.values():
                dist.all_reduce(g)
            out[arch, name] = {"loss": loss, "grads": grads, "embed_grad": embed_grad}
            if arch in ("qwen3_moe", "mixtral"):
                try:
                    model(**local, output_router_logits=True)
                    out[arch, name, "refusal"] = None
                except NotImplementedError as err:
                    out[arch, name, "refusal"] = str(err)
    return out


def test_families_under_sequence_parallelism_float64():
    from tests.dist_utils import run_distributed
    from tests.test_sequence_parallel import SEQ

    cases = ["streambp", "mini_seq"]
    results = run_distributed(families_sp_worker, 2, (SP_FAMILIES, cases))
    for arch in SP_FAMILIES:
        ref_loss, ref_grads, ref_embed = loss_and_grads(
            exact(make_model(arch, torch.float64, output_router_logits=False)), sp_batch(),
            use_reference=True, ref_dtype=torch.float64,
        )
        for rank, per_rank in enumerate(results):
            for name in cases:
                r = per_rank[arch, name]
                errs = {"loss": rel_err(r["loss"], ref_loss),
                        "embed_grad": rel_err(r["embed_grad"], ref_embed[:, rank * SEQ // 2 : (rank + 1) * SEQ // 2])}
                assert set(r["grads"]) == set(ref_grads)
                errs.update({n: rel_err(g, ref_grads[n]) for n, g in r["grads"].items()})
                assert max(errs.values()) < 1e-10, (arch, name, rank, max(errs, key=errs.get), max(errs.values()))
                if arch in ("qwen3_moe", "mixtral"):
                    assert "under sequence parallelism" in per_rank[arch, name, "refusal"]
