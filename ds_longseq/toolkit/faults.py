"""Fault injection for the package's own crash-safety tests. FOR TESTS ONLY: no user run sets it.

The fault tests (tests/test_faults.py, tests/test_sft.py, tests/test_multinode.py) need a rank to
die, hang or crash at a chosen point of a real DeepSpeed job. They ask for it through one
environment variable, read here and nowhere else, rather than through command-line flags: an
environment variable reaches every rank of a launcher (DeepSpeed forwards it to remote nodes when
it is listed in the ``.deepspeed_env`` file that ``DS_ENV_FILE`` names) and keeps the examples'
flags for users. Unset (the normal case), every hook below does nothing.

``DS_LONGSEQ_FAULT_INJECT`` takes one of:

- ``sigkill:RANK:STEP:WHERE``: global rank RANK acts in (1-based) step STEP; WHERE is
    ``backward``: SIGKILL before its first backward of the step (the others wait in a collective);
    ``save``: SIGKILL at its first file of the step-STEP checkpoint (the others may have written theirs);
    ``stop``: SIGSTOP before its backward (a hung rank);
    ``sleep``: sleep an hour before its backward (for a kill from outside).
- ``crash_during_save:STEP``: every rank exits (status 17) right after writing its part of the
  step-STEP checkpoint, before ``latest`` moves to it.
- ``enospc_during_save:STEP``: the disk fills up at every rank's first file of the step-STEP checkpoint: the file is
  left 0 bytes long and the write fails as torch's zip writer fails on a full disk (``unexpected pos``).

Holds:
    FAULT_INJECT_ENV: the variable's name.
    Fault: one parsed fault (kind, rank, step, where).
    parse_fault: text -> Fault, with an error naming the variable and the expected forms.
    active_fault: the fault the environment asks for, or None.
    before_backward: the hook a training loop calls before a step's first backward.
    arm_before_save / after_save: the hooks around writing a checkpoint (used by toolkit.checkpoint).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Literal

__all__ = ["FAULT_INJECT_ENV", "Fault", "parse_fault", "active_fault", "before_backward", "arm_before_save",
           "after_save", "CRASH_EXIT_CODE"]

FAULT_INJECT_ENV = "DS_LONGSEQ_FAULT_INJECT"
CRASH_EXIT_CODE = 17
"""Exit status of ``crash_during_save``: distinct from a Python error's 1, so a test sees which it got."""

_WHERE = ("backward", "save", "stop", "sleep")
_FORMS = ("'sigkill:RANK:STEP:WHERE' (WHERE: backward, save, stop or sleep), 'crash_during_save:STEP' or "
          "'enospc_during_save:STEP' (RANK >= 0, STEP >= 1)")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault to inject (see the module docstring for what each kind does)."""

    kind: Literal["sigkill", "crash_during_save", "enospc_during_save"]
    """What happens."""
    step: int
    """The 1-based optimizer step in which it happens."""
    rank: int | None = None
    """The global rank it happens on (``sigkill``); None: every rank (the ``*_during_save`` kinds)."""
    where: Literal["backward", "save", "stop", "sleep"] | None = None
    """For ``sigkill``: at which point of the step, and SIGKILL, SIGSTOP or a long sleep."""


def parse_fault(text: str) -> Fault:
    """``DS_LONGSEQ_FAULT_INJECT``'s value as a :class:`Fault`.

    Raises:
        ValueError: naming the variable, the bad value and the accepted forms.
    """
    parts = text.strip().split(":")
    try:
        if parts[0] == "sigkill" and len(parts) == 4 and parts[3] in _WHERE:
            fault = Fault("sigkill", step=int(parts[2]), rank=int(parts[1]), where=parts[3])
            if fault.rank >= 0 and fault.step >= 1:
                return fault
        elif parts[0] in ("crash_during_save", "enospc_during_save") and len(parts) == 2:
            fault = Fault(parts[0], step=int(parts[1]))
            if fault.step >= 1:
                return fault
    except ValueError:  # int() of a non-number: reported below with the forms
        pass
    raise ValueError(
        f"{FAULT_INJECT_ENV}={text!r} is not a fault: expected {_FORMS}. This variable is a test-only hook "
        f"of ds_longseq's crash-safety tests: unset it for a normal run"
    )


def active_fault() -> Fault | None:
    """The fault ``DS_LONGSEQ_FAULT_INJECT`` asks for, or None when it is unset or empty.

    Read on every call (cheap) rather than cached, so a test that sets the variable in-process is seen. A requeued
    SLURM job (``SLURM_RESTART_COUNT`` above 0) injects nothing: its environment is the first attempt's, and the fault
    belongs to that attempt (tests/test_slurm.py requeues a job whose task it made hang).
    """
    text = os.environ.get(FAULT_INJECT_ENV, "")
    if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return None
    return parse_fault(text) if text.strip() else None


def before_backward(rank: int, step: int) -> None:
    """Call before the first backward of (1-based) step ``step``: acts on a ``sigkill`` fault there."""
    fault = active_fault()
    if fault is None or fault.kind != "sigkill" or (fault.rank, fault.step) != (rank, step) or fault.where == "save":
        return
    if fault.where == "sleep":
        time.sleep(3600)
    os.kill(os.getpid(), signal.SIGSTOP if fault.where == "stop" else signal.SIGKILL)


def arm_before_save(engine, rank: int, step: int) -> None:
    """Call before saving the step-``step`` checkpoint: with a ``sigkill ... save`` fault for this rank
    and step, SIGKILL this process at the first file DeepSpeed's checkpoint engine writes (before writing it); with
    an ``enospc_during_save`` fault for this step, fail that file as a full disk does."""
    fault = active_fault()
    if fault is not None and (fault.kind, fault.step) == ("enospc_during_save", step):
        def full(state_dict, path, *args, **kwargs):
            open(path, "wb").close()  # what a full disk leaves: the file, empty
            raise RuntimeError(f"[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0 (injected by "
                               f"{FAULT_INJECT_ENV})")

        engine.checkpoint_engine.save = full
        return
    if fault is None or (fault.kind, fault.rank, fault.step, fault.where) != ("sigkill", rank, step, "save"):
        return

    def save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    engine.checkpoint_engine.save = save


def after_save(step: int) -> None:
    """Call after this rank wrote the step-``step`` checkpoint and before ``latest`` moves: exits on a
    ``crash_during_save`` fault for that step (``os._exit``: no cleanup, as a crash)."""
    fault = active_fault()
    if fault is not None and fault.kind == "crash_during_save" and fault.step == step:
        os._exit(CRASH_EXIT_CODE)
