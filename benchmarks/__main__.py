"""Run every benchmark suite in turn; each prints its own figures and ratios."""
from __future__ import annotations

import importlib
import sys

SUITES = (
    "benchmarks.io_bench",         # writer/reader vs fio, hashing cost, async blocking, memory
    "benchmarks.lifecycle_bench",  # archive proof with a fake lfs, restore vs plain parallel download
)


def main() -> int:
    rc = 0
    for name in SUITES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            print(f"[{name}] not present, skipped")
            continue
        print(f"\n=== {name} ===", flush=True)
        rc |= int(mod.main(sys.argv[1:]) or 0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
