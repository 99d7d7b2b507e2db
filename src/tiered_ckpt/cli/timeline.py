"""`tiered-ckpt timeline` (a PNG, a table or --json of what happened to each checkpoint) and the live
view of `tiered-ckpt status --watch`; both show lifecycle/timeline.py's data, which renders nothing.

matplotlib is not a node dependency: it is imported inside `draw`, and a node without it gets one
line naming the extra that brings it (`pip install 'tiered-ckpt[timeline]'`).
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from rich.table import Table

from tiered_ckpt.cli import argtypes
from tiered_ckpt.cli.output import human_bytes, print_json, print_table, redact, redact_data, stderr, stdout
from tiered_ckpt.config import NodeConfig, parse_duration
from tiered_ckpt.errors import EXIT_OK, ConfigError, UserError
from tiered_ckpt.io import fsafe
from tiered_ckpt.lifecycle import timeline as tl_mod
from tiered_ckpt.lifecycle.timeline import ARCHIVE, MEMORY, PENDING, RESTORE, RETENTION, WRITE, Timeline
from tiered_ckpt.tiers.backends import make_backend

INSTALL_HINT = "pip install 'tiered-ckpt[timeline]'"
COLORS = {WRITE: "#1f77b4", ARCHIVE: "#2ca02c", RESTORE: "#9467bd", RETENTION: "#ff7f0e", MEMORY: "#17becf"}
# retention action -> (matplotlib marker, colour)
RETENTION_MARKS = {"delete": ("X", "#ff7f0e"), "resume-delete": ("X", "#ff7f0e"), "release": ("v", "#8c564b"),
                   "blocked": ("|", "#d62728")}


def _utc(t: float | None) -> str:
    return "-" if t is None else datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _when(t: float | None, now: float) -> str:
    """The time of day within the last day (a live view has little room), else the date too."""
    if t is None or now - t > 86400:
        return _utc(t)
    return datetime.fromtimestamp(t, timezone.utc).strftime("%H:%M:%SZ")


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.1f}s"


def summary(tl: Timeline) -> list[tuple[str, ...]]:
    """One row per checkpoint: where it is, its write, its archive lag, retention, restores."""
    rows: list[tuple[str, ...]] = []
    for name in tl.checkpoints():
        w = tl.of(name, WRITE) or tl.of(name, MEMORY)     # a memory-only save: its memory commit
        a = tl.of(name, ARCHIVE)
        r = tl.of(name, RETENTION)
        x = tl.of(name, RESTORE)
        now = tl.generated_unix
        write = f"{_secs(w[-1].seconds)} at {_when(w[-1].end_unix, now)}" if w else "-"
        if w and w[-1].kind == MEMORY:
            write = f"memory: {write} ({w[-1].detail})"
        if not a:
            archived = "-"
        elif a[-1].action == PENDING:
            archived = f"not yet ({_secs(tl.generated_unix - a[-1].start_unix)} since commit): {a[-1].detail}"
        else:
            archived = f"after {_secs(a[-1].seconds)}"
        ret = "-"
        if r:    # why, where it matters: a delete's reason is always the same
            ret = f"{r[-1].action} at {_when(r[-1].start_unix, now)}" + (
                f": {r[-1].detail}" if r[-1].detail and r[-1].action not in ("delete", "release") else "")
        restore = ", ".join(f"{e.action} {_secs(e.seconds)}" for e in x) or "-"
        rows.append((name, tl.tiers.get(name, "gone"), write, archived, ret, restore))
    return rows


COLUMNS = ("checkpoint", "now", "write + commit", "proven archived", "last retention", "restores")


def draw(tl: Timeline, path: str | Path, title: str | None = None,
         markers: Sequence[tuple[float, str]] = ()) -> Path:
    """The timeline as a PNG: one lane per checkpoint; `markers`: (unix time, label) vertical lines."""
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise UserError(f"--out {path}: the timeline is drawn as a PNG; give a file name ending in .png")
    if out.is_dir() or (out.exists() and not out.is_file()):
        raise UserError(f"--out {path}: is not a regular file (a directory, FIFO or device); give a .png file's path")
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"drawing the timeline needs matplotlib, which is not installed here: {INSTALL_HINT} "
                        "(or leave out --out: the table and --json need nothing more)") from None
    matplotlib.use("Agg")  # no display on nodes or CI
    import matplotlib.pyplot as plt
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names = tl.checkpoints()
    lane = {n: i for i, n in enumerate(names)}
    ends = [e.end_unix or e.start_unix for e in tl.events] + [t for t, _ in markers]
    if any(e.action == PENDING for e in tl.events):
        ends.append(tl.generated_unix)
    t0 = min([e.start_unix for e in tl.events] + [t for t, _ in markers], default=tl.generated_unix)
    span = max(ends, default=t0) - t0
    unit, scale = ("hours", 3600.0) if span > 7200 else ("minutes", 60.0) if span > 180 else ("seconds", 1.0)

    def x(t: float) -> float:
        return (t - t0) / scale

    fig, ax = plt.subplots(figsize=(11, 2.2 + 0.45 * max(1, len(names))))
    for e in tl.events:
        y = lane[e.checkpoint]
        if e.kind == RETENTION:
            mark, color = RETENTION_MARKS.get(e.action, ("o", "grey"))
            big = e.action == "blocked"      # a thin bar: drawn taller to stand out on the archive span
            ax.plot([x(e.start_unix)], [y], marker=mark, color=color, markersize=18 if big else 9,
                    markeredgewidth=3 if big else 2, linestyle="none")
            continue
        end = e.end_unix if e.end_unix is not None else (tl.generated_unix if e.action == PENDING else e.start_unix)
        width = max(x(end) - x(e.start_unix), span / scale / 400 if span else 0.02)
        ax.barh(y, width, left=x(e.start_unix), height=0.25 if e.kind == ARCHIVE else 0.5,
                color=COLORS.get(e.kind, "grey"), alpha=0.9, hatch="//" if e.action == PENDING else None,
                fill=e.action != PENDING, edgecolor=COLORS.get(e.kind, "grey"))
        if e.kind == RESTORE:
            ax.text(x(end), y, f" {e.action}", va="center", fontsize=7, color=COLORS[RESTORE])
    for t, label in markers:
        ax.axvline(x(t), color="#d62728", linestyle="--", linewidth=1.5)
        ax.text(x(t), -0.55, f" {label}", color="#d62728", fontsize=8, va="bottom")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.9)   # first checkpoint on top, room for the markers' labels
    ax.set_xlim(left=0)
    ax.set_xlabel(f"{unit} since {_utc(t0)}")
    ax.set_title(title or f"tiered-ckpt timeline: {tl.model} ({tl.root})")
    legend: list[Artist] = [Patch(color=COLORS[MEMORY], label="memory tier commit (node RAM)"),
              Patch(color=COLORS[WRITE], label="write + commit"),
              Patch(color=COLORS[ARCHIVE], label="commit until proven archived"),
              Patch(facecolor="none", edgecolor=COLORS[ARCHIVE], hatch="//", label="not yet archived"),
              Patch(color=COLORS[RESTORE], label="restore (path)")]
    legend += [Line2D([], [], marker=m, color=c, linestyle="none", markeredgewidth=2, label=f"retention {a}")
               for a, (m, c) in RETENTION_MARKS.items() if a != "resume-delete"]
    legend += [Line2D([], [], color="#d62728", linestyle="--", label=label) for label in dict.fromkeys(m for _, m in markers)]
    ax.legend(handles=legend, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written whole and renamed into place; whatever was planted at the name meanwhile is refused.
    fsafe.replace_own(out, buf.getvalue())
    return out


def _since(args: argparse.Namespace) -> float | None:
    if args.since is None:
        return None
    # Longer ago than the epoch is "everything" (and never a timestamp before year 1).
    return max(0.0, time.time() - parse_duration(args.since, "--since"))


def cmd_timeline(args: argparse.Namespace, cfg: NodeConfig) -> int:
    since = _since(args)
    tl = tl_mod.gather(make_backend(cfg), since_unix=since)
    png = str(draw(tl, args.out)) if args.out else None
    if args.json:
        print_json({"ok": True, **tl.to_json(), "png": png})
        return EXIT_OK
    rows = [(_utc(e.start_unix), e.checkpoint, e.kind, e.action, _secs(e.seconds),
             human_bytes(e.bytes) if e.bytes else "", e.detail) for e in tl.events]
    print_table(f"timeline of {tl.model} ({tl.root})" + (f" since {_utc(since)}" if since else ""),
                ("time", "checkpoint", "event", "action", "duration", "bytes", "detail"), rows)
    for w in tl.warnings:
        stderr.print(f"[yellow]warning:[/] {w}", highlight=False)
    if png:
        stdout.print(f"timeline: {png}", highlight=False)
    return EXIT_OK


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("timeline", parents=[parent],
                       help="what happened to each checkpoint and when: write, archive, retention, restores",
                       description="The model's checkpoints on both tiers from the toolkit's own records (save and "
                                   "restore history, markers, archive listing, retention decisions): a table, --json, "
                                   f"or a PNG with --out (needs matplotlib: {INSTALL_HINT}).")
    p.add_argument("--since", metavar="DURATION", help="only what happened in the last DURATION, e.g. 30m, 6h, 2d")
    p.add_argument("--out", metavar="FILE.png", help="draw the timeline into this PNG")
    p.set_defaults(handler=cmd_timeline)


# -- status --watch ---------------------------------------------------------------------------

WATCH_INTERVAL = 2.0
_WATCH_ONLY = ("interval", "iterations", "since")


def wants_watch(args: argparse.Namespace) -> bool:
    """--watch, or one of its flags without it (which `watch` refuses rather than ignore)."""
    return bool(args.watch) or any(getattr(args, k) is not None for k in _WATCH_ONLY)


def add_watch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--watch", action="store_true",
                   help="a live view of each checkpoint's timeline, refreshed every --interval; Ctrl-C to stop "
                        "(not a terminal: one snapshot per interval)")
    p.add_argument("--interval", type=argtypes.seconds, metavar="S",
                   help=f"seconds between refreshes (default {WATCH_INTERVAL:g})")
    p.add_argument("--iterations", type=argtypes.count, metavar="N", help="stop after N refreshes (default: until Ctrl-C)")
    p.add_argument("--since", metavar="DURATION", help="with --watch: only what happened in the last DURATION")


def _view(tl: Timeline) -> Table:
    t = Table(title=redact(f"{tl.model} ({tl.root}) at {_utc(tl.generated_unix)}; Ctrl-C to stop"),
              title_justify="left", caption="\n".join(redact(w) for w in tl.warnings) or None)
    for c in COLUMNS:
        t.add_column(c)
    for r in summary(tl):
        t.add_row(*(redact(v) for v in r))
    return t


def _snapshot(tl: Timeline) -> None:
    """Not a terminal: one line per fact, so that a log or a pipe reads it without wrapping."""
    sys.stdout.write(f"{_utc(tl.generated_unix)} {tl.model} ({tl.root})\n")
    for r in summary(tl):
        sys.stdout.write(redact("  " + "; ".join(f"{k}: {v}" for k, v in zip(COLUMNS, r, strict=True))) + "\n")
    for w in tl.warnings:
        sys.stdout.write(redact(f"  warning: {w}") + "\n")
    sys.stdout.flush()


def watch(args: argparse.Namespace, cfg: NodeConfig) -> int:
    if not args.watch:
        given = ", ".join(f"--{k}" for k in _WATCH_ONLY if getattr(args, k) is not None)
        raise ConfigError(f"{given} only apply to status --watch; add --watch (or leave them out)")
    if args.interval is None:
        args.interval = WATCH_INTERVAL
    if args.interval <= 0:
        raise ConfigError(f"--interval: {args.interval} must be > 0 seconds")
    if args.iterations is not None and args.iterations < 1:
        raise ConfigError(f"--iterations: {args.iterations} must be >= 1")
    backend = make_backend(cfg)
    live_view = sys.stdout.isatty() and not args.json
    n = 0

    def one() -> Timeline:
        return tl_mod.gather(backend, since_unix=_since(args))

    try:
        if live_view:
            from rich.live import Live

            with Live(_view(one()), console=stdout, auto_refresh=False) as live:
                n = 1
                while args.iterations is None or n < args.iterations:
                    time.sleep(args.interval)
                    live.update(_view(one()), refresh=True)
                    n += 1
            return EXIT_OK
        while args.iterations is None or n < args.iterations:
            if n:
                time.sleep(args.interval)
            tl = one()
            if args.json:      # one JSON object per line: a stream a script can read line by line
                sys.stdout.write(json.dumps(redact_data({"ok": True, **tl.to_json()}), sort_keys=True) + "\n")
                sys.stdout.flush()
            else:
                _snapshot(tl)
            n += 1
    except KeyboardInterrupt:
        pass                   # stopping a watch is what Ctrl-C is for: not an error
    return EXIT_OK


__all__ = ["COLUMNS", "INSTALL_HINT", "add_watch_flags", "cmd_timeline", "draw", "register", "summary", "wants_watch",
           "watch"]
