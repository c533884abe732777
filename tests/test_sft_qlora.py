"""The training scripts' QLoRA (``--load-in-4bit`` beside ``--lora-rank``): a 4-bit base under a LoRA adapter.

examples/sft.py on the built-in model quantised to 4 bits: the start-up summary names the quantisation, the
checkpoints hold the adapter alone (no packed weight, no scale), --resume continues with the uninterrupted run's
losses, and the merged export is the trained 4-bit PEFT model's function on dequant(W4); the flags' refusals; the
4-bit weights kept out of bitsandbytes' CPU inference repacking; examples/trainer_sft.py with a 4-bit PEFT model.
The scripts' own wiring of the refusals (one line, exit status 2) is docs/BAD_INPUT.md's rows (tests/test_bad_input.py).
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ds_longseq.toolkit import FourBit, add_lora, build_model, check_args, copy_example, write_latest
from ds_longseq.toolkit.args import add_common_args
from tests.test_sft import ROOT, _config, losses, run_sft

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

# --lr 1e-2 as tests/test_sft_lora.py: WarmupLR starts at 0, and the adapter must move far enough in the few steps
# for a wrong export or a resume that drops it to change logits and losses visibly.
QLORA = ("--lora-rank", "4", "--lr", "1e-2", "--load-in-4bit")
SEQ_LEN = 256


def _script_env() -> dict:
    """A plain ``python examples/<script>`` (no launcher: one process, its own free port) importing this checkout."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_one_process(script: str, *flags: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=_script_env())
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def _sft(config, save_dir, *extra, expect_ok=True):
    return run_one_process("sft.py", "--ds_config", config, "--seq-len", str(SEQ_LEN), "--save-dir", str(save_dir),
                           *QLORA, *extra, expect_ok=expect_ok)


def _base_4bit(quant_type="nf4"):
    """sft.py's built-in model at --seq-len 256 --seed 0, loaded back quantised as --load-in-4bit loads it."""
    return build_model(None, torch.float32, seq_len=SEQ_LEN, seed=0, four_bit=FourBit(quant_type))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _args(**given):
    """The namespace of the shared flags as the scripts parse them, with ``given`` (dest=value) on top."""
    p = argparse.ArgumentParser()
    add_common_args(p, save_dir="unused", max_steps=4, seq_len=SEQ_LEN, lr=1e-3)
    return argparse.Namespace(**{**vars(p.parse_args([])), "data": None, "save_dir": None, **given})


def test_qlora_run_saves_the_adapter_alone_resumes_exactly_and_merges_into_the_dequantized_base(tmp_path):
    config = _config(tmp_path)
    straight = tmp_path / "straight"
    proc = _sft(config, straight, "--max-steps", "4", "--save-every", "2", "--save-total-limit", "0", "--merge-lora")
    out = proc.stdout + proc.stderr
    assert "base: 4-bit (nf4, double quantisation) in 14 linear layers" in out, out[-3000:]
    assert "hf_adapter/, hf_model/)" in proc.stdout

    # The checkpoint: the adapter's weights alone (DeepSpeed's exclude_frozen_parameters drops the packed weights;
    # the scales bitsandbytes adds to state_dict are left out too), so its size is the adapter's.
    states = straight / "step4" / "mp_rank_00_model_states.pt"
    trained = torch.load(states, weights_only=False)["module"]
    initial = add_lora(_base_4bit(), 4)
    lora_keys = {k for k in initial.state_dict() if "lora_" in k}
    assert set(trained) == lora_keys and len(lora_keys) == 2 * 7 * 2  # A and B of the 7 projections, 2 layers
    adapter_bytes = sum(v.numel() * v.element_size() for v in trained.values())
    base_bytes = sum(v.numel() * v.element_size() for k, v in initial.state_dict().items() if "lora_" not in k)
    # 32 KiB: the pickle's own fields (DeepSpeed's shapes, the config); the base as stored is 0.45 MiB
    assert states.stat().st_size <= adapter_bytes + 32 * 1024 < base_bytes

    # The merged export against the trained 4-bit PEFT model (the user's QLoRA model): the adapter was trained on
    # dequant(W4), and the merge adds it to exactly those weights. float32: the same weights give the same logits up
    # to summation order and the one rounding of W + s B A.
    from transformers import AutoModelForCausalLM

    initial.load_state_dict(trained, strict=False)
    merged = AutoModelForCausalLM.from_pretrained(straight / "hf_model", dtype=torch.float32)
    assert type(merged).__name__ == "LlamaForCausalLM" and not hasattr(merged.config, "quantization_config")
    assert all(type(m) is not bnb.nn.Linear4bit for m in merged.modules())
    ids = copy_example(10_000, SEQ_LEN, seed=0)["input_ids"][None]  # a sequence no training step saw
    ref = _logits(initial, ids)
    scale = ref.abs().max()
    assert (ref - _logits(_base_4bit(), ids)).abs().max() > 1e-3 * scale  # the adapter moved: the checks can fail
    assert (_logits(merged, ids) - ref).abs().max() <= 1e-5 * scale
    # PEFT's own load of hf_adapter/ onto a fresh 4-bit base: the trained model again
    loaded = peft.PeftModel.from_pretrained(_base_4bit(), straight / "hf_adapter")
    assert (_logits(loaded, ids) - ref).abs().max() <= 1e-6 * scale

    # --resume from step 2, as if the run had died after it: the base rebuilt and quantised again, the adapter and
    # its optimizer state loaded; steps 3-4 repeat the uninterrupted run's losses.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step4", "hf_*"))
    write_latest(str(resumed), "step2")
    proc = _sft(config, resumed, "--max-steps", "4", "--resume")
    assert "summary: 2 steps on 1 rank(s)" in proc.stdout
    a, b = losses(straight), losses(resumed)
    assert len(a) == len(b) == 4 and all(math.isfinite(x) for x in a)
    for x, y in zip(a, b, strict=True):  # same data, weights, optimizer state: float32 CPU runs repeat
        assert abs(x - y) <= 1e-6 * abs(x), (a, b)


def test_4bit_flags_parse_and_bad_ones_are_refused(tmp_path, monkeypatch):
    assert _args().load_in_4bit is None
    p = argparse.ArgumentParser()
    add_common_args(p, save_dir="unused", max_steps=4, seq_len=SEQ_LEN, lr=1e-3)
    assert FourBit.from_args(p.parse_args(["--load-in-4bit"])) == FourBit("nf4", double_quant=True)  # bare: nf4
    assert FourBit.from_args(p.parse_args(["--load-in-4bit", "fp4", "--no-double-quant"])) == FourBit("fp4", False)
    assert FourBit.from_args(p.parse_args([])) is None
    config = FourBit("fp4", False).config(torch.bfloat16)
    assert (config.load_in_4bit, config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == (True, "fp4", False)
    # the compute dtype and the packed weights' storage are the run's dtype (ZeRO-3 partitions them with the rest)
    assert config.bnb_4bit_compute_dtype == config.bnb_4bit_quant_storage == torch.bfloat16

    with pytest.raises(SystemExit, match=r"^--load-in-4bit needs --lora-rank: a 4-bit base is frozen and only a LoRA "
                                         r"adapter trains \(QLoRA\); add --lora-rank N \(N > 0\), or leave out "
                                         r"--load-in-4bit$"):
        check_args(_args(load_in_4bit="nf4"))
    with pytest.raises(SystemExit, match=r"^--no-double-quant given without --load-in-4bit: add --load-in-4bit, or "
                                         r"leave out --no-double-quant$"):
        check_args(_args(lora_rank=4, no_double_quant=True))
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"")
    pytest.importorskip("gguf")
    with pytest.raises(SystemExit, match=r"^--load-in-4bit with a GGUF --model \(.*model\.Q4_1\.gguf\): transformers "
                                         r"dequantizes GGUF on load and takes no second quantisation; pass the "
                                         r"model's Hugging Face directory"):
        check_args(_args(lora_rank=4, load_in_4bit="nf4", model=str(gguf)))
    check_args(_args(lora_rank=4, load_in_4bit="fp4", no_double_quant=True))  # accepted
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    with pytest.raises(SystemExit, match=r"^--load-in-4bit needs bitsandbytes, which is not installed: pip install "
                                         r"'ds_longseq\[qlora\]'"):
        check_args(_args(lora_rank=4, load_in_4bit="nf4"))


def test_4bit_weights_stay_unpacked_through_no_grad_forwards_in_eval_mode():
    """The 4-bit base as the scripts load it keeps its packed weights and scales through an eval, no-grad forward
    (bitsandbytes' CPU inference repacking would round the scales to bfloat16 in place), so repeated forwards agree
    and a training forward afterwards computes with dequant(W4)."""
    from ds_longseq.compat import keep_4bit_weights_unpacked

    model = _base_4bit("fp4")
    assert not model.training  # from_pretrained's eval mode: the case bitsandbytes repacks in
    layer = model.model.layers[0].self_attn.q_proj
    assert type(layer) is bnb.nn.Linear4bit
    def packed():  # the bytes (the float32 view of 4-bit codes holds NaN patterns, unequal to themselves)
        return layer.weight.data.view(torch.uint8).clone(), layer.weight.quant_state.absmax.clone()

    before = packed()
    ids = copy_example(3, 64, seed=0)["input_ids"][None]
    first, second = _logits(model, ids), _logits(model, ids)
    assert all(torch.equal(x, y) for x, y in zip(packed(), before, strict=True))
    assert torch.equal(first, second)
    assert keep_4bit_weights_unpacked(model) == 14  # idempotent: every linear of both layers
    assert keep_4bit_weights_unpacked(torch.nn.Linear(2, 2)) == 0

    if not bnb.functional.has_avx512bf16():
        pytest.skip("the control needs a CPU with avx512_bf16, where bitsandbytes repacks")
    # The control: the flag left as bitsandbytes sets it, the same forward repacks the weight (and the function then
    # refuses the model: its scales are rounded already).
    layer.support_avx512bf16_for_cpu = True
    _logits(model, ids)
    assert layer.weight.quant_state.packing_format_for_cpu and layer.weight.dtype == torch.uint8  # was float32
    with pytest.raises(ValueError, match=r"q_proj: its 4-bit weight was already repacked for CPU inference"):
        keep_4bit_weights_unpacked(model)


def test_trainer_example_trains_a_4bit_peft_model(tmp_path):
    """examples/trainer_sft.py --lora-rank --load-in-4bit: the Hugging Face Trainer on the 4-bit PEFT model, one
    process; the exported adapter loads onto a fresh 4-bit base."""
    out = tmp_path / "trainer"
    proc = run_one_process("trainer_sft.py", "--ds_config", _config(tmp_path, name="trainer_zero2_streambp.json"),
                           "--output-dir", str(out), "--max-steps", "3", "--lora-rank", "4", "--load-in-4bit")
    assert "summary: LongSeqTrainer, 3 steps on 1 rank(s)" in proc.stdout and "(hf_adapter/," in proc.stdout
    with open(out / "trainer_state.json") as f:
        logged = [h["loss"] for h in json.load(f)["log_history"] if "loss" in h]
    assert logged and all(math.isfinite(x) and x > 0 for x in logged)
    loaded = peft.PeftModel.from_pretrained(_base_4bit(), out / "hf_adapter")
    assert torch.isfinite(_logits(loaded, copy_example(0, 64, seed=0)["input_ids"][None])).all()


@pytest.mark.slow  # CI time: the default run keeps the one-process run, resume and merge above
def test_zero3_two_ranks_qlora_resume_repeats_the_losses(tmp_path):
    """Two CPU ranks through the launcher, ZeRO-3 partitioning every parameter (the packed 4-bit weights, stored in
    the compute dtype, included), --lora-dropout 0.1: a resume from step 3 repeats steps 4-5."""
    config = _config(tmp_path, stage=3, partition_all=True)
    flags = (*QLORA, "--lora-dropout", "0.1")
    straight = tmp_path / "straight"
    proc = run_sft(config, straight, "--max-steps", "5", "--save-every", "3", *flags)
    assert "base: 4-bit (nf4, double quantisation)" in proc.stdout + proc.stderr
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("step5", "hf_*"))
    write_latest(str(resumed), "step3")
    run_sft(config, resumed, "--max-steps", "5", *flags, "--resume")
    a, b = losses(straight), losses(resumed)
    assert len(a) == len(b) == 5
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-6 * abs(x), (a, b)


@pytest.mark.slow  # CI time: the default run keeps sft.py's run; these share its setup_run and export
@pytest.mark.parametrize("script", ["dpo.py", "grpo.py"])
def test_dpo_and_grpo_train_on_a_4bit_base(tmp_path, script):
    """dpo.py's reference (the policy with its adapters disabled) and grpo.py's old-policy log-probs run no-grad
    forwards of the 4-bit model between training steps: the runs train, and merge into the dequantized base."""
    out = tmp_path / script
    proc = run_one_process(script, "--ds_config", _config(tmp_path), "--seq-len", "64", "--save-dir", str(out),
                           "--max-steps", "3", *QLORA, "fp4", "--merge-lora")
    assert "base: 4-bit (fp4, double quantisation) in 14 linear layers" in proc.stdout + proc.stderr
    assert "hf_adapter/, hf_model/)" in proc.stdout
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
