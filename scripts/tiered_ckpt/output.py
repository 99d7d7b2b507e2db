"""Output for humans (rich tables, progress with bytes/rate/ETA on stderr) and machines (--json)."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

stderr = Console(stderr=True)
# Reports stay readable when piped (rich would fall back to 80 columns).
stdout = Console(width=None if sys.stdout.isatty() else 150)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def print_error(message: str, *, as_json: bool = False, exit_code: int = 1) -> None:
    if as_json:
        print_json({"ok": False, "error": message, "exit_code": exit_code})
    else:
        # One line however long (logs, grep), and the message's own brackets are not markup.
        stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    stdout.print(t)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class ByteProgress:
    """A byte-counting progress bar (bytes, rate, ETA); silent when disabled (--json)."""

    def __init__(self, progress: Progress | None, task: Any) -> None:
        self._p, self._t = progress, task

    def advance(self, nbytes: int) -> None:
        if self._p is not None:
            self._p.update(self._t, advance=nbytes)


@contextmanager
def byte_progress(description: str, total: int, enabled: bool = True) -> Iterator[ByteProgress]:
    if not enabled or not stderr.is_terminal and not _force_progress():
        yield ByteProgress(None, None)
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        transient=False,
    ) as p:
        task = p.add_task(description, total=total)
        yield ByteProgress(p, task)


def _force_progress() -> bool:
    import os

    return os.environ.get("TIERED_CKPT_PROGRESS") == "1"
