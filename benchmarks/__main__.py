"""Run every benchmark suite in turn; each prints its own figures and ratios."""
from __future__ import annotations

import importlib
import sys

SUITES = (
    "benchmarks.io_bench",         # writer/reader vs fio, hashing cost, async blocking, memory
    "benchmarks.lifecycle_bench",  # archive proof with a fake lfs, restore vs plain parallel download
)


def main() -> int:
    missed = []
    for name in SUITES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            print(f"[{name}] not present, skipped")
            continue
        print(f"\n=== {name} ===", flush=True)
        if int(mod.main(sys.argv[1:]) or 0):
            missed.append(name)
    # Benchmarks measure; they do not gate. A goal missed on this machine is reported above
    # with the figures that explain it (and in the README), not turned into a failed make.
    print("\nall goals met" if not missed else f"\ngoals not met on this machine in: {', '.join(missed)} (see above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
