"""axolotl on CPU for tests/test_axolotl.py, in a process of its own: one training run, as ``axolotl train`` runs it
but through axolotl's Python API (``load_cfg``, ``load_datasets``, ``train``), one process per rank (torchrun starts
two); or the start of several configs, up to where the plugin refuses them.

    python tests/axolotl_run.py train CONFIG.yml RESULT.json    # from the repository root; with ranks: RESULT.rank<r>
    python tests/axolotl_run.py check RESULT.json CONFIG.yml... # each config's refusal (or "ok"), in one process

``train`` writes what the test compares: the losses and gradient norms the Trainer logged (one per optimizer step),
each micro-batch this rank trained on (token ids and labels, before any cut across a sequence-parallel group), the
trainer's class, the engine, and whether ds_longseq served the model. The ``Recorder`` plugin (listed in the YAML by
the test) records the batches. ``check`` loads each config (the plugin's ``register``, axolotl's validation) and runs
the plugin's ``pre_model_load`` on the validated config, recording the error's type and message.

On CPU ranks: with a ``deepspeed:`` config, or more than one rank, the gloo process group is started before
``load_cfg`` (axolotl asks DeepSpeed for NCCL when it is one process, ``setup_deepspeed_env``, and DeepSpeed adopts a
group that exists); on several ranks the model is loaded on the CPU (axolotl would put it on GPU ``LOCAL_RANK``) and
accelerate is made to count the ranks (``_count_cpu_ranks``). None of this is needed on GPUs.
"""

from __future__ import annotations

import json
import os
import sys

from axolotl.integrations.base import BasePlugin

SEEN: list[dict] = []
"""The micro-batches this process trained on, in order (the Recorder fills it)."""


class Recorder(BasePlugin):
    """Records each micro-batch the trainer's ``training_step`` is given."""

    def post_trainer_create(self, cfg, trainer):
        step = trainer.training_step

        def training_step(model, inputs, num_items_in_batch=None):
            SEEN.append({key: inputs[key].tolist() for key in ("input_ids", "labels", "position_ids") if key in inputs}
                        | {"attention_mask": "attention_mask" in inputs})
            return step(model, inputs, num_items_in_batch)

        trainer.training_step = training_step


def _count_cpu_ranks() -> None:
    """accelerate counts CPU ranks under DeepSpeed only when its state is built with a backend (a GPU's; its CPU path
    leaves DeepSpeed out): built so here, and kept where TrainingArguments and axolotl would rebuild it from the
    environment with one process (``use_configured_state``, which TrainingArguments honours and then drops from the
    config, so ``AxolotlTrainer.create_accelerator_and_postprocess``'s reset is skipped too, in this process only)."""
    from accelerate import PartialState
    from axolotl.core.trainers.base import AxolotlTrainer
    from transformers import Trainer

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    AxolotlTrainer.create_accelerator_and_postprocess = Trainer.create_accelerator_and_postprocess


def _start_processes(uses_deepspeed: bool, world: int) -> None:
    if not (uses_deepspeed or world > 1):
        return
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from tests.dist_utils import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    if world > 1:
        _count_cpu_ranks()


def train(config: str, result: str) -> None:
    import yaml

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    with open(config) as f:
        _start_processes(bool(yaml.safe_load(f).get("deepspeed")), world)
    from axolotl.cli.args import TrainerCliArgs
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.train import train as axolotl_train

    import ds_longseq

    cfg = load_cfg(config)
    if world > 1:
        cfg.device_map = "cpu"
        cfg.accelerator_config = {"use_configured_state": True}
    meta = load_datasets(cfg=cfg, cli_args=TrainerCliArgs())
    model, _, trainer = axolotl_train(cfg=cfg, dataset_meta=meta)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    out = {"losses": [e["loss"] for e in logged], "grad_norms": [e.get("grad_norm") for e in logged], "seen": SEEN,
           "trainer": type(trainer).__name__, "enabled": ds_longseq.patch.is_enabled(model),
           "engine": type(trainer.model_wrapped).__name__}
    with open(result if world == 1 else f"{result}.rank{rank}", "w") as f:
        json.dump(out, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def check(result: str, *configs: str) -> None:
    from axolotl.cli.config import load_cfg
    from axolotl.integrations.base import PluginManager

    outcomes = []
    for config in configs:
        try:
            cfg = load_cfg(config)
            PluginManager.get_instance().pre_model_load(cfg)
            outcomes.append({"type": None, "message": "ok"})
        except Exception as err:  # noqa: BLE001 - the test reads the type and the message
            outcomes.append({"type": type(err).__name__, "message": str(err)})
    with open(result, "w") as f:
        json.dump(outcomes, f)


if __name__ == "__main__":
    from tests import axolotl_run  # the module the YAML's plugins line imports Recorder from: one SEEN

    getattr(axolotl_run, sys.argv[1])(*sys.argv[2:])
