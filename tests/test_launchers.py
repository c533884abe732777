"""An unmodified user script under every launcher: deepspeed, torchrun, accelerate launch and launch/mpirun.sh.

``tests/scripts/user_trainer.py`` is a Trainer / TRL script written the ALST way (``parallelism_config`` with
``sp_backend="deepspeed", sp_size=2``), with ds_longseq's two changes (a ``long_seq`` section in its DeepSpeed
JSON, ``with_long_seq(...)``) and no process-group code. Each launcher starts it on 2 CPU ranks with
transformers' ``Trainer``, TRL's ``SFTTrainer`` or ``DPOTrainer``; the reference is the stock trainer in one
process (no DeepSpeed, no ds_longseq). Under ALST's data semantics each step trains one rank's batch, the ranks'
batches in turn, which is the one-process run's order of batches (accelerate's seeded sampler, each rank every
other batch), so the logged losses and the trained weights must equal the reference's (float32: chunked sums
and DeepSpeed's flat buffers round differently, ~1e-7 a step; 1e-5 after 4 SGD steps at lr 0.5). Rows have 9-23
tokens, so the ranks' batches differ in their numbers of valid tokens.

By default each launcher runs once and each trainer at least once; the other pairs are marked slow.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from tests.dist_utils import free_port, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "user_trainer.py")
LAUNCHERS = ("deepspeed", "torchrun", "accelerate", "mpirun")
TRAINERS = ("trainer", "sft", "dpo")
DEFAULT_PAIRS = {("accelerate", "trainer"), ("mpirun", "trainer")}  # the rest: -m slow (CI time; sft under the
# DeepSpeed launcher is what tests/test_sft.py runs throughout)
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2}, "steps_per_print": 10**6,
    "long_seq": {"streambp": {"enabled": True, "chunk_size": 4}, "lm_head": {"enabled": True, "chunk_size": 8}},
}
ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {config}
  zero3_init_flag: false
machine_rank: 0
num_machines: 1
num_processes: 2
use_cpu: true
rdzv_backend: static
same_network: true
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The model (tiny Llama + word tokenizer), each trainer's data, the DeepSpeed JSON and the accelerate config;
    ``reference(trainer)``: the stock trainer's run in one process, run once."""
    from tests.test_trainer import _samples, save_tiny_llama
    from tests.test_trainer_trl_rl import preference_pairs, word_tokenizer

    root = tmp_path_factory.mktemp("launchers")
    model = root / "model"
    save_tiny_llama(str(model))
    word_tokenizer().save_pretrained(str(model))
    data = {
        "trainer": _samples(),
        "sft": [{"input_ids": s["input_ids"]} for s in _samples()],
        "dpo": preference_pairs(24),
    }
    for name, rows in data.items():
        (root / f"{name}.json").write_text(json.dumps(rows))
    config = root / "ds.json"
    config.write_text(json.dumps(DS_CONFIG))
    long_seq_sp = {**DS_CONFIG["long_seq"], "sequence_parallel": {"size": 2}}
    (root / "ds_sp.json").write_text(json.dumps({**DS_CONFIG, "long_seq": long_seq_sp}))
    (root / "accelerate.yaml").write_text(ACCELERATE_YAML.format(config=config))
    references = {}

    def reference(trainer: str) -> str:
        if trainer not in references:
            out = root / f"stock_{trainer}"
            proc = run_job([sys.executable, SCRIPT, *script_args(root, trainer, out), "--stock"], cwd=ROOT,
                           env=clean_env(), timeout=300)
            assert proc.returncode == 0, proc.stderr[-4000:]
            references[trainer] = out
        return references[trainer]

    return root, reference


def clean_env(**extra) -> dict[str, str]:
    """This environment without another launcher's variables, this checkout's package first."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
        "TORCHELASTIC_RUN_ID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "ACCELERATE_USE_DEEPSPEED")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    env.update(extra)
    return env


def script_args(root, trainer: str, out) -> list[str]:
    # DPO at lr 0.5 diverges within 4 steps (its loss 0.69 -> 4), which turns float32 rounding into 1e-4 weight
    # differences; at 0.1 its loss still moves every step
    return ["--trainer", trainer, "--model", str(root / "model"), "--data", str(root / f"{trainer}.json"),
            "--out", str(out), "--lr", "0.1" if trainer == "dpo" else "0.5"]


def launch(launcher: str, root, trainer: str, out):
    """``user_trainer.py`` on 2 CPU ranks through ``launcher``; the script's arguments as a user passes them."""
    port = str(free_port())
    args = script_args(root, trainer, out)
    ds = ["--deepspeed", str(root / "ds.json")]
    env = clean_env()
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", "2", "--master_port", port, SCRIPT, *ds, *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
               SCRIPT, *ds, *args]
    elif launcher == "accelerate":  # the DeepSpeed JSON comes from the accelerate config, as users write it
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(root / "accelerate.yaml"),
               "--main_process_port", port, SCRIPT, *args]
    else:
        mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        if mpirun is None:
            pytest.skip("no mpirun (bash .ci/install_mpi.sh installs MPICH's from PyPI)")
        pytest.importorskip("mpi4py", reason="mpi4py is not installed (bash .ci/install_mpi.sh)")
        cmd = ["bash", os.path.join(ROOT, "launch", "mpirun.sh"), *ds, *args]
        env.update(SCRIPT=SCRIPT, NP="2", MPIRUN=mpirun, MASTER_PORT=port, PYTHON=sys.executable)
    if launcher == "deepspeed" and shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not on PATH: pip install deepspeed")
    return run_job(cmd, cwd=ROOT, env=env, timeout=600)


def load_weights(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()


@pytest.mark.parametrize("launcher,trainer", [
    pytest.param(launcher, trainer, marks=() if (launcher, trainer) in DEFAULT_PAIRS else pytest.mark.slow)
    for launcher in LAUNCHERS for trainer in TRAINERS
])
def test_unmodified_script_trains_under_every_launcher(setup, launcher, trainer):
    root, reference = setup
    out = root / f"{launcher}_{trainer}"
    proc = launch(launcher, root, trainer, out)
    assert proc.returncode == 0, f"{launcher} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert_same_as_reference(root, out, reference(trainer))


def assert_same_as_reference(root, out, ref) -> None:
    """The run in ``out`` logged the stock one-process run's losses and saved its weights (float32, 1e-5)."""
    ours = json.loads((out / "log.json").read_text())
    stock = json.loads((ref / "log.json").read_text())
    assert [h["step"] for h in ours] == [h["step"] for h in stock] == [1, 2, 3, 4]
    assert [h["loss"] for h in ours] == pytest.approx([h["loss"] for h in stock], rel=1e-5, abs=1e-6)
    initial, trained = load_weights(root / "model"), load_weights(out / "hf_model")
    expected = load_weights(ref / "hf_model")
    moved = 0.0
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, (value - initial[name]).abs().max().item())
    assert moved > 1e-2  # the steps changed the weights far beyond the tolerance: the comparison can fail


def test_sequence_parallel_without_a_launcher_is_refused(monkeypatch):
    """No process group and no launcher variable: SP > 1 stops with one line naming the launch commands; one rank
    starts nothing."""
    import torch.distributed as dist

    from ds_longseq.processes import process_group

    assert not dist.is_initialized()
    for names in process_group.LAUNCHER_VARIABLES.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert process_group.launcher_environment() is None
    with pytest.raises(RuntimeError, match=r"2 ranks are needed .* deepspeed --num_gpus 2 script.py, torchrun "
                                           r"--nproc_per_node 2 .*launch/mpirun.sh"):
        process_group.ensure_process_group(2)
    assert process_group.ensure_process_group(1) is False and not dist.is_initialized()
    monkeypatch.setenv("PMI_RANK", "0")
    assert process_group.launcher_environment() == "mpirun"


def test_accelerate_seeing_fewer_ranks_than_the_group_is_refused(monkeypatch):
    """A bare mpirun on GPUs: accelerate set up one process while the process group spans two; the Trainer stops
    naming launch/mpirun.sh instead of training every rank on the same batches."""
    from types import SimpleNamespace

    import ds_longseq.trainer.mixin as trainer_module

    monkeypatch.setattr(trainer_module.dist, "get_world_size", lambda group=None: 2)
    fake = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1))
    with pytest.raises(RuntimeError, match=r"one of 2 ranks but accelerate set up 1 process.*launch/mpirun.sh"):
        trainer_module.check_world_matches_accelerate(fake)
    fake.accelerator.num_processes = 2
    trainer_module.check_world_matches_accelerate(fake)


@pytest.mark.parametrize("trainer", ["trainer", pytest.param("sft", marks=pytest.mark.slow),
                                     pytest.param("dpo", marks=pytest.mark.slow)])
def test_long_seq_sequence_parallel_equals_one_process(setup, trainer):
    """The other way to ask for sequence parallelism: long_seq.sequence_parallel.size=2 in the DeepSpeed JSON, no
    parallelism_config. The group's ranks read the same batches (one data-parallel replica here), so each step
    trains one batch of per_device_train_batch_size rows, as the stock trainer in one process does."""
    root, reference = setup
    out = root / f"long_seq_sp_{trainer}"
    args = script_args(root, trainer, out)
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), SCRIPT,
           "--deepspeed", str(root / "ds_sp.json"), "--sp", "1", *args]
    proc = run_job(cmd, cwd=ROOT, env=clean_env(), timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert_same_as_reference(root, out, reference(trainer))


OWN_LOOP = """
import sys, torch, torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
import ds_longseq.engine
dist.init_process_group("gloo")  # the user's own start-up: torch's group only, DeepSpeed's comm not told
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
g = torch.Generator().manual_seed(1)
batch = {"input_ids": torch.randint(1, 64, (2, 24), generator=g)}
batch["labels"] = batch["input_ids"].clone()
batch["labels"][1, :7] = -100
with torch.no_grad():
    stock = model(**batch).loss.item()
config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0,
          "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "long_seq": {"streambp": {"enabled": True, "chunk_size": 4}, "sequence_parallel": {"size": 2}}}
engine, *_ = ds_longseq.engine.initialize(model=model, model_parameters=model.parameters(), config=config)
loss = engine(**ds_longseq.engine.shard_batch(batch)).loss
engine.backward(loss)
engine.step()
print(f"RANK{dist.get_rank()} loss {loss.item():.8f} stock {stock:.8f}", flush=True)
"""


def test_own_loop_with_a_torch_process_group_it_started(tmp_path):
    """A training loop that starts torch.distributed itself, then calls ds_longseq.engine.initialize with sequence
    parallelism 2: the group is adopted for DeepSpeed's (its sequence-parallel groups asserted before), and each
    rank's loss is the stock loss of the whole batch."""
    script = tmp_path / "loop.py"
    script.write_text(OWN_LOOP)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script)]
    proc = run_job(cmd, cwd=ROOT, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    import re

    found = re.findall(r"RANK(\d) loss (\S+) stock (\d+\.\d{8})", proc.stdout)  # the ranks' lines may run together
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], proc.stdout[-3000:]
    for _, loss, stock in found:
        assert float(loss) == pytest.approx(float(stock), rel=1e-6)
