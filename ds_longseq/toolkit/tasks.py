"""The built-in tasks the examples train on without --model / --data, and the tiny model they start from.

Every task is synthetic, seeded by (seed, index), so every rank and every resumed run builds the
same rows, and each is built so that its loss can fall below a stated chance level only through
long-range memory (attention far back, or a recurrent state).

Shapes: T the row length (``seq_len``), G the completions of a group.

Holds:
    BOS, DOC_TOKENS, VOCAB: the token layout of the copy, pair and rollout tasks.
    copy_example: [BOS] doc doc: only the copy is trained on (examples/sft.py).
    rule_continuation: tokens counting up by one, wrapping inside DOC_TOKENS.
    synthetic_pair: a chosen (rule) and rejected (half corrupted) completion of a random prompt (examples/dpo.py).
    synthetic_group: G completions with rising corruption and their rewards (examples/grpo.py).
    TopicRecallTask: a topic told at the start, asked for all along the row (examples/ssm_adjoint.py).
    tiny_llama / build_model: the tiny Llama-shaped model built from a config, or a local HF model.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ds_longseq.toolkit.data import pad_row
from ds_longseq.toolkit.pretrained import load_config, load_model
from ds_longseq.toolkit.quantized import FourBit

__all__ = ["BOS", "DOC_TOKENS", "VOCAB", "DEFAULT_GROUP_SIZE", "copy_example", "rule_continuation", "synthetic_pair",
           "synthetic_group", "TopicRecallTask", "tiny_llama", "build_model"]

# Copy, pair and rollout tasks: 0 pad, 1 BOS, document tokens drawn uniformly from DOC_TOKENS.
BOS = 1
DOC_TOKENS = range(32, 256)
VOCAB = 256
DEFAULT_GROUP_SIZE = 4
"""G of :func:`synthetic_group`."""


def _generator(index: int, seed: int) -> torch.Generator:
    # One stream per (seed, index): item i is the same whichever rank builds it, in whatever order.
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def copy_example(index: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """[BOS] doc doc (pad): a random document and its copy; only the copy carries labels.

    The copy's first token is not labelled (nothing says where the copy starts); every other copy
    token is determined by the token (T-1)/2 positions back and by nothing else, so no token of the
    copy can be guessed better than chance (ln 224) without looking that far back.

    Returns:
        ``input_ids``, ``attention_mask``, ``labels``, each (T,).
    """
    half = (seq_len - 1) // 2
    if half < 2:
        raise ValueError(f"--seq-len {seq_len} is too short for the built-in copy task: use at least 5")
    g = _generator(index, seed)
    doc = torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop, (half,), generator=g)
    tail = seq_len - 1 - 2 * half
    ids = torch.cat([torch.tensor([BOS]), doc, doc, torch.zeros(tail, dtype=torch.long)])
    labels = torch.full_like(ids, -100)
    labels[half + 2 : 2 * half + 1] = ids[half + 2 : 2 * half + 1]
    mask = torch.ones_like(ids)
    mask[2 * half + 1 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def rule_continuation(start: int, length: int) -> torch.Tensor:
    """``length`` tokens counting up by one from ``start`` + 1, wrapping inside DOC_TOKENS; shape (length,)."""
    lo, n = DOC_TOKENS.start, len(DOC_TOKENS)
    return lo + (start - lo + 1 + torch.arange(length)) % n


def synthetic_pair(index: int, seq_len: int, seed: int) -> dict:
    """[BOS] prompt | completion: chosen follows the +1 rule, rejected has half its tokens randomised.

    Returns:
        ``{"chosen": row, "rejected": row}``, each row as :func:`~ds_longseq.toolkit.data.pad_row`
        makes it (T,) with labels on the completion only.
    """
    prompt_len = seq_len // 2
    completion_len = seq_len - prompt_len
    if prompt_len < 2 or completion_len < 2:
        raise SystemExit(f"--seq-len {seq_len} is too short for the built-in pairs: use at least 4")
    g = _generator(index, seed)
    body = torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop, (prompt_len - 1,), generator=g)
    prompt = torch.cat([torch.tensor([BOS]), body])
    chosen = rule_continuation(int(prompt[-1]), completion_len)
    rejected = chosen.clone()
    corrupt = torch.randperm(completion_len, generator=g)[: completion_len // 2]
    noise = torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop - 1, (len(corrupt),), generator=g)
    rejected[corrupt] = noise + (noise >= chosen[corrupt]).long()  # never the rule's own token
    p = prompt.tolist()
    rows = [pad_row(p + c.tolist(), [-100] * len(p) + c.tolist(), seq_len, 0) for c in (chosen, rejected)]
    return {"chosen": rows[0], "rejected": rows[1]}


def synthetic_group(index: int, seq_len: int, seed: int, group_size: int = DEFAULT_GROUP_SIZE) -> dict:
    """[BOS] prompt | completion i, i < G: the +1 rule with fraction i / (G - 1) of tokens randomised
    (completion lengths between half and all of the room left); reward = fraction following the rule.

    Returns:
        ``{"rows": G rows of (T,) tensors, "rewards": G floats}``.
    """
    prompt_len = seq_len // 2
    room = seq_len - prompt_len
    if prompt_len < 2 or room < 2:
        raise SystemExit(f"--seq-len {seq_len} is too short for the built-in rollouts: use at least 4")
    g = _generator(index, seed)
    prompt = [BOS] + torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop, (prompt_len - 1,), generator=g).tolist()
    rows, rewards = [], []
    for i in range(group_size):
        length = int(torch.randint(max(1, room // 2), room + 1, (1,), generator=g))
        rule = rule_continuation(prompt[-1], length)
        completion = rule.clone()
        corrupt = torch.randperm(length, generator=g)[: round(length * i / max(1, group_size - 1))]
        noise = torch.randint(DOC_TOKENS.start, DOC_TOKENS.stop - 1, (len(corrupt),), generator=g)
        completion[corrupt] = noise + (noise >= rule[corrupt]).long()  # never the rule's own token
        rows.append(pad_row(prompt + completion.tolist(), [-100] * len(prompt) + completion.tolist(), seq_len, 0))
        rewards.append(float((completion == rule).float().mean()))
    return {"rows": rows, "rewards": rewards}


@dataclasses.dataclass(frozen=True)
class TopicRecallTask:
    """Topic recall: a row opens with a briefing on its topic, then only filler and questions follow::

        position  0     1 .. C    C+1   ...   C+1+Q   C+2+Q  ...  C+1+2Q  ...
        input     BOS   c .. c    SEP   f ... QUERY   f      ...  QUERY   f ...
        trained                                 ->ANS                ->ANS

    The topic is one of ``num_topics``, drawn uniformly; the briefing is ``num_clues`` (C) clue
    tokens drawn from that topic's own CLUES_PER_TOPIC clue tokens. After SEP every position holds
    a random filler token (the same distribution for every topic), except that every
    ``query_every`` (Q) tokens a QUERY asks for the topic's answer token (``labels[q + 1]``). The
    answers never appear in the input, so they can only come from memory of the clues: a model
    without it does no better than chance, ln(num_topics).
    """

    BOS: ClassVar[int] = 0
    SEP: ClassVar[int] = 1
    QUERY: ClassVar[int] = 2
    ANSWER0: ClassVar[int] = 3
    """Answer token of topic k: ANSWER0 + k."""
    CLUES_PER_TOPIC: ClassVar[int] = 4

    seq_len: int = 1024
    """T, tokens per row."""
    num_topics: int = 4
    """Topics, one per row, drawn uniformly."""
    num_clues: int = 64
    """C, clue tokens in the briefing: a selective SSM from scratch writes one token into its state faintly."""
    query_every: int = 16
    """Q, tokens between two QUERY tokens."""
    num_filler: int = 32
    """Distinct filler tokens."""
    seed: int = 0
    """Seed of the rows (row i is the same on every rank and run)."""

    @property
    def vocab_size(self) -> int:
        return self.ANSWER0 + self.num_topics + self.num_topics * self.CLUES_PER_TOPIC + self.num_filler

    @property
    def filler0(self) -> int:
        """The first filler token (fillers are [filler0, filler0 + num_filler))."""
        return self.ANSWER0 + self.num_topics + self.num_topics * self.CLUES_PER_TOPIC

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Row ``index``: ``input_ids`` and ``labels`` (-100 except after each QUERY), each (T,)."""
        g = _generator(index, self.seed)
        topic = int(torch.randint(0, self.num_topics, (1,), generator=g))
        clue0 = self.ANSWER0 + self.num_topics + topic * self.CLUES_PER_TOPIC
        ids = torch.randint(self.filler0, self.filler0 + self.num_filler, (self.seq_len,), generator=g)
        ids[0] = self.BOS
        ids[1 : 1 + self.num_clues] = torch.randint(clue0, clue0 + self.CLUES_PER_TOPIC, (self.num_clues,),
                                                    generator=g)
        start = 1 + self.num_clues
        ids[start] = self.SEP
        queries = torch.arange(start + self.query_every, self.seq_len - 1, self.query_every)
        ids[queries] = self.QUERY  # the token after a QUERY stays filler: the answer never enters the input
        labels = torch.full_like(ids, -100)
        labels[queries + 1] = self.ANSWER0 + topic  # position q predicts labels[q + 1]: the answer to its QUERY
        return {"input_ids": ids, "labels": labels}


def tiny_llama(seq_len: int, seed: int, dtype: torch.dtype = torch.float32):
    """The built-in model: a 2-layer Llama-shaped LM (hidden 128, vocab VOCAB) from a config, seeded.

    Built from ``seed`` on every rank (and again for a reference or a LoRA merge), so every copy starts
    from the same weights without loading any file.
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(seq_len)).to(dtype)


def tiny_llama_config(seq_len: int):
    """The built-in model's ``LlamaConfig`` (what :func:`tiny_llama` builds, and what the memory preflight reads)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=max(seq_len, 2048), rope_theta=10000.0,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )


def model_config(model: str | None, seq_len: int):
    """The config of ``model`` (a local HF model directory or GGUF file; read, no weights loaded) or of the
    built-in model."""
    if model:
        return load_config(model)
    return tiny_llama_config(seq_len)


def build_model(model: str | None, dtype: torch.dtype, *, seq_len: int, seed: int, four_bit: FourBit | None = None):
    """``model`` (a local HF causal-LM directory or GGUF file) loaded with SDPA attention, or with None
    :func:`tiny_llama`; with ``four_bit`` its decoder's linear layers quantised to 4 bits (``--load-in-4bit``).

    The built-in model is quantised the way a directory is: its seeded weights are saved to a temporary directory
    and loaded back quantised (transformers quantises while loading), so every rank, a resume and a merge get the
    same 4-bit base.
    """
    if model:
        return load_model(model, dtype, four_bit)
    if four_bit is None:
        return tiny_llama(seq_len, seed, dtype)
    import os
    import tempfile

    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="ds_longseq_tiny_") as path:
        tiny = tiny_llama(seq_len, seed, dtype)
        # written here, not by save_pretrained: under torch.distributed that writes on global rank 0 alone, and
        # every rank needs its own copy (ranks may not share /tmp)
        tiny.config.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in tiny.state_dict().items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
        return load_model(path, dtype, four_bit)
