"""The registry of start rules: whether a run can start, one rule at a time, each declared beside what it is about.

Holds:
    Launch: what is known of the processes (ranks, whether DeepSpeed runs them).
    RunShape: what is known of the run (sequence length, padding for sequence parallelism, the ring degree).
    Start: what a rule reads: the DeepSpeed config, its parsed ``long_seq`` section, the launch and the run.
    StartRule, start_rule, start_rules: a rule's record, the decorator that registers one, and the registry.

A rule is a function ``Start -> list[str]`` (each string one problem, naming the fix) registered with
:func:`start_rule` in the module of the section it is about: ``config.py`` beside the ``long_seq`` sections
(sequence parallelism against the ranks and the length, a chunk that spans the sequence), ``resolver.py`` beside
DeepSpeed's own keys (the ZeRO stage, ``sequence_parallel_size``, the monitor section) and the techniques'
declared engine problems. :func:`ds_longseq.resolver.resolve` is the one caller: it runs every rule whose inputs
are known (a rule that ``needs`` the sequence length waits until one is given) and reports every problem at once.

This module imports nothing of ds_longseq (and no torch): the bottom of the import graph, so ``config.py`` can
register its rules here and the torch-free planner can resolve a config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["Launch", "RunShape", "Start", "StartRule", "start_rule", "start_rules", "NEEDS", "deepspeed_sp_size",
           "RULE_MODULES"]

NEEDS = frozenset({"world", "seq_len", "deepspeed"})
"""What a rule may need beyond the config: ``world`` (the launched ranks), ``seq_len`` (the run's length),
``deepspeed`` (whether the run goes through DeepSpeed; the Trainer without a DeepSpeed config does not)."""


@dataclass(frozen=True)
class Launch:
    """The processes, as far as the caller knows them (None: not known yet; the rules that need it wait)."""

    world: int | None = None
    """Ranks launched in all."""
    deepspeed: bool | None = None
    """Whether DeepSpeed runs the job (False: the Hugging Face Trainer without a DeepSpeed config)."""


@dataclass(frozen=True)
class RunShape:
    """The run, as far as the caller knows it (None: not known yet)."""

    seq_len: int | None = None
    """Tokens per sequence."""
    pad_for_sp: bool = False
    """Sequences are padded to what sequence parallelism needs (the scripts' --pad-for-sp), so any length fits."""
    ring: int | None = None
    """The ring degree of the sequence parallelism once chosen from the model's heads (None: the config's
    ``sequence_parallel.ring``, else 1 until a model is built)."""


@dataclass(frozen=True)
class Start:
    """What one rule reads."""

    ds_config: dict[str, Any]
    """DeepSpeed's config, without its ``long_seq`` section."""
    long_seq: Any
    """The parsed ``long_seq`` section (a ``ds_longseq.config.LongSeqConfig``)."""
    launch: Launch
    run: RunShape


@dataclass(frozen=True)
class StartRule:
    """One registered rule."""

    name: str
    """Where it belongs and what it checks, dotted (``sequence_parallel.divides_world``): unique."""
    check: Callable[[Start], list[str]]
    """The problems it finds (empty: none)."""
    needs: frozenset[str]
    """Of :data:`NEEDS`: what must be known for the rule to run."""
    warns: bool
    """Its findings are warnings (the run starts, logged once), not refusals."""

    @property
    def home(self) -> str:
        """The module the rule is written in."""
        return self.check.__module__


_RULES: dict[str, StartRule] = {}


def start_rule(name: str, *, needs: tuple[str, ...] = (), warns: bool = False) -> Callable:
    """Register the decorated ``check(start) -> list[str]`` as the start rule ``name``.

    Raises:
        ValueError: ``name`` is registered already (a rule exists once), or ``needs`` names an unknown input.
    """
    unknown = set(needs) - NEEDS
    if unknown:
        raise ValueError(f"start rule {name!r} needs {sorted(unknown)}: a rule may need {sorted(NEEDS)}")

    def register(check: Callable[[Start], list[str]]) -> Callable[[Start], list[str]]:
        if name in _RULES:
            raise ValueError(f"a start rule named {name!r} is already registered ({_RULES[name].home})")
        _RULES[name] = StartRule(name, check, frozenset(needs), warns)
        return check

    return register


RULE_MODULES = ("ds_longseq.config", "ds_longseq.ops.sp_layout", "ds_longseq.resolver")
"""Every module that registers start rules, imported by :func:`start_rules` before it answers: the rules in force
never depend on what happened to be imported first (all torch-free)."""


def start_rules() -> dict[str, StartRule]:
    """Every start rule by name (:data:`RULE_MODULES` loaded first), in registration order."""
    import importlib

    for module in RULE_MODULES:
        importlib.import_module(module)
    return dict(_RULES)


def deepspeed_sp_size(ds_config: Mapping[str, Any]) -> int | None:
    """DeepSpeed's top-level ``sequence_parallel_size`` when it is a positive integer (None: unset, or not one; the
    rule ``deepspeed.sequence_parallel_size`` refuses the latter)."""
    size = ds_config.get("sequence_parallel_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 1 else None
