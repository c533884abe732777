"""``--report-to``: which of DeepSpeed's monitors a run's per-step metrics also go to, from the command line.

Holds:
    REPORT_TO: the destinations, each with the DeepSpeed config's monitor section it turns on and the package it needs.
    report_to_sections: the sections a --report-to value names (None: not given; (): none).
    check_report_to: a bad value or a missing package refused in one line, before DeepSpeed starts.
    report_to_config: the DeepSpeed config with those sections on (writing under --save-dir), or every one off.

What :class:`~ds_longseq.toolkit.metrics.MetricsLog` writes to the monitors, and how W&B's step is kept, is there.
No torch here: the ``ds-longseq`` command checks the flag before it starts the launcher.
"""

from __future__ import annotations

import os

__all__ = ["REPORT_TO", "MONITOR_SECTIONS", "WANDB_PROJECT", "report_to_sections", "check_report_to",
           "report_to_config"]


REPORT_TO = {"tensorboard": ("tensorboard", "tensorboard"), "csv": ("csv_monitor", None), "wandb": ("wandb", "wandb")}
"""--report-to's destinations: {name: (the DeepSpeed config's monitor section it turns on, the package it needs)}."""


def report_to_sections(value: str | None) -> tuple[str, ...] | None:
    """The DeepSpeed monitor sections a --report-to value turns on: None when the flag is not given (the config
    decides), () for ``none``. Refuses an unknown name and ``none`` beside another, in one line."""
    if value is None:
        return None
    names = [name.strip() for name in value.split(",")]
    known = ", ".join(REPORT_TO)
    unknown = [name for name in names if name not in REPORT_TO and name != "none"]
    if unknown:
        raise SystemExit(f"--report-to {value}: unknown destination {unknown[0]!r}: pass a comma-separated list of "
                         f"{known}, or none")
    if "none" in names:
        if len(names) > 1:
            raise SystemExit(f"--report-to {value}: none turns every monitor off: pass it alone, or leave it out")
        return ()
    return tuple(dict.fromkeys(REPORT_TO[name][0] for name in names))


def check_report_to(value: str | None) -> None:
    """Refuse a bad --report-to (:func:`report_to_sections`) and a destination whose package is not installed,
    naming the pip install, before DeepSpeed starts (its monitor would fail only after the weights are built)."""
    import importlib.util

    report_to_sections(value)
    for name in [] if value is None else [n.strip() for n in value.split(",")]:
        package = REPORT_TO.get(name, (None, None))[1]
        if package and importlib.util.find_spec(package) is None:
            raise SystemExit(f"--report-to {name}: the {package} package is not installed: pip install {package}, or "
                             f"leave {name} out of --report-to")


WANDB_PROJECT = "ds-longseq"
"""The W&B project of ``--report-to wandb`` where neither the config's wandb section nor WANDB_PROJECT names one."""
MONITOR_SECTIONS = ("tensorboard", "csv_monitor", "wandb", "comet")
"""The DeepSpeed config's monitor sections (DeepSpeed's ``get_monitor_config`` reads these)."""


def report_to_config(ds_config: dict, report_to: str | None, save_dir: str) -> dict:
    """``ds_config`` with what ``--report-to`` asks for (a new dict; the sections it touches are new dicts too).

    Not given (None): the config as it is. ``none``: every monitor section it has turned off. Otherwise each named
    destination's section on, beside whatever the config enables: ``tensorboard`` and ``csv`` write in
    ``save_dir/tensorboard/`` and ``save_dir/csv_monitor/`` (the flag's place wins over the section's output_path),
    ``wandb`` keeps the section's project / team / group (project: WANDB_PROJECT, else ``ds-longseq``).

    With ``wandb``, WANDB_DIR is set to ``save_dir`` unless it is set already: DeepSpeed's monitor calls
    ``wandb.init`` without a directory, and W&B reads its place from there (else the working directory).
    """
    sections = report_to_sections(report_to)
    if sections is None:
        return ds_config
    config = dict(ds_config)
    if not sections:
        for key in MONITOR_SECTIONS:
            if key in config:
                config[key] = {**config[key], "enabled": False}
        return config
    for key in sections:
        section = {**config.get(key, {}), "enabled": True}
        if key == "wandb":
            section.setdefault("project", os.environ.get("WANDB_PROJECT", WANDB_PROJECT))
            os.environ.setdefault("WANDB_DIR", os.path.abspath(save_dir))
        else:
            section.update(output_path=save_dir, job_name=key)  # DeepSpeed writes in output_path/job_name/
        config[key] = section
    return config
