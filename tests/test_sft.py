"""examples/sft.py end to end on 2 CPU ranks through the DeepSpeed launcher: resume and crash safety; the JSONL
reader of ds_longseq.toolkit it uses."""

import json
import os
import re
import shutil
import sys

import pytest

from ds_longseq.toolkit import JsonlData
from ds_longseq.toolkit.faults import FAULT_INJECT_ENV
from tests.dist_utils import run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tmp_path, stage=2, name=None, sp=None, partition_all=False):
    """The shipped ``name`` (default zeroN_streambp.json) with chunks for 256 tokens; ``partition_all``: ZeRO-3's
    persistence threshold 0, so that every parameter is partitioned, the tiny model's included (ZeRO-3 keeps those
    under 1e5 elements whole on every rank)."""
    name = name or f"zero{stage}_streambp.json"
    with open(os.path.join(ROOT, "ds_configs", name)) as f:
        config = json.load(f)
    config["long_seq"]["streambp"]["chunk_size"] = 96  # 256 tokens: 3 chunks, the last one short
    config["long_seq"]["lm_head"]["chunk_size"] = 5
    if sp is not None:
        config["long_seq"]["sequence_parallel"] = {"size": sp}
    if partition_all:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path = tmp_path / f"{name}.sp{sp}{'.partition_all' if partition_all else ''}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _ring_config(tmp_path):
    """zero3_ulysses_streambp.json (ZeRO-3, StreamBP, SP 2) with the ring forced (``sequence_parallel.ring`` 2)."""
    path = tmp_path / "zero3_ring.json"
    with open(_config(tmp_path, name="zero3_ulysses_streambp.json")) as f:
        config = json.load(f)
    config["long_seq"]["sequence_parallel"] = {"size": 2, "ring": 2}
    path.write_text(json.dumps(config))
    return str(path)


def run_sft(config, save_dir, *extra, expect_ok=True, timeout=600, num_ranks=2, fault=None, seq_len=256):
    """examples/sft.py through the DeepSpeed launcher; ``fault``: a DS_LONGSEQ_FAULT_INJECT value for its ranks."""
    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not on PATH: pip install deepspeed")
    cmd = [
        "deepspeed",
        "--num_gpus",
        str(num_ranks),
        "--master_port",
        str(_port()),
        os.path.join(ROOT, "examples", "sft.py"),
        "--ds_config",
        config,
        "--seq-len",
        str(seq_len),
        "--save-dir",
        str(save_dir),
        *extra,
    ]
    # sys.path[0] of the launched script is examples/, so without PYTHONPATH the ranks would import
    # whichever ds_longseq is pip-installed (another checkout's, with `pip install -e`), not this one.
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath)
    env.pop(FAULT_INJECT_ENV, None)
    if fault is not None:
        env[FAULT_INJECT_ENV] = fault  # the local launcher passes its environment to every rank
    proc = run_job(cmd, cwd=ROOT, timeout=timeout, env=env)
    if expect_ok and proc.returncode != 0:
        # The output's tail is often another rank's "connection closed": name the ranks' own errors first.
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if re.match(r"\[rank\d+\]: \w*Error", line)]
        raise AssertionError(
            f"sft.py failed ({proc.returncode}):\n" + "\n".join(errors)
            + f"\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def _port():
    sys.path.insert(0, ROOT)
    from tests.dist_utils import free_port

    return free_port()


def losses(save_dir):
    with open(os.path.join(save_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.mark.slow  # heavy: the default run keeps test_faults.py's mid-save crash, the trainers' SP runs
def test_resume_after_a_crash_during_save_matches_an_uninterrupted_run(tmp_path):
    config = _config(tmp_path)
    straight = tmp_path / "straight"
    run_sft(config, straight, "--max-steps", "4", "--save-every", "1", "--save-total-limit", "2")
    assert (straight / "loss.png").exists() and (straight / "hf_model" / "config.json").exists()
    assert (straight / "latest").read_text() == "step4"
    assert sorted(p.name for p in straight.glob("step*")) == ["step3", "step4"]  # --save-total-limit 2

    crashed = tmp_path / "crashed"
    proc = run_sft(config, crashed, "--max-steps", "4", "--save-every", "2", fault="crash_during_save:4",
                   expect_ok=False)
    assert proc.returncode != 0
    # The step-4 checkpoint was being written when the run died: it is still step4.partial (renamed to step4 only
    # once every rank has written it) and ``latest`` still names step 2.
    assert (crashed / "latest").read_text() == "step2"
    assert (crashed / "step4.partial").exists() and not (crashed / "step4").exists()

    run_sft(config, crashed, "--max-steps", "4", "--resume")
    assert (crashed / "latest").read_text() == "step4"
    a, b = losses(straight), losses(crashed)
    assert len(a) == len(b) == 4
    # Same data order, same weights and optimizer state after step 2: float32 CPU runs repeat
    # bit for bit up to reduction order; 1e-6 relative leaves room for nothing else.
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-6 * abs(x), (a, b)


def test_bad_input_fails_before_training(tmp_path):
    config = _config(tmp_path)
    proc = run_sft(config, tmp_path / "bad", "--max-steps", "2", "--seq-len", "0", expect_ok=False)
    assert proc.returncode != 0
    # The flag is named, and the config is not blamed (it was once: "long_seq ... sequence length").
    out = proc.stdout + proc.stderr
    assert "--seq-len must be positive, got 0" in out and "long_seq" not in out
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_missing_model_and_data_paths_are_named(tmp_path):
    """--model / --data that are not there are named before anything loads (not transformers' "Repo id must be in
    the form ..." for a path it took for a hub id)."""
    from ds_longseq.toolkit import check_model_and_data

    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    model = tmp_path / "model"
    cases = {
        (str(tmp_path / "no" / "such"), None): "no such directory",
        (str(tmp_path), None): "no config.json in it",
        (None, str(data)): "--data needs --model",
    }
    model.mkdir()
    (model / "config.json").write_text("{}")
    cases[(str(model), str(tmp_path / "none.jsonl"))] = "none.jsonl: no such file"
    for (model_path, data_path), message in cases.items():
        with pytest.raises(SystemExit, match=message):
            check_model_and_data(model_path, data_path)
    check_model_and_data(str(model), str(data))  # both there: no error
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import sft
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit, match="--save-every must be >= 0"):
        sft.check_args(sft.parse_args(["--save-every", "-1"]))
    with pytest.raises(SystemExit, match="--save-total-limit must be >= 0.*pass 0 to keep every checkpoint"):
        sft.check_args(sft.parse_args(["--save-total-limit", "-1"]))
    with pytest.raises(SystemExit, match="--save-every-minutes must be >= 0"):
        sft.check_args(sft.parse_args(["--save-every-minutes", "-2"]))


def _tiny_hf_model_with_tokenizer(path):
    """A 2-layer Qwen3 and a byte-level BPE tokenizer trained here: a local from_pretrained path."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)
    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=len(fast), max_position_embeddings=512)
    Qwen3ForCausalLM(config).save_pretrained(path)


def test_local_model_and_jsonl_data_with_prompt_masking(tmp_path):
    model_dir = tmp_path / "model"
    _tiny_hf_model_with_tokenizer(model_dir)
    data = tmp_path / "data.jsonl"
    records = [{"prompt": "the quick brown fox ", "completion": "jumps over the lazy dog " * 8},
               {"text": "the lazy dog sleeps " * 12}]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "out"
    proc = run_sft(_config(tmp_path, stage=3), out, "--model", str(model_dir), "--data", str(data), "--max-steps", "2")
    assert "summary: 2 steps on 2 rank(s)" in proc.stdout
    assert len(losses(out)) == 2 and all(x > 0 for x in losses(out))
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "hf_model")  # ZeRO-3 weights were gathered for export
    assert exported.config.model_type == "qwen3"
    assert all(p.numel() > 0 for p in exported.parameters())


def test_jsonl_records_mask_the_prompt():
    class CharTokenizer:
        pad_token_id, eos_token_id = 0, 0

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write(json.dumps({"prompt": "ab", "completion": "cde"}) + "\n")
    item = JsonlData(f.name, CharTokenizer(), seq_len=8)[0]
    assert item["input_ids"].tolist() == [97, 98, 99, 100, 101, 0, 0, 0]
    assert item["labels"].tolist() == [-100, -100, 99, 100, 101, -100, -100, -100]
    assert item["attention_mask"].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    os.unlink(f.name)


def test_malformed_jsonl_names_the_file_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": "cut off\n')
    # Line 4 of the file (the blank line 2 counts), not json's "line 1 column 10".
    with pytest.raises(ValueError, match=r"data\.jsonl:4: not valid JSON: Unterminated string starting at \(column 10"):
        JsonlData(str(path), tokenizer=None, seq_len=8)
    path.write_text('{"text": "fine"}\n["text"]\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:2: expected a JSON object, got list"):
        JsonlData(str(path), tokenizer=None, seq_len=8)


@pytest.mark.slow  # heavy: the default run keeps test_faults.py's mid-save crash, the trainers' SP runs
def test_sequence_parallel_run_equals_one_process_on_the_whole_sequence(tmp_path):
    """ds_configs/zero3_ulysses_streambp.json: 2 ranks share each 256-token sequence (128 each, chunks of
    96). Its losses equal a 1-rank run of the same model and data without sequence parallelism."""
    sp_run, single = tmp_path / "sp", tmp_path / "single"
    proc = run_sft(_config(tmp_path, name="zero3_ulysses_streambp.json"), sp_run, "--max-steps", "3")
    assert "sequence parallel 2 x data parallel 1)" in proc.stdout
    run_sft(_config(tmp_path, name="zero3_ulysses_streambp.json", sp=1), single, "--max-steps", "3", num_ranks=1)
    a, b = losses(sp_run), losses(single)
    assert len(a) == len(b) == 3
    # float32; AdamW steps amplify reduction-order round-off a little over 3 steps
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (a, b)
    assert (sp_run / "hf_model" / "config.json").exists()

    # Ulysses x ring (issue 42): the built-in model's 4 heads forced to a ring of 2, each rank's 128 tokens two zigzag
    # blocks of 64 (examples/sft.py cuts by the enabled model's layout); StreamBP is refused under a ring, so the
    # MLPs and the head stream (mini_seq). The same losses as the one-process StreamBP run (exact methods, float32)
    ring_run = tmp_path / "ring"
    proc = run_sft(_ring_config(tmp_path), ring_run, "--max-steps", "3")
    assert "sequence parallel 2 x data parallel 1, Ulysses 1 x ring 2)" in proc.stdout
    for x, y in zip(losses(ring_run), b, strict=True):
        assert abs(x - y) <= 1e-5 * abs(y), (losses(ring_run), b)

    bad = run_sft(_config(tmp_path, name="zero3_ulysses_streambp.json"), tmp_path / "bad", "--seq-len", "255",
                  "--max-steps", "1", expect_ok=False)
    assert ("sequence length 255 is not divisible by sequence_parallel size 2: use --seq-len 256, or pad the "
            "sequences (--pad-for-sp; shard_batch(pad=True))") in (
        bad.stdout + bad.stderr
    )


def test_save_schedule_steps_minutes_and_the_last(monkeypatch):
    """--save-every N, --save-every-minutes M (the ranks' agreement asked only when the time rule decides; it
    counts from the last save) and the last step, alone and together."""
    from ds_longseq.toolkit.checkpoint import SaveSchedule
    from ds_longseq.toolkit.checkpoint import time as clock

    now = [0.0]
    monkeypatch.setattr(clock, "monotonic", lambda: now[0])
    asked = []

    def agree(late):  # one rank's view; a second rank late by itself would make every rank save
        asked.append(late)
        return late

    def saves(schedule, minutes_per_step):
        done = []
        for step in range(1, schedule.max_steps + 1):
            now[0] += 60 * minutes_per_step
            if schedule.due(step):
                schedule.saved()
                done.append(step)
        return done

    assert saves(SaveSchedule(3, 0, 10, agree=agree), 1) == [3, 6, 9, 10] and not asked
    assert saves(SaveSchedule(0, 2.5, 10, agree=agree), 1) == [3, 6, 9, 10] and asked.count(True) == 3
    asked.clear()
    assert saves(SaveSchedule(4, 2.5, 10, agree=agree), 1) == [3, 4, 7, 8, 10]  # a step save restarts the clock
    assert saves(SaveSchedule(0, 0, 5, agree=agree), 1) == [5]
    assert saves(SaveSchedule(0, 30, 5, agree=lambda late: True), 0.01) == [1, 2, 3, 4, 5]  # another rank was late
