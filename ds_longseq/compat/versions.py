"""The tested window: the lowest and highest release of each dependency the suite runs on, and how a build's
release is read (``"0.19.8"`` of ``"0.19.8+cu124"``).

Holds:
    TESTED_VERSIONS: (floor, top) per dependency; setup.py's lower bounds are the floors (tests/test_versions.py).
    release: the release a version string belongs to.
"""

from __future__ import annotations

import re

__all__ = [
    "TESTED_VERSIONS",
    "release",
]


TESTED_VERSIONS: dict[str, tuple[str, str]] = {
    # the two stacks the suite runs on: the floor is axolotl 0.19.0's pins (its `axolotl[deepspeed]` resolves
    # DeepSpeed 0.18.9), the top the newest releases on the package index; setup.py's lower bounds are the floors
    # (tests/test_versions.py)
    "torch": ("2.13.0", "2.13.0"),
    "transformers": ("5.16.1", "5.24.0"),
    "deepspeed": ("0.18.9", "0.19.8"),
    "trl": ("1.9.0", "1.16.0"),
    "accelerate": ("1.13.0", "1.15.0"),
    "peft": ("0.20.0", "0.21.2"),
}
"""(lowest, highest) release of each dependency the test suite ran on (README "Tested versions")."""


def release(version: str) -> str:
    """"0.19.8" of "0.19.8+cu124" or "0.19.8rc1": the release a build or pre-release belongs to."""
    parts = [re.match(r"\d+", p) for p in version.split("+")[0].split(".")[:3]]
    return ".".join(m.group() if m else "0" for m in parts)
