"""`python -m tiered_demo` (`make demo`): the local end-to-end run (see demo.py).

Local mode only: nodes never get this package. It reuses the toolkit's command-line edge
(errors, --json, redaction) with this one command.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tiered_ckpt.cli.app import main as toolkit_main
from tiered_ckpt.cli.output import human_bytes, print_json, print_table, stdout
from tiered_ckpt.config import NodeConfig, parse_duration, parse_size


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "demo", parents=[parent],
        help="run the whole lifecycle locally: write, export to Azurite, retention, loss, restore",
        description="Local end-to-end run against a directory and a private Azurite on 127.0.0.1.",
    )
    p.add_argument("--dir", default=".demo", help="work directory (default: .demo)")
    p.add_argument("--checkpoints", type=int, default=6, help="checkpoints to save (default: 6)")
    p.add_argument("--size", default="256MiB", help="bytes per checkpoint (default: 256MiB)")
    p.add_argument("--interval", default="3s", help="time between checkpoints (default: 3s)")
    p.add_argument("--keep-last", type=int, default=2, help="retention: keep the newest N (default: 2)")
    p.add_argument("--azurite-port", type=int, help="port for Azurite (default: any free one; a taken one is replaced)")
    p.add_argument("--no-png", action="store_true", help="skip the timeline picture")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, cfg: NodeConfig) -> int:
    from tiered_demo.demo import DemoOptions
    from tiered_demo.demo import run as run_demo

    opts = DemoOptions(
        workdir=Path(args.dir), checkpoints=args.checkpoints, size=parse_size(args.size, "--size"),
        interval=parse_duration(args.interval, "--interval"), keep_last=args.keep_last,
        azurite_port=args.azurite_port, png=not args.no_png, progress=not args.json,
    )

    def say(msg: str) -> None:
        if not args.json:
            stdout.print(f"[dim]{msg}[/]", highlight=False)

    report = run_demo(opts, say)
    if args.json:
        print_json(report.to_json())
        return 0
    print_table("Checkpoints", ["checkpoint", "size", "write s", "write GB/s", "archived after s", "retention"], [
        (c.name, human_bytes(c.bytes), f"{c.write_seconds:.2f}", f"{c.write_GBps:.2f}",
         "-" if c.archived_after_seconds is None else f"{c.archived_after_seconds:.1f}", c.retention or "kept")
        for c in report.checkpoints
    ])
    print_table(f"Retention actions ({report.retention_runs} runs on a timer, then one after export)",
                ["t (s)", "checkpoint", "decision", "reason"],
                [(f"{e['t']:.1f}", e["checkpoint"], e["decision"], e["reason"]) for e in report.retention_log])
    print_table("Retention: last plan", ["checkpoint", "decision", "reason"],
                [(e["checkpoint"], e["decision"], e["reason"]) for e in report.retention_final])
    stdout.print(
        f"restored [bold]{report.restored}[/] from Blob in {report.restore_seconds:.2f} s "
        f"({report.restore_GBps or 0:.2f} GB/s), hashes verified, identical to the last saved state: "
        f"[bold green]{'yes' if report.restore_matches_training else 'NO'}[/]"
    )
    stdout.print(f"{report.export_iterations} export iterations; total {report.total_seconds:.1f} s")
    if report.timeline_png:
        stdout.print(f"timeline: {report.timeline_png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m tiered_demo [--dir D] [--checkpoints N] ...`: the flags of the demo command."""
    args = list(sys.argv[1:] if argv is None else argv)
    return toolkit_main(["demo", *args], commands=(register,), prog="python -m tiered_demo")
