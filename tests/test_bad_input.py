"""docs/BAD_INPUT.md's table, run row by row: each bad input through its command (a subprocess started from a
temporary directory, not the repository root), checking the exit status, that the message holds every fragment the
row lists and that no traceback is printed; and a genuine internal error, which must still show its traceback."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "BAD_INPUT.md")


def _rows() -> list[tuple[str, str, int, list[str]]]:
    """(bad input, command, exit status, message fragments) per row of the doc's table."""
    with open(DOC) as f:
        lines = [line for line in f if line.startswith("| ") and not line.startswith(("| Bad input", "| ---"))]
    rows = []
    for line in lines:
        what, command, status, message = (cell.strip() for cell in line.strip().strip("|").split(" | "))
        rows.append((what, command.strip("`"), int(status), re.findall(r"`([^`]+)`", message)))
    return rows


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "trailing_comma.json").write_text(
        '{\n  "train_micro_batch_size_per_gpu": 1,\n  "zero_optimization": {"stage": 2},\n}\n')
    with open(os.path.join(ROOT, "ds_configs", "zero2_streambp.json")) as f:
        config = json.load(f)
    config["long_seq"]["streambp"]["chunk_size"] = "autox"
    (tmp / "bad_choice.json").write_text(json.dumps(config))
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}))
    earlier = tmp / "earlier_run"  # what a finished run leaves: its checkpoints and `latest`
    for step in (1, 2):
        (earlier / f"step{step}").mkdir(parents=True)
    (earlier / "latest").write_text("step2")
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}}
    (tmp / "bad_batch.json").write_text(json.dumps(config))
    return {"sft": os.path.join(ROOT, "examples", "sft.py"), "tmp": str(tmp), "earlier_run": str(earlier),
            "bad_batch": str(tmp / "bad_batch.json"),
            "trailing_comma": str(tmp / "trailing_comma.json"), "bad_choice": str(tmp / "bad_choice.json"),
            "model": str(tmp / "model")}


def _run(command: str, cwd: str) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    # `ds-longseq` as its console script runs it (tests/test_cli.py runs the installed script itself)
    commands = {"python": [sys.executable], "ds-longseq": [sys.executable, "-m", "ds_longseq.cli"]}
    argv[:1] = commands.get(argv[0], argv[:1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_table_has_rows():
    assert len(_rows()) >= 7


@pytest.mark.parametrize(("what", "command", "status", "fragments"), _rows(), ids=[r[0] for r in _rows()])
def test_bad_input_row(places, what, command, status, fragments):
    proc = _run(command.format(**places), places["tmp"])
    err = proc.stderr
    assert proc.returncode == status, (what, proc.returncode, err[-3000:])
    for fragment in fragments:
        assert fragment.format(**places) in err, (what, fragment, err[-3000:])
    assert "Traceback" not in err, (what, err[-3000:])


def test_an_internal_error_keeps_its_traceback(places):
    """Control: a genuine bug (here a planner function broken on purpose) is not turned into a one-line message."""
    code = ("import sys, ds_longseq.plan as p\n"
            "p.ModelDims.from_config = None  # an internal error: calling None\n"
            f"sys.exit(p.main(['--model', {places['model']!r}, '--seq-len', '1024']))")
    proc = _run(f"python -c {shlex.quote(code)}", places["tmp"])
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "TypeError" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("script", ["sft", "dpo", "grpo", "trainer_sft", "ds-longseq train"])
def test_help_says_each_default_once(script, capsys):
    """``--help`` of each example and of ``ds-longseq train``: no flag's entry says its default twice (its own words
    and argparse's)."""
    import importlib

    if script == "ds-longseq train":
        from ds_longseq.cli import main as parse_args

        argv = ["train", "--help"]
    else:
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        try:
            parse_args = importlib.import_module(script).parse_args
        finally:
            sys.path.pop(0)
        argv = ["--help"]
    with pytest.raises(SystemExit):
        parse_args(argv)
    text = capsys.readouterr().out.split("options:", 1)[1]
    entries = re.split(r"\n  (?=-)", text)  # one entry per flag (its lines up to the next flag)
    twice = [entry.split()[0] for entry in entries if entry.count("default") > 1]
    assert len(entries) > 5 and not twice, twice


def test_progress_bar_in_a_log_prints_lines_not_redraws():
    """tqdm into ``LogLines`` (what MetricsLog gives it when stderr is not a terminal): a thousand refreshes within
    the interval print the first line and, when the bar closes, the last; no carriage return reaches the log."""
    import io

    from tqdm import tqdm

    from ds_longseq.toolkit.metrics import LogLines

    out = io.StringIO()
    lines = LogLines(out, every_s=3600)
    bar = tqdm(total=1000, file=lines, desc="sft")
    for i in range(1000):
        bar.set_postfix(loss=f"{1 / (i + 1):.4f}")
        bar.update(1)
    bar.close()
    lines.finish()
    printed = out.getvalue().splitlines()
    assert len(printed) == 2 and "\r" not in out.getvalue(), printed
    assert printed[0].startswith("sft:") and "1000/1000" in printed[1], printed
