"""ds_longseq as an axolotl plugin: ``plugins: [ds_longseq.integrations.axolotl.LongSeqPlugin]`` and a ``long_seq:``
block in the YAML (docs/AXOLOTL.md).

Holds:
    LongSeqPlugin: the plugin. At each hook axolotl calls, in the order it calls them:
        ``register`` (the raw YAML): the block resolved as every entry point resolves it (``resolver.resolve``:
            the same errors), against the DeepSpeed config and the ranks launched; the axolotl settings refused
            beside it (``axolotl_config.AXOLOTL_RULES``); one error with every problem, before anything is loaded;
        ``get_input_args``: the block declared in axolotl's schema (``axolotl_config.LongSeqArgs``);
        ``pre_model_load`` (the validated config): the rules again, on what axolotl's validation derived;
        ``post_model_load`` (after any LoRA adapter): ``ds_longseq.enable`` on the model;
        ``get_trainer_cls``: axolotl's causal-LM trainer class with ``trainer.with_long_seq`` (the Trainer
            integration: the DeepSpeed engine, sequence parallelism's batches and loss), handed the block;
        ``post_trainer_create``: the trainer axolotl built is that class (another plugin's class would win
            otherwise).
    trainer_class: axolotl's trainer class wrapped, with the section it is handed.

axolotl keeps one plugin manager per process and calls every registered plugin's hooks for every config it loads,
so the plugin acts only on configs that list it (``register`` records whether this one does).
"""

from __future__ import annotations

import os
from typing import Any

from axolotl.integrations.base import BasePlugin

from ds_longseq.config import LongSeqConfig
from ds_longseq.integrations.axolotl_config import (
    PLUGIN,
    AxolotlConfigError,
    AxolotlLongSeq,
    axolotl_problems,
    lists_the_plugin,
    read_long_seq,
)
from ds_longseq.logging import get_logger, log_rank0
from ds_longseq.patch import enable, is_enabled
from ds_longseq.trainer import LongSeqTrainerMixin, with_long_seq

__all__ = ["LongSeqPlugin", "trainer_class"]

logger = get_logger(__name__)


def _world_launched() -> int | None:
    """The ranks the launcher started (torchrun, accelerate, deepspeed set WORLD_SIZE), None when not told."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def trainer_class(trainer_cls: type, long_seq: LongSeqConfig | None) -> type:
    """``with_long_seq(trainer_cls)``; with ``long_seq``, its subclass that hands the section to the mixin
    (``long_seq=``), as axolotl builds the trainer with its own arguments only. Without (the DeepSpeed config carries
    the section, where the mixin reads it) the wrapped class itself."""
    wrapped = with_long_seq(trainer_cls)
    if long_seq is None:
        return wrapped

    class WithLongSeqBlock(wrapped):
        """The wrapped trainer, handed the axolotl config's long_seq block."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, long_seq=long_seq, **kwargs)

    return WithLongSeqBlock


def _axolotl_trainer_class(cfg) -> type:
    """The causal-LM trainer class axolotl would pick without a plugin's (``HFCausalTrainerBuilder._get_trainer_cls``:
    its own ``trainer_cls``, the Mamba trainer, else ``AxolotlTrainer``; the reward trainers are refused in
    ``register``)."""
    from axolotl.core.trainers import AxolotlMambaTrainer, AxolotlTrainer
    from axolotl.utils.import_helper import get_cls_from_module_str

    if cfg.get("model_config_type") == "mamba":
        return AxolotlMambaTrainer
    if cfg.get("trainer_cls"):
        return get_cls_from_module_str(cfg["trainer_cls"])
    return AxolotlTrainer


class LongSeqPlugin(BasePlugin):
    """ds_longseq in axolotl (see the module docstring for what each hook does)."""

    def __init__(self):
        super().__init__()
        self.found: AxolotlLongSeq | None = None
        """The section of the config being trained, if it lists this plugin (``register``)."""

    def register(self, cfg: dict):
        self.found = None
        if not lists_the_plugin(cfg):
            return  # another config in this process (axolotl's plugin manager is one per process)
        self.found = read_long_seq(cfg, world=_world_launched())
        source = "the YAML's long_seq block" if self.found.for_trainer is not None else "the DeepSpeed config's section"
        log_rank0(logger, f"ds_longseq: axolotl plugin on, long_seq from {source}")

    def get_input_args(self) -> str:
        return "ds_longseq.integrations.axolotl_config.LongSeqArgs"

    def pre_model_load(self, cfg):
        if self.found is None:
            return
        problems = axolotl_problems(cfg, self.found.config, cfg.get("world_size") or _world_launched())
        if problems:
            raise AxolotlConfigError(problems)

    def post_model_load(self, cfg, model):
        if self.found is None or not self.found.config.any_enabled:
            return
        config = self.found.config
        sp_group = None
        if config.sequence_parallel.enabled:
            from ds_longseq.engine import sequence_parallel_groups

            sp_group = sequence_parallel_groups(config.sequence_parallel.size).get_sequence_parallel_group()
        if not is_enabled(model):
            enable(model, config, sp_group=sp_group)

    def get_trainer_cls(self, cfg) -> type | None:
        if self.found is None:
            return None
        return trainer_class(_axolotl_trainer_class(cfg), self.found.for_trainer)

    def post_trainer_create(self, cfg, trainer: Any):
        if self.found is not None and not isinstance(trainer, LongSeqTrainerMixin):
            raise AxolotlConfigError([
                f"axolotl built a {type(trainer).__name__}, not ds_longseq's trainer: another plugin listed before "
                f"{PLUGIN} returned its own trainer class; list ds_longseq's plugin first, or remove the other"])
