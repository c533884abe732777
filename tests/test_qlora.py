"""QLoRA: ds_longseq on a bitsandbytes 4-bit base under a PEFT LoRA adapter, against stock QLoRA on the same
quantized weights (float32 compute, CPU; bitsandbytes runs its 4-bit matmul on CPU).

Both sides load one float32 checkpoint with the same ``BitsAndBytesConfig``; quantizing is deterministic, so the
packed weights and their quantization state are bitwise equal (checked), and the LoRA adapters are drawn from one
seed. What remains is float32 rounding in another order (the chunked attention's online softmax, the chunked head's
sums, the chunks' partial weight gradients), the same as the float32 paths of every other test: loss, input gradient
and every LoRA gradient to 1e-5. The reference loss is computed from the stock model's logits.
"""

from __future__ import annotations

import pytest
import torch

import ds_longseq
from tests.helpers import compare, loss_and_grads, make_batch, make_model, rel_err

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOL = 1e-5

STREAMBP = {"streambp": {"enabled": True, "chunk_size": 5}, "attention": {"kv_block_size": 4},
            "lm_head": {"enabled": True, "chunk_size": 7}}
CASES = {
    "streambp": STREAMBP,
    "streambp_recompute": {**STREAMBP, "streambp": {"enabled": True, "chunk_size": 5,
                                                    "keep_attention_output": False}},
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 6}},
    "lm_head": {"lm_head": {"enabled": True, "chunk_size": 9}},
    "streambp_offload": {**STREAMBP, "offload": {"layer_inputs": "cpu", "keep_every": 2}},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama saved in float32 (with peaked attention: tests.helpers.make_model's initialisation)."""
    path = tmp_path_factory.mktemp("qlora_base")
    make_model("llama", torch.float32).save_pretrained(path)
    return str(path)


def quantized(path: str, quant_type: str = "nf4", double_quant: bool = True, storage=torch.float32):
    """The checkpoint at ``path`` loaded 4-bit (float32 compute), in training mode, its embedding output asking
    for a gradient (the input gradient compared)."""
    import transformers

    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()  # from_pretrained's eval mode would let bitsandbytes repack the weights for CPU inference
    model.enable_input_require_grads()
    return model


def qlora(model, targets=ALL_LINEAR):
    """PEFT LoRA (rank 4) on ``targets``, A and B drawn from one seed (init_lora_weights=False: nonzero gradients
    everywhere)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=list(targets))
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def packed_state(model) -> dict[str, torch.Tensor]:
    """Every 4-bit weight's packed storage and absmax (after double quantization: its codes), by name, as bytes (the
    packed codes stored as float32 hold NaN bit patterns, which torch.equal would call different)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            out[name] = module.weight.data.detach().contiguous().view(torch.uint8).clone()
            out[name + ".absmax"] = module.weight.quant_state.absmax.contiguous().view(torch.uint8).clone()
    return out


def test_the_base_is_4bit_and_both_sides_quantize_bitwise_alike(checkpoint):
    a, b = quantized(checkpoint), quantized(checkpoint)
    linears = [m for m in a.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 2 * len(ALL_LINEAR)  # every decoder projection; embedding and head stay float32
    assert a.lm_head.weight.dtype == torch.float32 and not isinstance(a.lm_head, bnb.nn.Linear4bit)
    pa, pb = packed_state(a), packed_state(b)
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_stock_qlora_float32(checkpoint, case):
    """Loss, input gradient and every LoRA gradient against stock QLoRA on the same 4-bit weights, 1e-5."""
    batch = make_batch()
    reference = loss_and_grads(qlora(quantized(checkpoint)), batch, use_reference=True)
    model = ds_longseq.enable(qlora(quantized(checkpoint)), CASES[case])
    before = packed_state(model)
    result = loss_and_grads(model, batch)
    assert result[1] and all("lora_" in n for n in result[1])
    errs = compare(result, reference)
    assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}
    after = packed_state(model)  # nothing of ds_longseq's (probes, replays) touched the packed base
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_fp4_without_double_quantization_matches_stock(checkpoint):
    batch = make_batch()
    kwargs = {"quant_type": "fp4", "double_quant": False}
    reference = loss_and_grads(qlora(quantized(checkpoint, **kwargs)), batch, use_reference=True)
    result = loss_and_grads(ds_longseq.enable(qlora(quantized(checkpoint, **kwargs)), STREAMBP), batch)
    errs = compare(result, reference)
    assert max(errs.values()) < TOL, errs


def test_approx_bp_activations_match_their_reference_on_the_4bit_base(checkpoint):
    """Approx-BP's activation (ReSiLU2) applies to a 4-bit base: against stock QLoRA whose activations are given the
    step derivative by hand (tests/test_approx_bp.py's reference), 1e-5."""
    from ds_longseq.ops.approx_autograd import RESILU2
    from tests.test_approx_bp import _step_activations

    batch = make_batch()
    reference = loss_and_grads(_step_activations(qlora(quantized(checkpoint)), RESILU2), batch, use_reference=True)
    model = ds_longseq.enable(qlora(quantized(checkpoint)), {**STREAMBP, "approx_bp": {"activation": "resilu2"}})
    errs = compare(loss_and_grads(model, batch), reference)
    assert max(errs.values()) < TOL, errs


def test_approx_bp_norm_folding_is_refused_on_4bit_weights(checkpoint):
    """MS-RMSNorm folds the norm's weight into the next linears: packed 4-bit weights cannot take it (refused in one
    line naming the setting, before anything changes)."""
    model = qlora(quantized(checkpoint))
    before = packed_state(model)
    from ds_longseq.forwards.approx_forwards import FoldError

    with pytest.raises(FoldError, match=r"bitsandbytes 4-bit quantised weight.*approx_bp.norm=null"):
        ds_longseq.enable(model, {**STREAMBP, "approx_bp": {"norm": "ms_rmsnorm"}})
    after = packed_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_inference_forward_leaves_the_4bit_weights_as_trained(checkpoint):
    """bitsandbytes repacks a Linear4bit's weight for CPU inference (bf16 absmax) at its first forward in eval mode
    without gradients, on CPUs with AVX-512 bf16; later training forwards would then run on other numbers. An
    enabled model keeps its weights as loaded, so an evaluation between steps changes no gradient."""
    batch = make_batch()
    model = ds_longseq.enable(qlora(quantized(checkpoint)), STREAMBP)
    first = loss_and_grads(model, batch)
    before = packed_state(model)
    model.eval()
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    model.train()
    assert all(torch.equal(before[k], v) for k, v in packed_state(model).items())
    second = loss_and_grads(model, batch)
    assert torch.equal(first[0], second[0]) and all(torch.equal(first[1][n], second[1][n]) for n in first[1])


# ---- ZeRO and sequence parallelism (2 CPU ranks, different data on each) -------------------------------------------

def _zero_worker(rank: int, stage: int, path: str, storage: torch.dtype):
    import ds_longseq.engine
    from tests.test_engine_dist import _gathered_state, ds_config, rank_batches

    model = qlora(quantized(path, storage=storage))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    config = ds_config(stage, 2, STREAMBP)
    engine, *_ = ds_longseq.engine.initialize(model=model, optimizer=optimizer, config=config)
    # under ZeRO-3 every packed 4-bit weight is partitioned: this rank holds half of its elements
    packed = [m.weight for m in engine.module.modules() if isinstance(m, bnb.nn.Linear4bit)]
    partitioned = all(w.ds_tensor.numel() * 2 == w.ds_numel for w in packed) if stage == 3 else None
    for batch in rank_batches(rank, 2 * 2):
        engine.backward(engine(**batch).loss)
        engine.step()
    return {n: p for n, p in _gathered_state(engine).items() if "lora_" in n}, partitioned


@pytest.mark.parametrize("stage,storage", [pytest.param(2, torch.float32, marks=pytest.mark.slow), (3, torch.float32),
                                           pytest.param(3, torch.uint8, marks=pytest.mark.slow)],
                         ids=["zero2", "zero3", "zero3-uint8-storage"])
def test_zero_on_two_ranks_matches_one_stock_qlora_process(checkpoint, stage, storage):
    """ZeRO-2 and ZeRO-3, the packed weights stored as float32 (bnb_4bit_quant_storage, as PEFT documents QLoRA under
    ZeRO-3) and as bitsandbytes' default uint8, 2 ranks x accumulation 2, 2 SGD steps: the LoRA weights equal one
    stock QLoRA process averaging the ranks' losses, 1e-5."""
    from tests.dist_utils import run_distributed
    from tests.test_engine_dist import rank_batches

    results = run_distributed(_zero_worker, 2, (stage, checkpoint, storage))
    model = qlora(quantized(checkpoint, storage=storage))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    per_rank = [rank_batches(r, 4) for r in range(2)]
    for step in range(2):
        optimizer.zero_grad()
        total = sum(model(**per_rank[r][step * 2 + m]).loss for r in range(2) for m in range(2))
        (total / 4).backward()
        optimizer.step()
    reference = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    for result, partitioned in results:
        assert partitioned is (True if stage == 3 else None)
        assert set(result) == set(reference)
        worst = max((rel_err(result[n], ref), n) for n, ref in reference.items())
        assert worst[0] < TOL, worst


def _sequence_parallel_worker(rank: int, path: str):
    import torch.distributed as dist

    from tests.sp_harness import rank_step
    from tests.test_sequence_parallel import global_batch

    model = ds_longseq.enable(qlora(quantized(path)), {**STREAMBP, "sequence_parallel": {"size": 2}},
                              sp_group=dist.group.WORLD)
    loss, grads, embed_grad, positions = rank_step(model, global_batch(), rank, 2, 1, loss_and_grads)
    return {"loss": loss, "grads": grads, "embed_grad": embed_grad, "positions": positions}


def test_sequence_parallel_two_ranks_match_one_stock_qlora_process(checkpoint):
    """Ulysses over 2 ranks with StreamBP: every rank's loss, its rows of the input gradient and the LoRA gradients
    summed over the group equal stock QLoRA on the whole batch (left and right padding and a masked prompt: uneven
    valid tokens per rank), 1e-5."""
    from tests.dist_utils import run_distributed
    from tests.test_sequence_parallel import global_batch

    results = run_distributed(_sequence_parallel_worker, 2, (checkpoint,))
    ref_loss, ref_grads, ref_embed = loss_and_grads(qlora(quantized(checkpoint)), global_batch(), use_reference=True)
    for r in results:
        errs = {"loss": rel_err(r["loss"], ref_loss),
                "embed_grad": rel_err(r["embed_grad"], ref_embed[:, r["positions"]])}
        assert set(r["grads"]) == set(ref_grads)
        errs.update({n: rel_err(g, ref_grads[n]) for n, g in r["grads"].items()})
        assert max(errs.values()) < TOL, {k: v for k, v in errs.items() if v >= TOL}


def test_recurrent_mixers_with_adapters_or_4bit_weights_are_not_cut_by_heads(tmp_path):
    """Sequence parallelism's recurrent='heads' cuts a linear-attention mixer's weights by heads: a mixer whose
    projections carry LoRA adapters (PEFT renames the weight) or are 4-bit (packed) is refused in one line naming
    them and the setting to use, where before the adapters crashed the forward with a KeyError."""
    import transformers

    from ds_longseq.families.mixer_heads import head_layout
    from tests import model_zoo

    stock = model_zoo.tiny_model("qwen3_5_text", torch.float32)
    mixer = stock.model.layers[0].linear_attn
    assert not isinstance(head_layout(mixer, 0, 2), str)  # the stock mixer can be cut
    adapted = peft.get_peft_model(stock, peft.LoraConfig(r=2, target_modules=["in_proj_qkv", "out_proj"]))
    reason = head_layout(adapted.base_model.model.model.layers[0].linear_attn, 0, 2)
    assert isinstance(reason, str) and "in_proj_qkv, out_proj carry LoRA adapters" in reason
    model_zoo.tiny_model("qwen3_5_text", torch.float32).save_pretrained(tmp_path)
    four_bit = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32,
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32))
    reason = head_layout(four_bit.model.layers[0].linear_attn, 0, 2)
    assert isinstance(reason, str) and "are quantised" in reason and "out_proj.weight" in reason


def test_the_memory_preflight_counts_a_4bit_base():
    """The scripts' preflight hands --load-in-4bit to the planner: at the Llama-3-8B shape a GPU that refuses the bf16
    LoRA step fits the QLoRA one, whose weights take about a third of the memory."""
    from ds_longseq import plan
    from ds_longseq.engine import PreflightError, memory_preflight

    config = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256}
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
          "long_seq": {"streambp": {"enabled": True, "chunk_size": 4096}, "lm_head": {"enabled": True}}}
    dims = plan.ModelDims.from_config(config)
    bf16 = plan.estimate(dims, plan.Setup.from_configs(ds, lora_rank=16), 32768).device_total
    four_bit = plan.estimate(dims, plan.Setup.from_configs(ds, lora_rank=16, load_in_4bit="nf4"), 32768).device_total
    assert bf16 - four_bit > 9 * 1024**3
    memory = ((bf16 + four_bit) / 2, 500 * 1024**3)
    with pytest.raises(PreflightError, match="do not fit"):
        memory_preflight(config, ds, 32768, lora_rank=16, device="cuda", memory=memory)
    assert memory_preflight(config, ds, 32768, lora_rank=16, device="cuda", memory=memory, load_in_4bit="nf4").fits


def _trainer_worker(rank: int, path: str, workdir: str, resume: str | None):
    import os

    from transformers import TrainingArguments

    from ds_longseq.trainer import LongSeqTrainer
    from tests.test_engine_dist import rank_batches

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0,
              "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 2}, "long_seq": STREAMBP}
    args = TrainingArguments(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=2, max_steps=2, learning_rate=0.5,
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, optim="sgd", deepspeed=config,
        report_to=[], logging_steps=1, use_cpu=True, disable_tqdm=True, save_strategy="steps", save_steps=1,
        remove_unused_columns=False)
    rows = [{k: v[i] for k, v in batch.items()} for batch in rank_batches(0, 2) for i in range(2)]
    trainer = LongSeqTrainer(model=qlora(quantized(path)), args=args, train_dataset=rows,
                             data_collator=lambda f: {k: torch.stack([x[k] for x in f]) for k in f[0]})
    trainer.train(resume_from_checkpoint=resume)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_the_trainers_checkpoints_hold_the_adapter_alone_and_resume(checkpoint, tmp_path):
    """LongSeqTrainer on a 4-bit PEFT model under DeepSpeed: each checkpoint's model states hold the LoRA weights
    only (not the base, nor the scales bitsandbytes adds to its state_dict), and resuming from the first one trains
    the second step to the uninterrupted run's loss."""
    from tests.dist_utils import run_distributed

    (losses,) = run_distributed(_trainer_worker, 1, (checkpoint, str(tmp_path / "a"), None))
    assert len(losses) == 2
    (states,) = (tmp_path / "a" / "out" / "checkpoint-1").rglob("mp_rank_00_model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    assert module and all("lora_" in k for k in module), sorted(k for k in module if "lora_" not in k)[:5]
    first = tmp_path / "a" / "out" / "checkpoint-1"
    (resumed,) = run_distributed(_trainer_worker, 1, (checkpoint, str(tmp_path / "a"), str(first)))
    assert resumed[-1] == pytest.approx(losses[-1], rel=1e-6)
