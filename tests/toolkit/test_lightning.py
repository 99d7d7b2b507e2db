"""The Lightning CheckpointIO plugin with a real Trainer on the CPU: saves commit through DCP, resume is bit-exact."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tiered_ckpt.errors import IntegrityError, UserError  # noqa: E402
from tiered_ckpt.io import commit  # noqa: E402
from tiered_ckpt.io.marker import MARKER  # noqa: E402
from tiered_ckpt.lightning import POINTER_FORMAT, TieredCheckpointIO  # noqa: E402

BATCHES = 3          # per epoch: a checkpoint at each epoch end is at step 3, 6, 9


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.start: dict[str, Any] = {}

    def training_step(self, batch: Any, _: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def on_train_start(self) -> None:
        # what the resumed run starts from, before its first step
        self.start = {"step": self.trainer.global_step, "epoch": self.trainer.current_epoch,
                      "weights": {k: v.clone() for k, v in self.state_dict().items()},
                      "optim": _clone(self.trainer.optimizers[0].state_dict())}


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _same(a: Any, b: Any) -> bool:
    """Equal structure and types; tensors bit-exact (same dtype, shape and bytes)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * 4, 4, generator=g)
    return DataLoader(TensorDataset(x, x[:, :2] * 0.5), batch_size=4, shuffle=False)


def _trainer(root: Path, lightning_dir: Path, epochs: int, **io: Any) -> tuple[pl.Trainer, ModelCheckpoint]:
    ck = ModelCheckpoint(dirpath=lightning_dir, save_last=True)     # top-1 per epoch end, plus last.ckpt
    t = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, callbacks=[ck], default_root_dir=lightning_dir.parent,
                   plugins=[TieredCheckpointIO(root=root, model="m", **io)])
    return t, ck


def _list(root: Path, tmp: Path) -> list[dict[str, Any]]:
    conf = tmp / "node.yaml"
    conf.write_text(f"root: {root}\nmodel: m\nbackend: local\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-m", "tiered_ckpt", "list", "--config", str(conf), "--json"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    return list(json.loads(p.stdout)["checkpoints"])


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two epochs saved through the plugin, a resume to three, and a run of three without a break."""
    tmp = tmp_path_factory.mktemp("lightning")
    root, ldir = tmp / "lustre", tmp / "pl" / "checkpoints"
    root.mkdir()
    first, ck = _trainer(root, ldir, epochs=2)
    m1 = Tiny()
    first.fit(m1, _data())
    saved = {"weights": {k: v.clone() for k, v in m1.state_dict().items()},
             "optim": _clone(first.optimizers[0].state_dict())}
    pointers = sorted(p.name for p in ldir.iterdir())
    best = ck.best_model_path

    resumed, _ = _trainer(root, ldir, epochs=3)
    m2 = Tiny()
    resumed.fit(m2, _data(), ckpt_path="last")

    (tmp / "lustre2").mkdir()
    straight, _ = _trainer(tmp / "lustre2", tmp / "pl2" / "checkpoints", epochs=3)
    m3 = Tiny()
    straight.fit(m3, _data())
    return {"tmp": tmp, "root": root, "ldir": ldir, "saved": saved, "pointers": pointers, "best": best,
            "m2": m2, "m3": m3, "trainer": resumed}


def test_each_save_is_a_committed_checkpoint_named_by_epoch_and_step(run: dict[str, Any]) -> None:
    root = run["root"]
    names = [c.name for c in commit.scan(root, "m") if c.committed]
    # epochs 0, 1 (first run) and 2 (resumed); last.ckpt at the same step wrote no second copy
    assert names == ["global_epoch0_step3", "global_epoch1_step6", "global_epoch2_step9"]
    for n in names:
        assert (root / "m" / n / MARKER).is_file()
    rows = {r["name"]: r for r in _list(root, run["tmp"])}
    assert all(rows[n]["committed"] for n in names) and rows["global_epoch2_step9"]["latest"]


def test_pointers_at_lightnings_paths_and_top_k_pruning_keeps_the_data(run: dict[str, Any]) -> None:
    # top-1: at epoch 1 Lightning removed epoch=0-step=3.ckpt; the checkpoint itself is retention's
    assert run["pointers"] == ["epoch=1-step=6.ckpt", "last.ckpt"]
    assert Path(run["best"]).name == "epoch=1-step=6.ckpt"
    assert commit.read_marker(run["root"] / "m" / "global_epoch0_step3") is not None
    d = json.loads((run["ldir"] / "last.ckpt").read_text())
    assert d["format"] == POINTER_FORMAT and d["name"] == "global_epoch2_step9" and d["model"] == "m"


def test_resume_from_last_continues_at_the_saved_step_bit_exact(run: dict[str, Any]) -> None:
    start, saved = run["m2"].start, run["saved"]
    assert (start["step"], start["epoch"]) == (6, 2)
    assert _same(start["weights"], saved["weights"])
    assert _same(start["optim"], saved["optim"])        # AdamW moments, step counters, param_groups
    assert int(start["optim"]["state"][0]["step"]) == 6
    # and training on from it is the run that never stopped, bit for bit
    assert _same(run["m2"].state_dict(), run["m3"].state_dict())


def test_load_respects_map_location_and_a_directory_path(run: dict[str, Any]) -> None:
    io = TieredCheckpointIO(root=run["root"], model="m")
    d = run["root"] / "m" / "global_epoch1_step6"
    ck = io.load_checkpoint(d)
    assert ck["global_step"] == 6 and ck["epoch"] == 1
    assert _same(dict(ck["state_dict"]), run["saved"]["weights"])
    meta = io.load_checkpoint(run["ldir"] / "last.ckpt", map_location="meta")
    assert meta["global_step"] == 9
    assert all(t.device.type == "meta" for t in meta["state_dict"].values())
    moved = io.load_checkpoint(d, map_location=lambda storage, loc: storage)
    assert _same(dict(moved["state_dict"]), run["saved"]["weights"])


def test_an_uncommitted_checkpoint_is_refused_on_resume(run: dict[str, Any], tmp_path: Path) -> None:
    root, ldir = tmp_path / "lustre", tmp_path / "pl" / "checkpoints"
    root.mkdir()
    t, _ = _trainer(root, ldir, epochs=1)
    t.fit(Tiny(), _data())
    d = root / "m" / "global_epoch0_step3"
    (d / MARKER).unlink()                     # as a save killed before its commit leaves it
    again, _ = _trainer(root, ldir, epochs=2)
    with pytest.raises(IntegrityError, match=f"{d} is not a committed checkpoint"):
        again.fit(Tiny(), _data(), ckpt_path="last")
    with pytest.raises(FileNotFoundError, match="not found"):
        TieredCheckpointIO(root=root, model="m").load_checkpoint(ldir / "nope.ckpt")


def test_remove_checkpoint_removes_the_pointer_never_the_checkpoint(run: dict[str, Any], tmp_path: Path) -> None:
    io = TieredCheckpointIO(root=run["root"], model="m")
    p = tmp_path / "epoch=2-step=9.ckpt"
    p.write_bytes((run["ldir"] / "last.ckpt").read_bytes())
    io.remove_checkpoint(p)
    assert not p.exists() and commit.read_marker(run["root"] / "m" / "global_epoch2_step9") is not None
    other = tmp_path / "not-a-pointer.ckpt"
    other.write_bytes(b"torch.save data")
    io.remove_checkpoint(other)          # not a pointer: left alone
    assert other.exists()


def test_a_committed_checkpoint_saved_elsewhere_is_never_overwritten(run: dict[str, Any], tmp_path: Path) -> None:
    from tiered_ckpt.errors import ConflictError

    io = TieredCheckpointIO(root=run["root"], model="m")     # not the plugin that saved it
    ck = io.load_checkpoint(run["root"] / "m" / "global_epoch2_step9")
    with pytest.raises(ConflictError, match="already a committed checkpoint"):
        io.save_checkpoint(ck, tmp_path / "again.ckpt")
    assert not (tmp_path / "again.ckpt").exists()


def test_a_pointer_inside_the_root_is_refused(run: dict[str, Any]) -> None:
    with pytest.raises(UserError, match="inside the tiered-ckpt root"):
        run["trainer"].save_checkpoint(run["root"] / "m" / "x.ckpt")


def test_step_only_naming(tmp_path: Path) -> None:
    from tiered_ckpt.config import NodeConfig

    root = tmp_path / "lustre"
    root.mkdir()
    t, _ = _trainer(root, tmp_path / "pl" / "checkpoints", epochs=1,
                    config=NodeConfig(root=str(root), model="m", naming="megatron"))
    t.fit(Tiny(), _data())
    assert [c.name for c in commit.scan(root, "m", naming="megatron") if c.committed] == ["iter_0000003"]


def test_without_arguments_the_node_config_names_root_model_and_naming(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "config.yaml"
    conf.write_text(f"root: {tmp_path}\nmodel: llama\nnaming: torchtitan\nbackend: local\n")
    monkeypatch.setenv("TIERED_CKPT_CONFIG", str(conf))
    io = TieredCheckpointIO()
    assert (io.root, io.model, io.naming) == (tmp_path, "llama", "torchtitan")
    assert io.checkpoint_dir(io.checkpoint_id({"epoch": 2, "global_step": 40})) == tmp_path / "llama" / "step-40"
    with pytest.raises(UserError, match="global_step"):
        io.checkpoint_id({"epoch": 2})


DDP = r'''
import json, sys
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from tiered_ckpt.lightning import TieredCheckpointIO

tmp = sys.argv[1]


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def on_train_start(self):
        self.start_step = self.trainer.global_step


x = torch.randn(24, 4, generator=torch.Generator().manual_seed(1))
data = DataLoader(TensorDataset(x, x[:, :2] * 0.5), batch_size=4, shuffle=False)


def fit(run, epochs, ckpt_path=None):
    t = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   callbacks=[ModelCheckpoint(dirpath=f"{tmp}/pl-{run}", save_last=True)],
                   plugins=[TieredCheckpointIO(root=f"{tmp}/lustre-{run}", model="m")])
    m = Tiny()
    t.fit(m, data, ckpt_path=ckpt_path)
    return t, m


fit("a", 2)
t, resumed = fit("a", 3, "last")                 # every rank resumes through the pointer
_, straight = fit("b", 3)
with open(f"{tmp}/rank{t.global_rank}.json", "w") as f:
    json.dump({"start": resumed.start_step, "end": t.global_step,
               "same": all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(),
                                                             straight.state_dict().values()))}, f)
'''


def test_ddp_two_gloo_processes_save_once_and_resume(tmp_path: Path) -> None:
    """Lightning's DDP on the CPU (gloo): rank 0 saves through the plugin, both ranks resume from last."""
    for run in ("a", "b"):
        (tmp_path / f"lustre-{run}").mkdir()
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240,
                       env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks == [{"start": 6, "end": 9, "same": True}] * 2
    assert [c.name for c in commit.scan(tmp_path / "lustre-a", "m") if c.committed] == [
        "global_epoch0_step3", "global_epoch1_step6", "global_epoch2_step9"]
    m = commit.read_marker(tmp_path / "lustre-a" / "m" / "global_epoch1_step6")
    assert m is not None and m.world_size == 1          # one process (rank 0) wrote the checkpoint
