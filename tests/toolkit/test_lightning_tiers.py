"""The Lightning plugin across tiers, with a real Trainer on the CPU and a real Azurite archive:
retention keeps the checkpoint ModelCheckpoint marked best (a keep-pin), a freed checkpoint is
restored on load (or the message says `tiered-ckpt restore NAME`), ckpt_path from resume_path()
restores a newest checkpoint only the archive holds, a re-run under the same name is refused at
train start, and every save leaves a save record (metrics, timeline)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tiered_ckpt import records  # noqa: E402
from tiered_ckpt.config import ArchiveConfig, NodeConfig  # noqa: E402
from tiered_ckpt.errors import IntegrityError, UserError  # noqa: E402
from tiered_ckpt.io import commit  # noqa: E402
from tiered_ckpt.lifecycle import retention  # noqa: E402
from tiered_ckpt.lifecycle.exporter import Exporter  # noqa: E402
from tiered_ckpt.lightning import TieredCheckpointIO  # noqa: E402
from tiered_ckpt.tiers.backends import make_backend  # noqa: E402


class Scored(pl.LightningModule):
    """Logs a score that only gets worse: ModelCheckpoint's best (mode=min) stays epoch 0's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 2)
        self.started_at: int | None = None

    def training_step(self, batch: Any, _: int) -> Any:
        x, y = batch
        self.log("score", float(self.current_epoch), on_epoch=True, on_step=False)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_train_start(self) -> None:
        self.started_at = self.trainer.global_step


def _data() -> DataLoader:
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x[:, :2]), batch_size=4)     # 3 steps an epoch


def _cfg(root: Path, conn: str, container: str) -> NodeConfig:
    return NodeConfig(root=str(root), model="m", backend="local",
                      archive=ArchiveConfig(connection_string=conn, container=container, prefix="checkpoints",
                                            retries=1, concurrency=2))


def _fit(io: TieredCheckpointIO, ldir: Path, epochs: int, ckpt_path: str | None = None,
         check: bool = False) -> tuple[pl.Trainer, ModelCheckpoint, Scored]:
    # best-1 by the score (epoch 0's, for ever), and the newest each epoch with last.ckpt
    ck = ModelCheckpoint(dirpath=ldir / "best", monitor="score", mode="min", save_top_k=1)
    newest = ModelCheckpoint(dirpath=ldir, save_top_k=1, save_last=True)
    t = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=True, default_root_dir=ldir.parent,
                   callbacks=[ck, newest] + ([io.run_check()] if check else []), plugins=[io])
    m = Scored()
    t.fit(m, _data(), ckpt_path=ckpt_path)
    return t, ck, m


def _retention(cfg: NodeConfig) -> dict[str, str]:
    res = retention.apply(cfg, make_backend(cfg), retention.Policy(keep_last=1, min_keep=1, restore_grace=0))
    return {d.name: d.action for d in res.decisions}


def test_best_is_kept_resident_and_a_freed_checkpoint_is_restored_on_load(
        tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    conn, container = azurite_container
    root, ldir = tmp_path / "lustre", tmp_path / "pl" / "ck"
    root.mkdir()
    cfg = _cfg(root, conn, container)
    io = TieredCheckpointIO(config=cfg)
    _, ck, _ = _fit(io, ldir, epochs=4)
    assert Path(ck.best_model_path).name == "epoch=0-step=3.ckpt"
    assert Exporter(cfg).iterate().ok
    got = _retention(cfg)
    # best (epoch 0) pinned by its pointer, newest kept, the rest freed once archived
    assert got == {"global_epoch0_step3": "keep", "global_epoch1_step6": "delete",
                   "global_epoch2_step9": "delete", "global_epoch3_step12": "keep"}, got
    why = {d.name: d.reason for d in retention.evaluate(cfg, make_backend(cfg), retention.Policy(
        keep_last=1, min_keep=1, restore_grace=0)).decisions}
    assert "pinned (lightning: " in why["global_epoch0_step3"] and "epoch=0-step=3.ckpt" in why["global_epoch0_step3"]
    assert io.load_checkpoint(ck.best_model_path)["global_step"] == 3

    # A freed checkpoint loads anyway: the plugin restores it from the archive (hash-checked).
    back = io.load_checkpoint(root / "m" / "global_epoch1_step6")
    assert back["global_step"] == 6 and commit.read_marker(root / "m" / "global_epoch1_step6") is not None

    # Without an archive in its config, the message says what to do.
    bare = TieredCheckpointIO(root=root, model="m")
    with pytest.raises(IntegrityError, match=r"retention freed it .*`tiered-ckpt restore global_epoch2_step9`"):
        bare.load_checkpoint(root / "m" / "global_epoch2_step9")

    # Pruned by Lightning (the pointer removed): the pin goes with it, and retention may free it.
    io.remove_checkpoint(ck.best_model_path)
    assert _retention(cfg)["global_epoch0_step3"] == "delete"


def test_resume_path_restores_the_newest_from_the_archive_and_a_rerun_is_refused_at_train_start(
        tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    conn, container = azurite_container
    root, ldir = tmp_path / "lustre", tmp_path / "pl" / "ck"
    root.mkdir()
    cfg = _cfg(root, conn, container)
    io = TieredCheckpointIO(config=cfg)
    assert io.resume_path() is None                    # a first start: nothing to resume
    _fit(io, ldir, epochs=2, check=True)
    # every save left a save record: metrics and the timeline know when each write started
    rec = records.read(str(root), "m", records.SAVE)
    assert rec is not None and rec["name"] == "global_epoch1_step6" and rec["totals"]["saves"] == 2
    assert rec["seconds"] > 0 and rec["bytes"] > 0

    # Re-running under the same name: refused before the first training step, saying what to do.
    again = TieredCheckpointIO(config=cfg)
    with pytest.raises(UserError, match=r"up to global_epoch1_step6.*ckpt_path=\"last\".*model=\"<model>-run2\""):
        _fit(again, tmp_path / "pl2" / "ck", epochs=2, check=True)

    assert Exporter(cfg).iterate().ok
    shutil.rmtree(root)                                 # Lustre and Lightning's directory both lost
    shutil.rmtree(ldir)
    path = TieredCheckpointIO(config=cfg).resume_path()
    assert path == str(root / "m" / "global_epoch1_step6")
    _, _, m = _fit(TieredCheckpointIO(config=cfg), ldir, epochs=3, ckpt_path=path, check=True)
    assert m.started_at == 6                           # resumed at the saved step, not step 0
