"""Whether a run can start: one function that every entry point calls, the rules it runs registered beside their
sections.

Holds:
    resolve: a DeepSpeed config (a path, a shipped config's name, or a dict with its ``long_seq`` section), the
        launch and the run -> :class:`Resolved` (DeepSpeed's config without ``long_seq``, the parsed section), or
        :class:`RunCannotStart` listing every problem at once.
    Resolved: the resolved settings; ``check(launch=, run=)`` runs the rules that what became known needs (the
        ranks once the process group is up, the ring degree once the model is built) without parsing again.
    RunCannotStart: the error, each problem with the rule that found it.
    SUPPORTED_ZERO_STAGES, zero_stage: DeepSpeed's ZeRO stages ds_longseq runs, and the one a config selects.

The entry points: ``engine.split_config`` / ``engine.initialize``, the Trainer (through ``split_config``), the
scripts' ``toolkit.start_distributed`` and ``setup_run``, the ``ds-longseq train`` command before it starts
ranks, the planner (``plan.Setup.from_configs``) and so the memory preflight. Where the rules are:

- each ``long_seq`` section's own (its fields' annotations, its ``problems()``) and the techniques' declared
  conflicts and needs: in ``config.py``, run when the section is parsed, reported here as the rule ``long_seq``;
- rules between the section and the rest of the world, registered with ``rules.start_rule`` beside the section
  they are about: ``config.py`` (sequence parallelism against DeepSpeed's keys, the ranks and DeepSpeed itself;
  chunks that span the sequence), ``ops/sp_layout.py`` (the lengths the sequence-parallel layout can cut), and
  this module (DeepSpeed's own keys: the ZeRO stage, ``sequence_parallel_size``, the batch triple, the monitor
  section; the techniques' ``engine_problems``). ``rules.start_rules()`` enumerates them.

Every rule is in force whatever was imported first (issue 62, item 12): ``rules.start_rules`` loads the modules that
register start rules (``rules.RULE_MODULES``, torch-free), and the registry of techniques loads the built-in ones
(``config.registered_techniques``), whose declared conflicts, needs and engine problems take part. That loads torch:
the planner's module imports without it, and resolving a config (``ds-longseq plan``) loads it, for the same answer
as a training run's.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ds_longseq.batch_size import batch_size_problems
from ds_longseq.config import LongSeqConfig, LongSeqConfigError, registered_techniques
from ds_longseq.config_files import find_ds_config, read_json_file
from ds_longseq.logging import get_logger, warn_once_rank0
from ds_longseq.rules import Launch, RunShape, Start, deepspeed_sp_size, start_rule, start_rules

__all__ = ["resolve", "Resolved", "RunCannotStart", "Launch", "RunShape", "SUPPORTED_ZERO_STAGES", "zero_stage"]

logger = get_logger(__name__)

SUPPORTED_ZERO_STAGES = (0, 1, 2, 3)
PARSE_RULE = "long_seq"
"""The name problems found while parsing the section carry (its sections' own rules, the techniques' conflicts)."""


class RunCannotStart(LongSeqConfigError):
    """The config, the launch and the run do not make a run that can start: every problem, one per line.

    ``by_rule``: [(the rule's name, the problem)], ``long_seq`` for a problem found parsing the section.
    A :class:`~ds_longseq.config.LongSeqConfigError`, so callers that catch that keep working."""

    def __init__(self, by_rule: list[tuple[str, str]]):
        self.by_rule = list(by_rule)
        rules = start_rules()
        # a problem of the config alone is an invalid config; one against the ranks or the length, a run that cannot
        # start with this config
        of_the_run = any(rules[name].needs for name, _ in self.by_rule if name in rules)
        super().__init__([problem for _, problem in self.by_rule],
                         what="this run cannot start" if of_the_run else "invalid long_seq config")


def zero_stage(ds_config: Mapping[str, Any]) -> int:
    """The ZeRO stage a DeepSpeed config selects (0 when it has no ``zero_optimization`` section)."""
    return (ds_config.get("zero_optimization") or {}).get("stage", 0)


def _known(launch: Launch, run: RunShape) -> set[str]:
    """Of ``rules.NEEDS``: what the launch and the run say."""
    given = {"world": launch.world, "deepspeed": launch.deepspeed, "seq_len": run.seq_len}
    return {name for name, value in given.items() if value is not None}


@dataclass(frozen=True)
class Resolved:
    """A config that passed every rule its inputs allowed."""

    ds_config: dict[str, Any]
    """DeepSpeed's config without ``long_seq``; ``sequence_parallel_size`` set under sequence parallelism."""
    long_seq: LongSeqConfig
    """The parsed ``long_seq`` section (DeepSpeed's ``sequence_parallel_size`` adopted when the section has none)."""
    launch: Launch = Launch()
    run: RunShape = RunShape()
    ran: frozenset[str] = frozenset()
    """The rules that ran (a rule whose inputs were unknown waits for :meth:`check`)."""
    warnings: tuple[str, ...] = field(default=())
    """What the warning rules found (logged once each)."""

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.ds_config)

    def check(self, launch: Launch | None = None, run: RunShape | None = None, *,
              _found: tuple[tuple[str, str], ...] = ()) -> Resolved:
        """The same settings checked against what became known: ``launch`` and ``run`` replace the ones held; the
        rules not run yet whose inputs are now known run, and so do those that read what was given anew.

        Raises:
            RunCannotStart: every problem (with the ones passed in as ``_found``, the parse's).
        """
        launch = self.launch if launch is None else launch
        run = self.run if run is None else run
        known = _known(launch, run)
        fresh = {"world", "deepspeed"} if launch != self.launch else set()  # what was given anew
        fresh |= {"seq_len"} if run != self.run else set()
        start = Start(self.ds_config, self.long_seq, launch, run)
        found, warnings, ran = list(_found), list(self.warnings), set(self.ran)
        for _, rule in sorted(start_rules().items()):  # by name: the same order whatever imported them first
            if not rule.needs <= known or (rule.name in ran and not rule.needs & fresh):
                continue
            ran.add(rule.name)
            for problem in rule.check(start):
                if rule.warns:
                    warnings += [problem] * (problem not in warnings)  # a re-run of the rule finds it again
                    warn_once_rank0(logger, problem)  # about the run: rank 0 alone says it (also before logging)
                else:
                    found.append((rule.name, problem))
        if found:
            raise RunCannotStart(found)
        return dataclasses.replace(self, launch=launch, run=run, ran=frozenset(ran), warnings=tuple(warnings))


def resolve(config: str | os.PathLike | Mapping[str, Any], launch: Launch | None = None,
            run: RunShape | None = None) -> Resolved:
    """Whether a run can start, and with what settings.

    Args:
        config: a DeepSpeed config: a path, or the name of a shipped one
            (:func:`~ds_longseq.config_files.find_ds_config`), or a dict (not modified) whose ``long_seq`` is a
            dict or the :class:`LongSeqConfig` a caller parsed (validated, not parsed again).
        launch: what is known of the processes (default: nothing; the rules that need it wait for
            :meth:`Resolved.check`).
        run: what is known of the run (default: nothing).

    Raises:
        RunCannotStart: every problem at once, each naming its fix.
        ConfigFileError: the file cannot be read or is not a JSON object (naming the file, line and column).
    """
    if isinstance(config, (str, os.PathLike)):
        ds_config = read_json_file(find_ds_config(config))
    elif isinstance(config, Mapping):
        ds_config = copy.deepcopy(dict(config))
    else:
        raise TypeError(f"config must be a path or a dict, got {type(config).__name__}")
    found: list[tuple[str, str]] = []
    try:  # parsed here, unless the caller (an example, the Trainer) passes its parsed section down
        long_seq = LongSeqConfig.of(ds_config.pop("long_seq", None))
    except LongSeqConfigError as err:
        found.extend((PARSE_RULE, problem) for problem in err.problems)
        long_seq = LongSeqConfig()  # the defaults, so that DeepSpeed's keys are still checked: all problems at once
    ds_size = deepspeed_sp_size(ds_config)  # DeepSpeed's key alone turns sequence parallelism on
    if ds_size is not None and ds_size > 1 and long_seq.sequence_parallel.size == 1:
        long_seq = dataclasses.replace(
            long_seq, sequence_parallel=dataclasses.replace(long_seq.sequence_parallel, size=ds_size))
    resolved = Resolved(ds_config, long_seq).check(launch, run, _found=tuple(found))
    if long_seq.sequence_parallel.enabled:
        resolved.ds_config["sequence_parallel_size"] = long_seq.sequence_parallel.size
    return resolved


# ---- DeepSpeed's own keys, and the techniques' engine problems ------------------------------------------------


@start_rule("run.positive_length", needs=("seq_len",))
def _positive_length(start: Start) -> list[str]:
    """A sequence has tokens."""
    seq_len = start.run.seq_len
    return [] if seq_len > 0 else [f"sequence length must be positive, got {seq_len}"]


@start_rule("deepspeed.zero_stage")
def _supported_zero_stage(start: Start) -> list[str]:
    """ZeRO stages 0-3."""
    stage = zero_stage(start.ds_config)
    if stage in SUPPORTED_ZERO_STAGES:
        return []
    return [f"zero_optimization.stage={stage!r} is not supported: use one of {SUPPORTED_ZERO_STAGES}"]


@start_rule("deepspeed.sequence_parallel_size")
def _deepspeed_sequence_parallel_size(start: Start) -> list[str]:
    """DeepSpeed's top-level ``sequence_parallel_size``, when set, is a size."""
    size = start.ds_config.get("sequence_parallel_size")
    if size is None or deepspeed_sp_size(start.ds_config) is not None:
        return []
    return [f"sequence_parallel_size must be a positive integer, got {size!r}"]


@start_rule("deepspeed.batch_size", needs=("world",))
def _batch_size(start: Start) -> list[str]:
    """DeepSpeed's batch triple agrees with the data-parallel replicas (the ranks over the sequence-parallel size),
    by DeepSpeed's own rule (``batch_size.read_batch_size``): refused here, before the model is built, instead of by
    DeepSpeed's assertion inside ``deepspeed.initialize``."""
    size = start.long_seq.sequence_parallel.size
    if start.launch.deepspeed is False or start.launch.world % size:
        return []  # no DeepSpeed: no triple; ranks the size cannot group: sequence_parallel.divides_world says so
    return batch_size_problems(start.ds_config, start.launch.world // size)


@start_rule("techniques.engine")
def _technique_engine_problems(start: Start) -> list[str]:
    """What each active technique declares it cannot run under (``Technique.engine_problems``: adjoint sharding
    with ZeRO-3, sequence parallelism with ZeRO-3 on a DeepSpeed release whose gradient average is unchecked)."""
    stage = zero_stage(start.ds_config)
    if stage not in SUPPORTED_ZERO_STAGES:
        return []  # deepspeed.zero_stage says so
    return [problem for technique in registered_techniques().values() if technique.active(start.long_seq)
            for problem in technique().engine_problems(start.long_seq, stage)]


MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml", "csv_monitor": None}


@start_rule("deepspeed.monitor", needs=("deepspeed",))
def _monitor_section(start: Start) -> list[str]:
    """A monitor section (tensorboard / csv_monitor / wandb / comet) DeepSpeed would reject, whose package is
    missing, or whose output_path cannot be written, refused before the model is built (DeepSpeed's own check comes
    at initialize, after the weights are allocated)."""
    import importlib.util

    config = start.ds_config
    if not start.launch.deepspeed or not any(key in config for key in MONITOR_PACKAGES):
        return []
    from deepspeed.monitor.config import get_monitor_config

    try:
        monitor = get_monitor_config(config)
    except Exception as err:  # pydantic's ValidationError: names the field and why
        return [f"the DeepSpeed config's monitor section is invalid (DeepSpeed's check): {err}"]
    problems = []
    for key, package in MONITOR_PACKAGES.items():
        section = getattr(monitor, key)
        if not section.enabled:
            continue
        if package and importlib.util.find_spec(package) is None:
            extra = " (pip install 'ds_longseq[monitor]')" if key == "tensorboard" else ""
            problems.append(f"the DeepSpeed config enables {key}, but the {package} package is not installed: "
                            f"pip install {package}{extra}, or set {key}.enabled to false")
            continue
        path = getattr(section, "output_path", "") or "."
        parent = os.path.abspath(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
            problems.append(f"{key}.output_path {path!r} cannot be written ({parent} is not a writable directory): "
                            "point it at a directory you can write")
    return problems
