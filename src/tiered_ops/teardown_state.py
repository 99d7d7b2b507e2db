"""What one teardown run is given and what it remembers: its options and its journal.

The journal (.teardown/<stack>.json) records which steps of a teardown are done, so that a
re-run after an interruption continues from there (docs/teardown.md, "Interrupted teardowns").
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tiered_ckpt.errors import ConfigError


@dataclass(frozen=True)
class Options:
    stack: str
    project_dir: Path
    state_dir: Path
    dry_run: bool = False
    yes: bool = False
    force: bool = False
    as_json: bool = False
    wait_timeout: float = 1800.0
    poll_interval: float = 30.0
    manual_export: bool = False
    lustre_root: Path | None = None
    blob_check: bool = True
    connection_string: str | None = None
    arm_endpoint: str | None = None
    disable_timeout: float = 1800.0
    verify_content: bool = False        # download and hash every file of every checkpoint
    lfs: str = "lfs"                    # the lfs binary for `lfs hsm_state` (with lustre_root)
    download_concurrency: int = 8



@dataclass
class Journal:
    """.teardown/<stack>.json: which steps of this teardown are done (re-runs continue from it)."""

    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, state_dir: Path, stack: str) -> Journal:
        path = state_dir / f"{stack}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            data = {}
        except ValueError:
            raise ConfigError(f"teardown journal {path} is not valid JSON; inspect it, then delete it and re-run") from None
        if data.get("completed"):
            data = {}      # a finished teardown: this is a new campaign's teardown
        data.setdefault("stack", stack)
        data.setdefault("steps", {})
        return cls(path, data)

    def done(self, step: str) -> bool:
        return step in self.data["steps"]

    def mark(self, step: str, **extra: Any) -> None:
        self.data["steps"][step] = {"utc": now_utc().isoformat(), **extra}
        self.save()

    def unmark(self, step: str) -> None:
        self.data["steps"].pop(step, None)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.path)


def now_utc() -> datetime:
    return datetime.now(timezone.utc)
