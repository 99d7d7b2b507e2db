"""Run every benchmark suite in turn (or the ones named), then one table of every goal: measured,
goal, met / not met, and for a goal not met what bounds it on this machine (cores, disk).

    python -m benchmarks                 # all suites (`make bench`); writes docs/benchmarks.md
    python -m benchmarks --quick         # tiny sizes, one round (a smoke run); writes .bench/benchmarks.md
    python -m benchmarks scale [--quick] # one suite: scale, io, lifecycle, dcp or memory; options go to the suites
    python -m benchmarks scale --json    # the scale suite's goals as one JSON object on stdout (dcp too)
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from benchmarks import dcp_bench, io_bench, lifecycle_bench, memory_bench, scale_bench
from benchmarks.harness import BENCH_ERROR, REPO, machine

# Registered by direct import: a suite that fails to import is an error, not a silent skip.
SUITES: tuple[tuple[str, str, Callable[[Sequence[str] | None], int]], ...] = (
    ("scale", "benchmarks.scale_bench", scale_bench.main),              # every goal of the save/load path at scale, met or not
    ("io", "benchmarks.io_bench", io_bench.main),                       # tc.save/tc.load vs fio on raw buffers, hashing cost, memory
    ("lifecycle", "benchmarks.lifecycle_bench", lifecycle_bench.main),  # archive proof with a fake lfs, restore vs plain parallel download
    ("dcp", "benchmarks.dcp_bench", dcp_bench.main),                    # TieredWriter/Reader vs DCP's FileSystemWriter/Reader and fio
    ("memory", "benchmarks.memory_bench", memory_bench.main),           # memory tier: blocked time vs copy floor, recovery per tier
)
# Where each suite leaves its results (harness.report / io_bench), and where the document goes.
RESULTS_DIR = REPO / ".bench"
RESULTS = {"scale": "scale_results.json", "io": "io_results.json", "dcp": "dcp_results.json",
           "memory": "memory_results.json"}
DOC, QUICK_DOC = REPO / "docs" / "benchmarks.md", REPO / ".bench" / "benchmarks.md"
# The io suite takes its sizes from the environment: --quick's.
QUICK_IO_ENV = {"BENCH_SIZE": "256MiB", "BENCH_REPEAT": "1", "BENCH_MEM_SIZE": "256MiB"}


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy (the suites' own tables go into the document)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, s: str) -> int:
        self.out.write(s)
        self.kept.write(s)
        return len(s)

    def flush(self) -> None:
        self.out.flush()


def _goal(key: str, spec: Any) -> tuple[str, float]:
    """(comparison, threshold) from a suite's GOALS entry: ("<=", 1.2), or a bare threshold (the
    DCP suite's: seconds and blocked-time ratios are upper bounds, speed ratios lower ones)."""
    if isinstance(spec, (list, tuple)):
        return str(spec[0]), float(spec[1])
    return ("<=" if key.startswith(("many_", "async_")) else ">="), float(spec)


def _bound(key: str, facts: dict[str, Any], disk: dict[str, float]) -> str:
    """What bounds a goal's figure on this machine, with the measurement: the disk for ratios
    against fio or a peer's I/O, the cores for per-item and copy work."""
    cores = f"{facts['cores']} cores, load average {facts['load_average'][0]:.1f}"
    io_keys = ("fio", "fsw", "fsr", "write", "load", "read")
    if any(k in key for k in ("many", "async", "train", "floor", "hash", "latest", "rss")):
        return f"CPU: {cores}"
    if any(k in key for k in io_keys):
        d = ", ".join(f"{rw} {disk[rw]:.2f} GB/s" for rw in ("write", "read") if rw in disk)
        return f"disk (fio best: {d}); {cores}" if d else f"disk; {cores}"
    return cores


def goal_rows(results: dict[str, dict[str, Any]], facts: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per goal of every suite that ran: suite, goal, measured (median), goal, met, bound."""
    rows = []
    for suite, res in results.items():
        goals = res.get("goals") or getattr({"scale": scale_bench, "io": io_bench, "dcp": dcp_bench,
                                             "memory": memory_bench}[suite], "GOALS", {})
        st = res.get("stats") or {}
        disk = {rw: st[f"fio_{rw}_GBps"]["median"] for rw in ("write", "read") if f"fio_{rw}_GBps" in st}
        if suite == "io" and res.get("runs_GBps"):
            disk = {rw: max(res["runs_GBps"][f"fio_{rw}"]) for rw in ("write", "read")}
        for key, ok in res.get("met", {}).items():
            measured = st.get(key, {}).get("median") if key in st else res.get("ratios", {}).get(key)
            op, thr = _goal(key, goals[key]) if key in goals else ("", float("nan"))
            rows.append({"suite": suite, "goal": key, "measured": measured, "op": op, "threshold": thr, "met": bool(ok),
                         "bound": "" if ok else _bound(key, facts, disk)})
    return rows


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"
    return str(x)


def render_rows(rows: list[dict[str, Any]]) -> str:
    head = "| suite | goal | measured | goal | met | what bounds it here |\n|---|---|---|---|---|---|\n"
    return head + "".join(f"| {r['suite']} | {r['goal']} | {_fmt(r['measured'])} | {r['op']} {_fmt(r['threshold'])} | "
                          f"{'met' if r['met'] else 'NOT MET'} | {r['bound']} |\n" for r in rows)


def write_doc(path: Path, command: str, facts: dict[str, Any], rows: list[dict[str, Any]], transcript: str,
              seconds: float) -> None:
    facts_line = (f"{facts['cores']} cores, load average {' / '.join(map(str, facts['load_average']))} (1/5/15 min, at "
                  f"the end), {facts['memory_gib']} GiB RAM, Linux {facts['kernel']}, Python {facts['python']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "# Benchmarks\n\n"
        f"Written by `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {seconds:.0f} s) from its own run; "
        "every figure below is from that run. Ratios use the disk's figure: fio's best over queue depth 1 and 8 and "
        "4 and 8 jobs, write and read (benchmarks/harness.py `disk`).\n\n"
        f"Machine: {facts_line}.\n\n## Goals\n\n{render_rows(rows)}\n## The suites' own tables\n\n```\n{transcript.strip()}\n```\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    names = [s[0] for s in SUITES]
    chosen = [a for a in args if a in names]
    rest = [a for a in args if a not in names]
    quick = "--quick" in rest
    # With --json (the scale and DCP suites'), stdout carries only the suites' JSON; the banners go to stderr.
    as_json = "--json" in rest
    text = sys.stderr if as_json else sys.stdout
    missed, failed, ran = [], [], []
    t0 = time.monotonic()
    tee = _Tee(sys.stdout)
    for short, name, run in SUITES:
        if chosen and short not in chosen:
            continue
        print(f"\n=== {name} ===", file=text, flush=True)
        env = QUICK_IO_ENV if quick and short == "io" else {}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with contextlib.redirect_stdout(tee if not as_json else sys.stdout):
                rc = int(run(rest) or 0)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        ran.append(short)
        if rc == BENCH_ERROR:
            failed.append(name)
        elif rc:
            missed.append(name)
    # Benchmarks measure; they do not gate. A goal missed on this machine is reported with the
    # figures that explain it, not turned into a failed make; a suite that could not measure is.
    facts = machine()
    results = {}
    for short in ran:
        p = RESULTS_DIR / RESULTS.get(short, "")
        if short in RESULTS and p.is_file():
            results[short] = json.loads(p.read_text())
    rows = goal_rows(results, facts)
    if rows and not as_json:
        print("\n=== every goal ===\n" + render_rows(rows), file=text)
    if not chosen and not as_json:
        doc = QUICK_DOC if quick else DOC
        write_doc(doc, "python -m benchmarks" + (" --quick" if quick else ""), facts, rows, tee.kept.getvalue(),
                  time.monotonic() - t0)
        print(f"written: {doc}", file=text)
    print("\nall goals met" if not missed else f"\ngoals not met on this machine in: {', '.join(missed)} (see above)",
          file=text)
    if failed:
        print(f"could not run: {', '.join(failed)} (see above)", file=text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
