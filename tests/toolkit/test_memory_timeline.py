"""The memory tier on the timeline: a memory save is an event of its own (commit on every rank, its
replica, whether it was persisted), and a checkpoint only in node RAM is shown as such."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiered_ckpt import memory_tier
from tiered_ckpt.cli.timeline import summary
from tiered_ckpt.config import MemoryConfig, NodeConfig
from tiered_ckpt.lifecycle import timeline
from tiered_ckpt.tiers.backends import make_backend

torch = pytest.importorskip("torch")


def test_memory_saves_are_on_the_timeline_persisted_or_not(tmp_path: Path) -> None:
    from tiered_ckpt.training import save_training

    lustre = tmp_path / "lustre"
    lustre.mkdir()
    cfg = NodeConfig(root=str(lustre), model="m", backend="local",
                     memory=MemoryConfig(dir=str(tmp_path / "shm"), persist_every=2))
    m = torch.nn.Linear(4, 2)
    for step in (1, 2):          # the first is persisted (every 2nd save, starting with the first)
        save_training(m, None, epoch=0, step=step, config=cfg, tier="memory")
        assert memory_tier.wait_background(60) is None
    tl = timeline.gather(make_backend(cfg))
    one, two = "global_epoch0_step1", "global_epoch0_step2"
    (e1,), (e2,) = tl.of(one, timeline.MEMORY), tl.of(two, timeline.MEMORY)
    assert "persisted to the root" in e1.detail and "not persisted" in e2.detail
    assert "no peer replica" in e2.detail and e2.seconds is not None and e2.seconds >= 0
    assert tl.of(one, timeline.WRITE) and not tl.of(two, timeline.WRITE)     # the persist wrote step 1
    assert tl.tiers[one] == "resident" and tl.tiers[two] == "memory tier only"
    rows = {r[0]: r for r in summary(tl)}
    assert rows[two][1] == "memory tier only" and rows[two][2].startswith("memory: ")
