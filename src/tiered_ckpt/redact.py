"""Credential redaction for every string that leaves the process (errors, --json, warnings, logs).

A Blob service URL built from a SAS connection string carries the token in its query string,
and SDK/urllib3 errors quote that URL ("Max retries exceeded with url: /c?...&sig=...").
`redact` removes what authenticates a request, wherever it appears in a string:

* SAS query parameters (the Azure Storage SAS reference lists them: sv, ss, srt, sp, se, st,
  spr, sip, sr, si, sig, sdd, skoid, sktid, skt, ske, sks, skv, saoid, suoid, scid, rscc, ...),
  after `?`, `&` or `;` (plain or percent-encoded), and `sig=` anywhere;
* `AccountKey=...` and `SharedAccessSignature=...` in connection strings;
* Authorization headers and bearer tokens, and JSON/dict fields holding tokens or secrets.

It is pure (no I/O, no dependencies) so library modules (blobstore) and the output edge
(output.py) can both use it.
"""
from __future__ import annotations

import re
from typing import Any

MASK = "REDACTED"

# Characters of a SAS value / base64 key: URL-safe, percent-encoded, base64, dates, comma lists.
_VAL = r"[A-Za-z0-9%+/=._~:,-]*"
_SAS_PARAMS = (
    "sv|ss|srt|sp|se|st|spr|sip|sr|si|sig|sdd|skoid|sktid|skt|ske|sks|skv|saoid|suoid|scid|"
    "rscc|rscd|rsce|rscl|rsct|ses|api-version-sas"
)

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Connection-string fields first: the whole SAS (it holds '&'-joined params) up to ';'.
    (re.compile(r"(?i)(SharedAccessSignature\s*=\s*)[^;\s\"'<>\[\]]*"), r"\1" + MASK),
    (re.compile(r"(?i)(AccountKey\s*=\s*)[^;\s\"'<>\[\]]*"), r"\1" + MASK),
    # SAS query parameters after ?, & or ; (and their percent-encoded separators %3F / %26).
    (re.compile(r"(?i)((?:[?&;]|%3F|%26)(?:" + _SAS_PARAMS + r")(?:=|%3D))" + _VAL), r"\1" + MASK),
    # Any signature, wherever it stands (e.g. a bare token "sv=...&sig=...").
    (re.compile(r"(?i)(\bsig(?:=|%3D))" + _VAL), r"\1" + MASK),
    # Authorization headers in any rendering: "Authorization: Bearer x", {'Authorization': 'x'}.
    (re.compile(r"(?i)(authorization[\"']?\s*[:=]\s*[\"']?)(?:(?:bearer|basic|sharedkey|sharedkeylite)\s+)?[^\s\"',;}\]]+"),
     r"\1" + MASK),
    (re.compile(r"(?i)(\bbearer\s+)[A-Za-z0-9._~+/=-]+"), r"\1" + MASK),
    # Token/secret fields of JSON or dicts (identity endpoints, az CLI output).
    (re.compile(r"(?i)([\"']?\b(?:access_?token|refresh_?token|id_?token|client_?secret|password|account_?key)[\"']?\s*[:=]\s*[\"']?)"
                r"[^\s\"',;&}\]]+"), r"\1" + MASK),
)


def redact(text: str) -> str:
    """`text` with every credential replaced by REDACTED (idempotent)."""
    if not text:
        return text
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


def redact_data(data: Any) -> Any:
    """A copy of JSON-like data (dicts, lists, tuples, strings) with every string redacted."""
    if isinstance(data, str):
        return redact(data)
    if isinstance(data, dict):
        return {redact_data(k): redact_data(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_data(v) for v in data]
    return data


def safe_url(url: str) -> str:
    """scheme://host/path of a URL: no query string, fragment or user info."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
    except ValueError:
        return redact(url.split("?", 1)[0])
    try:
        port = u.port
    except ValueError:
        port = None
    if not u.scheme or not u.hostname:
        return redact(url.split("?", 1)[0])
    host = u.hostname + (f":{port}" if port else "")
    return f"{u.scheme}://{host}{u.path}"
