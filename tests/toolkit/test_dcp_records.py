"""A save through DCP (TieredWriter, hence save_training and Lightning too) leaves the record tc.save leaves:
`tiered-ckpt metrics` has its save samples and the timeline knows when its write started."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402

from tiered_ckpt import records  # noqa: E402
from tiered_ckpt.config import NodeConfig  # noqa: E402
from tiered_ckpt.dcp import TieredWriter  # noqa: E402
from tiered_ckpt.lifecycle import metrics, timeline  # noqa: E402
from tiered_ckpt.tiers.backends import make_backend  # noqa: E402


def test_a_dcp_save_is_recorded_for_metrics_and_the_timeline(root: Path) -> None:
    cfg = NodeConfig(root=str(root), model="m", backend="local")
    t0 = time.time()
    dcp.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, no_dist=True,
             storage_writer=TieredWriter(config=cfg, epoch=0, step=7))
    rec = records.read(str(root), "m", records.SAVE)
    assert rec is not None and rec["name"] == "global_epoch0_step7" and rec["bytes"] >= 4 << 16
    assert rec["totals"] == {"saves": 1.0, "bytes": float(rec["bytes"])}
    got = metrics.samples(cfg, make_backend(cfg))
    assert any(k.startswith("tiered_ckpt_save_seconds") or k.endswith("save_seconds") for k in got), sorted(got)
    writes = [e for e in timeline.gather(make_backend(cfg)).events if e.kind == timeline.WRITE]
    assert [(e.checkpoint, e.action) for e in writes] == [("global_epoch0_step7", "save")]
    assert t0 - 1 <= writes[0].start_unix <= writes[0].end_unix      # not "write start unknown"
