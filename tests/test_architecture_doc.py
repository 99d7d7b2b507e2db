"""docs/architecture.md's "where to look" table stays true: each answer is one path that exists
and still defines the name it points at."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (?P<q>[^|]+\?) \| `(?P<path>[^`]+)` \(`(?P<name>[^`]+)`\) \|$")


def _defines(text: str, name: str) -> bool:
    *owners, last = name.split(".")
    for owner in owners:
        if not re.search(rf"^class {re.escape(owner)}\b", text, re.M):
            return False
    return bool(re.search(rf"^\s*(def|class) {re.escape(last)}\b|^{re.escape(last)}\s*[:=]", text, re.M))


def test_every_answer_is_one_path_that_defines_its_name() -> None:
    rows = [m for line in (REPO / "docs" / "architecture.md").read_text().splitlines() if (m := ROW.match(line))]
    assert len(rows) >= 4, "the table lost its rows (or their shape: | question? | `path` (`name`) |)"
    for m in rows:
        path = REPO / m["path"]
        assert path.is_file(), f"{m['q']}: {m['path']} does not exist"
        assert _defines(path.read_text(), m["name"]), f"{m['q']}: {m['path']} no longer defines {m['name']}"
