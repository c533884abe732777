"""The tested version window: setup.py's lower bounds are the floor stack's releases, the installed stack lies inside
the window docs/VERSIONS.md names, and ds_longseq's version-dependent code paths answer for the installed releases."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
from packaging.version import Version

from ds_longseq.compat import TESTED_VERSIONS

ROOT = Path(__file__).resolve().parent.parent


def _lower_bounds() -> dict[str, set[str]]:
    """Every ``name>=X`` in setup.py, by name (a name may appear in several extras)."""
    bounds: dict[str, set[str]] = {}
    for name, version in re.findall(r'"([A-Za-z0-9_.\-]+)>=([0-9][0-9.]*)', (ROOT / "setup.py").read_text()):
        bounds.setdefault(name, set()).add(version)
    return bounds


def test_setup_lower_bounds_are_the_tested_floors():
    bounds = _lower_bounds()
    for name, (floor, _top) in TESTED_VERSIONS.items():
        assert name in bounds, f"setup.py names no lower bound for {name}"
        # "1.9" admits 1.9.0: compare as releases
        assert {Version(v) for v in bounds[name]} == {Version(floor)}, (
            f"setup.py's lower bounds for {name} are {sorted(bounds[name])}, its tested floor is {floor} "
            "(ds_longseq.compat.TESTED_VERSIONS): the two must say the same")


def test_docs_name_both_ends_of_every_range():
    table = (ROOT / "docs" / "VERSIONS.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for name, (floor, top) in TESTED_VERSIONS.items():
        row = next((line for line in table.splitlines() if line.startswith(f"| {name} ")), None)
        assert row is not None, f"docs/VERSIONS.md's table has no row for {name}"
        assert f"| {floor} | {top} |" in row, f"docs/VERSIONS.md's row for {name} ({row!r}) must say {floor}, {top}"
        if name != "torch":
            assert f"{floor}-{top}" in readme, f"README's Tested versions line must say {name} {floor}-{top}"


@pytest.mark.parametrize("name", sorted(TESTED_VERSIONS))
def test_installed_release_is_inside_the_tested_window(name):
    """A run on a release outside the window tests something the README does not claim: extend TESTED_VERSIONS
    (and setup.py, README) when the suite has passed on it, or install a release inside."""
    try:
        installed = Version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name} is not installed (an optional extra)")
    floor, top = (Version(v) for v in TESTED_VERSIONS[name])
    release = Version(installed.base_version)  # 2.13.0+cpu -> 2.13.0
    assert floor <= release, f"{name} {installed} is older than the tested floor {floor}"
    assert release.release[:2] <= top.release[:2], f"{name} {installed} is newer than the tested {top}"
