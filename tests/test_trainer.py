"""ds_longseq in the Hugging Face Trainer (``ds_longseq.trainer``): 2 CPU ranks, real DeepSpeed.

Every run trains a tiny float32 Llama for 3 optimizer steps with the real ``Trainer`` and records
the whole (unsharded) batch each rank was given at each micro-step. The reference replays those
global batches in plain PyTorch in one process: per optimizer step the token-mean loss over every
data-parallel replica and accumulation step (the Trainer's ``average_tokens_across_devices``),
its gradient, and plain SGD (the Trainer's ``optim="sgd"``). Parameters after 3 steps (from the
HF-format model the Trainer saved, loaded into the stock class) and every logged loss must match.
Batches are right-padded with a different number of valid tokens per row and per rank.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import ds_longseq
from tests.dist_utils import run_distributed

# Plain SGD: the parameters after each step are linear in the gradients, so comparing them compares
# the gradients. (Adam's first steps are sign-like: an element whose gradient is ~1e-9, whose sign
# float32 rounding decides, moves by the whole learning rate.)
VOCAB, LR, STEPS = 64, 0.5, 3
EVAL_SAMPLES = 8  # 4 eval batches of 2: accelerate gives batches 0, 2 to rank 0 and 1, 3 to rank 1


def _samples(n: int = 24, seed: int = 0) -> list[dict[str, list[int]]]:
    """Token sequences of 9..23 tokens, the first 2-4 of each a prompt (labels -100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(9, 24, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """Right padding to the longest row (pad id 0, mask 0, label -100)."""
    T = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n] = torch.tensor(f["input_ids"])
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(f["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def save_tiny_llama(path: str, ring: bool = False) -> None:
    """The tiny Llama the Trainer tests train: 4 heads on 2 kv heads; ``ring``: 3 heads on 1 kv head, which
    sequence parallelism 2 cannot split by heads, so it runs a ring of 2 (``ops.sp_layout.sp_degrees``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = {"hidden_size": 24, "num_attention_heads": 3, "num_key_value_heads": 1} if ring else {
        "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
    cfg = LlamaConfig(
        vocab_size=VOCAB, intermediate_size=64, num_hidden_layers=2, tie_word_embeddings=False,
        attn_implementation="sdpa", **heads,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)


def ds_config(stage: int, sp: int, long_seq: bool = True) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "steps_per_print": 10**6,
    }
    if long_seq:
        config["long_seq"] = {  # under a ring (3 heads at SP 2) StreamBP's K/V are gathered over the ring
            "streambp": {"enabled": True, "chunk_size": 4}, "attention": {"kv_block_size": 4},
            "lm_head": {"enabled": True, "chunk_size": 8},
            "sequence_parallel": {"size": sp},
        }
    return config


def train_body(rank: int, workdir: str, model_dir: str, stage: int, sp: int, gas: int, opts: dict):
    """One Trainer run on this rank; returns (batches it trained on, logged losses)."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from ds_longseq.trainer import LongSeqTrainer

    args = TrainingArguments(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=2, gradient_accumulation_steps=gas,
        max_steps=opts.get("max_steps", STEPS), learning_rate=opts.get("lr", LR), lr_scheduler_type="constant",
        max_grad_norm=0.0, weight_decay=opts.get("weight_decay", 0.0), optim=opts.get("optim", "sgd"),
        deepspeed=ds_config(stage, sp),
        report_to=[], logging_steps=1, use_cpu=True,
        disable_tqdm=True, seed=opts.get("seed", 7), save_strategy=opts.get("save_strategy", "no"),
        save_steps=opts.get("save_steps", 1), remove_unused_columns=False, per_device_eval_batch_size=2,
    )
    # after TrainingArguments: under ZeRO-3 the model is created partitioned (zero.Init), as users do
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if opts.get("lora"):
        model = add_lora(model)
    seen = []

    class Recording(LongSeqTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items()})
            return super().training_step(model, inputs, num_items_in_batch=num_items_in_batch)

    trainer = Recording(model=model, args=args, train_dataset=_samples(), data_collator=collate)
    if opts.get("ring"):  # 3 heads at sequence parallelism 2: a ring of 2, each rank's tokens the zigzag layout's
        assert ds_longseq.patch.sequence_parallel_of(trainer.model).ring == 2
    trainer.train(resume_from_checkpoint=opts.get("resume"))
    # under sequence parallelism each rank's eval batch runs sharded across the group, the group's batches in
    # turn: the decoder sees (batch, length / P) inputs, recorded here for the test
    lengths = []
    hook = trainer.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(int(kwargs["input_ids"].shape[1])), with_kwargs=True)
    metrics = trainer.evaluate(eval_dataset=_samples(EVAL_SAMPLES, seed=1))
    eval_loss = metrics["eval_loss"]
    hook.remove()
    with open(os.path.join(workdir, f"eval_lengths{rank}.json"), "w") as f:
        json.dump(lengths, f)
    with open(os.path.join(workdir, f"eval_metrics{rank}.json"), "w") as f:
        json.dump(metrics, f)
    if opts.get("generate"):
        prompt = torch.tensor([_samples(1, seed=2)[0]["input_ids"][:6]])
        with trainer.sequence_parallel_paused(), torch.no_grad():
            seen.append({"generated": trainer.model.generate(prompt, max_new_tokens=4, do_sample=False)})
    trainer.save_model(os.path.join(workdir, "hf_model"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return seen, losses, eval_loss


def add_lora(model):
    """LoRA on attention and MLP projections, seeded (the reference builds the same adapter)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(123)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "up_proj"])
    model = get_peft_model(model, config)
    with torch.no_grad():  # B starts at zero: make it non-zero so every LoRA gradient is non-trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    return model


def tiny_tokenizer():
    """A word-level tokenizer over the test vocabulary (TRL needs one for its pad token); offline."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token=f"t{VOCAB - 1}")


def trl_body(rank: int, workdir: str, model_dir: str, stage: int, sp: int, gas: int, opts: dict):
    """TRL's SFTTrainer (packing on or off) with ds_longseq on this rank."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from ds_longseq.trainer import with_long_seq

    args = SFTConfig(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=2, gradient_accumulation_steps=gas,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        optim="sgd", deepspeed=ds_config(stage, sp, long_seq=opts.get("long_seq", True)),
        report_to=[], logging_steps=1,
        use_cpu=True, disable_tqdm=True, seed=7, save_strategy="no", packing=opts["packing"], max_length=40,
        bf16=False,  # SFTConfig's default is bf16 training
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = datasets.Dataset.from_list([{"input_ids": s["input_ids"]} for s in _samples()])
    seen = []
    trainer_cls = with_long_seq(SFTTrainer) if opts.get("long_seq", True) else SFTTrainer

    class Recording(trainer_cls):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super().training_step(model, inputs, num_items_in_batch=num_items_in_batch)

    trainer = Recording(model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer())
    if opts.get("ring"):  # 3 heads at sequence parallelism 2: a ring of 2
        assert ds_longseq.patch.sequence_parallel_of(trainer.model).ring == 2
    trainer.train()
    if opts.get("eval"):  # TRL's fused-head evaluation (packed like training), by position
        evaluation = datasets.Dataset.from_list([{"input_ids": s["input_ids"]} for s in _samples(EVAL_SAMPLES, seed=1)])
        with open(os.path.join(workdir, f"eval_metrics{rank}.json"), "w") as f:
            json.dump(trainer.evaluate(eval_dataset=evaluation), f)
    trainer.save_model(os.path.join(workdir, "hf_model"))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return seen, [h["loss"] for h in logs], [h["mean_token_accuracy"] for h in logs]


def reference(model_dir: str, steps: list[list[dict]], lora: bool = False):
    """Plain PyTorch on one process: (per-step losses, model after the steps; merged with LoRA)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if lora:
        model = add_lora(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batches in steps:
        count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
        total = 0.0
        for b in batches:
            for ids, mask, labels in _documents(b):
                logits = model(input_ids=ids, attention_mask=mask).logits
                loss = F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
                ) / count
                loss.backward()
                total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.merge_and_unload() if lora else model


def _documents(batch: dict):
    """(input_ids, attention_mask, labels) to run through the stock model: the batch itself, or for
    packed rows (TRL's padding-free collator: restarting position_ids, no mask) each document alone."""
    if "attention_mask" in batch or "position_ids" not in batch:
        return [(batch["input_ids"], batch.get("attention_mask"), batch["labels"])]
    out = []
    for ids, pos, labels in zip(batch["input_ids"], batch["position_ids"], batch["labels"], strict=True):
        starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            out.append((ids[None, a:b], None, labels[None, a:b]))
    return out


def global_steps(results, sp: int, gas: int) -> list[list[dict]]:
    """The global batches of each optimizer step, from each rank's record; checks that the ranks of
    a sequence-parallel group trained on the same batches and the replicas on different ones."""
    world = len(results)
    per_rank = [r[0] for r in results]
    for r in range(world):
        leader = per_rank[r - r % sp]
        assert len(per_rank[r]) == len(leader)
        for a, b in zip(per_rank[r], leader, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a), f"rank {r} got other batches than its SP group's"
    replicas = [per_rank[g] for g in range(0, world, sp)]
    if len(replicas) > 1:
        assert not torch.equal(replicas[0][0]["input_ids"], replicas[1][0]["input_ids"])
    n = len(replicas[0])
    assert n == STEPS * gas
    return [[rep[s * gas + m] for rep in replicas for m in range(gas)] for s in range(STEPS)]


def reference_eval_loss(model, world: int = 2) -> float:
    """The Trainer's eval_loss: eval step k runs batches k*world + r (sequential, 2 samples each) on
    the ranks r, its loss is their token-weighted mean (average_tokens_across_devices), and
    eval_loss is the mean over the steps."""
    import torch.nn.functional as F

    samples = _samples(EVAL_SAMPLES, seed=1)
    batches = [collate(samples[i : i + 2]) for i in range(0, EVAL_SAMPLES, 2)]
    step_losses = []
    with torch.no_grad():
        for k in range(0, len(batches), world):
            total, count = 0.0, 0
            for b in batches[k : k + world]:
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
                labels = b["labels"][:, 1:]
                total += F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum").item()
                count += int((labels != -100).sum())
            step_losses.append(total / count)
    return sum(step_losses) / len(step_losses)


def reference_position_losses(model, prompts_masked: bool = True) -> list[float]:
    """The loss of the evaluation samples' targets in each eighth of their sample (the target token's place in its
    row over the row's length), as the Trainer's eval_loss_pos_<b>of8; every token a target without
    ``prompts_masked``."""
    import torch.nn.functional as F

    sums, counts = [0.0] * 8, [0] * 8
    with torch.no_grad():
        for sample in _samples(EVAL_SAMPLES, seed=1):
            ids = torch.tensor([sample["input_ids"]])
            labels = torch.tensor(sample["labels"] if prompts_masked else sample["input_ids"])
            losses = F.cross_entropy(model(input_ids=ids).logits[0, :-1], labels[1:], reduction="none")
            n = len(sample["input_ids"])
            for t in range(1, n):  # the target token t
                if labels[t] != -100:
                    sums[8 * t // n] += losses[t - 1].item()
                    counts[8 * t // n] += 1
    return [s / c for s, c in zip(sums, counts, strict=True)]


def assert_matches_reference(tmp_path, results, model_dir, sp, gas, lora: bool = False):
    from transformers import AutoModelForCausalLM

    ref_losses, ref_model = reference(model_dir, global_steps(results, sp, gas), lora)
    for result in results:
        assert result[1] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        # train_body's runs also evaluated after training (trl_body's third item is its token accuracies)
        if len(result) == 3 and isinstance(result[2], float):
            assert result[2] == pytest.approx(reference_eval_loss(ref_model), rel=1e-5)
            by_position = reference_position_losses(ref_model)
            for rank in range(len(results)):  # every rank reports the loss by position over all ranks' samples
                metrics = json.loads((tmp_path / f"eval_metrics{rank}.json").read_text())
                got = [metrics[f"eval_loss_pos_{b}of8"] for b in range(1, 9)]
                assert got == pytest.approx(by_position, rel=1e-5), (rank, got, by_position)
    if lora:  # the Trainer saved the adapter alone, in PEFT's format
        from peft import PeftModel

        assert (tmp_path / "hf_model" / "adapter_config.json").exists()
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        trained = PeftModel.from_pretrained(base, tmp_path / "hf_model").merge_and_unload()
    else:
        trained = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_model", dtype=torch.float32)
    ref = dict(ref_model.named_parameters())
    for name, p in trained.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if not lora:  # the saved config is the stock one: no ds_longseq attention name leaks into it
        assert "ds_longseq" not in json.dumps(json.loads((tmp_path / "hf_model" / "config.json").read_text()))
    return ref_model


CASES = {
    "zero3-sp2-gas2": (3, 2, 2),
    "zero2-sp1-gas1": (2, 1, 1),
}
SLOW_CASES = {
    "zero2-sp2-gas1": (2, 2, 1),
    "zero2-sp2-gas2": (2, 2, 2),
    "zero2-sp1-gas2": (2, 1, 2),
    "zero3-sp1-gas1": (3, 1, 1),
    "zero3-sp1-gas2": (3, 1, 2),
    "zero3-sp2-gas1": (3, 2, 1),
}


@pytest.mark.parametrize(
    "case",
    list(CASES) + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
)
def test_trainer_matches_plain_pytorch(tmp_path, case):
    stage, sp, gas = {**CASES, **SLOW_CASES}[case]
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    job = (str(tmp_path), model_dir, stage, sp, gas, {"generate": True})
    results = run_distributed(train_body, 2, job, timeout=600)
    generated = [seen.pop()["generated"] for seen, _, _ in results]
    ref_model = assert_matches_reference(tmp_path, results, model_dir, sp, gas)
    prompt = torch.tensor([_samples(1, seed=2)[0]["input_ids"][:6]])
    with torch.no_grad():
        expected = ref_model.generate(prompt, max_new_tokens=4, do_sample=False)
    for tokens in generated:  # greedy generation after training, sequence parallelism paused
        assert torch.equal(tokens, expected)
    # evaluation ran sharded under sequence parallelism: the group's 2 batches per step, each cut in P
    # (padded to a multiple of P), so every rank saw both batches' halves; the eval loss matched above
    samples = _samples(EVAL_SAMPLES, seed=1)
    batch_lengths = [max(len(s["input_ids"]) for s in samples[i:i + 2]) for i in range(0, EVAL_SAMPLES, 2)]
    expected_lengths = [-(-n // sp) for n in batch_lengths] if sp > 1 else [batch_lengths[r::2] for r in (0, 1)]
    for rank in (0, 1):
        seen_lengths = json.loads((tmp_path / f"eval_lengths{rank}.json").read_text())
        assert seen_lengths == (expected_lengths if sp > 1 else expected_lengths[rank]), (rank, seen_lengths)


def test_trainer_under_a_ring_matches_plain_pytorch(tmp_path):
    """A model whose 3 heads sequence parallelism 2 cannot split runs a ring of 2 (ZeRO-2, 2 accumulation steps):
    each batch cut by the ring's layout (a rank's tokens two zigzag blocks, not a contiguous half), the losses, the
    parameters after 3 steps, the evaluation loss and the loss by position bucket (each shard's recorded log-probs
    matched to its own tokens' buckets) equal plain PyTorch (float32, 1e-5 as the Ulysses cases)."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir, ring=True)
    results = run_distributed(train_body, 2, (str(tmp_path), model_dir, 2, 2, 2, {"ring": True}), timeout=600)
    assert_matches_reference(tmp_path, results, model_dir, 2, 2)
    # evaluation cut across the group: each batch padded to a multiple of 2 x 2 (the zigzag blocks), half per rank
    samples = _samples(EVAL_SAMPLES, seed=1)
    batch_lengths = [max(len(s["input_ids"]) for s in samples[i:i + 2]) for i in range(0, EVAL_SAMPLES, 2)]
    for rank in (0, 1):
        seen_lengths = json.loads((tmp_path / f"eval_lengths{rank}.json").read_text())
        assert seen_lengths == [-(-n // 4) * 2 for n in batch_lengths], (rank, seen_lengths)


@pytest.mark.parametrize("packing, ring", [
    (True, False), pytest.param(False, False, marks=pytest.mark.slow), pytest.param(True, True, marks=pytest.mark.slow),
], ids=["True", "False", "packed-ring"])
def test_trl_sft_trainer_matches_plain_pytorch(tmp_path, packing, ring):
    """TRL's SFTTrainer, its fused-LM-head calls served by ds_longseq's chunked head, ZeRO-3, SP=2;
    with packing the rows are TRL's padding-free ones (restarting position_ids, cu_seq_lens). ``ring``: the 3-head
    model (a ring of 2): packed documents cut by the ring's layout, and their position buckets with them."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir, ring=ring)
    results = run_distributed(trl_body, 2, (str(tmp_path), model_dir, 3, 2, 2,
                                            {"packing": packing, "eval": True, "ring": ring}), timeout=600)
    if packing:  # the records are TRL's packed rows
        assert "position_ids" in results[0][0][0] and "attention_mask" not in results[0][0][0]
    ref_model = assert_matches_reference(tmp_path, results, model_dir, 2, 2)
    by_position = reference_position_losses(ref_model, prompts_masked=False)
    for rank in (0, 1):  # evaluation sharded like training (SP 2), TRL's fused calls recorded by position
        metrics = json.loads((tmp_path / f"eval_metrics{rank}.json").read_text())
        assert [metrics[f"eval_loss_pos_{b}of8"] for b in range(1, 9)] == pytest.approx(by_position, rel=1e-5)
    for _, _, accuracy in results:
        assert all(0.0 <= a <= 1.0 for a in accuracy)


def test_trl_metrics_equal_trl_without_ds_longseq(tmp_path):
    """One process, no SP: the loss and TRL's token-accuracy metric from ds_longseq's fused head equal
    TRL's own fused head on the same batches."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    ours = run_distributed(trl_body, 1, (str(tmp_path / "a"), model_dir, 2, 1, 1, {"packing": True}), timeout=600)
    theirs = run_distributed(
        trl_body, 1, (str(tmp_path / "b"), model_dir, 2, 1, 1, {"packing": True, "long_seq": False}), timeout=600
    )
    assert ours[0][1] == pytest.approx(theirs[0][1], rel=1e-5)
    assert ours[0][2] == pytest.approx(theirs[0][2], abs=1e-6)


@pytest.mark.slow  # CI time: the reshaped resume below runs the same ZeRO-3 SP 2 checkpoint by default
def test_trainer_resume_from_checkpoint(tmp_path):
    """ZeRO-3, SP=2: a checkpoint the Trainer wrote at step 2 resumes to the uninterrupted step-3 loss."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    full = run_distributed(
        train_body, 2, (str(tmp_path / "full"), model_dir, 3, 2, 1, {"save_strategy": "steps", "save_steps": 2}),
        timeout=600,
    )
    checkpoint = str(tmp_path / "full" / "out" / "checkpoint-2")
    assert os.path.isdir(checkpoint)
    resumed = run_distributed(
        train_body, 2, (str(tmp_path / "resumed"), model_dir, 3, 2, 1, {"resume": checkpoint}), timeout=600
    )
    for (_, full_losses, _), (resumed_seen, resumed_losses, _) in zip(full, resumed, strict=True):
        assert len(resumed_seen) == 1  # one step trained after the checkpoint
        # the log history of steps 1-2 comes back with the checkpoint; step 3 is trained again
        assert resumed_losses == pytest.approx(full_losses, rel=1e-6)


def _hf_weights(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).named_parameters())


ADAM = {"optim": "adamw_torch", "lr": 1e-2, "weight_decay": 0.1}
"""DeepSpeed's universal checkpoint converts Adam's states (exp_avg, exp_avg_sq) only: the reshape tests train with
it. Its updates at step 3 are no longer sign-like where float32 rounding decides a sign: the gradients that small sit
under its epsilon. Weight decay puts the LayerNorm weights in the Trainer's second (no-decay) parameter group, whose
hyperparameters and step count DeepSpeed's ZeRO-3 universal load gets wrong (compat.repair_universal_load)."""


@pytest.mark.parametrize(("stage", "sp", "gas_after", "lora"), [
    pytest.param(2, 1, 2, False, marks=pytest.mark.slow),  # 2 replicas -> 1 rank accumulating 2 (test_reshape's)
    (3, 2, 1, False),  # ZeRO-3, one replica cut across 2 ranks -> 1 rank: where DeepSpeed's load needs repairs
    pytest.param(2, 1, 2, True, marks=pytest.mark.slow),  # a PEFT adapter (its checkpoint leaves the base out)
], ids=["z2-dp2-to-1-gas2", "z3-sp2-to-1", "z2-dp2-to-1-gas2-lora"])
def test_trainer_resumes_on_another_number_of_ranks(tmp_path, stage, sp, gas_after, lora):
    """Adam, a checkpoint the Trainer wrote at step 2 on 2 ranks resumed on 1 rank with the same global batch (2 rows
    per device: data parallel 2 -> accumulation 2; or sequence parallel 2 -> 1): trainer/resume.py converts it to
    DeepSpeed's universal form beside the original, and step 3 trains on the uninterrupted run's rows (each replica's
    batch in turn) to its parameters."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    full = run_distributed(
        train_body, 2, (str(tmp_path / "full"), model_dir, stage, sp, 1,
                        {"save_strategy": "steps", "save_steps": 2, "lora": lora, **ADAM}),
        timeout=600,
    )
    checkpoint = tmp_path / "full" / "out" / "checkpoint-2"
    manifest = json.loads((checkpoint / "ds_longseq_checkpoint.json").read_text())
    assert (manifest["world_size"], manifest["sequence_parallel_size"], manifest["step"]) == (2, sp, 2)
    before = sorted(p.name for p in (checkpoint / "global_step2").iterdir())
    [(seen, losses, _)] = run_distributed(
        train_body, 1, (str(tmp_path / "resumed"), model_dir, stage, 1, gas_after,
                        {"resume": str(checkpoint), "lora": lora, **ADAM}),
        timeout=600,
    )
    assert (checkpoint / "latest_universal").read_text() == "global_step2.universal"
    assert sorted(p.name for p in (checkpoint / "global_step2").iterdir()) == before  # the original, only read
    replicas = [full[r][0][2] for r in range(0, 2, sp)]  # step 3's batch of each replica (rank 0's, then rank 1's)
    assert len(seen) == gas_after == len(replicas)
    for mine, theirs in zip(seen, replicas, strict=True):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert losses[:2] == full[0][1][:2]  # steps 1-2 come back with the checkpoint's log history
    if lora:  # the Trainer saved the adapters alone, in PEFT's format
        from safetensors.torch import load_file

        ours, reference = (load_file(str(tmp_path / run / "hf_model" / "adapter_model.safetensors"))
                           for run in ("resumed", "full"))
        assert reference and all("lora_" in name for name in reference)
    else:
        ours, reference = (_hf_weights(tmp_path / run / "hf_model") for run in ("resumed", "full"))
    for name, value in reference.items():  # float32: the same sums in another order (replicas vs accumulation)
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_trainer_resume_refusals(tmp_path):
    """What ``resume_from_checkpoint`` refuses before any weight is loaded (trainer/resume.py), on checkpoints laid
    out as the Trainer leaves them: another global batch (naming the accumulation that keeps it), another model,
    and a checkpoint without ds_longseq's manifest from another number of ranks (naming DeepSpeed's conversion)."""
    from types import SimpleNamespace

    from ds_longseq.engine.manifest import write_manifest
    from ds_longseq.engine.reshape import conversion_failure
    from ds_longseq.trainer.resume import ResumeError, prepare_resume

    model = torch.nn.Linear(4, 3)
    shape = {"world_size": 2, "sequence_parallel_size": 1, "zero_stage": 2, "micro_batch": 2,
             "gradient_accumulation": 1}
    checkpoint = tmp_path / "checkpoint-2"
    (checkpoint / "global_step2").mkdir(parents=True)
    (checkpoint / "latest").write_text("global_step2")
    for r in range(2):
        (checkpoint / "global_step2" / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"x")

    def trainer(gas: int, net=model):
        args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config={"zero_optimization": {"stage": 2}}),
                               per_device_train_batch_size=2, gradient_accumulation_steps=gas)
        return SimpleNamespace(args=args, long_seq_sp_size=1, model=net)

    with pytest.raises(ResumeError, match="has no ds_longseq_checkpoint.json to tell its shape; this run has 1. "
                                          "Launch 2 ranks, or convert it with DeepSpeed: python -m deepspeed"):
        prepare_resume(trainer(2), str(checkpoint))
    write_manifest(str(checkpoint), {"model_class": "Linear", "parameters": {"weight": [3, 4], "bias": [3]},
                                     **shape}, 2)
    with pytest.raises(ResumeError, match=r"global batch was 4 sequences per step \(.*\), this run's is 2.*set "
                                          "gradient_accumulation_steps to 2"):
        prepare_resume(trainer(1), str(checkpoint))
    with pytest.raises(ResumeError, match=r"another model .* weight is \[3, 4\] there, \[5, 4\] here\. Load the "
                                          "model that run trained"):
        prepare_resume(trainer(2, torch.nn.Linear(4, 5)), str(checkpoint))
    # an optimizer without Adam's moments (the Trainer's optim="sgd"): DeepSpeed's conversion fails on its state
    failed = conversion_failure(str(checkpoint / "global_step2"), 1, "Traceback ...\nKeyError: 'exp_avg'\n")
    assert failed.startswith(f"{checkpoint / 'global_step2'} holds no Adam moments (exp_avg)") and \
        failed.endswith("resume it on the number of ranks and sequence-parallel size that wrote it"), failed
    other = conversion_failure("c/global_step2", 2, "Traceback ...\nOSError: no space left\n\n")
    assert other == "DeepSpeed's ds_to_universal failed on c/global_step2 (status 2): OSError: no space left"


def bad_input_body(rank: int, workdir: str, model_dir: str) -> dict[str, str]:
    """Each bad set-up on one rank; returns {case: "ExceptionType: message"} (raised at construction)."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from ds_longseq.trainer import LongSeqTrainer

    def attempt(config: dict, model=None, **kwargs) -> str:
        args = TrainingArguments(output_dir=workdir, deepspeed=config, use_cpu=True, report_to=[], max_steps=1)
        try:
            LongSeqTrainer(
                model=model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir),
                args=args, train_dataset=_samples(4), data_collator=collate, **kwargs,
            )
        except Exception as err:  # noqa: BLE001 - the test reads the type and the message
            return f"{type(err).__name__}: {err}"
        return "no error"

    bad_chunk = ds_config(2, 1)
    bad_chunk["long_seq"]["streambp"]["chunk_size"] = 0
    headless = AutoModelForCausalLM.from_pretrained(model_dir)
    headless.lm_head = torch.nn.Identity()  # no Linear head to chunk: refused at enable()
    fixed = {**ds_config(2, 1), "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.5}  # the Trainer: 8, 1.0
    return {
        "values the trainer sets": attempt(fixed),
        "invalid section": attempt(bad_chunk),
        "sp does not divide world": attempt(ds_config(2, 2)),
        "unsupported model": attempt(ds_config(2, 1), model=headless),
        "given twice": attempt(ds_config(2, 1), long_seq={"lm_head": {"enabled": True}}),
    }


def _alst_collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """:func:`collate` at a fixed 24 tokens with position ids: what stock ALST's dataloader adapter needs (it
    gathers the ranks' batches, so their shapes must agree, and it wants position_ids in every batch)."""
    batch = collate(features)
    pad = 24 - batch["input_ids"].shape[1]
    batch = {k: torch.nn.functional.pad(v, (0, pad), value=-100 if k == "labels" else 0) for k, v in batch.items()}
    batch["position_ids"] = torch.arange(24).expand(len(features), 24).clone()
    return batch


def alst_body(rank: int, workdir: str, model_dir: str, ours: bool, ring: bool = False) -> dict:
    """A Trainer script written the ALST way (TrainingArguments(parallelism_config=ParallelismConfig(sp_backend=
    "deepspeed", sp_size=2)), ZeRO-2): stock (``ours`` False: transformers' Trainer, accelerate's Ulysses) or with
    ds_longseq (LongSeqTrainer, a long_seq section without sequence_parallel; accelerate's Ulysses made to raise
    if anything calls it). Returns the batches each step trained on, the log history and the sp_handler warning."""
    import logging

    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from ds_longseq.trainer import LongSeqTrainer

    config = ds_config(2, 1)  # ring: save_tiny_llama(ring=True)
    if ours:
        def refuse(*args, **kwargs):
            raise AssertionError("accelerate's Ulysses ran under ds_longseq")

        ulysses_sp.UlyssesSPAttentionHF.register_with_transformers = refuse
        ulysses_sp.UlyssesSPDataLoaderAdapter.__init__ = refuse
    else:
        del config["long_seq"]
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=2, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, optim="sgd", deepspeed=config,
        report_to=[], logging_steps=1, use_cpu=True, disable_tqdm=True, seed=7, save_strategy="no",
        remove_unused_columns=False,
        parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=handler),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert model.config.get_text_config().vocab_size >= VOCAB  # the samples' token ids fit
    seen = []

    class Recording(LongSeqTrainer if ours else Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super().training_step(model, inputs, num_items_in_batch=num_items_in_batch)

    records = []
    capture = logging.Handler()
    capture.emit = records.append
    logging.getLogger("ds_longseq.trainer").addHandler(capture)
    trainer = Recording(model=model, args=args, train_dataset=_samples(), data_collator=_alst_collate)
    if ring:  # 3 heads at sp_size 2: a ring of 2
        assert ds_longseq.patch.sequence_parallel_of(trainer.model).ring == 2
    trainer.train()
    return {"seen": seen, "log": [h for h in trainer.state.log_history if "loss" in h],
            "warnings": [r.getMessage() for r in records]}


def plain_sgd_losses(model_dir: str, batches: list[dict]) -> list[float]:
    """The stock model's loss on each batch in turn, with a plain SGD step after each (the runs' optimizer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        loss = model(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def test_parallelism_config_runs_ds_longseq_with_alst_semantics(tmp_path):
    """A script written the ALST way runs with ds_longseq once LongSeqTrainer replaces Trainer: parallelism_config's
    sp_size sets the sequence-parallel size (its sp_handler settings ignored with a warning), none of accelerate's
    Ulysses runs, and each step trains on the same samples as stock ALST (every rank's batch in turn across the
    group: its first step's loss equal, ALST's shards are cut from ours), with the same steps per epoch. Our losses
    equal plain PyTorch on those batches in that order (float32, 1e-5). Stock ALST's own steps after the first
    differ: on this setup its gradient is sp_size times the batch mean loss's (docs/TRAINER.md)."""
    import deepspeed
    from packaging.version import Version

    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    # DeepSpeed 0.18's stock ALST dataloader (UlyssesSPDataLoaderAdapter) all-gathers 0-dim tensors, which gloo
    # refuses (0.19 sends 1-element ones): there only ours runs, checked against plain PyTorch below
    stock_runs = Version(deepspeed.__version__) >= Version("0.19")
    if stock_runs:
        stock = run_distributed(alst_body, 2, (str(tmp_path / "stock"), model_dir, False), timeout=300)
    ours = run_distributed(alst_body, 2, (str(tmp_path / "ours"), model_dir, True), timeout=300)
    assert "sp_attn_implementation" in ours[0]["warnings"][0] and "are ignored" in ours[0]["warnings"][0]
    for rank in (0, 1) if stock_runs else ():
        assert [h["epoch"] for h in ours[rank]["log"]] == [h["epoch"] for h in stock[rank]["log"]]
        assert ours[rank]["log"][0]["loss"] == pytest.approx(stock[rank]["log"][0]["loss"], rel=1e-6)
        for full, shard in zip(ours[rank]["seen"], stock[rank]["seen"], strict=True):
            assert torch.equal(full["input_ids"][:, rank * 12:(rank + 1) * 12], shard["input_ids"])
    expected = plain_sgd_losses(model_dir, ours[0]["seen"])
    assert [h["loss"] for h in ours[0]["log"]] == pytest.approx(expected, rel=1e-5)
    assert [h["loss"] for h in ours[1]["log"]] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_parallelism_config_under_a_ring(tmp_path):
    """The ALST-way script with a model whose 3 heads sp_size 2 cannot split (stock ALST refuses it): ds_longseq runs
    a ring of 2 with ALST's data semantics, and its losses equal plain PyTorch on the batches in that order (float32,
    1e-5)."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir, ring=True)
    ours = run_distributed(alst_body, 2, (str(tmp_path / "ours"), model_dir, True, True), timeout=300)
    assert [torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(ours[0]["seen"], ours[1]["seen"],
                                                                        strict=True)] == [True] * STEPS
    expected = plain_sgd_losses(model_dir, ours[0]["seen"])
    for rank in (0, 1):
        assert [h["loss"] for h in ours[rank]["log"]] == pytest.approx(expected, rel=1e-5)


def trl_alst_body(rank: int, workdir: str, model_dir: str, gas: int, packing: bool = False) -> dict:
    """A TRL script written the ALST way (SFTConfig(parallelism_config=ParallelismConfig(sp_backend="deepspeed",
    sp_size=2)), ZeRO-3) with ds_longseq's two changes: a long_seq section in the DeepSpeed JSON and
    with_long_seq(SFTTrainer). accelerate's Ulysses is made to raise if anything calls it."""
    import datasets
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from ds_longseq.trainer import with_long_seq

    def refuse(*args, **kwargs):
        raise AssertionError("accelerate's Ulysses ran under ds_longseq")

    ulysses_sp.UlyssesSPAttentionHF.register_with_transformers = refuse
    ulysses_sp.UlyssesSPDataLoaderAdapter.__init__ = refuse
    args = SFTConfig(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=2, gradient_accumulation_steps=gas,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        optim="sgd", deepspeed=ds_config(3, 1), report_to=[], logging_steps=1, use_cpu=True, disable_tqdm=True,
        seed=7, save_strategy="no", packing=packing, max_length=40, bf16=False,
        parallelism_config=ParallelismConfig(
            sp_backend="deepspeed", sp_size=2,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
        ),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    data = datasets.Dataset.from_list([{"input_ids": s["input_ids"]} for s in _samples()])
    seen = []

    class Recording(with_long_seq(SFTTrainer)):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super().training_step(model, inputs, num_items_in_batch=num_items_in_batch)

    trainer = Recording(model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer())
    trainer.train()
    trainer.save_model(os.path.join(workdir, "hf_model"))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return seen, [h["loss"] for h in logs], [h["mean_token_accuracy"] for h in logs]


@pytest.mark.parametrize("packing", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_trl_script_written_the_alst_way(tmp_path, packing):
    """TRL's SFTTrainer under parallelism_config (sp_size 2, ZeRO-3, 2 accumulation steps): each rank's batches
    trained in turn across the group (ALST's samples per step), the loss token-weighted over the accumulation window;
    losses and trained parameters equal plain PyTorch on those batches (float32, 1e-5). With packing, TRL's
    padding-free rows (restarting position ids, a document may span the two ranks' halves)."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    results = run_distributed(trl_alst_body, 2, (str(tmp_path), model_dir, 2, packing), timeout=600)
    if packing:
        assert "attention_mask" not in results[0][0][0]
    assert len(results[0][0]) == STEPS * 2
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    # TRL 1.16's collator returns position ids under parallelism_config (its return_position_ids); TRL 1.9's has no such
    # option and pads with an attention mask (ds_longseq makes the position ids when it cuts the batch)
    collator_positions = "return_position_ids" in DataCollatorForLanguageModeling.__dataclass_fields__
    for seen, _, accuracy in results:
        assert "position_ids" in seen[0] or not (packing or collator_positions)
        assert all(0.0 <= a <= 1.0 for a in accuracy)
    assert_matches_reference(tmp_path, results, model_dir, 2, 2)


def test_parallelism_config_runs_a_qwen3_5_hybrid(tmp_path):
    """The ALST-way script with a Qwen3.5-shaped hybrid (Gated DeltaNet layers beside attention, which accelerate's own
    Ulysses refuses): under ds_longseq its linear-attention layers run sharded by heads across the 2 ranks, and the
    losses equal plain PyTorch on the batches each step trained on (float32, 1e-5)."""
    from tests import model_zoo

    model_dir = str(tmp_path / "init")
    model_zoo.tiny_model("qwen3_5_text", torch.float32).save_pretrained(model_dir)
    ours = run_distributed(alst_body, 2, (str(tmp_path / "ours"), model_dir, True), timeout=600)
    expected = plain_sgd_losses(model_dir, ours[0]["seen"])
    for rank in (0, 1):
        assert [h["loss"] for h in ours[rank]["log"]] == pytest.approx(expected, rel=1e-5)


def test_parallelism_config_and_long_seq_disagreeing_is_refused(tmp_path):
    from ds_longseq.trainer import LongSeqTrainerMixin

    class Fake:
        sp_size, sp_handler = 2, None

    with pytest.raises(ValueError, match=r"parallelism_config sp_size=2 and long_seq.sequence_parallel.size=4 "
                                         r"disagree"):
        LongSeqTrainerMixin._long_seq_take_parallelism_config(object.__new__(LongSeqTrainerMixin), Fake(),
                                                     {"sequence_parallel": {"size": 4}})


def test_trainer_bad_input_fails_at_construction(tmp_path):
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    errors = run_distributed(bad_input_body, 1, (str(tmp_path), model_dir), timeout=300)[0]
    # the resolver's refusals (ds_longseq.resolver: RunCannotStart, a LongSeqConfigError)
    assert errors["invalid section"].startswith("RunCannotStart: invalid long_seq config") and \
        "chunk_size" in errors["invalid section"]
    assert "sequence_parallel size 2 does not divide the 1 rank: launch a multiple of 2" in \
        errors["sp does not divide world"]
    assert errors["unsupported model"].startswith("UnsupportedModelError") and "lm_head" in errors["unsupported model"]
    assert "keep only one" in errors["given twice"]
    mismatch = errors["values the trainer sets"]  # transformers' own check would raise only inside train()
    assert mismatch.startswith("TrainerConfigError: the DeepSpeed config's values that the Trainer also sets differ"), \
        mismatch
    assert "train_micro_batch_size_per_gpu=1 vs hf per_device_train_batch_size=8" in mismatch
    assert "gradient_clipping=0.5 vs hf max_grad_norm=1.0" in mismatch and 'Set them to "auto"' in mismatch


def test_trl_trainers_without_integration_are_refused():
    trl = pytest.importorskip("trl")
    from ds_longseq.trainer import LongSeqTrainer, with_long_seq

    for name in ("KTOTrainer", "RLOOTrainer"):
        with pytest.raises(NotImplementedError, match=f"TRL's {name} yet.*plain TRL trainer"):
            with_long_seq(getattr(trl, name))()  # refused before the Trainer's own __init__ runs
    assert with_long_seq(trl.SFTTrainer) is with_long_seq(trl.SFTTrainer)
    assert with_long_seq(LongSeqTrainer) is LongSeqTrainer


def test_trl_sft_loss_type_nll_under_the_chunked_head(tmp_path):
    """TRL 1.9's SFTTrainer with loss_type="nll" reads the logits of its loss calls, which the chunked head never forms:
    refused at construction, naming the TRL release and the ways out. TRL 1.16 serves "nll" through fused-LM-head
    calls: it builds (one process, no DeepSpeed)."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from ds_longseq.compat import trl_makes_fused_head_calls
    from ds_longseq.trainer import with_long_seq

    save_tiny_llama(str(tmp_path / "init"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "init", dtype=torch.float32)
    args = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], bf16=False, loss_type="nll",
                     max_length=40)
    data = datasets.Dataset.from_list([{"input_ids": s["input_ids"]} for s in _samples(4)])

    def build():
        return with_long_seq(SFTTrainer)(model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer(),
                                         long_seq=ds_config(2, 1)["long_seq"])

    if trl_makes_fused_head_calls():
        assert ds_longseq.is_enabled(build().model)
        return
    import trl

    with pytest.raises(NotImplementedError, match=rf"TRL {trl.__version__}'s SFTTrainer with loss_type='nll' reads the "
                                                  r"logits .* use loss_type='chunked_nll' .* pip install 'trl>=1.16'"):
        build()


@pytest.mark.slow
def test_trainer_lora_zero3_sp2(tmp_path):
    """A PEFT LoRA model (frozen base, the ZeRO-3 leaf case of ds_longseq's fix) in the Trainer,
    ZeRO-3, SP=2: the saved adapter, merged, equals the plain-PyTorch LoRA reference."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    results = run_distributed(train_body, 2, (str(tmp_path), model_dir, 3, 2, 1, {"lora": True}), timeout=600)
    assert_matches_reference(tmp_path, results, model_dir, 2, 1, lora=True)


def one_process_args(output_dir: str):
    """TrainingArguments of the one-process comparisons: SGD at a constant rate, no clipping, sequential
    batches (the same ones in both runs), a loss logged every step."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=2, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", max_grad_norm=0.0, optim="sgd", report_to=[], logging_steps=1,
        use_cpu=True, disable_tqdm=True, save_strategy="no", remove_unused_columns=False,
        train_sampling_strategy="sequential",
    )


def test_trainer_without_deepspeed_one_process(tmp_path):
    """LongSeqTrainer(..., long_seq=...) without DeepSpeed, one process: the same losses and trained
    parameters as the stock Trainer on the same data (sequential sampling: the same batches)."""
    from transformers import AutoModelForCausalLM, Trainer

    from ds_longseq.trainer import LongSeqTrainer

    save_tiny_llama(str(tmp_path / "init"))
    runs = {}
    for name in ("stock", "ds_longseq"):
        args = one_process_args(str(tmp_path / name))
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "init", dtype=torch.float32)
        kwargs = dict(model=model, args=args, train_dataset=_samples(), data_collator=collate)
        if name == "stock":
            trainer = Trainer(**kwargs)
        else:
            trainer = LongSeqTrainer(**kwargs, long_seq=ds_config(2, 1)["long_seq"])
            assert ds_longseq.is_enabled(model)
        trainer.train()
        runs[name] = ([h["loss"] for h in trainer.state.log_history if "loss" in h], dict(model.named_parameters()))
    assert runs["ds_longseq"][0] == pytest.approx(runs["stock"][0], rel=1e-5)
    for n, p in runs["stock"][1].items():
        torch.testing.assert_close(runs["ds_longseq"][1][n], p, rtol=1e-5, atol=1e-5)


def test_target_buckets_by_place_in_the_document():
    """Each position gets the bucket of the token it predicts: its place in its row (left or right padding) or packed
    document over that document's length; -1 where the next token is padding or there is none."""
    from ds_longseq.trainer.positions import target_buckets as _target_buckets

    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]])  # right and left padding, 4 tokens each
    got = _target_buckets({"input_ids": ids, "attention_mask": mask}, 4)
    assert got.tolist() == [[1, 2, 3, -1, -1, -1, -1, -1], [-1, -1, -1, 0, 1, 2, 3, -1]]
    packed = {"input_ids": ids[:1], "position_ids": torch.tensor([[0, 1, 0, 1, 2, 3, 4, 5]])}  # documents of 2 and 6
    assert _target_buckets(packed, 2).tolist() == [[1, 0, 0, 0, 1, 1, 1, -1]]
