"""A representative of each attention feature the sweep brought in, beyond the sweep's single process: LoRA
through PEFT and 2-rank ZeRO-3 against one process.

gpt-oss (attention sinks, sliding windows, a mixture of experts returning router scores), DeepSeek-V3
(multi-head latent attention: StreamBP's whole-cache mode, a MoE with shared experts and grouped sigmoid
routing), Llama 4 text (chunked attention, no-RoPE layers with temperature tuning, a MoE returning its
output flat) and Gemma 4 text (per-layer inputs, cross-layer K/V sharing, an MoE block beside the dense MLP,
per-layer head dims). Models come from ``tests/model_zoo.py`` (tiny, features shrunk below the test length).
"""

from __future__ import annotations

import copy

import pytest
import torch

import ds_longseq
from tests import model_sweep, model_zoo
from tests.dist_utils import run_distributed

REPRESENTATIVES = ["gpt_oss", "deepseek_v3", "llama4_text", "gemma4_text"]


# --- LoRA through PEFT, float64 ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(model_sweep.MODES))
@pytest.mark.parametrize("model_type", REPRESENTATIVES)
def test_lora_matches_peft(model_type, mode):
    """LoRA on every linear layer but the routers (PEFT's "all-linear"), wrapped before ``enable``: the loss
    and every LoRA gradient as PEFT's own model gives them, at 1e-10 (both in full float64, as in the sweep)."""
    peft = pytest.importorskip("peft")
    base = model_zoo.tiny_model(model_type, torch.float64)
    base.enable_input_require_grads()  # the frozen embedding's output gets a gradient to compare
    # routers stay frozen: Llama 4's is an nn.Linear subclass returning a tuple, which PEFT's own LoRA layer
    # cannot wrap (the reference would fail, not ours)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules="all-linear", exclude_modules=r".*router.*")
    torch.manual_seed(1)
    reference_model = peft.get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(1)
    ours_model = ds_longseq.enable(peft.get_peft_model(copy.deepcopy(base), config), model_sweep.MODES[mode])
    batch = model_zoo.tiny_batch(model_type)
    ref_loss, ref_grads, ref_embeds = model_sweep._loss_and_grads(reference_model, batch)
    loss, grads, embeds = model_sweep._loss_and_grads(ours_model, batch)
    assert set(grads) == set(ref_grads) and ref_grads and all("lora_" in n for n in ref_grads)
    assert model_sweep._rel(loss, ref_loss) < 1e-10
    assert model_sweep._rel(embeds, ref_embeds) < 1e-10
    worst = max(model_sweep._rel(grads[n], ref_grads[n]) for n in ref_grads)
    assert worst < 1e-10, worst


# --- ZeRO-3 on 2 CPU ranks, float32 -------------------------------------------------------------------------

LR = 0.3
STEPS = 2


def _rank_batches(model_type: str, rank: int) -> list[dict]:
    """Different tokens and different numbers of valid targets on each rank and step."""
    out = []
    for step in range(STEPS):
        batch = model_zoo.tiny_batch(model_type, seed=100 * rank + step)
        batch["labels"][1, : 3 + 6 * rank + step] = -100  # a prompt of rank-dependent length
        out.append(batch)
    return out


def _model(model_type: str):
    model = model_zoo.tiny_model(model_type, torch.float32)
    model.train()
    return model


def _zero3_worker(rank: int, model_type: str, mode: str):
    import ds_longseq.engine
    from ds_longseq.compat import gathered_parameters  # DeepSpeed 0.18's gather on gloo: see its docstring

    model = _model(model_type)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0,  # DeepSpeed clips at 1.0 by default; exactness needs none
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
        "long_seq": model_sweep.MODES[mode],
    }
    engine, *_ = ds_longseq.engine.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config
    )
    losses = []
    for batch in _rank_batches(model_type, rank):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = list(engine.module.parameters())
    with gathered_parameters(params):
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"params": state, "losses": losses}


def _one_process(model_type: str, world_size: int) -> dict[str, torch.Tensor]:
    """The stock model, plain autograd, on every rank's batch: the mean of the ranks' losses per step."""
    model = _model(model_type)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = [_rank_batches(model_type, r) for r in range(world_size)]
    for step in range(STEPS):
        optimizer.zero_grad()
        sum(model(**per_rank[r][step]).loss for r in range(world_size)).div(world_size).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_type,mode", [
    # heavy: mini_seq's ZeRO-3 steps run in the default suite on Llama (tests/test_engine_dist.py)
    pytest.param(t, m, marks=pytest.mark.slow) if m == "mini_seq" else (t, m)
    for t in REPRESENTATIVES for m in sorted(model_sweep.MODES)])
def test_zero3_two_ranks_match_one_process(model_type, mode):
    """2 optimizer steps under ZeRO-3 with StreamBP or mini_seq (+ chunked head): every parameter as one
    process with the stock model (1e-5 relative: float32 rounding over two steps)."""
    results = run_distributed(_zero3_worker, 2, (model_type, mode))
    reference = _one_process(model_type, 2)
    for name, ref in reference.items():
        for rank, result in enumerate(results):
            err = model_sweep._rel(result["params"][name], ref)
            assert err < 1e-5, (name, rank, err)
    assert results[0]["losses"] != results[1]["losses"]  # the ranks saw different data


# --- Ulysses sequence parallelism on 2 CPU ranks, float64 ------------------------------------------------------

SP_MODES = {
    "ulysses_only": {},
    "streambp": {"streambp": {"enabled": True, "chunk_size": 7}, "attention": {"kv_block_size": 4},
                 "lm_head": {"enabled": True, "chunk_size": 9}},
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 9}},
}


def _sp_worker(rank: int, model_type: str, modes: tuple[str, ...] = tuple(SP_MODES), mutation: str | None = None,
               sequence_parallel: dict | None = None):
    """Each rank its shard of the batch (40 tokens over the world's ranks, all of them one sequence-parallel group;
    different valid-token counts), every mode; the ranks' gradients summed (each holds its tokens' share).
    ``out["capture_at"]``: where the sequence-parallel StreamBP layers took their keys/values
    (``GlobalKVStream.capture_at``). ``mutation`` (a control): "expanded_kv_grad_dropped", keys/values taken at
    the attention call are detached in the K/V pass, so their gradient never reaches the layer's K/V projections;
    "state_not_passed", recurrent layers start every rank from zeros (the previous rank's states are received and
    dropped); "mixer_input_grad_dropped", a head-sharded mixer's input gradient is not pushed back through the
    layer before it. ``sequence_parallel``: more fields of that config section (``recurrent``). The patches are
    undone before it returns, so a rank may call it once per family."""
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch
    from ds_longseq.ops.chunk_grads import ChunkGrads
    from ds_longseq.ops.kv_stream import GlobalKVStream
    from ds_longseq.ops.state_passing import StateRing

    places = set()
    saved = [(GlobalKVStream, "attends"), (GlobalKVStream, "_take"), (StateRing, "from_previous"),
             (ChunkGrads, "backward_to")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
    attends, take = GlobalKVStream.attends, GlobalKVStream._take

    def recorded(self, key, value):
        try:
            return attends(self, key, value)
        finally:
            places.add(self.capture_at)

    def dropped(self, key, value):
        if self.mode == "capture_grad" and self.capture_at == "attention":
            key, value = key.detach(), value.detach()
        return take(self, key, value)

    GlobalKVStream.attends = recorded
    if mutation == "expanded_kv_grad_dropped":
        GlobalKVStream._take = dropped
    if mutation == "state_not_passed":  # recurrent layers start every rank from zeros
        StateRing.from_previous = lambda self, device, segment=0: (
            {} if self.prev[segment] is None else (self._recv(self.prev[segment], device), {})[1])
    if mutation == "mixer_input_grad_dropped":
        backward_to = ChunkGrads.backward_to
        ChunkGrads.backward_to = lambda self, outs, grads, leaves: (backward_to(self, outs, grads, leaves), (None,))[1]
    size = dist.get_world_size()
    local = shard_batch(model_zoo.tiny_batch(model_type), rank, size)
    out = {}
    try:
        for mode in modes:
            config = SP_MODES[mode]
            try:
                model = ds_longseq.enable(model_zoo.tiny_model(model_type, torch.float64).train(),
                                          {**config, "sequence_parallel": {"size": size, **(sequence_parallel or {})}},
                                          sp_group=dist.group.WORLD)
            except ds_longseq.UnsupportedModelError as error:
                out[mode] = str(error)
                continue
            loss, grads, embeds = model_sweep._loss_and_grads(model, local)
            for g in grads.values():
                dist.all_reduce(g)
            out[mode] = (loss, grads, embeds)
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    out["capture_at"] = places
    return out


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma4_text", "llama4_text", "deepseek_v3"])
def test_sequence_parallel_matches_one_process(model_type):
    """Under Ulysses SP=2, with StreamBP, mini_seq or neither: loss, this rank's input gradient and every parameter
    gradient as one process, at 1e-10. gpt-oss: attention sinks (each rank takes its heads' sinks), sliding
    windows across the shard boundary. Gemma 4: per-layer inputs cut with the shard; the last layers attend an
    earlier layer's keys/values (under StreamBP heads-sharded, their gradient sent back to it). Llama 4: attention
    chunks counted from the global start, temperature tuning at global positions (the shard's offset).
    DeepSeek-V3: values of another head dim than queries and keys; under StreamBP the keys/values expanded from
    the cached latent are taken at the attention call and exchanged like any layer's."""
    batch = model_zoo.tiny_batch(model_type)
    ref_loss, ref_grads, ref_embeds = model_sweep._loss_and_grads(
        model_zoo.tiny_model(model_type, torch.float64).train(), batch)
    half = batch["input_ids"].shape[1] // 2
    for rank, result in enumerate(run_distributed(_sp_worker, 2, (model_type,))):
        assert result.pop("capture_at") == {"attention" if model_type == "deepseek_v3" else "cache"}
        for mode, outcome in result.items():
            loss, grads, embeds = outcome
            errors = {"loss": model_sweep._rel(loss, ref_loss),
                      "input_grad": model_sweep._rel(embeds, ref_embeds[:, rank * half:(rank + 1) * half])}
            errors.update({n: model_sweep._rel(grads[n], ref_grads[n]) for n in ref_grads})
            worst = max(errors, key=errors.get)
            assert errors[worst] < 1e-10, (mode, rank, worst, errors[worst])


@pytest.mark.parametrize("model_type", ["deepseek_v2", "qwen2_moe"])
def test_unverified_families_stay_refused_under_sequence_parallelism(model_type):
    """Families found from their structure without a parity test under sequence parallelism: refused before
    anything runs."""
    with pytest.raises(ds_longseq.UnsupportedModelError, match=r"sequence_parallel on .*without such a test"):
        ds_longseq.patch.check_model(model_zoo.tiny_model(model_type, torch.float64),
                                     {"sequence_parallel": {"size": 2}, "streambp": {"enabled": True}})


def test_mutation_expanded_kv_without_gradient_is_caught():
    """DeepSeek-V3 under SP=2 with StreamBP: if the keys/values taken at the attention call (expanded from the
    cached latent) got no gradient in the K/V pass, the latent's projections would miss the attention's share;
    the parity check must see it."""
    batch = model_zoo.tiny_batch("deepseek_v3")
    _, ref_grads, _ = model_sweep._loss_and_grads(model_zoo.tiny_model("deepseek_v3", torch.float64).train(), batch)
    result = run_distributed(_sp_worker, 2, ("deepseek_v3", ("streambp",), "expanded_kv_grad_dropped"))[0]
    _, grads, _ = result["streambp"]
    worst = max(ref_grads, key=lambda n: model_sweep._rel(grads[n], ref_grads[n]))
    assert "kv_a_proj" in worst or "kv_b_proj" in worst or "kv_a_layernorm" in worst, worst
    assert model_sweep._rel(grads[worst], ref_grads[worst]) > 1e-3


# --- packed documents, float64 ----------------------------------------------------------------------------------

PACKED_ROWS = [[1, 9, 7, 12, 11], [14, 1, 25]]
"""Document lengths per 40-token row: a 1-token document, documents crossing StreamBP chunks (13) and attention
tiles (5), one longer than gpt-oss's window and Llama 4's attention chunk."""


@pytest.mark.parametrize("mode", sorted(model_sweep.MODES))
@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3", "gemma4_text"])
def test_packed_documents_match_documents_alone(model_type, mode):
    """Rows of packed documents (restarting position_ids) under ds_longseq against every document run alone
    through the stock model: loss over the same targets, each document's input gradient and every parameter
    gradient at 1e-10 (both in full float64; a gradient zero in exact arithmetic, such as a key bias's, is
    compared against 1e-6 of the largest, as in the sweep). Sinks and sliding windows, the latent cache's
    whole-cache mode, shared K/V and per-layer inputs: each bounded at its document's start. gpt-oss's stock
    masks ignore the position ids (transformers attends across its packed documents), so without StreamBP
    (mini_seq keeps the stock attention) packed rows are refused before compute. Llama 4 counts its attention
    temperature along the row in transformers (packed is not the documents alone there):
    tests/test_model_sweep.py compares it with the stock model on the packed rows."""
    from tests.test_packing import documents_alone, packed_run

    ids = model_zoo.tiny_batch(model_type, batch=2, seq_len=44)["input_ids"][:, :40]  # no padding in 40
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKED_ROWS])
    starts = [[sum(row[:i]) for i in range(len(row))] for row in PACKED_ROWS]
    documents = [ids[r, s:s + n] for r, row in enumerate(PACKED_ROWS) for s, n in zip(starts[r], row, strict=True)]
    batch = {"input_ids": ids, "position_ids": positions, "labels": ids.clone()}
    model = model_zoo.tiny_model(model_type, torch.float64).train()
    with model_sweep.full_float64():
        ref_loss, ref_grads, ref_embeds = documents_alone(model, documents)
        ours = ds_longseq.enable(model, model_sweep.MODES[mode])
        try:
            if model_type == "gpt_oss" and mode == "mini_seq":
                with pytest.raises(NotImplementedError, match="GptOssForCausalLM without long_seq.streambp: its "
                                                              "decoder builds its stock attention masks without"):
                    ours(**batch)
                return
            loss, grads, embeds = packed_run(ours, batch)
        finally:
            ds_longseq.disable(model)
    worst, error = model_sweep.worst_error((loss, grads, embeds), (ref_loss, ref_grads, ref_embeds))
    assert error < 1e-10, (worst, error)
