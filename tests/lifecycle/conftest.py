"""Fixtures of the lifecycle tests: the fake lfs environment and a store with fast retries."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fake_lfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the fake lfs at a fresh state file; returns the process-counter file."""
    state = tmp_path / "lfs-state.json"
    count = tmp_path / "lfs-count.txt"
    monkeypatch.setenv("FAKE_LFS_STATE", str(state))
    monkeypatch.setenv("FAKE_LFS_COUNT", str(count))
    monkeypatch.delenv("FAKE_LFS_DEFAULT_FLAGS", raising=False)
    monkeypatch.delenv("FAKE_LFS_COST", raising=False)
    return count
