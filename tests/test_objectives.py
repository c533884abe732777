"""DPO and GRPO through ds_longseq's chunked per-token log-probs against a naive implementation of
each formula on the stock model's full logits: float64 to 1e-10 on the loss, the input-embedding
gradient and every parameter gradient, with StreamBP, mini_seq and the stock head, uneven chunks,
prompt masks, pairs and groups of different lengths. Plus the StreamBP paper's DPO scheme (per-chunk
gradients accumulated, then one correction factor) against autograd, and bad input."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ds_longseq
from ds_longseq.ops import TokenLogprobs, dpo_loss, group_advantages, grpo_loss
from tests.helpers import VOCAB, compare, full_precision_norms, grads_of, make_model

CONFIGS = {
    "streambp": {"streambp": {"enabled": True, "chunk_size": 5}, "attention": {"kv_block_size": 4},
                 "lm_head": {"enabled": True, "chunk_size": 7}},
    "mini_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 3}, "lm_head": {"enabled": True, "chunk_size": 4}},
    "streambp_stock_head": {"streambp": {"enabled": True, "chunk_size": 6}},
}


def rows(prompt_lens, completion_lens, seq_len=29, seed=0):
    """Right-padded rows of prompt + completion; labels only on the completion."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    ids = torch.randint(0, VOCAB, (B, seq_len), generator=g)
    mask = torch.zeros(B, seq_len, dtype=torch.long)
    labels = torch.full((B, seq_len), -100)
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens, strict=True)):
        mask[i, : p + c] = 1
        labels[i, p : p + c] = ids[i, p : p + c]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def naive_logprobs(model, batch) -> TokenLogprobs:
    """The formula on full logits: log_softmax of the stock model's float64 logits, gathered."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits.double()
    targets = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
    mask = targets != -100
    log_p = torch.log_softmax(logits, -1)
    logps = log_p.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask
    entropy = -(log_p.exp() * log_p).sum(-1) * mask
    return TokenLogprobs(logps, mask, entropy)


def ours_logprobs(model, batch, entropy=False) -> TokenLogprobs:
    return model(**batch, return_token_logprobs=True, return_token_entropy=entropy)


def models(seed=0):
    policy = full_precision_norms(make_model("llama", torch.float64, seed=seed))
    reference = full_precision_norms(make_model("llama", torch.float64, seed=seed + 1))
    return policy, reference


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_token_logprobs_and_entropy_equal_full_logits(config):
    policy, _ = models()
    ours = ds_longseq.enable(copy.deepcopy(policy), CONFIGS[config])
    batch = rows([3, 5, 1], [20, 9, 27])
    g = torch.Generator().manual_seed(4)
    w_lp = torch.randn(3, 29, generator=g, dtype=torch.float64)
    w_h = torch.randn(3, 29, generator=g, dtype=torch.float64)

    def objective(lp):
        return (lp.logprobs * w_lp).sum() + (lp.entropy * w_h).sum()

    ref = grads_of(policy, lambda: objective(naive_logprobs(policy, batch)))
    got = grads_of(ours, lambda: objective(ours_logprobs(ours, batch, entropy=True)))
    errs = compare(got, ref)
    assert max(errs.values()) < 1e-10, errs


# --- DPO --------------------------------------------------------------------------------------------


def dpo_batch():
    """3 pairs: chosen rows then rejected rows, each with its own prompt and completion length."""
    return rows([4, 2, 6, 4, 2, 6], [12, 20, 7, 18, 5, 15], seed=1)


def dpo_objective(lp: TokenLogprobs, ref_lp: TokenLogprobs, **options):
    seq, ref = lp.sequence_logprobs(), ref_lp.sequence_logprobs()
    n = seq.shape[0] // 2
    return dpo_loss(seq[:n], seq[n:], ref[:n].detach(), ref[n:].detach(), **options)[0]


@pytest.mark.parametrize("config", ["streambp", "mini_seq"])
@pytest.mark.parametrize("options", [{"beta": 0.1}, {"beta": 0.5, "label_smoothing": 0.2}], ids=["plain", "smoothed"])
def test_dpo_matches_full_logits_float64(config, options):
    """Reference log-probs from a separate reference model run through the same chunked path."""
    policy, reference = models()
    batch = dpo_batch()
    with torch.no_grad():
        ref_naive = naive_logprobs(reference, batch)
        ref_ours = ours_logprobs(ds_longseq.enable(copy.deepcopy(reference), CONFIGS[config]), batch)
    torch.testing.assert_close(ref_ours.logprobs, ref_naive.logprobs, rtol=0, atol=1e-12)
    expected = grads_of(policy, lambda: dpo_objective(naive_logprobs(policy, batch), ref_naive, **options))
    ours = ds_longseq.enable(copy.deepcopy(policy), CONFIGS[config])
    got = grads_of(ours, lambda: dpo_objective(ours_logprobs(ours, batch), ref_ours, **options))
    errs = compare(got, expected)
    assert max(errs.values()) < 1e-10, errs


def test_dpo_autograd_equals_the_papers_accumulate_then_correct_scheme():
    """StreamBP Sec. 3.2.1: dL/dθ = (1/B) Σ_i -β σ(-β m_i) ∇(chosen_i - rejected_i) (no smoothing): one
    backward of the sequence log-prob differences weighted by the per-pair factor (computed from the
    margins first) gives the gradient autograd takes through dpo_loss."""
    policy, reference = models()
    batch, beta = dpo_batch(), 0.3
    ours = ds_longseq.enable(copy.deepcopy(policy), CONFIGS["streambp"])
    with torch.no_grad():
        ref = ours_logprobs(ds_longseq.enable(copy.deepcopy(reference), CONFIGS["streambp"]), batch)
        ref_seq = ref.sequence_logprobs()
        seq = ours_logprobs(ours, batch).sequence_logprobs()
        margins = (seq[:3] - ref_seq[:3]) - (seq[3:] - ref_seq[3:])
        factor = -beta * torch.sigmoid(-beta * margins) / 3

    def accumulate_then_correct():
        s = ours_logprobs(ours, batch).sequence_logprobs()
        return (factor * (s[:3] - s[3:])).sum()

    scheme = grads_of(ours, accumulate_then_correct)
    autograd = grads_of(ours, lambda: dpo_objective(ours_logprobs(ours, batch), ref, beta=beta))
    assert set(scheme[1]) == set(autograd[1])
    for name, g in autograd[1].items():
        torch.testing.assert_close(scheme[1][name], g, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(scheme[2], autograd[2], rtol=1e-10, atol=1e-14)


def test_dpo_reference_from_the_policy_with_lora_disabled():
    """The reference log-probs of a LoRA policy: the same model with its adapters disabled equals the
    base model's log-probs (no second model in memory)."""
    peft = pytest.importorskip("peft")
    policy, _ = models()
    batch = dpo_batch()
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(0)
    model = ds_longseq.enable(peft.get_peft_model(copy.deepcopy(policy), config), CONFIGS["streambp"])
    with torch.no_grad(), model.disable_adapter():
        ref = ours_logprobs(model, batch).logprobs
        base = naive_logprobs(policy, batch).logprobs
    torch.testing.assert_close(ref, base, rtol=0, atol=1e-12)
    with torch.no_grad():
        assert (ours_logprobs(model, batch).logprobs - base).abs().max() > 1e-3  # the adapters do act


# --- GRPO -------------------------------------------------------------------------------------------


def grpo_batch():
    """2 prompts x 3 completions of different lengths (one of a single token)."""
    return rows([5, 5, 5, 3, 3, 3], [14, 1, 22, 9, 17, 4], seed=2)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("config", ["streambp", "mini_seq"])
def test_grpo_matches_full_logits_float64(config, loss_type):
    """Old policy = a perturbed policy (ratios != 1, and epsilon small enough that some tokens clip),
    k3 KL to a separate reference model."""
    policy, reference = models()
    old_policy = copy.deepcopy(policy)
    with torch.no_grad():
        for p in old_policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    batch = grpo_batch()
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1], dtype=torch.float64)
    advantages = group_advantages(rewards, 3)
    with torch.no_grad():
        old = naive_logprobs(old_policy, batch).logprobs
        ref = naive_logprobs(reference, batch).logprobs
    options = dict(old_logprobs=old, ref_logprobs=ref, beta=0.1, epsilon=0.05, epsilon_high=0.08,
                   loss_type=loss_type, max_completion_length=24, num_items=40.0)
    expected = grads_of(policy, lambda: grpo_loss(naive_logprobs(policy, batch), advantages, **options)[0])
    ours = ds_longseq.enable(copy.deepcopy(policy), CONFIGS[config])
    got_metrics = {}

    def loss_fn():
        loss, metrics = grpo_loss(ours_logprobs(ours, batch), advantages, **options)
        got_metrics.update(metrics)
        return loss

    got = grads_of(ours, loss_fn)
    errs = compare(got, expected)
    assert max(errs.values()) < 1e-10, errs
    assert 0 < got_metrics["clip_ratio"] < 1 and got_metrics["kl"] > 0  # clipping and KL both bite


def test_grpo_formula_by_hand():
    """One sequence, two tokens, numbers worked out by hand (TRL's per-token surrogate, dapo)."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    logps = TokenLogprobs(lp, torch.ones(1, 2, dtype=torch.bool))
    loss, _ = grpo_loss(logps, torch.tensor([2.0], dtype=torch.float64), old_logprobs=old, epsilon=0.2,
                        loss_type="bnpo")
    r = torch.exp(torch.tensor([0.5, -1.0], dtype=torch.float64))  # 1.6487 (clipped to 1.2), 0.3679
    expected = -(torch.minimum(r * 2, r.clamp(0.8, 1.2) * 2)).sum() / 2
    torch.testing.assert_close(loss, expected)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([[0.0, -r[1].item()]], dtype=torch.float64))  # clipped: no grad


def test_group_advantages():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv = group_advantages(rewards, 3)
    torch.testing.assert_close(adv[:3], torch.tensor([-1.0, 0.0, 1.0]) / (1.0 + 1e-4))
    assert torch.equal(adv[3:], torch.zeros(3))  # a group of equal rewards: no signal (5 - 5 = 0 exactly)
    torch.testing.assert_close(group_advantages(rewards, 3, "none"), torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(
        group_advantages(rewards, 3, "batch"), torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / (rewards.std() + 1e-4)
    )


# --- bad input --------------------------------------------------------------------------------------


def test_bad_input_gets_clear_errors_before_compute():
    seq = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="one entry per pair"):
        dpo_loss(seq, seq[:2], seq, seq)
    with pytest.raises(ValueError, match="ref_rejected_logps is missing"):
        dpo_loss(seq, seq, seq, None)
    with pytest.raises(ValueError, match=r"require grad; compute them under torch.no_grad\(\)"):
        dpo_loss(seq, seq, seq.clone().requires_grad_(), seq)
    with pytest.raises(ValueError, match="group of size 1 has no standard deviation"):
        group_advantages(torch.ones(4), 1)
    with pytest.raises(ValueError, match="cannot be split into groups of 3"):
        group_advantages(torch.ones(4), 3)
    lp = TokenLogprobs(torch.zeros(2, 5, dtype=torch.float64), torch.tensor([[True] * 5, [False] * 5]))
    with pytest.raises(ValueError, match=r"rows \[1\] have no target token \(an empty completion"):
        lp.sequence_logprobs()  # the DPO input: an empty chosen or rejected completion
    assert lp.sequence_logprobs(allow_empty=True).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"rows \[1\] have no completion token"):
        grpo_loss(lp, torch.zeros(2))
    with pytest.raises(ValueError, match="beta != 0 needs ref_logprobs"):
        grpo_loss(lp, torch.zeros(2), beta=0.1)
    model = ds_longseq.enable(make_model("llama", torch.float32), CONFIGS["streambp"])
    batch = rows([2], [5])
    with pytest.raises(ValueError, match="return_token_logprobs needs the targets"):
        model(input_ids=batch["input_ids"], return_token_logprobs=True)


# --- sequence parallelism and ZeRO-3 on 2 CPU ranks -------------------------------------------------


def sp_objective(name: str, lp: TokenLogprobs, ref: TokenLogprobs) -> torch.Tensor:
    if name == "dpo":
        return dpo_objective(lp, ref, beta=0.2)
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1], dtype=torch.float64), 3)
    return grpo_loss(lp, advantages, ref_logprobs=ref.logprobs, beta=0.1, loss_type="grpo")[0]


def sp_objectives_worker(rank: int):
    """DPO and GRPO with each sequence split over 2 ranks (Ulysses + StreamBP, chunked head)."""
    import torch.distributed as dist

    from ds_longseq.engine import shard_batch

    policy, reference = models()
    cfg = {**CONFIGS["streambp"], "sequence_parallel": {"size": 2}}
    ours = ds_longseq.enable(copy.deepcopy(policy), cfg, sp_group=dist.group.WORLD)
    ref_model = ds_longseq.enable(copy.deepcopy(reference), cfg, sp_group=dist.group.WORLD)
    out = {}
    for name, batch in (("dpo", dpo_batch()), ("grpo", grpo_batch())):
        batch = {k: v[:, :28] for k, v in batch.items()}  # an even length: 14 tokens per rank
        local = shard_batch(batch, rank, 2)
        with torch.no_grad():
            ref = ours_logprobs(ref_model, local)
        loss_fn = lambda name=name, local=local, ref=ref: sp_objective(name, ours_logprobs(ours, local), ref)  # noqa: E731
        loss, grads, embed = grads_of(ours, loss_fn)
        for g in grads.values():
            dist.all_reduce(g)
        out[name] = (loss, grads, embed)
    return out


def test_dpo_and_grpo_under_sequence_parallelism_match_one_process():
    """The loss on every rank equals one process on whole sequences; the ranks' gradients summed
    (DeepSpeed's reduction) equal its gradients, float64 to 1e-10."""
    from tests.dist_utils import run_distributed

    results = run_distributed(sp_objectives_worker, 2)
    policy, reference = models()
    for name, batch in (("dpo", dpo_batch()), ("grpo", grpo_batch())):
        batch = {k: v[:, :28] for k, v in batch.items()}
        with torch.no_grad():
            ref = naive_logprobs(reference, batch)
        loss_fn = lambda name=name, batch=batch, ref=ref: sp_objective(name, naive_logprobs(policy, batch), ref)  # noqa: E731
        expected = grads_of(policy, loss_fn)
        for rank, per_rank in enumerate(results):
            loss, grads, embed = per_rank[name]
            shard = expected[2][:, rank * 14 : (rank + 1) * 14]
            errs = compare((loss, grads, embed), (expected[0], expected[1], shard))
            assert max(errs.values()) < 1e-10, (name, rank, errs)


def zero3_dpo_worker(rank: int, ref_logps: torch.Tensor):
    import ds_longseq.engine
    from tests.test_engine_dist import _gathered_state, ds_config

    model = make_model("llama", torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = ds_longseq.engine.initialize(
        model=model, optimizer=optimizer, config=ds_config(3, 1, CONFIGS["streambp"], batch=6)
    )
    batch = rows([4, 2, 6, 4, 2, 6], [12, 20, 7, 18, 5, 15], seed=10 + rank)  # different pairs per rank
    for _ in range(2):
        lp = engine(**batch, return_token_logprobs=True)
        seq = lp.sequence_logprobs()
        loss, _ = dpo_loss(seq[:3], seq[3:], ref_logps[rank, :3], ref_logps[rank, 3:], beta=0.2)
        engine.backward(loss)
        engine.step()
    return _gathered_state(engine)


def test_zero3_dpo_on_two_ranks_matches_one_process():
    """ZeRO-3 + StreamBP + chunked head, each rank its own pairs, precomputed reference log-probs:
    after 2 SGD steps every weight equals one process averaging the ranks' losses (fp32)."""
    from tests.dist_utils import run_distributed

    batches = [rows([4, 2, 6, 4, 2, 6], [12, 20, 7, 18, 5, 15], seed=10 + r) for r in range(2)]
    reference = make_model("llama", torch.float32, seed=1)
    with torch.no_grad():
        ref_logps = torch.stack([naive_logprobs(reference, b).sequence_logprobs().float() for b in batches])
    results = run_distributed(zero3_dpo_worker, 2, (ref_logps,))
    model = make_model("llama", torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        losses = []
        for r in range(2):
            seq = naive_logprobs(model, batches[r]).sequence_logprobs()
            losses.append(dpo_loss(seq[:3], seq[3:], ref_logps[r, :3].double(), ref_logps[r, 3:].double(), beta=0.2)[0])
        (sum(losses) / 2).backward()
        optimizer.step()
    for result in results:
        for name, p in model.named_parameters():
            err = ((result[name] - p.detach()).norm() / p.detach().norm()).item()
            assert err < 1e-5, (name, err)
