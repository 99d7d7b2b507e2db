"""Output for humans (rich tables, progress with bytes/rate/ETA on stderr) and machines (--json).

This is the output edge: every string printed here (errors, --json, tables, warnings, log
records) passes through `redact`, so a SAS token or account key that reached a message
(a service URL, an SDK error quoting one) is never shown.
"""
from __future__ import annotations

import json
import logging
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

from tiered_ckpt.redact import redact, redact_data

__all__ = ["redact", "redact_data"]


class _RedactingConsole(Console):
    """A rich Console that redacts its string arguments before rendering.

    Before, not after: rendering wraps long lines, which could split a token across lines
    where no pattern would find it again.
    """

    def print(self, *objects: Any, **kwargs: Any) -> None:
        super().print(*(redact(o) if isinstance(o, str) else o for o in objects), **kwargs)

    def log(self, *objects: Any, **kwargs: Any) -> None:
        super().log(*(redact(o) if isinstance(o, str) else o for o in objects), **kwargs)


stderr = _RedactingConsole(stderr=True)
# Reports stay readable when piped (rich would fall back to 80 columns).
stdout = _RedactingConsole(width=None if sys.stdout.isatty() else 150)


def print_json(data: Any) -> None:
    text = json.dumps(redact_data(data), indent=2, sort_keys=True, default=lambda o: redact(str(o)))
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_error(message: str, *, as_json: bool = False, exit_code: int = 1) -> None:
    message = redact(message)
    if as_json:
        print_json({"ok": False, "error": message, "exit_code": exit_code})
    else:
        # One line however long (logs, grep), and the message's own brackets are not markup.
        stderr.print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)


def write_err(text: str) -> None:
    """Plain text to stderr (no markup, no wrapping), redacted."""
    sys.stderr.write(redact(text))
    sys.stderr.flush()


class RedactingHandler(logging.Handler):
    """Log records (ours and the Azure SDK's) to the current sys.stderr, credentials removed."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(redact(self.format(record)) + "\n")
        except Exception:      # logging must never take the command down
            self.handleError(record)


def install_log_redaction(level: int = logging.WARNING) -> None:
    """Route root logging through RedactingHandler (instead of logging's unredacted lastResort)."""
    root = logging.getLogger()
    if not any(isinstance(h, RedactingHandler) for h in root.handlers):
        h = RedactingHandler(level)
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)


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
        task = p.add_task(redact(description), total=total)
        yield ByteProgress(p, task)


def _force_progress() -> bool:
    import os

    return os.environ.get("TIERED_CKPT_PROGRESS") == "1"
