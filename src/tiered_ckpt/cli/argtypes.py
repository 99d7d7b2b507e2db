"""argparse types for command-line values that the OS or the clock would otherwise reject late,
with a traceback: a port outside 0-65535 (bind(2)), a number of seconds that is not finite or
does not fit a timestamp (time.sleep, datetime)."""
from __future__ import annotations

import argparse
import math

MAX_SECONDS = 7 * 86400.0      # a refresh interval longer than a week is a typo, not a wish


def port(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a port number; use 1-65535 (0: any free port)") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port number; use 1-65535 (0: any free port)")
    return n


def seconds(value: str) -> float:
    """A positive, finite number of seconds, at most MAX_SECONDS."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds, e.g. 2 or 0.5") from None
    if not math.isfinite(x) or x <= 0 or x > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{value!r}: use a number of seconds > 0 and at most {MAX_SECONDS:g}")
    return x


def count(value: str) -> int:
    """A whole number >= 1 (of iterations, files, threads)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be >= 1")
    return n
