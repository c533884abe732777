"""The mixin that brings ds_longseq into a Hugging Face ``Trainer`` or a TRL trainer, and its two ready classes.

Holds:
    LongSeqTrainerMixin: put it first among the bases of ``transformers.Trainer`` or a subclass.
    LongSeqTrainer: ``LongSeqTrainerMixin`` + ``transformers.Trainer``.
    with_long_seq: ``with_long_seq(SFTTrainer)`` builds that subclass for any Trainer class.

The mixin is a shell: it takes the ``long_seq`` section, enables the model, routes ``deepspeed.initialize`` to
``engine.initialize_with`` while the Trainer runs, and hands the dataloaders, ``compute_loss`` and
``prediction_step`` to the case chosen once in ``__init__`` (``trainer/cases.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Mapping

import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from ds_longseq.batch_size import read_batch_size
from ds_longseq.compat import (
    accelerate_parallelism_hidden,
    deepspeed_gathers_one_at_a_time,
    deepspeed_initialize_replaced,
    trainer_checkpointing_turned_off,
    trainer_counts_batch_tokens,
)
from ds_longseq.config import LongSeqConfig
from ds_longseq.engine import data_parallel_rank_and_size, initialize_with, sequence_parallel_groups
from ds_longseq.logging import get_logger
from ds_longseq.patch import (
    configure_fused_lm_head,
    configure_loss_statistics,
    disable,
    enable,
    get_config,
    is_enabled,
)
from ds_longseq.resolver import Launch, resolve
from ds_longseq.toolkit.quantized import quant_state_left_out
from ds_longseq.trainer.cases import TrainerCase, choose_case
from ds_longseq.trainer.positions import PositionLosses
from ds_longseq.trainer.resume import CheckpointCallback, prepare_resume
from ds_longseq.trainer.trl import check_loss_calls, check_trainer_class, fused_head_settings, reads_loss_statistics

__all__ = ["LongSeqTrainerMixin", "LongSeqTrainer", "with_long_seq", "TrainerConfigError",
           "check_values_the_trainer_sets"]

logger = get_logger("ds_longseq.trainer")


class LongSeqTrainerMixin:
    """ds_longseq in a Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``);
    list it first among the bases.

    Args:
        long_seq: the ``long_seq`` section (dict or :class:`LongSeqConfig`, which is not parsed again): for a
            run without a DeepSpeed config (one process), or beside a DeepSpeed config that has none (usually it
            is in the DeepSpeed JSON, where the Trainer finds it).
        *args, **kwargs: the Trainer's own.

    Raises (from ``__init__``, before any training):
        LongSeqConfigError: the ``long_seq`` section or the ZeRO stage is invalid.
        TrainerConfigError: a DeepSpeed config value the Trainer also sets (batch sizes, learning rate, clipping,
            ...) is neither ``"auto"`` nor TrainingArguments' value (transformers would say so only inside
            ``train()``).
        ValueError: the sequence-parallel size does not divide the world size; ``parallelism_config``'s
            ``sp_size`` and ``long_seq.sequence_parallel.size`` disagree; ``long_seq`` given twice.
        UnsupportedModelError: the model family or one of its settings is not supported.
        NotImplementedError: a TRL trainer other than ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``; TRL 1.9's
            ``SFTTrainer`` with ``loss_type="nll"`` under the chunked LM head (``trainer/trl.py``);
            under sequence parallelism, a DPO MoE router loss, and the GRPO options that span the group's turns
            (``top_entropy_quantile``, an entropy bonus, a router loss, ``vespo``, vLLM).
    """

    def __init__(self, *args, long_seq: Mapping[str, Any] | LongSeqConfig | None = None, **kwargs):
        check_trainer_class(type(self))
        super().__init__(*args, **kwargs)
        check_values_the_trainer_sets(self.args)
        self._long_seq_checkpoints = CheckpointCallback(self)  # each checkpoint's manifest; repairs after a reshape
        self.add_callback(self._long_seq_checkpoints)
        self._long_seq_routing = False  # inside train / evaluate / predict: deepspeed.initialize is ours
        self._long_seq_alst = False  # sequence parallelism asked through parallelism_config (ALST's way)
        self._long_seq_positions: PositionLosses | None = None  # while an evaluation loop records
        self._long_seq_section, self.long_seq_config = self._long_seq_take_section(long_seq)
        cfg = self.long_seq_config
        sp_group = None
        if cfg.sequence_parallel.enabled:
            # the process group accelerate started (or the launcher's environment describes): DeepSpeed's groups
            # need deepspeed.comm to know it, which on CPU ranks it does not until deepspeed.initialize
            sp_group = sequence_parallel_groups(cfg.sequence_parallel.size).get_sequence_parallel_group()
            check_world_matches_accelerate(self)
        if is_enabled(self.model):
            if get_config(self.model) != cfg:
                raise ValueError(
                    "the model was enabled with a different long_seq config than the Trainer's: call "
                    "ds_longseq.disable(model) first, or pass the same settings"
                )
            disable(self.model)  # re-enabled on top of whatever the Trainer (TRL's fused head) put over it
        # TRL's SFTConfig turns checkpointing on by default (the Trainer applies it in train()); StreamBP
        # already keeps only each layer's input
        if cfg.streambp.enabled and trainer_checkpointing_turned_off(self):
            logger.warning(
                "ds_longseq: activation checkpointing turned off: StreamBP already recomputes each layer from its "
                "input (pass activation_checkpointing=False, before transformers 5.23 gradient_checkpointing=False, "
                "to silence this)"
            )
        check_loss_calls(self, cfg.lm_head.enabled)
        if cfg.any_enabled:
            enable(self.model, cfg, sp_group=sp_group)
            fused_head = fused_head_settings(self)
            if fused_head is not None:
                configure_fused_lm_head(self.model, **fused_head)
            if reads_loss_statistics(self):  # TRL 1.9's SFT (trainer/trl.py)
                configure_loss_statistics(self.model)
        self._long_seq_case: TrainerCase = choose_case(self, super(), cfg, sp_group, self._long_seq_alst)

    # ---- set-up ---------------------------------------------------------------------------------

    def _long_seq_take_section(self, long_seq) -> tuple[Any, LongSeqConfig]:
        """(the section as given, None without DeepSpeed; the config, parsed once here); removes the section from
        the DeepSpeed config, which DeepSpeed itself must not see."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None:
            if dist.is_initialized() and dist.get_world_size() > 1 and long_seq is not None:
                raise ValueError(
                    "ds_longseq's Trainer integration runs several processes through DeepSpeed: pass "
                    "TrainingArguments(deepspeed=<config with a 'long_seq' section>) instead of long_seq="
                )
            return None, resolve({"long_seq": long_seq}, launch=Launch(deepspeed=False)).long_seq
        ds_config = plugin.deepspeed_config
        section = ds_config.pop("long_seq", None)
        hf_config = getattr(getattr(self.args, "hf_deepspeed_config", None), "config", None)
        if hf_config is not None and hf_config is not ds_config:
            hf_config.pop("long_seq", None)
        if long_seq is not None:
            if section is not None:
                raise ValueError("long_seq is in the DeepSpeed config and passed as long_seq=: keep only one")
            section = long_seq  # a dict, or a LongSeqConfig someone parsed: resolve parses a dict only
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and getattr(pc, "sp_enabled", False):
            section = self._long_seq_take_parallelism_config(pc, section)
        # resolved against the ranks accelerate started: a size they cannot make whole groups of is refused here
        world = dist.get_world_size() if dist.is_initialized() else None
        # train_batch_size left out: the Trainer filled it counting every rank a replica (accelerate's world), and
        # checked it against its TrainingArguments; _long_seq_initialize sets it again from the replicas
        given = {k: v for k, v in ds_config.items() if k != "train_batch_size"}
        cfg = resolve({**given, "long_seq": section}, launch=Launch(world=world, deepspeed=True)).long_seq
        return section, cfg

    def _long_seq_take_parallelism_config(self, pc, section: dict | LongSeqConfig | None) -> dict | LongSeqConfig:
        """The long_seq section with its sequence-parallel size from ``parallelism_config`` (the ALST way to
        ask for it: ``ParallelismConfig(sp_backend="deepspeed", sp_size=P, sp_handler=...)``). accelerate's
        own Ulysses (its attention, its dataloader adapter, the Trainer's loss) is then kept out of the run and
        ds_longseq's does the work, with ALST's data semantics (``cases.AlstTurns``)."""
        if isinstance(section, LongSeqConfig):  # parsed already: its size set on the object, not through a dict
            ours = {"size": section.sequence_parallel.size}
        else:
            section = dict(section or {})
            ours = dict(section.get("sequence_parallel") or {})
        if ours.get("size", 1) not in (1, pc.sp_size):
            raise ValueError(
                f"parallelism_config sp_size={pc.sp_size} and long_seq.sequence_parallel.size={ours['size']} disagree: "
                "set one of them (or both to the same size)"
            )
        handler = getattr(pc, "sp_handler", None)
        knobs = {name: getattr(handler, name, None) for name in ("sp_seq_length", "sp_attn_implementation")}
        set_knobs = {name: value for name, value in knobs.items() if value is not None}
        if set_knobs:
            logger.warning(
                "ds_longseq: parallelism_config's sp_handler settings %s are ignored: ds_longseq's own attention "
                "runs every layer (its kernel choice: long_seq.attention) and takes any sequence length (a batch is "
                "padded to a multiple of sp_size)", set_knobs,
            )
        self._long_seq_alst = True
        # The Trainer turned the batch's token count off for ALST, whose loss counts each shard's tokens itself; ours
        # takes the batch's count (num_items_in_batch) as without parallelism_config, so the loss is token-weighted over
        # the accumulation window and TRL's trainers (which divide by that count) sum exactly over the group
        trainer_counts_batch_tokens(self)
        if isinstance(section, LongSeqConfig):
            return dataclasses.replace(
                section, sequence_parallel=dataclasses.replace(section.sequence_parallel, size=pc.sp_size))
        section["sequence_parallel"] = {**ours, "size": pc.sp_size}
        return section

    @property
    def long_seq_sp_size(self) -> int:
        """Ranks per sequence (1 without sequence parallelism)."""
        return self.long_seq_config.sequence_parallel.size

    def sequence_parallel_paused(self):
        """Context in which the model runs whole sequences on each rank (no sequence parallelism),
        e.g. for ``trainer.model.generate(...)``; a no-op without sequence parallelism."""
        return self._long_seq_case.paused()

    # ---- the DeepSpeed engine, while the Trainer runs ----------------------------------------------

    def _long_seq_initialize(self, original, **kwargs):
        """Stands in for ``deepspeed.initialize`` while the Trainer runs: ``engine.initialize_with``."""
        config = dict(kwargs.pop("config_params", None) or kwargs.pop("config", None) or {})
        if self._long_seq_section is not None:
            # the parsed object, not the raw section: the resolver passes it through unparsed
            config["long_seq"] = self.long_seq_config
        if self._long_seq_checkpoints.universal_dir is not None:  # a resume on another shape (train())
            config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": True}
        sp = self.long_seq_sp_size
        if sp > 1 and "train_batch_size" in config and dist.is_initialized():
            # accelerate counts every rank as a data-parallel replica (the Trainer filled train_batch_size so);
            # DeepSpeed checks world / P: the global batch again from the micro-batch and accumulation it filled
            per_rank = {k: config[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                        if k in config}
            config["train_batch_size"] = read_batch_size(per_rank, data_parallel_rank_and_size(sp)[1]).train_batch
        return initialize_with(original, config=config, **kwargs)

    @contextlib.contextmanager
    def _long_seq_engine(self):
        """``deepspeed.initialize`` routed to ours; under ``parallelism_config``, accelerate's and the Trainer's ALST
        machinery (its attention, dataloader adapter and loss) kept out of sight: all of it is ds_longseq's here."""
        if self._long_seq_routing or getattr(self.accelerator.state, "deepspeed_plugin", None) is None:
            yield
            return
        self._long_seq_routing = True
        try:
            with deepspeed_initialize_replaced(self._long_seq_initialize), \
                    accelerate_parallelism_hidden(self.accelerator, hidden=self._long_seq_alst):
                yield
        finally:
            self._long_seq_routing = False

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's ``train``; a ``resume_from_checkpoint`` is checked first (``trainer/resume.py``: another
        model or an incomplete copy refused, another number of ranks or sequence-parallel size continued through
        DeepSpeed's universal checkpoint)."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:  # the Trainer's own rule: the newest checkpoint-<N> of output_dir
            checkpoint = get_last_checkpoint(self.args.output_dir)
        universal = prepare_resume(self, checkpoint) if isinstance(checkpoint, str) and self.is_deepspeed_enabled \
            else None
        self._long_seq_checkpoints.universal_dir = universal
        # the DeepSpeed checkpoints the Trainer writes leave a PEFT model's frozen parameters out, but not the scales
        # bitsandbytes adds to a 4-bit base's state_dict (not parameters): left out too, the checkpoint holds the
        # adapter alone (the Trainer loads a PEFT model's checkpoint non-strictly; the base is the loaded model's)
        with self._long_seq_engine(), quant_state_left_out(self.model):
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def save_model(self, *args, **kwargs):
        """The Trainer's ``save_model``, its ZeRO-3 16-bit gathers safe on DeepSpeed 0.18 under gloo (``compat``)."""
        with deepspeed_gathers_one_at_a_time():
            return super().save_model(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        with self._long_seq_engine(), self._long_seq_case.evaluate_context():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        with self._long_seq_engine():
            return super().predict(*args, **kwargs)

    # ---- what the case decides ----------------------------------------------------------------------

    def get_train_dataloader(self):
        return self._long_seq_case.train_dataloader(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        return self._long_seq_case.eval_dataloader(super().get_eval_dataloader(eval_dataset))

    def get_total_train_batch_size(self, args) -> int:
        return self._long_seq_case.total_train_batch_size(args)

    def _prepare_inputs(self, inputs):
        with self._long_seq_case.prepare_inputs_context():  # TRL's GRPO generates and scores here
            return super()._prepare_inputs(inputs)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        return self._long_seq_case.compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return self._long_seq_case.prediction_step(model, inputs, prediction_loss_only, ignore_keys,
                                                   self._long_seq_positions)

    def evaluation_loop(self, *args, **kwargs):
        """The Trainer's, plus the loss by position when ds_longseq's forward serves the model: ``<prefix>_loss_pos_
        <b>of8``, the token-mean loss over the targets in the b-th eighth of their document (a row, or a packed
        document; padding left out), summed over every rank (so under sequence parallelism too)."""
        positions = PositionLosses(self.model) if is_enabled(self.model) else None
        self._long_seq_positions = positions
        try:
            output = super().evaluation_loop(*args, **kwargs)
        finally:
            self._long_seq_positions = None
        if positions is not None and output.metrics is not None:
            prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
            output.metrics.update(positions.metrics(prefix, self.args.device))
        return output


class TrainerConfigError(ValueError):
    """The DeepSpeed config and TrainingArguments disagree on a value both set: one line naming the config, each
    value on both sides, and the fix."""


def check_values_the_trainer_sets(args) -> None:
    """Refuse, in the Trainer's constructor, the DeepSpeed config values that disagree with ``args``
    (TrainingArguments): transformers collects them when ``args`` is built (``hf_deepspeed_config.mismatches``:
    ``train_micro_batch_size_per_gpu`` against ``per_device_train_batch_size``, the optimizer's ``lr`` against
    ``learning_rate``, ...) but raises only inside ``train()``, after the model is set up and the ranks have
    started; the examples' ``ds_configs/zero*_streambp.json`` (fixed micro-batch and learning rate) are the
    usual cause."""
    hf_config = getattr(args, "hf_deepspeed_config", None)
    mismatches = [m.lstrip("- ") for m in getattr(hf_config, "mismatches", None) or ()]
    if not mismatches:
        return
    source = f"TrainingArguments(deepspeed={args.deepspeed!r}): the" if isinstance(args.deepspeed, str) else "the"
    raise TrainerConfigError(
        f"{source} DeepSpeed config's values that the Trainer also sets differ from TrainingArguments': "
        + "; ".join(mismatches) + ". Set them to \"auto\" in the config (the Trainer's presets do: "
        "trainer_zero2_streambp, trainer_zero3_ulysses_streambp; `ds-longseq configs`) or pass the same values to "
        "TrainingArguments"
    )


def check_world_matches_accelerate(trainer) -> None:
    """accelerate must see the ranks DeepSpeed's groups span (it shards the data over them): under a bare mpirun on
    GPUs it does not (it reads LOCAL_RANK, which MPI does not set), and would train every rank on the same batches."""
    world, seen = dist.get_world_size(), trainer.accelerator.num_processes
    if seen != world:
        raise RuntimeError(
            f"this process is one of {world} ranks but accelerate set up {seen} process(es) (under mpirun it reads "
            "RANK / LOCAL_RANK / WORLD_SIZE, which MPI does not set): launch through SCRIPT=your_script.py bash "
            "launch/mpirun.sh, which sets them, or with deepspeed / torchrun / accelerate launch"
        )


class LongSeqTrainer(LongSeqTrainerMixin, Trainer):
    """``transformers.Trainer`` with ds_longseq (see :class:`LongSeqTrainerMixin`)."""


_CLASSES: dict[type, type] = {}


def with_long_seq(trainer_cls: type) -> type:
    """The subclass of ``trainer_cls`` (a Trainer class, e.g. TRL's ``SFTTrainer``) with
    :class:`LongSeqTrainerMixin` first; the same class for the same argument."""
    if not isinstance(trainer_cls, type):
        raise TypeError(f"with_long_seq takes a Trainer class, got {trainer_cls!r}")
    if issubclass(trainer_cls, LongSeqTrainerMixin):
        return trainer_cls
    if trainer_cls not in _CLASSES:
        _CLASSES[trainer_cls] = type(f"LongSeq{trainer_cls.__name__}", (LongSeqTrainerMixin, trainer_cls), {
            "__doc__": f"{trainer_cls.__name__} with ds_longseq (see LongSeqTrainerMixin).",
            "__module__": "ds_longseq.trainer",
        })
    return _CLASSES[trainer_cls]
