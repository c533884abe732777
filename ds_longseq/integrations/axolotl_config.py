"""What the axolotl plugin checks, without axolotl: the ``long_seq:`` block and the axolotl settings beside it.

Holds:
    LongSeqArgs: the ``long_seq:`` block as axolotl's config schema declares it (``LongSeqPlugin.get_input_args``;
        axolotl drops the top-level keys no schema declares), checked by ds_longseq's own parser.
    AxolotlLongSeq: what :func:`read_long_seq` found: the resolved section, and where the Trainer finds it.
    read_long_seq: the block (or the DeepSpeed config's ``long_seq`` section) through ``resolver.resolve``, as every
        entry point checks it, with the axolotl settings refused beside it: one error listing every problem.
    axolotl_problems: the axolotl settings ds_longseq refuses beside a section, one line each (the rules in
        ``AXOLOTL_RULES``, one function each).
    AxolotlConfigError: the error for those.
    PLUGIN, lists_the_plugin: the plugin's name as the YAML's ``plugins:`` lists it; whether a config does.

Where the section lives: the YAML's ``long_seq:`` block is the one source. A DeepSpeed config that carries a
``long_seq`` section too (the shipped Trainer configs do) is accepted when the two are the same settings and refused
when they differ; a DeepSpeed config's section alone (no block) is read as the Trainer reads it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping

from pydantic import BaseModel, Field, field_validator

from ds_longseq.config import LongSeqConfig, LongSeqConfigError
from ds_longseq.config_files import read_json_file
from ds_longseq.resolver import Launch, RunCannotStart, resolve

__all__ = [
    "PLUGIN", "lists_the_plugin", "LongSeqArgs", "AxolotlLongSeq", "AxolotlConfigError", "read_long_seq",
    "axolotl_problems", "AXOLOTL_RULES",
]

PLUGIN = "ds_longseq.integrations.axolotl.LongSeqPlugin"
"""The plugin as axolotl's ``plugins:`` list names it."""


def lists_the_plugin(cfg: Mapping[str, Any]) -> bool:
    """Whether axolotl's config lists the plugin (under :data:`PLUGIN`, or ``ds_longseq.integrations.LongSeqPlugin``,
    the package's name for it, which axolotl's import finds too)."""
    return any(isinstance(name, str) and name.startswith("ds_longseq.") and name.endswith(".LongSeqPlugin")
               for name in cfg.get("plugins") or ())


class LongSeqArgs(BaseModel):
    """The plugin's keys in axolotl's config (mixed into axolotl's ``AxolotlInputConfig``)."""

    long_seq: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"description": "ds_longseq's long_seq section (StreamBP, the chunked LM head, sequence "
                                          "parallelism, ...): the keys of the DeepSpeed JSON's 'long_seq' section, "
                                          "in YAML (docs/AXOLOTL.md)"},
    )

    @field_validator("long_seq")
    @classmethod
    def _parsed_by_ds_longseq(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        """The block as ``LongSeqConfig.from_dict`` reads it: the same problems, word for word, as any entry point
        (pydantic puts them under its own heading); the block stays a dict in axolotl's config."""
        if value is not None:
            LongSeqConfig.from_dict(value)
        return value


class AxolotlConfigError(LongSeqConfigError):
    """An axolotl config that ds_longseq cannot train: every problem, one line each (the section's own, as the
    resolver words them, and the axolotl settings refused beside it)."""

    def __init__(self, problems: list[str]):
        super().__init__(problems, what="ds_longseq cannot train this axolotl config")


@dataclasses.dataclass(frozen=True)
class AxolotlLongSeq:
    """The section a run trains with, and how the Trainer gets it."""

    config: LongSeqConfig
    """The resolved ``long_seq`` section."""
    for_trainer: LongSeqConfig | None
    """What the Trainer is handed as ``long_seq=`` (the YAML block's); None where the DeepSpeed config carries the
    section, where the Trainer reads it (handing it twice is refused there)."""


def _deepspeed_config(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The DeepSpeed config axolotl's ``deepspeed:`` names (a path, or the config itself), a copy; None without."""
    value = cfg.get("deepspeed")
    if not value:
        return None
    if isinstance(value, (str, os.PathLike)):
        return read_json_file(value)
    return dict(value)


def _section_of(ds_config: Mapping[str, Any] | None, section: Any, world: int | None) -> LongSeqConfig:
    """``section`` resolved against the DeepSpeed config's own keys (its ZeRO stage, ``sequence_parallel_size``, the
    batch triple) and the ranks, as the Trainer resolves it."""
    given = {k: v for k, v in (ds_config or {}).items() if k != "long_seq"}
    launch = Launch(world=world, deepspeed=ds_config is not None)
    return resolve({**given, "long_seq": section}, launch=launch).long_seq


def read_long_seq(cfg: Mapping[str, Any], world: int | None = None) -> AxolotlLongSeq:
    """The run's ``long_seq`` section, from axolotl's config (the raw YAML or the validated one).

    Args:
        cfg: axolotl's config: its ``long_seq`` block, its ``deepspeed`` (a path or a dict) and the settings
            :func:`axolotl_problems` reads.
        world: the ranks launched (None: not known; the rules that need it wait for the Trainer's check).

    Raises:
        RunCannotStart: the section or the DeepSpeed config has problems (the resolver's error, unchanged).
        AxolotlConfigError: an axolotl setting is refused, or the section is missing or given twice with different
            settings: every problem, the resolver's among them.
        ConfigFileError: the DeepSpeed config file cannot be read.
    """
    ds_config = _deepspeed_config(cfg)
    in_yaml = cfg.get("long_seq")
    in_ds = None if ds_config is None else ds_config.get("long_seq")
    if in_yaml is None and in_ds is None:
        raise AxolotlConfigError([f"plugins lists {PLUGIN} but the config has no long_seq block: add one (long_seq: "
                                  "{streambp: {enabled: true}, ...}; docs/AXOLOTL.md), or remove the plugin"])
    unresolved: RunCannotStart | None = None
    try:
        config = _section_of(ds_config, in_yaml if in_yaml is not None else in_ds, world)
    except RunCannotStart as err:
        unresolved, config = err, None
    found = []
    if config is not None and in_yaml is not None and in_ds is not None and not _same(ds_config, in_ds, config, world):
        found.append(f"long_seq is in the YAML and in the DeepSpeed config {_named(cfg)} with different settings: "
                     "keep the YAML block (the one source) and remove the DeepSpeed config's long_seq section")
    found.extend(axolotl_problems(cfg, config if config is not None else LongSeqConfig(), world))
    if unresolved is not None and not found:
        raise unresolved  # the resolver's problems alone: its error, as every entry point raises it
    if found:
        raise AxolotlConfigError(([] if unresolved is None else unresolved.problems) + found)
    return AxolotlLongSeq(config, config if in_yaml is not None and in_ds is None else None)


def _same(ds_config, in_ds, config: LongSeqConfig, world: int | None) -> bool:
    """Whether the DeepSpeed config's section reads as the same settings as the block (``config``)."""
    try:
        return _section_of(ds_config, in_ds, world) == config
    except LongSeqConfigError:
        return False


def _named(cfg: Mapping[str, Any]) -> str:
    value = cfg.get("deepspeed")
    return repr(os.fspath(value)) if isinstance(value, (str, os.PathLike)) else "(given inline)"


# ---- the axolotl settings refused beside a long_seq section -----------------------------------------------------

AxolotlRule = Callable[[Mapping[str, Any], LongSeqConfig, "int | None"], "str | None"]
AXOLOTL_RULES: list[AxolotlRule] = []
"""The axolotl settings ds_longseq refuses: each rule reads axolotl's config, the section and the ranks (None: not
known), and returns its one-line refusal or None. Each runs on the raw YAML (the plugin's ``register``) and again on
the validated config (``pre_model_load``: the values axolotl's validation derives, such as how the attention treats
packed rows)."""


def _rule(fn: AxolotlRule) -> AxolotlRule:
    AXOLOTL_RULES.append(fn)
    return fn


def axolotl_problems(cfg: Mapping[str, Any], long_seq: LongSeqConfig, world: int | None = None) -> list[str]:
    """Every refusal of :data:`AXOLOTL_RULES` for this config, one line each."""
    return [problem for rule in AXOLOTL_RULES if (problem := rule(cfg, long_seq, world)) is not None]


@_rule
def _trainer_the_plugin_wraps(cfg, long_seq, world):
    """The plugin wraps axolotl's causal-LM (SFT / pretraining) trainer; its RL and reward trainers are not wired."""
    for key in ("rl", "reward_model", "process_reward_model"):
        if cfg.get(key):
            return (f"{key}: {cfg[key]!r} trains through axolotl's {'RL' if key == 'rl' else 'reward'} trainers, which "
                    "the ds_longseq plugin does not wrap (it wraps the causal-LM trainer): remove the plugin, or train "
                    "DPO / GRPO with ds-longseq dpo / grpo or TRL's trainers with with_long_seq (docs/TRAINER.md)")
    return None


@_rule
def _axolotl_context_parallel(cfg, long_seq, world):
    """axolotl's own sequence parallelism (ring-flash-attn context parallelism) would cut the sequences again."""
    key = next((k for k in ("context_parallel_size", "sequence_parallel_degree") if (cfg.get(k) or 1) > 1), None)
    if key is None:
        return None
    return (f"{key}={cfg[key]} is axolotl's own sequence parallelism (ring-flash-attn), which would cut the sequences "
            f"ds_longseq already cuts: remove {key} and set long_seq.sequence_parallel.size: {cfg[key]}")


@_rule
def _tiled_mlp(cfg, long_seq, world):
    """ALST's tiled MLP replaces the MLP forward that ds_longseq runs a chunk at a time."""
    if not cfg.get("tiled_mlp"):
        return None
    return ("tiled_mlp: true is axolotl's ALST tiled MLP, which replaces the MLP forward ds_longseq runs itself: "
            "remove tiled_mlp (StreamBP already runs the MLP a chunk at a time; without StreamBP, long_seq.mini_seq "
            "tiles the MLP)")


@_rule
def _checkpointing_under_streambp(cfg, long_seq, world):
    """StreamBP keeps each decoder layer's input and recomputes the layer chunk by chunk: checkpointing the same
    layers recomputes them again, for nothing."""
    value = cfg.get("gradient_checkpointing")
    if not value or not long_seq.streambp.enabled:
        return None
    shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as the YAML writes it
    return (f"gradient_checkpointing: {shown} recomputes the decoder layers that long_seq.streambp already "
            "recomputes chunk by chunk from their inputs: remove gradient_checkpointing (StreamBP keeps only each "
            "layer's input; long_seq.offload.layer_inputs: cpu moves those to host memory)")


@_rule
def _packed_rows_ds_longseq_can_read(cfg, long_seq, world):
    """ds_longseq finds packed documents from restarting ``position_ids`` with no ``attention_mask``. axolotl's
    sample_packing gives the model that when the attention decontaminates packing (``attn_decontaminates_packing``:
    sdpa, eager, flash / flex: axolotl drops the mask column, and each sample's positions restart at 0); otherwise it
    keeps its per-document mask (1, 2, 3, ... along the row), and pretraining without ``pretrain_multipack_attn``
    gives no position ids at all. Read on the validated config (where axolotl derives the attention's flag)."""
    if not cfg.get("sample_packing"):
        return None
    if cfg.get("pretraining_dataset") and cfg.get("pretrain_multipack_attn") is False:
        return ("sample_packing with pretrain_multipack_attn: false packs documents without position ids, so nothing "
                "tells the model where one ends: set pretrain_multipack_attn: true (the documents then restart their "
                "position ids, which ds_longseq reads), or turn sample_packing off")
    if cfg.get("attn_decontaminates_packing") is False:
        return (f"sample_packing with attn_implementation={cfg.get('attn_implementation')!r} keeps axolotl's "
                "per-document attention_mask (1, 2, 3, ...) beside the restarting position ids, which ds_longseq does "
                "not read as documents: use attn_implementation sdpa or eager (axolotl then drops the mask and "
                "ds_longseq finds the documents from the position ids), or turn sample_packing off")
    return None


@_rule
def _deepspeed_for_several_processes(cfg, long_seq, world):
    """Under the Trainer, ds_longseq runs several processes through DeepSpeed (one process without it)."""
    if cfg.get("fsdp") or cfg.get("fsdp_config"):
        return ("fsdp / fsdp_config: ds_longseq runs through DeepSpeed (ZeRO-2 / ZeRO-3), not FSDP: remove the FSDP "
                "settings and set deepspeed: <a DeepSpeed JSON> (docs/AXOLOTL.md)")
    if world is not None and world > 1 and not cfg.get("deepspeed"):
        return (f"{world} processes without deepspeed: ds_longseq runs several processes through DeepSpeed: set "
                "deepspeed: <a DeepSpeed JSON> (ZeRO-2: docs/AXOLOTL.md), or run one process")
    return None


@_rule
def _steps_under_sequence_parallelism(cfg, long_seq, world):
    """axolotl turns num_epochs into steps counting every rank a data-parallel replica (``batch_size`` times the
    world size): under sequence parallelism the P ranks of a group share each sequence, so the count would be P
    times too small and the run would stop after 1/P of each epoch."""
    size = long_seq.sequence_parallel.size
    if size <= 1 or cfg.get("max_steps"):
        return None
    return (f"long_seq.sequence_parallel.size={size} without max_steps: axolotl counts every rank a data-parallel "
            f"replica when it turns num_epochs into steps, but {size} ranks share each sequence, so the run would "
            f"stop after 1/{size} of an epoch: set max_steps")


@_rule
def _warmup_under_sequence_parallelism(cfg, long_seq, world):
    """axolotl sizes the warmup from its step count (``warmup_ratio`` times it, or 3% of it, at most 100, when no
    warmup is set), the smaller of ``max_steps`` and its count of the epochs' steps: that count takes every rank for
    a data-parallel replica, so under sequence parallelism it is P times too small and so would be the warmup."""
    size = long_seq.sequence_parallel.size
    if size <= 1 or cfg.get("warmup_steps") is not None:
        return None
    what = f"warmup_ratio: {cfg['warmup_ratio']}" if cfg.get("warmup_ratio") is not None else "axolotl's default warmup"
    return (f"long_seq.sequence_parallel.size={size} with {what}: axolotl sizes the warmup from a step count that "
            f"takes every rank for a data-parallel replica, {size} times too few under sequence parallelism: set "
            "warmup_steps (0 for none)")
