"""`make bench`: measured figures for the README (speed and memory goals live here, not in tests)."""
from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What a suite's main() returns: 0 every goal met; GOALS_MISSED some goal not met on this machine
# (reported in its table, not a failure); BENCH_ERROR the suite could not measure (missing fio, a
# child that failed), which makes `python -m benchmarks` exit nonzero.
GOALS_MISSED = 1
BENCH_ERROR = 2


def tools_missing(torch_for: str) -> bool:
    """Say on stderr what is missing (fio, torch) and how to install it; True when something is."""
    if shutil.which("fio") is None:
        print("fio not found: run `make install` (installs Debian's fio)", file=sys.stderr)
        return True
    try:
        import torch  # noqa: F401
    except ImportError:
        print(f"torch not installed: {torch_for} (`make install` installs the pinned CPU torch)", file=sys.stderr)
        return True
    return False


def report(res: dict[str, Any], out: Path, as_json: bool, render: Callable[[dict[str, Any]], str]) -> int:
    """Write the results to `out`, print the JSON or the table; 0 when every goal is met, else GOALS_MISSED."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    if as_json:
        print(json.dumps(res))
    else:
        print(render(res))
        print(f"results: {out}")
    return 0 if all(res["met"].values()) else GOALS_MISSED     # in the table; not an error of the bench
