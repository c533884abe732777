"""ds_configs/*.json and the engine's pre-training checks."""

import glob
import json
import logging
import os

import pytest

from ds_longseq import LongSeqConfigError
from ds_longseq.engine import MIN_DEEPSPEED_VERSION, check_sequence_length, split_config
from ds_longseq.engine.initialize import _version_tuple

CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "ds_configs", "*.json")))


def test_the_promised_config_files_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"zero2_streambp.json", "zero3_streambp.json", "zero3_offload_streambp.json", "zero2_mst.json"} <= names


def filled_by_the_trainer(ds_config: dict, output_dir: str) -> dict:
    """A Hugging Face Trainer config (ds_configs/trainer_*.json) with its "auto" values filled the way
    transformers' own code fills them from TrainingArguments(bf16=True), which must accept the rest."""
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    try:
        hf = HfTrainerDeepSpeedConfig(ds_config)
        hf.trainer_config_process(TrainingArguments(output_dir=output_dir, bf16=True, use_cpu=True, report_to="none"))
        return hf.config
    finally:
        unset_hf_deepspeed_config()


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_config_file_loads_and_validates(path, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    ds_config, long_seq = split_config(path)
    assert "long_seq" not in ds_config and long_seq.any_enabled
    if os.path.basename(path).startswith("trainer_"):
        ds_config = filled_by_the_trainer(ds_config, str(tmp_path))
        assert "auto" not in json.dumps(ds_config)
    parsed = DeepSpeedConfig(ds_config)  # DeepSpeed's own validation (extra keys are errors there)
    assert parsed.zero_optimization_stage == json.load(open(path))["zero_optimization"]["stage"]
    assert ds_config["bf16"]["enabled"] is True  # GPU default; examples/sft.py switches CPU runs to fp32


def test_gpu_presets_carry_the_gpu_tiles_and_cpu_presets_get_a_hint_on_cuda():
    """The GPU presets use the whole-prefix tile (the GPU measurements' best) and StreamBP chunks chosen within a
    budget ("auto", 10 GiB: issue 61 item 3), and draw no hint on CUDA; every CPU preset with StreamBP draws one
    there, and nothing is said on CPU."""
    from ds_longseq.toolkit.distributed import cpu_tuned_config_hint

    gpu = [p for p in CONFIGS if os.path.basename(p).startswith(("gpu", "multinode"))]
    assert len(gpu) == 3
    for path in CONFIGS:
        _, long_seq = split_config(path)
        hint = cpu_tuned_config_hint(long_seq, on_cuda=True)
        if path in gpu:
            assert long_seq.streambp.chunk_size == "auto" and long_seq.streambp.auto_budget_gib == 10, path
            assert long_seq.attention.kv_block_size is None, path
            assert hint is None, path
        elif long_seq.streambp.enabled:
            assert hint is not None and "ds_configs/gpu*.json" in hint, path
        assert cpu_tuned_config_hint(long_seq, on_cuda=False) is None
    readme = open(os.path.join(os.path.dirname(CONFIGS[0]), "README.md")).read()
    assert all(f"`{os.path.basename(p)}`" in readme for p in CONFIGS)  # every file is described


def test_split_config_reports_long_seq_and_zero_stage_problems_together():
    with pytest.raises(LongSeqConfigError) as info:
        split_config({"zero_optimization": {"stage": 4}, "long_seq": {"streambp": {"enabeld": True}}})
    assert len(info.value.problems) == 2
    assert "zero_optimization.stage=4" in str(info.value) and "'enabeld'" in str(info.value)


def test_split_config_does_not_modify_its_input():
    config = {"train_micro_batch_size_per_gpu": 1, "long_seq": {"lm_head": {"enabled": True}}}
    split_config(config)
    assert "long_seq" in config


def test_chunk_sizes_larger_than_the_sequence_warn_once_instead_of_failing(caplog):
    """A chunk longer than the sequence is one chunk (docs/SUPPORT.md: "shorter than a chunk" is supported):
    the shipped configs (chunk_size 1024) must run --seq-len 512, with a warning, not an error."""
    _, long_seq = split_config({"long_seq": {"streambp": {"enabled": True, "chunk_size": 4096}}})
    caplog.set_level(logging.WARNING, logger="ds_longseq")
    check_sequence_length(long_seq, 4096)
    assert not caplog.records
    check_sequence_length(long_seq, 1000)
    check_sequence_length(long_seq, 1000)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "chunk_size=4096 exceeds the sequence length 1000" in warned[0], warned
    # ops.tokenwise_chunks skips empty chunks, so more MLP chunks than tokens is legal too.
    _, mst = split_config({"long_seq": {"mini_seq": {"enabled": True, "mlp_num_chunks": 8}}})
    check_sequence_length(mst, 5)
    assert "mlp_num_chunks=8 exceeds the sequence length 5" in caplog.records[-1].getMessage()
    for bad in (0, -3):
        with pytest.raises(LongSeqConfigError, match=f"sequence length must be positive, got {bad}"):
            check_sequence_length(long_seq, bad)


def test_version_parsing():
    assert _version_tuple("0.19.8+cpu") == (0, 19, 8) and _version_tuple("1.0.0rc1") == (1, 0, 0)
    assert _version_tuple(MIN_DEEPSPEED_VERSION) <= _version_tuple(__import__("deepspeed").__version__)


def test_old_deepspeed_is_refused_with_the_install_command(monkeypatch):
    import deepspeed

    from ds_longseq.engine import initialize

    monkeypatch.setattr(deepspeed, "__version__", "0.16.4")
    with pytest.raises(RuntimeError, match=r"DeepSpeed 0.16.4 is older than .*pip install 'deepspeed>="):
        initialize(model=object(), config={"train_micro_batch_size_per_gpu": 1})


def test_initialize_rejects_a_model_enabled_with_other_settings():
    import ds_longseq
    from ds_longseq.engine import initialize
    from tests.helpers import make_model

    model = ds_longseq.enable(make_model("llama"), {"lm_head": {"enabled": True}})
    with pytest.raises(ValueError, match="different long_seq config"):
        initialize(model=model, config={"long_seq": {"lm_head": {"enabled": True, "chunk_size": 8}}})
