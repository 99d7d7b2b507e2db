"""Logging of the toolkit: one record per operation outcome, as concise text or one JSON object a line.

Library modules log through `logging.getLogger(__name__)` (never print) and attach the operation's
facts as `extra=fields(...)`: model, checkpoint, operation, duration_s, bytes, outcome. Nothing is
logged per tensor or per block: a record per save/load/retention run/restore/export iteration.

`configure(fmt, level)` routes the `tiered_ckpt` loggers (and other libraries' warnings, e.g. the
Azure SDK's) to stderr through `redact`, so a SAS token or account key that reached a message or a
field never leaves the process:

* "text": `LEVEL logger: message` (the facts are in the message already);
* "json": one JSON object per line (python-json-logger) with ts (ISO 8601, UTC), level, logger,
  message and each structured field that is present.

The CLI calls it from its `--log-format` / `--log-level` flags; a training script may call it too
(`tiered_ckpt.logs.configure("json")`) or attach its own handlers to the `tiered_ckpt` logger.
"""
from __future__ import annotations

import logging
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from tiered_ckpt.redact import redact, redact_data

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
LOGGER = "tiered_ckpt"
_state: dict[str, str] = {"format": "text"}


def fields(operation: str, *, model: str | None = None, checkpoint: str | None = None,
           duration_s: float | None = None, nbytes: int | None = None, outcome: str = "ok",
           **more: Any) -> dict[str, Any]:
    """`extra=` for one operation record: the fields that are known (None ones are left out)."""
    got: dict[str, Any] = {"operation": operation, "model": model, "checkpoint": checkpoint,
                           "duration_s": None if duration_s is None else round(float(duration_s), 6),
                           "bytes": nbytes, "outcome": outcome, **more}
    return {k: v for k, v in got.items() if v is not None}


class JsonLineFormatter(JsonFormatter):
    """ts, level, logger, message, then the record's extra fields; every string redacted."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s %(message)s",
                         rename_fields={"levelname": "level", "name": "logger"}, timestamp="ts",
                         json_ensure_ascii=False)

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        ts = log_data.pop("ts", None)
        head = {"ts": ts.isoformat(timespec="milliseconds") if ts is not None else None}
        return {**head, **redact_data(log_data)}


class RedactingHandler(logging.Handler):
    """Records to the current sys.stderr (looked up per record: tests and callers may swap it),
    credentials removed from the formatted line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(redact(self.format(record)) + "\n")
            sys.stderr.flush()
        except Exception:      # logging must never take the command down
            self.handleError(record)


def configure(fmt: str = "text", level: str = "info") -> None:
    """Send log records to stderr in `fmt` ("text" | "json"), the toolkit's at `level` and up.

    Other libraries log at WARNING and up whatever `level` is (the Azure SDK logs every HTTP
    request at INFO). Calling it again replaces the handler it installed (idempotent).
    """
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: one of {', '.join(FORMATS)}")
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r}: one of {', '.join(LEVELS)}")
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, RedactingHandler):
            root.removeHandler(h)
    h = RedactingHandler()
    h.setFormatter(JsonLineFormatter() if fmt == "json" else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(h)
    root.setLevel(logging.WARNING)
    logging.getLogger(LOGGER).setLevel(level.upper())
    _state["format"] = fmt


def json_active() -> bool:
    """Whether configure() set JSON lines (the CLI then logs what it would print on stderr)."""
    return _state["format"] == "json"
