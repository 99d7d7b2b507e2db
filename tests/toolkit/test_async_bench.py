"""The async bench's figures come from a fresh process, and that process shows the first small
async_save mapping what it saves, not the default 4 GiB budget; the GPU check says 'no CUDA'
cleanly where there is none."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.async_bench import measure_async

REPO = Path(__file__).resolve().parents[2]


def test_measure_async_reports_every_figure_from_a_fresh_process(tmp_path: Path) -> None:
    r = measure_async(tmp_path / "bench", 8 << 20)
    for key in ("memcpy_gbps", "floor_s", "blocked_s_1", "blocked_s_2", "ratio_1", "ratio_2", "write_s_2",
                "train_base", "train_during_2", "train_kept", "small_first_s", "small_rss_added",
                "small_staging_bytes"):
        assert isinstance(r[key], (int, float)) and r[key] >= 0, key
    assert r["bytes"] >= 0.9 * (8 << 20) and r["memcpy_gbps"] > 0
    # the default budget (4 GiB) is never mapped for a 4 KiB save: a few pages of staging, little RSS
    assert r["small_staging_bytes"] <= 64 << 10, r["small_staging_bytes"]
    assert r["small_rss_added"] < 256 << 20, r["small_rss_added"]
    assert r["staging_mappings"] >= 1 and r["staging_bytes"] >= r["bytes"]
    assert not list((tmp_path / "bench").glob("*/global_epoch*")), "the bench removes its checkpoints"


def test_gpu_check_says_no_cuda_cleanly() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run python -m benchmarks.gpu_check_async itself")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check_async"], capture_output=True, text=True,
                       cwd=REPO, env=env, timeout=120)
    assert p.returncode == 0 and "no CUDA" in p.stdout and "Traceback" not in p.stderr, p.stderr[-2000:]
