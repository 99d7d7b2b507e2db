"""The runtime dependencies are ranges whose lower bounds are what `make test-lowest` installs and tests
(constraints-lowest.txt), and whose exact versions live in one lock (constraints.txt) inside those ranges.
Under `make test-lowest` (TIERED_CKPT_LOWEST=1) it also checks that the lowest versions are the ones imported."""
from __future__ import annotations

import importlib.metadata as md
import os
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ImportError:            # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)$")


def _pins(name: str) -> dict[str, str]:
    out = {}
    for line in (REPO / name).read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def _runtime() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["torch"]]


def _floor(r: Requirement) -> str:
    lows = [s.version for s in r.specifier if s.operator == ">="]
    assert len(lows) == 1, f"{r}: one >= lower bound expected"
    return lows[0]


def test_lower_bounds_are_what_make_test_lowest_installs_and_the_lock_is_inside_the_ranges() -> None:
    lowest, lock = _pins("constraints-lowest.txt"), _pins("constraints.txt")
    for r in _runtime():
        name = r.name.lower()
        assert Version(lowest[name]) == Version(_floor(r)), f"{name}: constraints-lowest.txt vs {r}"
        assert r.specifier.contains(lock[name]), f"constraints.txt pins {name}=={lock[name]} outside {r}"
    # what a training image brings must be admitted
    by = {r.name: r.specifier for r in _runtime()}
    assert by["numpy"].contains("1.26.4") and by["pydantic"].contains("2.9.2")


@pytest.mark.skipif(os.environ.get("TIERED_CKPT_LOWEST") != "1", reason="only under make test-lowest")
def test_the_lowest_versions_are_the_ones_imported() -> None:
    import numpy
    import pydantic

    assert numpy.__version__ == _pins("constraints-lowest.txt")["numpy"]
    assert pydantic.VERSION == _pins("constraints-lowest.txt")["pydantic"]
    for name, v in _pins("constraints-lowest.txt").items():
        assert Version(md.version(name)) == Version(v), name
