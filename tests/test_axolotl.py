"""ds_longseq's axolotl plugin (``ds_longseq.integrations.axolotl.LongSeqPlugin``) inside axolotl, on CPU, float32.

Every run trains docs/AXOLOTL.md's YAML (its DeepSpeed JSON too) with the keys that name the model, the data and the
sizes replaced (``doc_overrides``) for a tiny Llama made here (4 heads on 2 kv heads, a tokenizer trained on the
data) and 32 alpaca rows of 33-48 tokens whose responses (the trained tokens) have 1-11 words, packed by axolotl's
sample packing into rows of 128 tokens, 2 rows per micro-batch, 2 micro-batches per step, 3 steps, plain SGD (the
parameters after a step are linear in the gradient: Adam's first steps are sign-like and its update hides a
gradient's scale). Each run is a process of its own (``tests/axolotl_run.py``; two under torchrun), as axolotl keeps
one plugin manager per process. Compared, to 1e-5 relative (float32 rounding of a loss near 6 and of the gradient
norms over a different order of sums; a wrong normalisation is a factor, a dropped token ~1e-2):

- the YAML as written (StreamBP, the chunked head, ZeRO-2) against the same YAML without the plugin;
- sequence parallelism over 2 ranks against 1 (each rank holds a half of every row, with a different number of
  trained tokens);
- LoRA (axolotl's ``adapter: lora``, the adapter loaded from a directory made here, so both runs start from the same
  weights: axolotl draws a new adapter from an unseeded generator), without DeepSpeed (the Trainer handed the block).

And each refusal, through axolotl's own config loading, in its one line (their words: tests/test_axolotl_config.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("axolotl", reason="axolotl is not installed (the floor run, .ci/floor, installs axolotl 0.19.0)")

import yaml  # noqa: E402

from tests.dist_utils import free_port, run_job  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "AXOLOTL.md"
PLUGIN = "ds_longseq.integrations.axolotl.LongSeqPlugin"
RECORDER = "tests.axolotl_run.Recorder"
RTOL = 1e-5

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n{output}")


def doc_config() -> tuple[dict, dict]:
    """(the YAML, the DeepSpeed JSON) of docs/AXOLOTL.md: its first ```yaml and ```json blocks."""
    text = DOC.read_text()
    block = {lang: re.search(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M).group(1) for lang in ("yaml", "json")}
    return yaml.safe_load(block["yaml"]), json.loads(block["json"])


def doc_overrides(tiny: Path) -> dict:
    """The doc YAML's keys that name the model, the data and the sizes, as the tiny runs set them."""
    return {
        "base_model": str(tiny / "model"),
        "special_tokens": {"pad_token": "<pad>"},
        "datasets": [{"path": str(tiny / "data.jsonl"), "ds_type": "json", "type": "alpaca"}],
        "dataset_prepared_path": str(tiny / "prepared"),
        "sequence_len": 128,  # rows of 33-48 tokens, packed 2-3 to a row
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "optimizer": "sgd",
        "learning_rate": 0.1,
        "lr_scheduler": "constant",
        "bf16": False,  # float32 on CPU
        "deepspeed": str(tiny / "zero2.json"),  # the doc's JSON block, written there
    }


CHUNK_SIZES = {"streambp": 12, "lm_head": 16}
"""The doc block's chunk sizes for the tiny rows: 12 leaves an uneven last chunk of a 128-token row (and of a rank's 64
under sequence parallelism), 16 is less than the trained tokens of a micro-batch."""


def test_the_doc_yaml_has_the_keys_the_runs_replace():
    config, ds_config = doc_config()
    replaced = set(doc_overrides(Path("tiny")))
    assert replaced <= set(config), replaced - set(config)
    assert config["plugins"] == [PLUGIN]
    assert all("chunk_size" in config["long_seq"].get(section, {}) for section in CHUNK_SIZES)
    assert config["sample_packing"] is True and "zero_optimization" in ds_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama with a tokenizer trained on the data, 32 alpaca rows, a LoRA adapter, the doc's DeepSpeed JSON."""
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("axolotl")
    rows = [{"instruction": f"Count {i}", "input": "",
             "output": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + (7 * i) % 11))} for i in range(32)]
    with open(root / "data.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEMPLATE.format(**row) for row in rows] * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(root / "model")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id))
    model.save_pretrained(root / "model")
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # B = 0 at init would leave A's gradient 0
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    lora.save_pretrained(root / "adapter")
    (root / "zero2.json").write_text(json.dumps(doc_config()[1]))
    return root


def config(tiny: Path, name: str, *, plugin: bool = True, long_seq: dict | None = None, **changes) -> Path:
    """docs/AXOLOTL.md's YAML for the tiny model (``doc_overrides``, the block's chunk sizes scaled), the Recorder
    listed, without the plugin and its block if ``plugin`` is False; ``long_seq`` merged into the block, ``changes``
    set (None deletes a key). Written to ``tiny/<name>.yml``."""
    cfg, _ = doc_config()
    cfg.update(doc_overrides(tiny), output_dir=str(tiny / f"out_{name}"), tokenizer_type="PreTrainedTokenizerFast",
               # the packed rows in file order on any number of ranks: on 2 accelerate draws the packing sampler's
               # shuffle from another generator than on 1, which would give the two runs different batches
               curriculum_sampling=True,
               dataset_num_proc=1)  # no pools of worker processes on a small machine
    for section, size in CHUNK_SIZES.items():
        cfg["long_seq"][section]["chunk_size"] = size
    cfg["long_seq"].update(long_seq or {})
    cfg["plugins"] = ([PLUGIN] if plugin else []) + [RECORDER]
    if not plugin:
        del cfg["long_seq"]
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path = tiny / f"{name}.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _env(**extra) -> dict:
    return dict(os.environ, AXOLOTL_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), **extra)


def train(tiny: Path, path: Path, ranks: int = 1) -> list[dict]:
    """``tests/axolotl_run.py train`` on ``ranks`` processes; each rank's record."""
    result = tiny / f"{path.stem}.json"
    script = [str(ROOT / "tests" / "axolotl_run.py"), "train", str(path), str(result)]
    if ranks == 1:
        cmd, env = [sys.executable, *script], _env(MASTER_PORT=str(free_port()))
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               f"--master-port={free_port()}", *script]
        env = _env()
    proc = run_job(cmd, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    files = [result] if ranks == 1 else [Path(f"{result}.rank{r}") for r in range(ranks)]
    return [json.loads(f.read_text()) for f in files]


def assert_same_training(run: dict, reference: dict) -> None:
    assert run["seen"] == reference["seen"]  # the same micro-batches, in the same order
    assert len(run["losses"]) == len(reference["losses"]) == 3
    assert run["losses"] == pytest.approx(reference["losses"], rel=RTOL)
    assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=RTOL)


@pytest.fixture(scope="module")
def doc_runs(tiny) -> dict[str, dict]:
    """The doc YAML with and without the plugin (ZeRO-2, one rank)."""
    return {"plain": train(tiny, config(tiny, "plain", plugin=False))[0],
            "plugin": train(tiny, config(tiny, "plugin"))[0]}


def test_the_doc_yaml_trains_as_plain_axolotl(doc_runs):
    plain, ours = doc_runs["plain"], doc_runs["plugin"]
    assert (plain["trainer"], plain["enabled"]) == ("AxolotlTrainer", False)
    assert ours["trainer"] != "AxolotlTrainer" and ours["enabled"]  # ds_longseq's trainer class served the model
    assert plain["engine"] == ours["engine"] == "DeepSpeedEngine"
    # axolotl's packed rows, as ds_longseq reads them: restarting position ids, no attention mask
    first = ours["seen"][0]
    assert not first["attention_mask"] and all(row.count(0) >= 2 for row in first["position_ids"])
    assert_same_training(ours, plain)


def test_sequence_parallelism_over_two_ranks_equals_one(tiny, doc_runs):
    # warmup_steps set: axolotl's default warmup is sized from its step count, refused under SP (test_axolotl_config)
    ranks = train(tiny, config(tiny, "sp2", long_seq={"sequence_parallel": {"size": 2}}, warmup_steps=0), ranks=2)
    for run in ranks:  # the group read the same batches as the one rank, each cut in two across it
        assert run["enabled"] and run["engine"] == "DeepSpeedEngine"
        assert_same_training(run, doc_runs["plugin"])
    # each rank held half of every row: their trained tokens differ (a rank may hold none of a row's)
    halves = [[sum(t != -100 for t in row[half * 64:(half + 1) * 64]) for half in (0, 1)]
              for batch in ranks[0]["seen"] for row in batch["labels"]]
    assert any(a != b for a, b in halves), halves


def test_lora_equals_plain_axolotl(tiny):
    lora = {"adapter": "lora", "lora_model_dir": str(tiny / "adapter"), "lora_r": 4, "lora_alpha": 8,
            "lora_dropout": 0.0, "lora_target_linear": True,
            # axolotl's fused LoRA kernels are CUDA-only (Triton)
            "lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False}
    plain = train(tiny, config(tiny, "lora_plain", plugin=False, deepspeed=None, **lora))[0]
    ours = train(tiny, config(tiny, "lora_plugin", deepspeed=None, **lora))[0]
    assert ours["enabled"] and not plain["enabled"] and plain["engine"] == ours["engine"] == "PeftModel"
    assert_same_training(ours, plain)


def test_each_refusal_in_one_line(tiny):
    """Through axolotl's ``load_cfg`` (the plugin's ``register``: before validation, so before any data or model) and
    the plugin's ``pre_model_load`` on the validated config: the error and its one line, as the plugin words it."""
    from ds_longseq.integrations.axolotl_config import AxolotlConfigError, axolotl_problems
    from ds_longseq.resolver import Launch, RunCannotStart, resolve

    differing = tiny / "zero2_long_seq.json"
    differing.write_text(json.dumps({**doc_config()[1], "long_seq": {"streambp": {"enabled": True}}}))
    bad = {"streambp": {"enabled": True, "chunk": 12}}
    cases = {  # name: (the config, the error it gets)
        "context_parallel": (config(tiny, "refuse_cp", deepspeed=None, context_parallel_size=2), None),
        "tiled_mlp": (config(tiny, "refuse_tiled", deepspeed=None, tiled_mlp=True), None),
        "checkpointing": (config(tiny, "refuse_ckpt", deepspeed=None, gradient_checkpointing=True), None),
        # found on the validated config (pre_model_load): no attn_implementation keeps axolotl's mask
        "packing_mask": (config(tiny, "refuse_mask", deepspeed=None, attn_implementation=None), None),
        "sp_without_max_steps": (config(tiny, "refuse_steps", long_seq={"sequence_parallel": {"size": 2}},
                                        max_steps=None, warmup_steps=0), None),
        "sp_warmup_ratio": (config(tiny, "refuse_warmup", long_seq={"sequence_parallel": {"size": 2}},
                                   warmup_ratio=0.1), None),
        "both_places": (config(tiny, "refuse_both", deepspeed=str(differing)), None),
        "resolver": (config(tiny, "refuse_bad", deepspeed=None, long_seq=bad), None),
    }
    result = tiny / "refusals.json"
    proc = run_job([sys.executable, str(ROOT / "tests" / "axolotl_run.py"), "check", str(result),
                    *(str(path) for path, _ in cases.values())], timeout=600, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    outcomes = dict(zip(cases, json.loads(result.read_text()), strict=True))

    def line_of(name: str, cfg: dict) -> str:
        from ds_longseq.config import LongSeqConfig

        block = yaml.safe_load(cases[name][0].read_text())["long_seq"]
        (line,) = axolotl_problems(cfg, LongSeqConfig.from_dict(block), cfg.get("world"))
        return line

    expected = {
        "context_parallel": line_of("context_parallel", {"context_parallel_size": 2}),
        "tiled_mlp": line_of("tiled_mlp", {"tiled_mlp": True}),
        "checkpointing": line_of("checkpointing", {"gradient_checkpointing": True}),
        "packing_mask": line_of("packing_mask", {"sample_packing": True, "attn_decontaminates_packing": False}),
        "sp_without_max_steps": line_of("sp_without_max_steps", {"warmup_steps": 0}),
        "sp_warmup_ratio": line_of("sp_warmup_ratio", {"max_steps": 3, "warmup_ratio": 0.1}),
        "both_places": (f"long_seq is in the YAML and in the DeepSpeed config {str(differing)!r} with different "
                        "settings: keep the YAML block (the one source) and remove the DeepSpeed config's long_seq "
                        "section"),
    }
    for name, line in expected.items():
        assert outcomes[name] == {"type": "AxolotlConfigError", "message": str(AxolotlConfigError([line]))}, name
    # the block's own problems: the resolver's error, as every entry point raises it
    with pytest.raises(RunCannotStart) as theirs:
        resolve({"long_seq": {**yaml.safe_load(cases["resolver"][0].read_text())["long_seq"]}},
                launch=Launch(deepspeed=False))
    assert outcomes["resolver"] == {"type": "RunCannotStart", "message": str(theirs.value)}


def test_the_plugins_hooks():
    """In this process: the hooks act on a config that lists the plugin only (axolotl keeps one plugin manager per
    process and calls every registered plugin for every config); the trainer class; a foreign trainer refused."""
    from axolotl.core.trainers import AxolotlTrainer

    from ds_longseq.integrations.axolotl import LongSeqPlugin
    from ds_longseq.integrations.axolotl_config import AxolotlConfigError, LongSeqArgs
    from ds_longseq.trainer import LongSeqTrainerMixin, with_long_seq

    plugin = LongSeqPlugin()
    module, name = plugin.get_input_args().rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name) is LongSeqArgs
    block = {"streambp": {"enabled": True, "chunk_size": 12}}
    plugin.register({"plugins": ["some.OtherPlugin"], "long_seq": block})
    assert plugin.get_trainer_cls({}) is None
    plugin.post_trainer_create({}, object())  # not this config's plugin: nothing checked
    plugin.register({"plugins": [PLUGIN], "long_seq": block})
    cls = plugin.get_trainer_cls({})
    assert issubclass(cls, with_long_seq(AxolotlTrainer)) and issubclass(cls, LongSeqTrainerMixin)
    assert cls is not with_long_seq(AxolotlTrainer)  # handed the block (axolotl passes only its own arguments)
    # the DeepSpeed config carries the section: the wrapped class itself, which reads it there
    plugin.register({"plugins": [PLUGIN], "deepspeed": {"zero_optimization": {"stage": 2}, "long_seq": block}})
    assert plugin.get_trainer_cls({}) is with_long_seq(AxolotlTrainer)
    plugin.register({"plugins": ["ds_longseq.integrations.LongSeqPlugin"], "long_seq": block})  # the package's name
    assert plugin.get_trainer_cls({}) is not None
    with pytest.raises(AxolotlConfigError, match="axolotl built a object, not ds_longseq's trainer"):
        plugin.post_trainer_create({}, object())
