"""The ``ds-longseq`` command (``python -m ds_longseq.cli``): train, plan, and the shipped configs, from any directory.

    ds-longseq train [FLAGS]        examples/sft.py's training (``ds-longseq train --help``); without a launcher it
                                    starts DeepSpeed's over the local GPUs (2 CPU ranks without), or runs one
                                    process with --num_gpus 1
    ds-longseq dpo   [FLAGS]        examples/dpo.py's DPO, started as train is
    ds-longseq grpo  [FLAGS]        examples/grpo.py's GRPO on precomputed rollouts, started as train is
    ds-longseq plan  [FLAGS]        the memory planner (python -m ds_longseq.plan)
    ds-longseq configs [NAME]       the shipped DeepSpeed configs, or one of them as JSON (to copy and edit)
    ds-longseq verify [FLAGS]       one step of your model, stock against your config's long_seq: exact or not
                                    (docs/VERIFY.md; exit 1 when not)

Holds:
    main: the command's entry point (setup.py's console script); returns the exit status.
    OBJECTIVES: the training subcommands (train, dpo, grpo) and the module of each.
    objective_command: ``ds-longseq train`` / ``dpo`` / ``grpo``: under a launcher, one rank's training; without one,
        the launcher started here (or one process).
    configs_command: ``ds-longseq configs``.
    launcher_command: the DeepSpeed launcher's command line for ``ds-longseq train`` (``CUDA_VISIBLE_DEVICES`` kept),
        or for another subcommand (dpo, grpo, verify).
    run_forwarding_signals: run it in its own process group, passing SIGTERM / SIGINT / SIGHUP on to all of it.

Exit statuses, every subcommand: 0 done (the planner: the run fits), 1 the step does not fit, 2 bad input with one
line on stderr; another status is a genuine error, with its traceback. Nothing heavy is imported before a subcommand
needs it (``ds-longseq configs`` loads no torch).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from typing import Mapping

from ds_longseq.config_files import SHIPPED_CONFIGS, ConfigFileError, find_ds_config, read_json_file, shipped_configs

__all__ = ["main", "OBJECTIVES", "objective_command", "configs_command", "launcher_command", "run_forwarding_signals",
           "DEFAULT_CPU_RANKS"]

PROG = "ds-longseq"
DEFAULT_CPU_RANKS = 2
"""Ranks ``ds-longseq train`` starts on a machine without a GPU: the README quick start's shape."""
OBJECTIVES = {"train": "ds_longseq.cli.train", "dpo": "ds_longseq.cli.dpo", "grpo": "ds_longseq.cli.grpo"}
"""{subcommand: its module}; each module has ``build_parser(prog)``, ``check_args(args)`` and ``main(argv)``."""

USAGE = __doc__.split("\n\n")[1]


def main(argv: list[str] | None = None) -> int:
    """``ds-longseq SUBCOMMAND ...``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} {{train,dpo,grpo,plan,configs,verify}} ...\n\n{USAGE}\n\n"
              f"{PROG} SUBCOMMAND --help: its flags.")
        return 0 if argv else 2
    if argv[0] == "--version":
        from importlib.metadata import version

        print(f"{PROG} {version('ds_longseq')}")
        return 0
    command, rest = argv[0], argv[1:]
    if command in OBJECTIVES:
        return objective_command(command, rest)
    if command == "plan":
        from ds_longseq import plan

        return plan.main(rest, prog=f"{PROG} plan")
    if command == "configs":
        return configs_command(rest)
    if command == "verify":
        from ds_longseq.cli import verify

        return verify.main(rest, prog=f"{PROG} verify", launch=_launch_verify)
    print(f"{PROG}: unknown subcommand {command!r}: use train, dpo, grpo, plan, configs or verify ({PROG} --help)",
          file=sys.stderr)
    return 2


def _add_launch_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags ``ds-longseq train`` (dpo, grpo) reads itself (how to start the ranks), which no launched rank sees."""
    group = p.add_argument_group("starting the ranks (only without a launcher)")
    group.add_argument("--num_gpus", "--num-gpus", dest="num_gpus", type=int, default=None,
                       help="ranks to start through DeepSpeed's launcher, as `deepspeed --num_gpus N` (CPU ranks "
                            f"without a GPU); 1 runs one process, no launcher. Default: every local GPU, or "
                            f"{DEFAULT_CPU_RANKS} CPU ranks without one. Under a launcher (deepspeed, torchrun, "
                            "mpirun) the launcher's ranks are used and this is refused")
    group.add_argument("--master_port", "--master-port", dest="master_port", type=int, default=None,
                       help="the launcher's rendezvous port (default: a free one)")
    return p


def objective_command(command: str, argv: list[str]) -> int:
    """``ds-longseq train`` (``dpo``, ``grpo``: a key of :data:`OBJECTIVES`): under a launcher, this rank's training
    (the module's ``main``). Without one, the flags and the DeepSpeed config are checked here, once, then
    DeepSpeed's launcher starts ``--num_gpus`` ranks of this same command (saying so on stderr), or with one rank the
    training runs in this process."""
    import importlib

    from ds_longseq.processes.process_group import free_port, launcher_environment
    from ds_longseq.toolkit.args import exit_status

    objective = importlib.import_module(OBJECTIVES[command])
    launch, rest = _add_launch_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False)).parse_known_args(argv)
    # all checked, --help; abbreviations off as in the ranks' parser (an abbreviation accepted here and not there
    # would fail only after the ranks started)
    args = _add_launch_args(objective.build_parser(prog=f"{PROG} {command}")).parse_args(argv)
    launcher = launcher_environment()

    def refuse_or_launch(_argv):
        if launcher is not None:
            if launch.num_gpus is not None:
                raise SystemExit(f"--num_gpus {launch.num_gpus}: this process was started by {launcher}, whose ranks "
                                 f"are used: leave --num_gpus out, or run `{PROG} {command}` without a launcher")
            return objective.main(rest)
        ranks = _local_ranks(launch.num_gpus)
        if ranks == 1:
            return objective.main(rest)
        objective.check_args(args)  # once, here: the ranks would each print the same refusal
        _check_ranks_fit(args.ds_config, ranks)
        device = "GPUs" if _cuda_count() else "CPU ranks"
        port = launch.master_port or free_port()
        command_line = launcher_command(ranks, port, rest, cuda=bool(_cuda_count()), subcommand=command)
        start, end = command_line.index("deepspeed.launcher.runner") + 1, command_line.index("--no_local_rank")
        shown = " ".join(command_line[start:end])
        print(f"{PROG}: no launcher: starting DeepSpeed's launcher over {ranks} {device} (as `deepspeed {shown}`); "
              "--num_gpus 1 runs one process", file=sys.stderr, flush=True)
        return run_forwarding_signals(command_line)

    return exit_status(refuse_or_launch, argv)


def launcher_command(ranks: int, port: int, rest: list[str], *, cuda: bool,
                     env: Mapping[str, str] | None = None, subcommand: str = "train") -> list[str]:
    """DeepSpeed's launcher over ``ranks`` local ranks running ``ds-longseq <subcommand> rest``. On GPUs with
    ``CUDA_VISIBLE_DEVICES`` set, the first ``ranks`` of those devices by ``--include localhost:...``: DeepSpeed's
    runner ignores (and removes) the variable whenever ``--num_gpus`` is passed, and would start the ranks on devices
    0..N-1 instead."""
    env = os.environ if env is None else env
    visible = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    where = ["--include", "localhost:" + ",".join(visible[:ranks])] if cuda and visible else ["--num_gpus", str(ranks)]
    return [sys.executable, "-u", "-m", "deepspeed.launcher.runner", *where, "--master_port", str(port),
            "--no_local_rank", "--module", "ds_longseq.cli", subcommand, *rest]


def _launch_verify(ranks: int, argv: list[str]) -> int:
    """``ds-longseq verify argv`` on ``ranks`` ranks started by DeepSpeed's launcher (a sequence-parallel config)."""
    from ds_longseq.processes.process_group import free_port

    return run_forwarding_signals(launcher_command(ranks, free_port(), argv, cuda=bool(_cuda_count()),
                                                   subcommand="verify"))


FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What ``ds-longseq train`` (dpo, grpo) passes on to the launcher it started (SLURM and container runtimes send
SIGTERM first; in a container the command is often PID 1, whose children would otherwise outlive it)."""
KILL_AFTER_S = 30.0
"""How long the launcher's processes have to end after a forwarded signal before they are killed."""


def run_forwarding_signals(command: list[str]) -> int:
    """Run ``command`` (the launcher) in a process group of its own and wait for it; a SIGTERM, SIGINT or SIGHUP to
    this process goes to that whole group (the runner, its launch process and every rank), and whatever is still
    alive :data:`KILL_AFTER_S` later is killed. Returns the launcher's status, or 128 + the signal's number."""
    import time

    proc = subprocess.Popen(command, start_new_session=True)
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        while True:
            try:
                status = proc.wait(timeout=None if not received else KILL_AFTER_S)
                break
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        if received:
            deadline = time.monotonic() + KILL_AFTER_S  # the ranks may outlive the runner: the group ends too
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            return 128 + received[0]
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _local_ranks(num_gpus: int | None) -> int:
    """--num_gpus, or every local GPU, or :data:`DEFAULT_CPU_RANKS` without a GPU."""
    if num_gpus is not None and num_gpus < 1:
        raise SystemExit(f"--num_gpus must be >= 1, got {num_gpus}")
    gpus = _cuda_count()
    if num_gpus is not None and gpus and num_gpus > gpus:
        raise SystemExit(f"--num_gpus {num_gpus}: this machine has {gpus} GPU(s); pass at most {gpus}, or use a "
                         "hostfile for several machines (docs/LAUNCHING.md)")
    return num_gpus or gpus or DEFAULT_CPU_RANKS


def _check_ranks_fit(ds_config: str, ranks: int) -> None:
    """Refuse a sequence-parallel size that does not divide the ranks about to start (before starting them)."""
    from ds_longseq.resolver import Launch, resolve
    from ds_longseq.toolkit.distributed import resolve_or_exit

    resolve_or_exit(ds_config, lambda: resolve(ds_config, launch=Launch(world=ranks)))


def configs_command(argv: list[str]) -> int:
    """``ds-longseq configs``: every shipped DeepSpeed config with what it is for; ``ds-longseq configs NAME``: that
    config's JSON on stdout (``> my.json`` to edit a copy)."""
    p = argparse.ArgumentParser(prog=f"{PROG} configs", description=configs_command.__doc__.split(";")[0])
    p.add_argument("name", nargs="?", help="a shipped config's name (or a path): print its JSON")
    p.add_argument("--path", action="store_true", help="print the file's path instead of its JSON")
    args = p.parse_args(argv)
    if args.name is None:
        about = _descriptions()
        width = max(map(len, shipped_configs()))
        print(f"shipped DeepSpeed configs ({SHIPPED_CONFIGS}); pass a name as --ds_config NAME:\n")
        for name in shipped_configs():
            print(f"  {name:<{width}}  {about.get(name, '')}")
        print(f"\n{PROG} configs NAME prints one (> my.json to edit a copy); details: "
              f"{os.path.join(SHIPPED_CONFIGS, 'README.md')}")
        return 0
    try:
        path = find_ds_config(args.name)
        text = json.dumps(read_json_file(path), indent=2)
    except ConfigFileError as err:
        print(err, file=sys.stderr)
        return 2
    print(path if args.path else text)
    return 0


def _descriptions() -> dict[str, str]:
    """{name: what it is}, from the rows of the shipped configs' README tables (``| `name.json` | ... | what |``)."""
    about = {}
    with open(os.path.join(SHIPPED_CONFIGS, "README.md"), encoding="utf-8") as f:
        for line in f:
            match = re.match(r"\|\s*`([\w.-]+)\.json`\s*\|(.*)\|\s*$", line)
            if match:
                cells = [cell.strip() for cell in match.group(2).split("|")]
                text = re.sub(r"\s*\([^()]*\)", "", cells[-1].replace("`", "")).split("; ")[0]  # the README: more
                about[match.group(1)] = (f"[{cells[0]}] " if len(cells) > 1 else "") + text
    return about
