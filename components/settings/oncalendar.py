"""systemd OnCalendar= validation in pure Python (systemd.time(7), "Calendar Events").

The retention timer's schedule reaches systemd on the login VM at first boot; a schedule systemd
rejects there leaves the timer dead and retention silently off. This checks the grammar before
anything is deployed: `[WEEKDAYS] [[YEAR-]MONTH-DAY] [HOUR:MINUTE[:SECOND]] [TIMEZONE]`, the
shorthands (minutely ... annually), `@<unix seconds>`; each numeric field a list of `*`, values,
`a..b` ranges and `/n` repetitions within the field's range; `~` before the day counts from the
month's end. tests/infra/test_infra_validation.py runs `systemd-analyze calendar` as the oracle.
"""
from __future__ import annotations

import re
import zoneinfo

SHORTHANDS = frozenset({"minutely", "hourly", "daily", "monthly", "weekly", "yearly", "annually", "quarterly",
                        "semiannually"})
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
# systemd's calendar-spec bounds: years 1970-2199.
_RANGES = {"year": (1970, 2199), "month": (1, 12), "day": (1, 31), "hour": (0, 23), "minute": (0, 59), "second": (0, 59)}
_NUM = re.compile(r"[0-9]+")
_SEC = re.compile(r"[0-9]+(\.[0-9]{1,6})?")


def _weekday(tok: str) -> int | None:
    t = tok.lower()
    for i, name in enumerate(WEEKDAYS):
        if t in (name, name[:3]):
            return i
    return None


def _weekdays(tok: str) -> bool:
    for part in tok.split(","):
        a, sep, b = part.partition("..")
        first, last = _weekday(a), (_weekday(b) if sep else 0)
        if first is None or last is None or (sep and last < first):
            return False
    return True


def _number(text: str, field: str) -> float | None:
    if not (_SEC if field == "second" else _NUM).fullmatch(text):
        return None
    value = float(text)
    lo, hi = _RANGES[field]
    return value if lo <= value <= hi + (0.999999 if field == "second" else 0) else None


def _component(tok: str, field: str) -> bool:
    if tok == "":
        return False
    for part in tok.split(","):
        if part == "*":
            continue
        base, slash, rep = part.partition("/")
        if slash and (not _NUM.fullmatch(rep) or int(rep) == 0):
            return False
        a, dots, b = base.partition("..")
        start = _number(a, field)
        if start is None:
            return False
        if dots:
            end = _number(b, field)
            if end is None or end < start:
                return False
    return True


def _date(tok: str) -> bool:
    tilde = tok.count("~")
    if tilde > 1:
        return False
    parts = re.split(r"[-~]", tok)
    if tilde and not re.search(r"~[^-~]*$", tok):
        return False      # '~' may only stand before the day
    if len(parts) == 2:
        parts = ["*", *parts]
    if len(parts) != 3:
        return False
    return all(_component(p, f) for p, f in zip(parts, ("year", "month", "day"), strict=True))


def _time(tok: str) -> bool:
    parts = tok.split(":")
    if len(parts) == 2:
        parts.append("0")
    if len(parts) != 3:
        return False
    return all(_component(p, f) for p, f in zip(parts, ("hour", "minute", "second"), strict=True))


def _timezone(tok: str) -> bool:
    return tok == "UTC" or tok in zoneinfo.available_timezones()


def problem(spec: str) -> str | None:
    """None if systemd would accept `spec` as OnCalendar=, else what is wrong with it."""
    if spec != spec.strip() or not spec:
        return "has leading or trailing blanks" if spec else "is empty"
    if spec.startswith("@"):
        return None if _NUM.fullmatch(spec[1:]) else "'@' must be followed by unix seconds"
    tokens = spec.split()
    if tokens and _timezone(tokens[-1]) and len(tokens) > 1:
        tokens = tokens[:-1]
    if len(tokens) == 1 and tokens[0].lower() in SHORTHANDS:
        return None
    if any(t.lower() in SHORTHANDS for t in tokens):
        return "a shorthand (daily, hourly, ...) stands alone, optionally with a time zone"
    if tokens and re.match(r"[A-Za-z]", tokens[0]):
        if not _weekdays(tokens[0]):
            return f"{tokens[0]!r} is not a weekday list such as Mon..Fri or Sat,Sun"
        tokens = tokens[1:]
        if not tokens:
            return None
    if len(tokens) == 2:
        date, time = tokens
        if not _date(date):
            return f"{date!r} is not a [YEAR-]MONTH-DAY date"
        if not _time(time):
            return f"{time!r} is not a HOUR:MINUTE[:SECOND] time"
        return None
    if len(tokens) == 1:
        tok = tokens[0]
        if ":" in tok:
            return None if _time(tok) else f"{tok!r} is not a HOUR:MINUTE[:SECOND] time (0-23:0-59:0-59)"
        if "-" in tok or "~" in tok:
            return None if _date(tok) else f"{tok!r} is not a [YEAR-]MONTH-DAY date"
        return f"{tok!r} is neither a date nor a time"
    return "has more parts than [WEEKDAYS] [DATE] [TIME] [TIMEZONE]"
