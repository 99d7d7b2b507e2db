"""The memory tier's settings, budget policy, metrics and status, without torch: copies are written
with tc.save (the same commit protocol) into the layout tiers/memory.py defines."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import tiered_ckpt as tc
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import ConfigError, MemoryConfig, NodeConfig, dump, load
from tiered_ckpt.errors import UserError
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.lifecycle import metrics
from tiered_ckpt.tiers import memory as tm


def _copy(root: Path, step: int, nbytes: int = 4096) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tc.save({"w": os.urandom(nbytes)}, epoch=0, step=step, root=root, model="m")


def test_memory_settings_are_checked_and_left_out_of_a_default_dump(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("memory:\n  keep: 0\n  budget_bytes: lots\n  persist_evry: 3\n")
    with pytest.raises(ConfigError) as e:
        load(str(conf))
    msg = str(e.value)
    assert "memory.keep" in msg and "memory.budget_bytes" in msg and "did you mean persist_every" in msg
    conf.write_text("memory:\n  dir: /dev/shm/tiered-ckpt\n  budget_bytes: 120GiB\n  timeout: 30s\n")
    cfg = load(str(conf))
    assert (cfg.memory.budget_bytes, cfg.memory.timeout, cfg.memory.keep) == (120 << 30, 30.0, 2)
    assert "memory" not in dump(NodeConfig()) and "memory" in dump(cfg)


def test_the_budget_evicts_the_oldest_copies_and_a_refusal_evicts_nothing(tmp_path: Path) -> None:
    mdir = tmp_path / "shm"
    root = tm.own_root(mdir, 1, 0)
    for step in (1, 2, 3):
        _copy(root, step)
    size = sum(p.stat().st_size for p in (root / "m" / "global_epoch0_step1").iterdir())
    cfg = MemoryConfig(dir=str(mdir), keep=5, budget_bytes=tm.usage(mdir))      # full: the next needs one out
    room = tm.make_room(cfg, root, "m", "global_epoch", size, "global_epoch0_step4")
    assert room.evicted == ("global_epoch0_step1",)
    assert [i.name for i in tm.committed(root, "m", "global_epoch")] == ["global_epoch0_step2", "global_epoch0_step3"]
    with pytest.raises(UserError, match=r"memory tier full.*memory.budget_bytes=.*nothing was evicted"):
        tm.make_room(cfg, root, "m", "global_epoch", 3 * size, "global_epoch0_step4")
    assert len(tm.committed(root, "m", "global_epoch")) == 2
    # memory.keep counts the copy about to be written.
    tm.make_room(MemoryConfig(dir=str(mdir), keep=1), root, "m", "global_epoch", size, "global_epoch0_step4")
    assert tm.committed(root, "m", "global_epoch") == []


def test_a_half_written_copy_is_not_a_checkpoint_and_is_cleared(tmp_path: Path) -> None:
    mdir = tmp_path / "shm"
    root = tm.own_root(mdir, 2, 1)
    _copy(root, 1)
    _copy(root, 2)
    (root / "m" / "global_epoch0_step2" / MARKER).unlink()     # killed before its marker
    assert [i.name for i in tm.committed(root, "m", "global_epoch")] == ["global_epoch0_step1"]
    _copy(root, 3)
    tm.trim(root, "m", "global_epoch", keep=2)
    assert not (root / "m" / "global_epoch0_step2").exists()
    assert [i.name for i in tm.committed(root, "m", "global_epoch")] == ["global_epoch0_step1", "global_epoch0_step3"]


def test_metrics_and_status_show_this_nodes_memory_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mdir, lustre = tmp_path / "shm", tmp_path / "lustre"
    lustre.mkdir()
    for step in (1, 2):
        _copy(tm.own_root(mdir, 2, 0), step)
    _copy(tm.peer_root(mdir, 2, 1), 2)
    tm.write_stats(mdir, 0, {"saves": 2, "replicas": 2, "replica_failures": 1, "replica_lag_seconds": 0.25,
                             "persists": 1, "flushes": 1, "fallbacks": 0})
    cfg = NodeConfig(root=str(lustre), model="m", backend="local", memory=MemoryConfig(dir=str(mdir), budget_bytes=1 << 30))
    prom = tmp_path / "m.prom"
    metrics.write_textfile(cfg, None, str(prom))        # type: ignore[arg-type]  # tiers unreadable: check_ok 0
    got = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))): s.value
           for fam in text_string_to_metric_families(prom.read_text()) for s in fam.samples}
    assert got[("tiered_ckpt_memory_checkpoints", (("kind", "own"),))] == 2
    assert got[("tiered_ckpt_memory_checkpoints", (("kind", "peer"),))] == 1
    assert got[("tiered_ckpt_memory_newest_step", ())] == 2
    assert got[("tiered_ckpt_memory_replica_lag_seconds", ())] == 0.25
    assert got[("tiered_ckpt_memory_replica_failures_total", ())] == 1
    assert got[("tiered_ckpt_memory_flushes_total", ())] == 1
    assert got[("tiered_ckpt_memory_budget_bytes", ())] == 1 << 30
    assert got[("tiered_ckpt_memory_bytes", ())] == tm.usage(mdir) > 0
    conf = tmp_path / "node.yaml"
    conf.write_text(dump(cfg))
    cli.main(["status", "--json", "--config", str(conf)])
    doc = json.loads(capsys.readouterr().out)
    assert doc["memory"]["own"] == 2 and doc["memory"]["newest"] == "global_epoch0_step2"
    cli.main(["status", "--config", str(conf)])
    assert "memory tier (this node" in capsys.readouterr().out


def test_latest_knows_every_tier(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tiered_ckpt import memory_tier

    mdir, lustre = tmp_path / "shm", tmp_path / "lustre"
    cfg = NodeConfig(root=str(lustre), model="m", memory=MemoryConfig(dir=str(mdir)))
    lustre.mkdir()
    assert memory_tier.latest(cfg, 1, 2) is None
    _copy(tm.peer_root(mdir, 2, 1), 3)          # only a replica this node holds for rank 1
    assert memory_tier.latest(cfg, 1, 2) == ("global_epoch0_step3", "peer")
    _copy(lustre, 2)
    _copy(tm.own_root(mdir, 2, 0), 4)           # a memory-only checkpoint is never "none"
    assert memory_tier.latest(cfg, 0, 2) == ("global_epoch0_step4", "memory")
    _copy(lustre, 5)
    assert memory_tier.latest(cfg, 0, 2) == ("global_epoch0_step5", "lustre")
    assert memory_tier.latest(cfg, 0, 4) == ("global_epoch0_step5", "lustre")    # another world size: memory is not it


def test_planted_symlinks_in_the_memory_tier_are_neither_followed_nor_written_through(tmp_path: Path) -> None:
    mdir, elsewhere = tmp_path / "shm", tmp_path / "elsewhere"
    _copy(elsewhere / "w2" / "r0", 7)
    own = tm.own_root(mdir, 2, 0)
    own.mkdir(parents=True)
    (own / "m").symlink_to(elsewhere / "w2" / "r0" / "m")          # another user's copies, or anything
    assert tm.committed(own, "m", "global_epoch") == []
    assert tm.usage(mdir) == 0
    peer = tm.peer_root(mdir, 2, 1)
    peer.parent.mkdir(parents=True)
    peer.symlink_to(elsewhere)
    assert tm.held_replicas(mdir, 2, "m", "global_epoch") == {}
    with pytest.raises(OSError):
        tm.write_copy(peer, mdir, "m", "global_epoch0_step8", [("x.bin", [b"data"])])
    assert not (elsewhere / "m").exists()
