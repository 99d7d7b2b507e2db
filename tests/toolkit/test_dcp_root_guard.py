"""A DCP save on a node whose config says amlfs never creates its root off Lustre: with AMLFS not
mounted, /lustrefs is an empty directory of the OS disk, and checkpoints there would never be archived."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiered_ckpt import config
from tiered_ckpt.io import commit, mounts

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def _node(tmp_path: Path, backend: str) -> config.NodeConfig:
    conf = tmp_path / f"{backend}.yaml"
    conf.write_text(f"root: {tmp_path / 'lustrefs' / 'checkpoints'}\nmodel: m\nbackend: {backend}\n")
    return config.load(str(conf))


def _mounts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lustre: bool) -> None:
    # /proc/mounts lines (proc_pid_mounts(5)): the OS disk, and a Lustre client mount as mount.lustre(8) makes it
    lines = ["/dev/sda1 / ext4 rw,relatime 0 0"]
    if lustre:
        lines.append(f"10.0.0.4@tcp:/lustrefs {tmp_path / 'lustrefs'} lustre rw,flock,lazystatfs 0 0")
    (tmp_path / "mounts").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv(mounts.MOUNTS_ENV, str(tmp_path / "mounts"))


def _save(cfg: config.NodeConfig) -> None:
    from tiered_ckpt.dcp import TieredWriter

    dcp.save({"w": torch.arange(8.0)}, storage_writer=TieredWriter(config=cfg, epoch=0, step=1), no_dist=True)


def test_an_unmounted_lustre_root_is_refused_and_nothing_is_created(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "lustrefs").mkdir()              # the mount point, AMLFS not mounted on it
    _mounts(tmp_path, monkeypatch, lustre=False)
    # DCP hands a rank's exception back in a CheckpointException that carries its text
    with pytest.raises(dcp.api.CheckpointException) as e:
        _save(_node(tmp_path, "amlfs"))
    msg = str(e.value)
    assert "UserError: checkpoint root" in msg and "not on Lustre" in msg and "findmnt" in msg, msg
    assert not (tmp_path / "lustrefs" / "checkpoints").exists()


def test_the_root_is_created_on_lustre_and_anywhere_with_backend_local(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "lustrefs").mkdir()
    _mounts(tmp_path, monkeypatch, lustre=True)
    cfg = _node(tmp_path, "amlfs")
    _save(cfg)
    assert [c.name for c in commit.scan(cfg.root, "m") if c.committed] == ["global_epoch0_step1"]
    other = tmp_path / "other"
    other.mkdir()
    _mounts(other, monkeypatch, lustre=False)
    local = _node(other, "local")
    _save(local)
    assert [c.name for c in commit.scan(local.root, "m") if c.committed] == ["global_epoch0_step1"]
