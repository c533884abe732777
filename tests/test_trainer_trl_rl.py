"""TRL's DPOTrainer and GRPOTrainer through ``with_long_seq``: 2 CPU ranks, real DeepSpeed.

Each test trains the same tiny float32 Llama twice from the same initial weights, data and seed:
once with ``with_long_seq(TRLTrainer)`` (StreamBP + chunked LM head, no sequence parallelism), its
fused-LM-head calls served by ds_longseq's head, once with the plain TRL trainer (TRL's own fused
head). SGD (parameters after a step are linear in the gradients), no clipping, float32. The
logged losses and metrics must agree, and the parameters each run saved must agree, as must their
changes from the initial weights (relative to the size of the change: the test would otherwise pass
when the updates are small against the tolerance).

What each metric checks on our side: DPO's ``logits/chosen`` / ``logits/rejected`` are TRL's
means of ``mean_logits``; with ``use_weighting`` (WPO) the loss weights are built from
``log_sum_sq_probs``; GRPO runs at temperature 0.7, so its gradients (hence the parameters) and
``entropy`` are those of the temperature-scaled distribution (its loss value, with the policy as
its own old policy, does not depend on the temperature). The reference model (DPO; GRPO with ``beta > 0``) keeps TRL's
own fused head in both runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.test_trainer import VOCAB, add_lora, ds_config, save_tiny_llama

LR, STEPS = 0.5, 3
EOS = f"t{VOCAB - 1}"


def word_tokenizer():
    """Whitespace-split word-level tokenizer over the test vocabulary ("t1 t7 ..."), offline: TRL's
    DPO and GRPO trainers take text prompts and completions."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token=EOS)


def _words(g: torch.Generator, low: int, high: int) -> str:
    n = int(torch.randint(low, high, (1,), generator=g))
    return " ".join(f"t{i}" for i in torch.randint(1, VOCAB - 1, (n,), generator=g).tolist())


def preference_pairs(n: int = 16, seed: int = 0) -> list[dict[str, str]]:
    """Prompts of 2-5 words, chosen / rejected completions of 3-9 words ending with EOS (so TRL adds
    none: its EOS is appended without a space)."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"prompt": _words(g, 2, 6), "chosen": f" {_words(g, 3, 10)} {EOS}", "rejected": f" {_words(g, 3, 10)} {EOS}"}
        for _ in range(n)
    ]


def prompts(n: int = 16, seed: int = 0) -> list[dict[str, str]]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": _words(g, 2, 7)} for _ in range(n)]


def even_token_reward(completions, **kwargs) -> list[float]:
    """A deterministic reward with spread inside each group: the fraction of even tokens."""
    return [sum(int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1) for c in completions]


def common_args(workdir: str, stage: int, sp: int, long_seq: bool) -> dict:
    return dict(
        output_dir=os.path.join(workdir, "out"), per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0,
        optim="sgd", deepspeed=ds_config(stage, sp, long_seq=long_seq), report_to=[], logging_steps=1,
        use_cpu=True, disable_tqdm=True, seed=7, save_strategy="no", bf16=False,  # TRL configs default to bf16
        per_device_eval_batch_size=2,
    )


def plain_deepspeed_repaired():
    """A callback for the plain TRL runs (DeepSpeed without ds_longseq's engine): DeepSpeed 0.18's ZeRO-1/2 flat buffers
    detached as ds_longseq's engine detaches them (``compat.zero_flat_buffers_detached``; a no-op on DeepSpeed 0.19 and
    ZeRO-3), so the reference runs on DeepSpeed 0.18.9 get past its in-place all-gather into a view."""
    from transformers import TrainerCallback

    from ds_longseq.compat import zero_flat_buffers_detached

    class Repaired(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            zero_flat_buffers_detached(getattr(optimizer, "optimizer", optimizer))

    return Repaired()


def dpo_body(rank: int, workdir: str, model_dir: str, stage: int, sp: int, opts: dict):
    """One DPOTrainer run on this rank: its logged metrics per step."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    from ds_longseq.trainer import with_long_seq

    long_seq = opts.get("long_seq", True)
    args = DPOConfig(**common_args(workdir, stage, sp, long_seq), beta=0.5,
                     use_weighting=opts.get("weighting", False))
    # after the config: under ZeRO-3 the model is created partitioned (zero.Init), as users do
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if opts.get("lora"):  # no reference model: TRL's reference is the policy with its adapter off
        model = add_lora(model)
    trainer_cls = with_long_seq(DPOTrainer) if long_seq else DPOTrainer
    trainer = trainer_cls(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(preference_pairs()),
        processing_class=word_tokenizer(), callbacks=None if long_seq else [plain_deepspeed_repaired()],
    )
    if opts.get("ring") and long_seq and sp > 1:  # 3 heads at sequence parallelism 2: a ring of 2
        from ds_longseq.patch import sequence_parallel_of

        assert sequence_parallel_of(trainer.model).ring == 2
    lengths = []  # the decoder's input lengths (cut in P under sequence parallelism), reference model's included
    decoders = [trainer.accelerator.unwrap_model(m) for m in (trainer.model, trainer.ref_model) if m is not None]
    for decoder in decoders:
        decoder = decoder.get_base_model() if hasattr(decoder, "get_base_model") else decoder
        decoder.model.register_forward_pre_hook(
            lambda module, args, kwargs: lengths.append(int(kwargs["input_ids"].shape[1])), with_kwargs=True)
    trainer.train()
    evaluation = None
    if opts.get("eval"):  # under sequence parallelism the group's ranks read the same pairs, cut like training
        evaluation = trainer.evaluate(eval_dataset=datasets.Dataset.from_list(preference_pairs(4, seed=1)))
    trainer.save_model(os.path.join(workdir, "hf_model"))
    return [h for h in trainer.state.log_history if "loss" in h], evaluation, lengths


def grpo_body(rank: int, workdir: str, model_dir: str, stage: int, sp: int, opts: dict):
    """One GRPOTrainer run on this rank: (logged metrics per step, the completions it trained on)."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from ds_longseq.trainer import with_long_seq

    long_seq = opts.get("long_seq", True)
    common = {**common_args(workdir, stage, sp, long_seq),
              "gradient_accumulation_steps": opts.get("gas", 1)}
    args = GRPOConfig(
        **common, num_generations=2, max_completion_length=4, temperature=0.7, beta=opts.get("beta", 0.0),
        use_vllm=False, loss_type=opts.get("loss_type", "dapo"),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer_cls = with_long_seq(GRPOTrainer) if long_seq else GRPOTrainer
    seen = []

    class Recording(trainer_cls):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.append(out["completion_ids"].clone())
            return out

    trainer = Recording(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(prompts()), reward_funcs=even_token_reward,
        processing_class=word_tokenizer(), callbacks=None if long_seq else [plain_deepspeed_repaired()],
    )
    if opts.get("ring") and long_seq and sp > 1:  # 3 heads at sequence parallelism 2: a ring of 2
        from ds_longseq.patch import sequence_parallel_of

        assert sequence_parallel_of(trainer.model).ring == 2
    trainer.train()
    trainer.save_model(os.path.join(workdir, "hf_model"))
    return [h for h in trainer.state.log_history if "loss" in h], seen


def saved_model(model_dir, saved):
    """The model a run saved: the whole model, or (a LoRA run) its adapter merged into the initial weights."""
    from transformers import AutoModelForCausalLM

    if not os.path.exists(os.path.join(saved, "adapter_config.json")):
        return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, saved).merge_and_unload()


def assert_same_training(tmp_path, model_dir, ours_logs, theirs_logs, metrics):
    from transformers import AutoModelForCausalLM

    assert len(ours_logs) == len(theirs_logs) == STEPS
    for step, (a, b) in enumerate(zip(ours_logs, theirs_logs, strict=True)):
        for key in ("loss", *metrics):
            # absolute 1e-5: DPO's rewards (small, ~0.06) are beta x differences of float32 sequence log-probs of
            # ~-30, whose last bit is 1.9e-6 (3.8e-6 above 32): measured 1.2e-6 apart, 1 bit (2026-11-27)
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), f"step {step + 1} {key}: {a[key]} vs {b[key]}"
    initial = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    ours = saved_model(model_dir, tmp_path / "ours" / "hf_model")
    theirs = dict(saved_model(model_dir, tmp_path / "theirs" / "hf_model").named_parameters())
    moved = 0.0
    for name, p in ours.named_parameters():
        delta, ref_delta = (p - initial[name]).detach(), (theirs[name] - initial[name]).detach()
        # each element within 1e-5 of the parameter's largest update (at least 1): float32 rounding of the
        # gradients scales with the update, not with the weight (measured: 1.5e-5 apart where the update is 2.2)
        torch.testing.assert_close(p, theirs[name], rtol=1e-5, atol=1e-5 * max(1.0, ref_delta.abs().max().item()),
                                   msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, ref_delta.norm().item())
        err = (delta - ref_delta).norm() / ref_delta.norm().clamp_min(1e-30)
        assert ref_delta.norm() == 0 or err < 1e-4, f"{name}: update differs by {err:.2e} of its size"
    assert moved > 1e-3, "training did not move the parameters: the comparison would be vacuous"


DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


def run_dpo(tmp_path, stage: int, weighting: bool):
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    ours = run_distributed(dpo_body, 2, (str(tmp_path / "ours"), model_dir, stage, 1, {"weighting": weighting}),
                           timeout=600)
    theirs = run_distributed(
        dpo_body, 2, (str(tmp_path / "theirs"), model_dir, stage, 1, {"weighting": weighting, "long_seq": False}),
        timeout=600,
    )
    assert_same_training(tmp_path, model_dir, ours[0][0], theirs[0][0], DPO_METRICS)
    # the metrics read from mean_logits are real values, not TRL's 0.0 for "no tokens"
    assert all(abs(h["logits/chosen"]) > 0 for h in ours[0][0])


@pytest.mark.parametrize(
    "stage,weighting",
    # heavy (all of them): the sequence-parallel DPO tests below compare ds_longseq with plain TRL too
    [pytest.param(2, True, marks=pytest.mark.slow), pytest.param(2, False, marks=pytest.mark.slow),
     pytest.param(3, True, marks=pytest.mark.slow)],
    ids=["zero2-wpo", "zero2", "zero3-wpo"],
)
def test_dpo_trainer_matches_plain_trl(tmp_path, stage, weighting):
    run_dpo(tmp_path, stage, weighting)


def run_dpo_sequence_parallel(tmp_path, stage: int, opts: dict):
    """TRL's DPOTrainer with ds_longseq at sequence parallelism 2 on 2 ranks against plain TRL on one rank (the same
    batches: one data-parallel replica either way), then evaluation on 4 pairs (the same 2 batches of 2)."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir, ring=opts.get("ring", False))
    opts = {**opts, "eval": True}
    ours = run_distributed(dpo_body, 2, (str(tmp_path / "ours"), model_dir, stage, 2, opts), timeout=600)
    theirs = run_distributed(dpo_body, 1, (str(tmp_path / "theirs"), model_dir, stage, 1, {**opts, "long_seq": False}),
                             timeout=600)
    for logs, evaluation, lengths in ours:
        assert_same_training(tmp_path, model_dir, logs, theirs[0][0], DPO_METRICS + ("num_tokens",))
        # means over the pairs (2 steps of 2 pairs in both runs); absolute 3e-5: the rewards are beta (0.5) x
        # differences of float32 sequence log-probs of ~-30, whose rounding is ~1e-5 after 3 trained steps and
        # depends on the BLAS kernels (1.2e-5 on eval_rewards/chosen under MKL_CBWR=AVX2, zero-3 + WPO, 2026-11-28)
        for key in ("eval_loss", "eval_rewards/chosen", "eval_rewards/margins", "eval_logps/rejected", "eval_entropy",
                    "eval_logits/chosen", "eval_mean_token_accuracy"):
            assert evaluation[key] == pytest.approx(theirs[0][1][key], rel=1e-5, abs=3e-5), key
        # every forward (policy and reference; training, then evaluation) ran on half of each batch
        whole = theirs[0][2]
        assert len(whole) == 2 * STEPS + 2 * 2  # 2 evaluation steps of 2 pairs
        unit = 4 if opts.get("ring") else 2  # under a ring padded to 2 x 2 zigzag blocks
        assert lengths == [-(-n // unit) * unit // 2 for n in whole], (lengths, whole)


@pytest.mark.parametrize(
    "stage,opts",
    [(3, {"weighting": True}), pytest.param(2, {}, marks=pytest.mark.slow),
     pytest.param(2, {"lora": True}, marks=pytest.mark.slow),
     pytest.param(2, {"weighting": True, "ring": True}, marks=pytest.mark.slow)],  # heavy: the Trainer's ring test
    ids=["zero3-wpo-ref-model", "zero2-ref-model", "zero2-lora", "zero2-wpo-ref-model-ring"],
)
def test_dpo_trainer_sequence_parallel_matches_one_rank(tmp_path, stage, opts):
    """Each sequence cut in two across the ranks (the reference model's forward too: a model of its own, or the
    LoRA policy with its adapter off), TRL's loss and metrics computed from the whole sequences' per-token outputs:
    losses, every DPO metric and the trained parameters equal plain TRL's on one rank (float32, 1e-5); evaluation,
    cut across the group the same way, too. ``ring``: a model with 3 heads, so the two ranks run a ring of 2 (policy
    and reference): each call cut by the ring's layout and its per-token outputs put back in the sequence's order."""
    run_dpo_sequence_parallel(tmp_path, stage, opts)


GRPO_METRICS = ("entropy", "reward", "reward_std")


def run_grpo(tmp_path, stage: int, beta: float, sp: int = 1, **options):
    """Ours (sequence parallelism ``sp``) against plain TRL, both on 2 ranks. Under sequence parallelism each rank
    still generates for its own prompts as plain TRL does, and the group trains on the ranks' batches in turn."""
    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir, ring=options.get("ring", False))
    opts = {"beta": beta, **options}
    ours = run_distributed(grpo_body, 2, (str(tmp_path / "ours"), model_dir, stage, sp, opts), timeout=600)
    theirs = run_distributed(
        grpo_body, 2, (str(tmp_path / "theirs"), model_dir, stage, 1, {**opts, "long_seq": False}), timeout=600
    )
    for (_, ours_seen), (_, theirs_seen) in zip(ours, theirs, strict=True):
        # same sampled completions: generation is unchanged by ds_longseq, and the policy is the same
        assert len(ours_seen) == len(theirs_seen) == STEPS
        for step, (a, b) in enumerate(zip(ours_seen, theirs_seen, strict=True)):
            assert torch.equal(a, b), f"step {step + 1}: other completions sampled (the policies differ before it)"
    metrics = GRPO_METRICS + (("kl",) if beta > 0 else ())
    if sp > 1:  # the metrics the group's turns recombine, on every rank
        metrics += ("clip_ratio/low_mean", "clip_ratio/high_max")
    for rank in range(2 if sp > 1 else 1):
        assert_same_training(tmp_path, model_dir, ours[rank][0], theirs[rank][0], metrics)


@pytest.mark.parametrize(
    "stage,beta",
    # heavy (all of them): the sequence-parallel GRPO test below compares ds_longseq with plain TRL too
    [pytest.param(2, 0.0, marks=pytest.mark.slow), pytest.param(3, 0.0, marks=pytest.mark.slow),
     pytest.param(3, 0.2, marks=pytest.mark.slow)],
    ids=["zero2", "zero3", "zero3-ref-model"],
)
def test_grpo_trainer_matches_plain_trl(tmp_path, stage, beta):
    run_grpo(tmp_path, stage, beta)


@pytest.mark.parametrize(
    "stage,beta,options",
    [pytest.param(3, 0.2, {}, marks=pytest.mark.slow), (2, 0.0, {"gas": 2, "loss_type": "bnpo"}),
     # DPO's ring case runs WholeSequenceCalls under a ring by default already
     pytest.param(2, 0.2, {"ring": True}, marks=pytest.mark.slow)],
    ids=["zero3-ref-model", "zero2-gas2-bnpo", "zero2-ref-model-ring"],
)
def test_grpo_trainer_sequence_parallel_matches_plain_trl(tmp_path, stage, beta, options):
    """Losses, GRPO's metrics (entropy and kl token-weighted over the world's batch, as plain TRL computes them),
    the sampled completions and the trained parameters equal plain TRL's on the same 2 ranks (float32, 1e-5).
    ``ring``: a model with 3 heads, so the group trains each rank's batch in turn over a ring of 2."""
    run_grpo(tmp_path, stage, beta, sp=2, **options)


def test_grpo_under_parallelism_config_is_trls_refusal():
    """The GRPO row of docs/TRAINER.md's "What one step trains" under parallelism_config: TRL's GRPOConfig itself
    refuses sp_size > 1 (TRL 1.16), before any trainer exists; ds_longseq's sequence parallelism for GRPO is
    long_seq.sequence_parallel.size. If TRL starts accepting it, this fails and that row must be decided anew."""
    from accelerate.parallelism_config import ParallelismConfig
    from trl import GRPOConfig

    with pytest.raises(ValueError, match="GRPOTrainer does not support sequence-dim parallelism"):
        GRPOConfig(output_dir="unused", use_cpu=True, report_to=[],
                   parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))


def construction_body(rank: int, workdir: str, model_dir: str) -> dict:
    """Each TRL trainer built on this rank under sequence parallelism (size 2): the error it raises at construction
    (GRPO), or what ds_longseq set up (DPO: its reference model enabled with the policy's sequence parallelism); without
    sequence parallelism, the fused-head settings ds_longseq's forward got from it."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    from ds_longseq.trainer import with_long_seq

    def build(trainer_cls, sp: int, **options):
        extra = {"train_dataset": datasets.Dataset.from_list(preference_pairs(4))}
        config_cls = DPOConfig
        if trainer_cls is GRPOTrainer:
            extra = {"train_dataset": datasets.Dataset.from_list(prompts(4)), "reward_funcs": even_token_reward}
            config_cls, options = GRPOConfig, {"num_generations": 2, "max_completion_length": 4, **options}
        args = config_cls(**common_args(os.path.join(workdir, str(len(results))), 2, sp, True), **options)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return with_long_seq(trainer_cls)(model=model, args=args, processing_class=word_tokenizer(), **extra)

    import ds_longseq
    from ds_longseq.patch import sequence_parallel_of

    results = {}
    trainer = build(DPOTrainer, 2)
    ref = trainer.accelerator.unwrap_model(trainer.ref_model)
    results["DPOTrainer"] = {
        "ref enabled": ds_longseq.is_enabled(ref), "ref sp size": sequence_parallel_of(ref).size,
        "ref head": ref.forward.fused_head, "ref streambp": ds_longseq.get_config(ref).streambp.enabled,
    }
    results["GRPOTrainer"] = type(build(GRPOTrainer, 2)).__name__
    for name, options in (("top_entropy_quantile", {"top_entropy_quantile": 0.5}),):
        try:
            build(GRPOTrainer, 2, **options)
        except Exception as err:  # noqa: BLE001 - the test reads the type and the message
            results[f"GRPO {name}"] = f"{type(err).__name__}: {err}"
    # the forward ds_longseq installed on the model (no PEFT here), and what it computes for fused calls
    results["grpo"] = build(GRPOTrainer, 1, temperature=0.6, cast_lm_head_to_fp32=True).model.forward.fused_head
    results["dpo"] = build(DPOTrainer, 1).model.forward.fused_head
    results["dpo-wpo"] = build(DPOTrainer, 1, use_weighting=True).model.forward.fused_head
    return results


def test_trl_trainers_at_construction(tmp_path):
    """Under sequence parallelism DPO's reference model is enabled with the same sequence parallelism (the head TRL
    gave it, no StreamBP: it runs without gradient), GRPO builds and its options that span the group's turns are
    refused; otherwise what each asked of its own
    fused head (GRPO's temperature and cast_lm_head_to_fp32, DPO's fields with and without WPO) is what ds_longseq's
    forward computes."""
    from ds_longseq.forwards.token_outputs import FusedHeadSettings

    model_dir = str(tmp_path / "init")
    save_tiny_llama(model_dir)
    dpo_fields = ("log_probs", "entropy", "mean_logits", "is_top1")
    for results in run_distributed(construction_body, 2, (str(tmp_path), model_dir), timeout=600):
        assert results["GRPOTrainer"] == "LongSeqGRPOTrainer"
        message = results["GRPO top_entropy_quantile"]
        assert message.startswith("NotImplementedError"), message
        assert "TRL's GRPOTrainer under long_seq.sequence_parallel.size=2 with top_entropy_quantile < 1" in message
        assert results["DPOTrainer"] == {"ref enabled": True, "ref sp size": 2, "ref head": FusedHeadSettings(),
                                         "ref streambp": False}
        assert results["grpo"] == FusedHeadSettings(0.6, ("log_probs", "entropy"), True)
        assert results["dpo"] == FusedHeadSettings(1.0, dpo_fields)
        assert results["dpo-wpo"] == FusedHeadSettings(1.0, (*dpo_fields, "log_sum_sq_probs"))
