"""Policy optimisation on preferences (DPO) and on scored rollouts (GRPO): the frozen reference,
per-token log-probs, and the two JSONL data formats.

Shapes: B rows of a micro-batch, T the row length, G the completions of a group.

Holds:
    Reference: the frozen initial policy run through the same chunked path under no_grad (with LoRA:
        the policy with its adapters disabled).
    token_logprobs: a micro-batch's per-token log-probs under a model (sharded under sequence parallelism).
    PreferenceData / preference_micro_batch: {"prompt", "chosen", "rejected"[, reference log-probs]} pairs,
        batched chosen rows first.
    RolloutData / rollout_micro_batch: {"prompt", "completions", "rewards"} groups, batched group after group.
    check_group_size: refuse groups of one completion when rewards are normalised within groups.
    completion_tokens: the scored completion tokens of a batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ds_longseq.ops import TokenLogprobs
from ds_longseq.patch import enable
from ds_longseq.toolkit.data import pad_id_of, pad_row, read_jsonl, require_keys

if TYPE_CHECKING:
    from ds_longseq.toolkit.run import Run

__all__ = ["Reference", "token_logprobs", "PreferenceData", "preference_micro_batch", "RolloutData",
           "rollout_micro_batch", "check_group_size", "completion_tokens"]


class Reference:
    """The frozen initial policy, for reference log-probs under no_grad.

    Without LoRA: a second copy of the model built as the policy was (same --model or the same
    seeded built-in weights), enabled with the same long_seq settings (chunked head, StreamBP,
    sequence parallelism), so its log-probs come through the same chunked path. With LoRA: no
    second model; the policy with its adapters disabled is the base it started from.
    """

    def __init__(self, run: Run):
        self.run = run
        self.model = None
        if not run.args.lora_rank:
            model = run.build_base()
            # Default sp_group: DeepSpeed's sequence-parallel group, which engine.initialize set up.
            self.model = enable(model, run.long_seq).to(run.engine.device).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> TokenLogprobs:
        if self.model is not None:
            return self.model(**batch, use_cache=False, return_token_logprobs=True)
        with self.run.engine.module.disable_adapter():
            return self.run.engine(**batch, use_cache=False, return_token_logprobs=True)


def token_logprobs(model, batch: dict[str, torch.Tensor]) -> TokenLogprobs:
    """Per-token log-probs of ``batch['labels']`` (or its ``shift_labels`` shard) under ``model``."""
    return model(**batch, use_cache=False, return_token_logprobs=True)


class PreferenceData:
    """Pairs from --data, tokenised with --model's tokenizer, each side padded to --seq-len.

    Every problem is found here, before training, and named by path:line.
    """

    def __init__(self, path: str, tokenizer, seq_len: int):
        self.tokenizer, self.seq_len = tokenizer, seq_len
        self.pad_id = pad_id_of(tokenizer)
        self.items = []
        with_ref = None
        for lineno, rec in read_jsonl(path):
            where = f"{path}:{lineno}"
            require_keys(rec, ("prompt", "chosen", "rejected"), where, "'prompt', 'chosen' and 'rejected' (strings)")
            for key in ("prompt", "chosen", "rejected"):
                if not isinstance(rec[key], str):
                    raise ValueError(f"{where}: '{key}' must be a string, got {type(rec[key]).__name__}")
            has_ref = [k in rec for k in ("ref_chosen_logp", "ref_rejected_logp")]
            if any(has_ref) and not all(has_ref):
                raise ValueError(f"{where}: give both 'ref_chosen_logp' and 'ref_rejected_logp', or neither")
            if with_ref is None:
                with_ref = all(has_ref)
            elif with_ref != all(has_ref):
                raise ValueError(
                    f"{where}: precomputed reference log-probs on some lines and not others: give "
                    "'ref_chosen_logp'/'ref_rejected_logp' on every line, or on none (then the reference model runs)"
                )
            p_ids = tokenizer(rec["prompt"], add_special_tokens=True)["input_ids"] if rec["prompt"] else []
            item = {}
            for key in ("chosen", "rejected"):
                c_ids = tokenizer(rec[key], add_special_tokens=not p_ids)["input_ids"]
                if not c_ids:
                    raise ValueError(
                        f"{where}: '{key}' is empty (no tokens): every pair needs two non-empty completions"
                    )
                ids, labels = (p_ids + c_ids)[:seq_len], ([-100] * len(p_ids) + c_ids)[:seq_len]
                # A label at position 0 predicts nothing (log-probs are of labels[t + 1]).
                if all(x == -100 for x in labels[1:]):
                    raise ValueError(
                        f"{where}: the prompt fills --seq-len {seq_len}, leaving no '{key}' token to score: "
                        "raise --seq-len or shorten the prompt"
                    )
                item[key] = pad_row(ids, labels, seq_len, self.pad_id)
            if with_ref:
                for key in ("ref_chosen_logp", "ref_rejected_logp"):
                    value = rec[key]
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                        raise ValueError(
                            f"{where}: '{key}' must be a finite number (a sequence log-prob), got {value!r}"
                        )
                item["ref"] = (float(rec["ref_chosen_logp"]), float(rec["ref_rejected_logp"]))
            self.items.append(item)
        if not self.items:
            raise ValueError(f"--data {path} holds no records")
        self.precomputed_ref = bool(with_ref)

    def __getitem__(self, index: int) -> dict:
        return self.items[index % len(self.items)]


def preference_micro_batch(source, indices) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Chosen rows of the pairs, then their rejected rows; and their precomputed reference log-probs.

    Args:
        source: item ``i`` -> a pair (e.g. ``PreferenceData.__getitem__`` or ``tasks.synthetic_pair``).
        indices: the pairs of this micro-batch (n of them).

    Returns:
        (batch of (2n, T) tensors, rows 0..n-1 chosen and n..2n-1 rejected; the (2n,) reference
        sequence log-probs in the same order, or None when the data has none).
    """
    items = [source(i) for i in indices]
    rows = [it["chosen"] for it in items] + [it["rejected"] for it in items]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    ref = None
    if "ref" in items[0]:
        ref = torch.tensor([it["ref"][0] for it in items] + [it["ref"][1] for it in items], dtype=torch.float32)
    return batch, ref


def check_group_size(group_size: int, scale: str, where: str) -> None:
    """Refuse groups of one completion under ``scale`` "group" (no reward std); ``where`` names the line."""
    if group_size == 1 and scale == "group":
        raise ValueError(
            f"{where}: groups of 1 completion with --scale-rewards group: a group of size 1 has no reward standard "
            "deviation (every advantage would be 0): sample >= 2 completions per prompt, or pass --scale-rewards "
            "batch (or none)"
        )


class RolloutData:
    """Groups from --data, tokenised with --model's tokenizer, each row padded to --seq-len.

    Every problem is found here, before training, and named by path:line.
    """

    def __init__(self, path: str, tokenizer, seq_len: int, scale_rewards: str):
        self.pad_id = pad_id_of(tokenizer)
        self.items, self.group_size = [], None
        for lineno, rec in read_jsonl(path):
            where = f"{path}:{lineno}"
            require_keys(rec, ("prompt", "completions", "rewards"), where,
                         "'prompt' (a string), 'completions' (G strings) and 'rewards' (G numbers)")
            prompt, completions, rewards = rec["prompt"], rec["completions"], rec["rewards"]
            if not isinstance(prompt, str):
                raise ValueError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
            if not isinstance(completions, list) or not all(isinstance(c, str) for c in completions):
                raise ValueError(f"{where}: 'completions' must be a list of strings")
            if not completions:
                raise ValueError(f"{where}: 'completions' is empty: give the G completions sampled for the prompt")
            if not isinstance(rewards, list) or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in rewards
            ):
                raise ValueError(f"{where}: 'rewards' must be a list of finite numbers")
            if len(rewards) != len(completions):
                raise ValueError(
                    f"{where}: {len(completions)} completions but {len(rewards)} rewards: "
                    "give one reward per completion"
                )
            if self.group_size is None:
                self.group_size = len(completions)
                check_group_size(self.group_size, scale_rewards, where)
            elif len(completions) != self.group_size:
                raise ValueError(
                    f"{where}: {len(completions)} completions, but the first line has {self.group_size}: every prompt "
                    "needs the same number G of completions"
                )
            p_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"] if prompt else []
            rows = []
            for i, completion in enumerate(completions):
                c_ids = tokenizer(completion, add_special_tokens=not p_ids)["input_ids"]
                if not c_ids:
                    raise ValueError(
                        f"{where}: completion {i} is empty (no tokens): drop it from the group (with its reward) "
                        "or drop the line"
                    )
                ids, labels = (p_ids + c_ids)[:seq_len], ([-100] * len(p_ids) + c_ids)[:seq_len]
                if all(x == -100 for x in labels[1:]):  # a label at position 0 predicts nothing
                    raise ValueError(
                        f"{where}: the prompt fills --seq-len {seq_len}, leaving no token of completion {i} to train "
                        "on: raise --seq-len or shorten the prompt"
                    )
                rows.append(pad_row(ids, labels, seq_len, self.pad_id))
            self.items.append({"rows": rows, "rewards": [float(r) for r in rewards]})
        if not self.items:
            raise ValueError(f"--data {path} holds no records")

    def __getitem__(self, index: int) -> dict:
        return self.items[index % len(self.items)]


def rollout_micro_batch(source, indices) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The groups' rows, group after group (G consecutive rows each): a batch of (B, T) tensors, B = G x
    len(indices), and their (B,) rewards."""
    items = [source(i) for i in indices]
    rows = [r for it in items for r in it["rows"]]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    return batch, torch.tensor([x for it in items for x in it["rewards"]], dtype=torch.float32)


def completion_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Scored completion tokens of a whole (unsharded) batch: log-probs are of labels[:, 1:]."""
    return int((batch["labels"][:, 1:] != -100).sum())
