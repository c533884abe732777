"""examples/sft.py --lora-rank: only the adapter trains; it is exported in PEFT's format (gathered under
ZeRO-3), reproduces the trained model when loaded onto a fresh base, merges, and survives a resume."""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ds_longseq.toolkit import add_lora, check_args, copy_example, tiny_llama, write_latest
from tests.test_sft import ROOT, _config, losses, run_sft

peft = pytest.importorskip("peft")

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# 1e-2 rather than the built-in 3e-3: WarmupLR starts at 0, and the adapter must move far enough in
# 3 effective steps for a wrong export or a resume that drops it to change logits and losses visibly.
LORA = ("--lora-rank", "4", "--lr", "1e-2")
DROPOUT = ("--lora-dropout", "0.1")  # PEFT's lora_dropout, replayed in StreamBP's chunk re-forwards


def _args(**lora):
    """The namespace of the shared flags, at sft.py's defaults, with the LoRA flags ``lora`` (lora_rank=...)."""
    defaults = dict(seq_len=256, max_steps=400, save_every=0, data=None, model=None, lora_rank=0, lora_alpha=None,
                    lora_dropout=None, lora_targets=None, merge_lora=False)
    return argparse.Namespace(**{**defaults, **lora})


def _base():
    """sft.py's built-in model at --seq-len 256 --seed 0, as it starts."""
    return tiny_llama(256, seed=0)


def _adapter_file(save_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(save_dir, "hf_adapter", "adapter_model.safetensors"))


def _as_saved(state):
    """PeftModel state-dict keys as PEFT's adapter file names them: without the adapter name."""
    return {k.replace(".default.", "."): v for k, v in state.items() if "lora_" in k}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def test_lora_run_trains_only_the_adapter_and_its_export_reproduces_the_model(tmp_path):
    out = tmp_path / "lora"
    proc = run_sft(_config(tmp_path), out, "--max-steps", "4", *LORA, "--merge-lora", num_ranks=1)
    assert len(losses(out)) == 4 and all(math.isfinite(x) for x in losses(out))
    assert "outputs:" in proc.stdout and "hf_adapter/, hf_model/)" in proc.stdout

    initial = add_lora(_base(), 4).state_dict()  # as sft.py starts
    # A LoRA checkpoint holds the adapter (and its optimizer state), not the frozen base: --resume rebuilds the base
    # from --model (the built-in model here) and loads the adapter onto it.
    trained = torch.load(out / "step4" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    lora_keys = [k for k in initial if "lora_" in k]
    assert set(trained) == set(lora_keys)
    assert len(lora_keys) == 2 * len(PROJECTIONS) * 2  # A and B of every projection of both layers
    for key in lora_keys:
        assert not torch.equal(trained[key], initial[key]), f"{key} did not train"
    num_lora = sum(trained[k].numel() for k in lora_keys)
    assert f"training {num_lora:,} of {sum(v.numel() for v in initial.values()):,} parameters" in (
        proc.stdout + proc.stderr
    )

    adapter_dir = out / "hf_adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == ("LORA", 4, 8, 0.0)
    assert sorted(config["target_modules"]) == sorted(PROJECTIONS)  # short names, and no lm_head
    saved, want = _adapter_file(out), _as_saved(trained)
    assert set(saved) == set(want) and all(torch.equal(saved[k], want[k]) for k in want)

    # The user's path: a fresh base built the same way + the adapter, against the trained weights.
    from transformers import AutoModelForCausalLM

    trained_model = add_lora(_base(), 4)
    trained_model.load_state_dict(trained, strict=False)
    loaded = peft.PeftModel.from_pretrained(_base(), adapter_dir)
    merged = AutoModelForCausalLM.from_pretrained(out / "hf_model")
    assert type(merged).__name__ == "LlamaForCausalLM" and not any("lora_" in n for n, _ in merged.named_parameters())
    ids = copy_example(10_000, 256, seed=0)["input_ids"][None]  # a sequence no training step saw
    ref = _logits(trained_model, ids)
    scale = ref.abs().max()
    # The adapter moves the logits by far more than the tolerance below, so the checks can fail.
    assert (ref - _logits(_base(), ids)).abs().max() > 1e-3 * scale
    # float32: the same weights give the same logits up to summation order (merged: W + s B A rounded once).
    assert (_logits(loaded, ids) - ref).abs().max() <= 1e-5 * scale
    assert (_logits(merged, ids) - ref).abs().max() <= 1e-5 * scale


@pytest.mark.slow  # CI time: the default run keeps the LoRA run, export and merge (ZeRO-2) and tests/test_dropout.py
def test_zero3_two_ranks_exports_the_gathered_adapter_and_resume_restores_it(tmp_path):
    """With --lora-dropout 0.1: the checkpoint carries each rank's generator state, so the resumed steps draw the
    uninterrupted run's masks (and without that state they do not)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # all of this model's LoRA weights are under ZeRO-3's persistence threshold: partitioned anyway, so that the
    # export has to gather them
    config = _config(tmp_path, stage=3, partition_all=True)
    straight = tmp_path / "straight"
    run_sft(config, straight, "--max-steps", "5", "--save-every", "3", *LORA, *DROPOUT)
    assert not (straight / "hf_model").exists()  # no --merge-lora: the base is unchanged, only the adapter
    # DeepSpeed's own consolidation of the 2 ranks' partitions of the last checkpoint.
    gathered = get_fp32_state_dict_from_zero_checkpoint(str(straight), tag="step5", exclude_frozen_parameters=True)
    saved, want = _adapter_file(straight), _as_saved(gathered)
    assert len(want) == 2 * len(PROJECTIONS) * 2 and set(saved) == set(want)
    for key, value in want.items():
        assert saved[key].shape == value.shape and value.abs().max() > 0, key
        assert torch.equal(saved[key], value), key

    # Resume from the step-3 checkpoint (as if the run had died after it): steps 4-5 are trained again
    # from the restored LoRA weights, optimizer state and step. Not step 2: WarmupLR's rate is 0 for
    # the first two steps, so the adapter first moves in step 3.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step5", "hf_adapter"))
    write_latest(str(resumed), "step3")
    proc = run_sft(config, resumed, "--max-steps", "5", *LORA, *DROPOUT, "--resume")
    assert "summary: 2 steps on 2 rank(s)" in proc.stdout
    assert (resumed / "latest").read_text() == "step5"
    a, b = losses(straight), losses(resumed)
    assert len(a) == len(b) == 5
    # Same data, weights and optimizer state: float32 CPU runs repeat up to reduction order.
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-6 * abs(x), (a, b)
    again = _adapter_file(resumed)
    for key, value in saved.items():
        assert (again[key] - value).norm() <= 1e-6 * value.norm(), key
    # The control: the same resume without the generator states draws other masks from step 4 on.
    forgetful = tmp_path / "forgetful"
    shutil.copytree(straight, forgetful, ignore=shutil.ignore_patterns("step5", "hf_adapter", "rng_state_rank*"))
    write_latest(str(forgetful), "step3")
    run_sft(config, forgetful, "--max-steps", "5", *LORA, *DROPOUT, "--resume")
    c = losses(forgetful)
    assert c[:3] == a[:3] and abs(c[3] - a[3]) > 1e-5 * abs(a[3]), (a, c)


def test_bad_lora_arguments_are_refused(monkeypatch):
    # The checks sft.py, dpo.py and grpo.py run before DeepSpeed starts.
    with pytest.raises(SystemExit, match=r"^--lora-rank must be >= 0 \(0: no LoRA\), got -2: pass e\.g\. --lora-rank"):
        check_args(_args(lora_rank=-2))
    with pytest.raises(SystemExit, match=(
        r"^--lora-alpha, --merge-lora given without --lora-rank \(no LoRA\): add --lora-rank N \(N > 0\), "
        r"or leave out --lora-alpha, --merge-lora$"
    )):
        check_args(_args(lora_alpha=16.0, merge_lora=True))
    with pytest.raises(SystemExit, match=r"^--lora-alpha given without --lora-rank"):
        check_args(_args(lora_alpha=0.0))  # 0 is a value given, not "unset"
    with pytest.raises(SystemExit, match=r"^--lora-alpha must be positive, got 0\.0$"):
        check_args(_args(lora_rank=4, lora_alpha=0.0))
    with pytest.raises(SystemExit, match=r"^--lora-targets 'q_proj,' has an empty name"):
        check_args(_args(lora_rank=4, lora_targets="q_proj,"))
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    with pytest.raises(ImportError, match=r"^--lora-rank needs peft, which is not installed: pip install 'peft>=0\.21"):
        check_args(_args(lora_rank=4))


def test_sft_refuses_bad_lora_flags_before_deepspeed_starts():
    """The script's own wiring: its flags reach the checks, which fail before DeepSpeed starts (a plain python
    run, no launcher: reaching the process-group start-up would fail with another error)."""
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "sft.py"), "--lora-rank", "-2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=pythonpath))
    assert proc.returncode != 0
    assert "--lora-rank must be >= 0 (0: no LoRA), got -2: pass e.g. --lora-rank 16" in proc.stderr, proc.stderr[-3000:]


def test_lora_targets_are_checked_against_the_model():
    with pytest.raises(SystemExit, match=(
        r"^--lora-targets: qkv matches no module of LlamaForCausalLM; its decoder layers' linear projections "
        r"are q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj$"
    )):
        add_lora(_base(), 4, targets="q_proj,qkv")
    with pytest.raises(SystemExit, match=r"^--lora-targets must not adapt the LM head \(lm_head\)"):
        add_lora(_base(), 4, targets="v_proj,lm_head")

    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32))  # layers at transformer.h
    with pytest.raises(SystemExit, match=r"^--lora-rank: GPT2LMHeadModel has no decoder layers at model\.layers"):
        add_lora(gpt2, 4)

    model = add_lora(_base(), 4, targets="q_proj, v_proj", alpha=2.0)
    adapted = {name for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {f"base_model.model.model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")}
    assert all(model.get_submodule(name).scaling["default"] == 0.5 for name in adapted)  # alpha / rank
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{name}.lora_{ab}.default.weight" for name in adapted for ab in "AB"
    }
