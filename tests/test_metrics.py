"""What a run reports each optimizer step (``toolkit.MetricsLog``): examples/sft.py on 2 CPU ranks writes the loss,
learning rate, gradient norm, tokens/s, MFU and memory to metrics.jsonl and, with the DeepSpeed config's
``tensorboard`` and ``csv_monitor`` sections, to TensorBoard event files and CSV files."""

import csv
import json
import os

import pytest
import torch

from ds_longseq.toolkit import tiny_llama
from ds_longseq.toolkit.metrics import PEAK_FLOPS_ENV, BackwardProgress, training_flops_per_token
from tests.test_sft import _config, run_sft

STEPS = 4
KEYS = ("step", "loss", "lr", "grad_norm", "step_s", "tokens/s", "mfu", "gpu_peak_gib", "host_rss_gib", "host_peak_gib")


def _expected_learning_rates(config: dict) -> list[float]:
    """DeepSpeed's own WarmupLR (the config's scheduler), stepped as the engine steps it: the rate of each step."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = WarmupLR(optimizer, **config["scheduler"]["params"])
    rates = []
    for _ in range(STEPS):
        rates.append(scheduler.get_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def test_every_step_reports_its_metrics_to_the_jsonl_tensorboard_and_csv(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    path = _config(tmp_path)
    config = json.loads(open(path).read())
    config["tensorboard"] = {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "sft"}
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "sft"}
    (tmp_path / "monitored.json").write_text(json.dumps(config))
    monkeypatch.setenv(PEAK_FLOPS_ENV, "0.001")  # 1 GFLOP/s per rank: the CPU has no known peak, MFU needs one
    out = tmp_path / "out"
    run_sft(str(tmp_path / "monitored.json"), out, "--max-steps", str(STEPS), "--lr", "1e-3")
    config["scheduler"]["params"]["warmup_max_lr"] = 1e-3  # what --lr sets
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert set(row) == set(KEYS), row
        assert row["grad_norm"] > 0 and row["step_s"] > 0 and row["tokens/s"] > 0
        assert row["gpu_peak_gib"] is None  # no GPU
        assert 0 < row["host_rss_gib"] <= row["host_peak_gib"]
        # MFU = step tokens x model FLOPs per token / (step time x 2 ranks x peak): the formula, back out of the row
        flops_per_token = row["mfu"] * 2 * 1e9 / row["tokens/s"]
        assert flops_per_token == pytest.approx(training_flops_per_token(tiny_llama(256, seed=0), 256), rel=1e-9)
    assert [r["lr"] for r in rows] == pytest.approx(_expected_learning_rates(config), rel=1e-12, abs=1e-15)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "sft"))
    events.Reload()
    for key in ("loss", "lr", "grad_norm", "tokens/s", "mfu", "host_peak_gib"):
        scalars = events.Scalars(f"Train/ds_longseq/{key}")
        assert [s.step for s in scalars] == list(range(1, STEPS + 1)), key
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in rows], rel=1e-6), key
    with open(tmp_path / "csv" / "sft" / "Train_ds_longseq_loss.csv") as f:
        table = list(csv.reader(f))
    assert [float(v) for _, v in table[1:]] == pytest.approx([r["loss"] for r in rows], rel=1e-9)


def test_flops_per_token_counts_lora_and_tied_heads():
    """Full training: 6 per weight that multiplies (the input embedding is a lookup); LoRA: 4 per frozen weight and 6
    per adapter weight; attention: 6 x layers x heads x head_dim x seq_len."""
    model = tiny_llama(256, seed=0)
    cfg = model.config
    embedding = model.get_input_embeddings().weight.numel()
    weights = sum(p.numel() for p in model.parameters()) - embedding
    attention = 6 * cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * 256
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert training_flops_per_token(model, 256) == 6 * weights + attention
    from ds_longseq.toolkit import add_lora

    lora = add_lora(tiny_llama(256, seed=0), 4)
    adapter = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert training_flops_per_token(lora, 256) == 4 * (weights + adapter) + 2 * adapter + attention


def test_backward_progress_names_each_layer_as_the_backward_reaches_it():
    model = tiny_llama(64, seed=0)

    class Bar:
        desc, shown = "sft", []

        def set_description_str(self, text):
            self.shown.append(text)

    bar = Bar()
    progress = BackwardProgress(model, bar, bar_every_s=0.0)
    progress.start_step(6)
    ids = torch.randint(0, 100, (1, 64))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    progress.remove()
    assert bar.shown == ["sft [step 7 backward layer 2/2]", "sft [step 7 backward layer 1/2]"]
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # removed: nothing more
    assert len(bar.shown) == 2


def test_a_monitor_section_deepspeed_would_reject_is_named_before_the_model(tmp_path, monkeypatch):
    """Bad monitor sections stop in start_distributed's resolve (before the weights), naming the field."""
    from ds_longseq.resolver import Launch, RunCannotStart, resolve

    def check_monitor_config(config):  # the monitor start rule, as start_distributed runs it (DeepSpeed launched)
        return resolve(config, launch=Launch(deepspeed=True))

    check_monitor_config({"train_micro_batch_size_per_gpu": 1})  # no monitor: nothing to check
    check_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path / "new" / "csv")}})
    with pytest.raises(RunCannotStart, match="(?s)monitor section is invalid.*output_pth"):
        check_monitor_config({"tensorboard": {"enabled": True, "output_pth": "x"}})
    with pytest.raises(RunCannotStart, match="csv_monitor.enabled"):
        check_monitor_config({"csv_monitor": {"enabled": "yes please"}})
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if not os.access(locked, os.W_OK):  # root writes anywhere: the check cannot be exercised then
        with pytest.raises(RunCannotStart, match="cannot be written"):
            check_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(locked / "csv")}})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RunCannotStart, match="wandb package is not installed"):
        check_monitor_config({"wandb": {"enabled": True}})
