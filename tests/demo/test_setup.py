"""`make demo` / `make test` set-up faults: an unreachable npm registry says what failed."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("npm") is None or shutil.which("make") is None, reason="needs npm and make")
@pytest.mark.timeout(120)
def test_unreachable_npm_registry_gives_one_clear_message(tmp_path: Path) -> None:
    for name in ("Makefile", "package.json", "package-lock.json"):
        shutil.copy(REPO / name, tmp_path / name)
    env = {**os.environ, "npm_config_registry": "http://127.0.0.1:9/", "npm_config_fetch_retries": "0",
           "npm_config_cache": str(tmp_path / "npm-cache"), "npm_config_offline": "false"}
    r = subprocess.run(["make", "node_modules/.bin/azurite-blob"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=110)
    assert r.returncode != 0
    assert "error: npm could not install Azurite (package.json) from the npm registry" in r.stderr
    assert "http://127.0.0.1:9/" in r.stderr
    assert not (tmp_path / "node_modules" / ".bin" / "azurite-blob").exists()
