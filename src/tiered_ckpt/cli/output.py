"""Output for humans (rich tables, progress with bytes/rate/ETA on stderr) and machines (--json).

Only the command line renders: library code (io, lifecycle, tiers) reports progress through
callbacks, which `byte_progress` and `progress_bars` turn into bars here.

This is the output edge: every string printed here (errors, --json, tables, warnings, log
records) passes through `redact`, so a SAS token or account key that reached a message
(a service URL, an SDK error quoting one) is never shown.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
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
from rich.text import Text

from tiered_ckpt import logs
from tiered_ckpt.redact import redact, redact_data

RedactingHandler = logs.RedactingHandler
__all__ = ["RedactingHandler", "redact", "redact_data"]


_cli_log = logging.getLogger("tiered_ckpt.cli")


class _RedactingConsole(Console):
    """A rich Console that redacts its string arguments before rendering.

    Before, not after: rendering wraps long lines, which could split a token across lines
    where no pattern would find it again. With `--log-format json` the stderr console's lines
    become log records instead (stderr then holds only JSON objects, one a line).
    """

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.stderr and logs.json_active() and all(isinstance(o, str) for o in objects):
            text = " ".join(Text.from_markup(o).plain if kwargs.get("markup", True) else o for o in objects)
            level, _, rest = text.partition(": ")
            if level in ("warning", "failed"):
                _cli_log.warning(rest)
            else:
                _cli_log.info(text)
            return
        super().print(*(redact(o) if isinstance(o, str) else o for o in objects), **kwargs)

    def log(self, *objects: Any, **kwargs: Any) -> None:
        super().log(*(redact(o) if isinstance(o, str) else o for o in objects), **kwargs)


# Not a terminal (a pipe, a file, journald): one line per fact, never wrapped (rich would wrap at
# $COLUMNS or 80), so grep and log shippers see whole lines. A terminal keeps rich's layout.
UNWRAPPED_WIDTH = 1 << 20


def _console(*, to_stderr: bool) -> _RedactingConsole:
    tty = (sys.stderr if to_stderr else sys.stdout).isatty()
    return _RedactingConsole(stderr=to_stderr, width=None if tty else UNWRAPPED_WIDTH, soft_wrap=not tty)


stderr = _console(to_stderr=True)
stdout = _console(to_stderr=False)


def print_json(data: Any) -> None:
    text = json.dumps(redact_data(data), indent=2, sort_keys=True, default=lambda o: redact(str(o)))
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_error(message: str, *, as_json: bool = False, exit_code: int = 1) -> None:
    message = redact(message)
    if logs.json_active():
        _cli_log.error(message, extra={"outcome": "error", "exit_code": exit_code})
    if as_json:
        print_json({"ok": False, "error": message, "exit_code": exit_code})
    elif not logs.json_active():
        # One line however long (logs, grep), and the message's own brackets are not markup.
        stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    t = Table(title=redact(title), title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*("" if v is None else redact(str(v)) for v in r))
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


def _bars() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        transient=False,
    )


def _showing(enabled: bool) -> bool:
    # No bars between JSON log lines: stderr is for the log shipper then.
    return enabled and not logs.json_active() and (stderr.is_terminal or os.environ.get("TIERED_CKPT_PROGRESS") == "1")


@contextmanager
def byte_progress(description: str, total: int, enabled: bool = True) -> Iterator[ByteProgress]:
    """One bar, known up front; `advance(n)` adds n bytes (the io layer's progress callbacks)."""
    if not _showing(enabled):
        yield ByteProgress(None, None)
        return
    with _bars() as p:
        task = p.add_task(redact(description), total=total)
        yield ByteProgress(p, task)


@contextmanager
def progress_bars(enabled: bool = True) -> Iterator[Callable[[str, int, int], None] | None]:
    """A (what, bytes done, bytes total) callback for a library call (restore): one bar per `what`.

    A bar appears with the first bytes reported for it, so a step that moves nothing (a
    resident checkpoint) shows none. None when disabled (--json, not a terminal).
    """
    if not _showing(enabled):
        yield None
        return
    lock = threading.Lock()
    tasks: dict[str, Any] = {}
    bars: list[Progress] = []

    def report(what: str, done: int, total: int) -> None:
        with lock:      # called from the threads that move the bytes
            if not bars:
                bars.append(_bars())
                bars[0].start()
            if what not in tasks:
                tasks[what] = bars[0].add_task(redact(what), total=total)
            bars[0].update(tasks[what], completed=done, total=total)

    try:
        yield report
    finally:
        with lock:
            if bars:
                bars[0].stop()
