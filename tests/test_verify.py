"""``ds-longseq verify`` (ds_longseq/cli/verify.py): exact on two families' checkpoints, a planted wrong gradient
caught, Approx-BP reported not exact with its measured difference, sequence parallelism over 2 ranks checked against
one process, bad input refused with status 2. The checkpoints are tiny models saved with ``save_pretrained``, their
weights drawn large enough for peaked attention (tests/helpers.make_model), and the configs' chunks small, so that
every run streams several chunks per layer (3 StreamBP chunks of 16, the last uneven, and kv tiles of 8)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from ds_longseq.cli import verify
from ds_longseq.config import LongSeqConfig
from ds_longseq.toolkit import exactness as library
from tests.dist_utils import run_distributed
from tests.helpers import make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG_SEQ = {"streambp": {"enabled": True, "chunk_size": 16}, "attention": {"kv_block_size": 8},
            "lm_head": {"enabled": True, "chunk_size": 16}}


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("verify")
    out = {}
    out["llama"] = str(tmp / "llama")
    make_model("llama", torch.float32).save_pretrained(out["llama"])
    out["qwen3"] = str(tmp / "qwen3")  # with a tokenizer, for --data
    make_model("qwen3", torch.float32, vocab_size=300).save_pretrained(out["qwen3"])
    _byte_level_tokenizer().save_pretrained(out["qwen3"])
    out["data"] = str(tmp / "data.jsonl")
    with open(out["data"], "w") as f:
        for record in ({"prompt": "the quick brown fox ", "completion": "jumps over the lazy dog " * 8},
                       {"text": "the lazy dog sleeps " * 12}):
            f.write(json.dumps(record) + "\n")
    configs = {"streambp": LONG_SEQ, "approx": {**LONG_SEQ, "approx_bp": {"activation": "resilu2"}},
               "sp2": {**LONG_SEQ, "sequence_parallel": {"size": 2}}}
    for name, long_seq in configs.items():
        out[name] = str(tmp / f"{name}.json")
        with open(out[name], "w") as f:
            json.dump({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "long_seq": long_seq}, f)
    return out


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer of 300 tokens trained here (tests/test_sft.py's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def _verify(argv: list[str]) -> tuple[int, str, str]:
    """(status, stdout, stderr) of ``ds-longseq verify argv`` in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = verify.main(argv)
    return status, out.getvalue(), err.getvalue()


def _worst(stdout: str) -> float:
    """The largest gradient difference the report lists."""
    rows = re.findall(r"^  \S+\s+([0-9.e+-]+|inf)", stdout, flags=re.M)
    assert rows, stdout
    return max(float(r) for r in rows)


def test_exact_on_llama_random_tokens(places):
    """float64 against the stock model: the report says EXACT, exit 0, a progress line per phase."""
    status, out, err = _verify(["--model", places["llama"], "--ds_config", places["streambp"]])
    assert status == 0, out + err
    assert "verdict: EXACT" in out and _worst(out) < 1e-12, out
    assert "all 2 layers" in out and "random tokens" in out, out
    assert "40 tokens" in out  # two and a half chunks of 16, rounded to an even length
    assert "[5/5]" in err


def test_exact_on_qwen3_first_layer_with_the_users_data(places):
    """qwen3 (q/k norms, explicit head_dim) on its first layer only, with the real final norm and head, on the rows
    of a JSONL file (a prompt masked, padding)."""
    status, out, err = _verify(["--model", places["qwen3"], "--ds_config", places["streambp"], "--layers", "1",
                                "--data", places["data"]])
    assert status == 0, out + err
    assert "verdict: EXACT" in out and _worst(out) < 1e-12, out
    assert "the first 1 of 2 decoder layers" in out and "rows of " + places["data"] in out, out
    assert "(model.layers.0." in out and "model.layers.1." not in out  # layer 1 is not loaded, nor compared


@pytest.mark.slow
def test_bf16_is_judged_against_the_stock_models_own_error(places):
    status, out, err = _verify(["--model", places["llama"], "--ds_config", places["streambp"], "--dtype", "bf16"])
    assert status == 0, out + err
    assert "stock bf16" in out and "verdict: EXACT" in out, out


def test_a_planted_wrong_gradient_is_caught(places, monkeypatch):
    """A mutation in the chunked backward (the first chunk's output gradient scaled by 1 + 1e-6, as a lost rounding
    or a misplaced normalisation would): not exact, exit 1, the difference measured."""
    from ds_longseq.ops.chunk_grads import ChunkGrads

    backward = ChunkGrads.backward

    def mutated(self, outputs, grad_outputs, x_chunk, start, end, *args, **kwargs):
        if start == 0:
            grad_outputs = [None if g is None else g * (1 + 1e-6) for g in grad_outputs]
        return backward(self, outputs, grad_outputs, x_chunk, start, end, *args, **kwargs)

    monkeypatch.setattr(ChunkGrads, "backward", mutated)
    status, out, err = _verify(["--model", places["llama"], "--ds_config", places["streambp"], "--layers", "1"])
    assert status == 1, out + err
    assert "verdict: NOT EXACT (" in out, out
    assert 1e-10 < _worst(out) < 1e-4, out  # the planted 1e-6, diluted over the chunks, not a crash


def test_approx_bp_is_reported_not_exact(places):
    status, out, err = _verify(["--model", places["llama"], "--ds_config", places["approx"], "--layers", "1"])
    assert status == 1, out + err
    assert "NOT EXACT by design" in out and "resilu2" in out, out
    assert _worst(out) > 1e-2, out  # its measured difference: a step function's gradient, by design


def _sp_rank(rank: int, argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = verify.main(argv)
    return status, out.getvalue()


def test_sequence_parallel_over_two_ranks_against_one_process(places):
    """Each rank runs its shard (80 tokens: 40 per rank, three StreamBP chunks each), the gradients are summed over
    the group, and rank 0 compares them with one process's stock run; every rank exits with the verdict."""
    argv = ["--model", places["llama"], "--ds_config", places["sp2"]]
    results = run_distributed(_sp_rank, world_size=2, args=(argv,), timeout=300)
    assert [status for status, _ in results] == [0, 0], results
    out = results[0][1]
    assert "2 ranks against one process" in out and "verdict: EXACT" in out and _worst(out) < 1e-12, out
    assert results[1][1] == ""  # rank 0 alone reports


@pytest.mark.slow
def test_sequence_parallel_starts_its_ranks(places, tmp_path):
    """Without a launcher, ``ds-longseq verify`` starts DeepSpeed's over the config's 2 ranks (as ``train`` does)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "ds_longseq.cli", "verify", "--model", places["llama"],
                           "--ds_config", places["sp2"]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "starting DeepSpeed's launcher over 2 ranks" in proc.stderr and "verdict: EXACT" in proc.stdout


@pytest.mark.parametrize("flags,message", [
    (["--seq-len", "20"], "--seq-len 20 is shorter than two of the config's chunks"),
    (["--layers", "0"], "--layers 0: pass a number of decoder layers >= 1"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
])
def test_bad_input_is_refused_with_status_2(places, flags, message):
    argv = ["--model", places["llama"], "--ds_config", places["streambp"], *flags]
    status, out, err = _verify(argv)
    assert status == 2 and message in err and "Traceback" not in err, err


def test_sequence_parallel_refused_in_one_process_without_a_launcher(places):
    status, _, err = _verify(["--model", places["llama"], "--ds_config", places["sp2"]])
    assert status == 2 and "needs 2 ranks" in err, err
    status, _, err = _verify(["--model", places["llama"], "--ds_config", places["sp2"], "--seq-len", "66"])
    assert status == 2 and "pass a multiple of 4, e.g. 68" in err, err  # refused before any rank starts


def test_lengths_cover_two_chunks_per_rank():
    one = LongSeqConfig.from_dict(LONG_SEQ)
    assert verify.min_seq_len(one) == 32 and verify.default_seq_len(one) == 40
    two = LongSeqConfig.from_dict({**LONG_SEQ, "sequence_parallel": {"size": 2}})
    assert verify.min_seq_len(two) == 64 and verify.default_seq_len(two) == 80  # a multiple of 2 P (a ring's cut)
    mst = LongSeqConfig.from_dict({"mini_seq": {"enabled": True, "mlp_num_chunks": 8}})
    assert verify.min_seq_len(mst) == 16


def test_truncated_config_cuts_per_layer_lists_and_turns_dropout_off():
    import transformers

    config = transformers.Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[1, 3], attention_dropout=0.1,
                                         layer_types=["full_attention"] * 4)
    cut, changed = library.truncated_config(config, 2)
    assert cut.num_hidden_layers == 2 and cut.layer_types == ["full_attention"] * 2
    assert cut.mlp_only_layers == [1] and cut.attention_dropout == 0.0
    assert changed == ["attention_dropout 0.1 -> 0"]
    assert config.num_hidden_layers == 4 and config.attention_dropout == 0.1  # the caller's config is left as it was


def test_judge_rules():
    bf16 = library.tolerance_for("bf16")
    assert library.judge({"a": 0.02, "b": 0.01}, {"a": 0.02, "b": 0.01}, bf16)[0]
    assert not library.judge({"a": 0.04, "b": 0.01}, {"a": 0.02, "b": 0.01}, bf16)[0]  # the worst over 1.5 x
    float32 = library.tolerance_for("float32")
    assert library.judge({"a": 5e-6}, {"a": 1e-7}, float32)[0]  # under the 1e-5 floor
    assert not library.judge({"a": 2e-5}, {"a": 1e-7}, float32)[0]
    assert library.judge({"a": 2e-5}, {"a": 2e-5}, float32)[0]  # the stock model's own float32 error is allowed
    assert not library.judge({"a": 2e-10}, None, library.tolerance_for("float64"))[0]


def test_layers_that_fit_take_the_first_layers_the_memory_holds():
    """Without --layers: every layer when they fit, else the first ones that do (the check's bytes per parameter
    against 80% of the free memory), refused when not even the embeddings and head fit."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=101)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    outside = sum(p.numel() for p in model.parameters()) - 4 * layer
    host = (outside + 2.5 * layer) * library.BYTES_PER_PARAM / library.FIT_FRACTION  # two layers and a half
    assert library.layers_that_fit(config, None, host)[:2] == (2, 4)
    assert library.layers_that_fit(config, None, 100 * host)[:2] == (4, 4)
    assert library.layers_that_fit(config, 3, host)[:2] == (3, 4)  # --layers is the user's call
    with pytest.raises(SystemExit, match="embeddings, head and one decoder layer need"):
        library.layers_that_fit(config, None, outside)
