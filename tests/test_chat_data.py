"""Chat ``messages`` records (issue 29 item 5): rendered by the tokenizer's chat template, trained on the
assistant turns only; records without an assistant turn skipped and counted; a tokenizer without a template, or a
template whose turns cannot be told apart, refused before any step. The tokenizer is built here (no hub)."""

from __future__ import annotations

import json
import logging

import pytest

from ds_longseq.toolkit.data import JsonlData, chat_tokens

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer(template: str | None = CHATML):
    """A byte-level BPE tokenizer trained here, with ChatML's turn markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<eos>", "<|im_start|>",
                                                                  "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog user assistant system " * 20], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = template
    return fast


CHAT = [
    {"role": "system", "content": "the lazy dog"},
    {"role": "user", "content": "the quick fox"},
    {"role": "assistant", "content": "jumps over"},
    {"role": "user", "content": "the dog"},
    {"role": "assistant", "content": "the brown fox"},
]


def _write(tmp_path, records) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_assistant_turns_only_are_trained():
    tok = chat_tokenizer()
    ids, labels = chat_tokens(tok, CHAT, "x:1")
    assert ids == tok.apply_chat_template(CHAT, tokenize=True, return_dict=False)  # the template's own rendering
    trained = [t for t in labels if t != -100]
    # each assistant turn's content and end-of-turn, not its "<|im_start|>assistant\n" header
    assert tok.decode(trained) == "jumps over<|im_end|>\nthe brown fox<|im_end|>\n"
    spans = [i for i, t in enumerate(labels) if t != -100]
    assert all(labels[i] == ids[i] for i in spans)


def test_jsonl_chats_mixed_with_other_records_and_skipped_ones(tmp_path, caplog):
    tok = chat_tokenizer()
    path = _write(tmp_path, [
        {"messages": CHAT},
        {"messages": [{"role": "user", "content": "the fox"}]},  # nothing to train on: skipped, counted
        {"text": "the lazy dog"},
        {"prompt": "the quick", "completion": " brown fox"},
    ])
    with caplog.at_level(logging.WARNING, logger="ds_longseq.toolkit.data"):
        data = JsonlData(path, tok, seq_len=64)
    assert len(data) == 3 and data.skipped == [2]
    assert "skipped 1 chat record(s) without an assistant turn" in caplog.text and "lines [2]" in caplog.text
    row = data[0]
    ids, labels = chat_tokens(tok, CHAT, "x")
    assert row["input_ids"][: len(ids)].tolist() == ids and row["labels"][: len(ids)].tolist() == labels
    assert row["labels"][len(ids):].eq(-100).all() and row["attention_mask"].sum() == len(ids)


def test_chat_data_refusals(tmp_path):
    chats = _write(tmp_path, [{"messages": CHAT}])
    with pytest.raises(ValueError, match=r"holds chat 'messages' records, but the tokenizer has no chat template"):
        JsonlData(chats, chat_tokenizer(None), seq_len=64)
    # a template that closes only the last turn renders the earlier ones differently once more follow
    last_only = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "{% if loop.last %}<|im_end|>{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: the tokenizer's chat template renders the turns before "
                                         r"turn 1 \(user\) differently"):
        JsonlData(chats, chat_tokenizer(last_only), seq_len=64)
    only_users = _write(tmp_path, [{"messages": [{"role": "user", "content": "the fox"}]}])
    with pytest.raises(ValueError, match=r"holds no records with an assistant turn \(1 chat records without one\)"):
        JsonlData(only_users, chat_tokenizer(), seq_len=64)
    bad = _write(tmp_path, [{"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"chat\.jsonl:1: 'messages' must be a non-empty list"):
        JsonlData(bad, chat_tokenizer(), seq_len=64)


def _chat_model_dir(path):
    """A 2-layer Qwen3 with :func:`chat_tokenizer`: a local from_pretrained path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = chat_tokenizer()
    tok.save_pretrained(path)
    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=512)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def _chat_file(tmp_path) -> str:
    turns = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "the fox"}]},
             {"messages": CHAT[1:3] * 6}]
    return _write(tmp_path, turns)


@pytest.mark.slow  # heavy: the default run keeps test_sft_on_chat_data
def test_trainer_sft_trl_on_a_local_model_and_chat_data(tmp_path):
    """examples/trainer_sft.py --model --data (chat records) --trl on 2 CPU ranks: trains, logs finite losses,
    counts the skipped record, saves the tokenizer with the model."""
    from tests.test_dpo_example import run_example
    from tests.test_trainer_example import trainer_config

    out = tmp_path / "out"
    proc = run_example("trainer_sft.py", trainer_config(tmp_path), out, "--trl", "--max-steps", "2",
                       "--model", str(_chat_model_dir(tmp_path / "model")), "--data", _chat_file(tmp_path))
    assert "summary: LongSeqSFTTrainer, 2 steps on 2 rank(s), seq_len 256" in proc.stdout
    assert "skipped 1 chat record(s) without an assistant turn" in proc.stderr + proc.stdout
    with open(out / "trainer_state.json") as f:
        logged = [h for h in json.load(f)["log_history"] if "loss" in h]
    assert len(logged) == 2 and all(h["loss"] > 0 for h in logged), logged
    assert (out / "hf_model" / "tokenizer_config.json").exists()


@pytest.mark.slow  # a 2-rank run (CI time); the chat rendering and masking are checked in-process above
def test_sft_on_chat_data(tmp_path):
    """examples/sft.py --model --data with chat records (ZeRO-2, 2 CPU ranks): 2 finite steps."""
    from tests.test_sft import _config, losses, run_sft

    out = tmp_path / "out"
    proc = run_sft(_config(tmp_path), out, "--model", str(_chat_model_dir(tmp_path / "model")), "--data",
                   _chat_file(tmp_path), "--max-steps", "2")
    assert "summary: 2 steps on 2 rank(s)" in proc.stdout
    assert len(losses(out)) == 2 and all(x > 0 for x in losses(out))
