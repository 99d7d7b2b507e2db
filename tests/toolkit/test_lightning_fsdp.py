"""Lightning's FSDP2 path (ModelParallelStrategy, fully_shard in configure_model) through the toolkit:
TieredModelParallelStrategy saves the sharded states with TieredWriter on every rank and resumes from
`last` bit-exact. A real Trainer, 2 CPU processes (gloo) launched by Lightning itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from tiered_ckpt.io import commit  # noqa: E402

SCRIPT = r'''
import json, os, sys
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.lightning import TieredCheckpointIO, TieredModelParallelStrategy

mode, root, ldir, out = sys.argv[1:5]

class Sharded(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        self.start = None

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def full(self):
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).tolist() for k, v in self.net.state_dict().items()}

    def on_train_start(self):
        self.start = {"step": self.trainer.global_step, "w": self.full()}

x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
data = DataLoader(TensorDataset(x, x[:, :2]), batch_size=4)       # 4 steps an epoch (batch size 4 per rank)
io = TieredCheckpointIO(config=NodeConfig(root=root, model="m", backend="local"))
t = pl.Trainer(max_epochs=2 if mode == "save" else 3, accelerator="cpu", devices=2, logger=False,
               strategy=TieredModelParallelStrategy(io, process_group_backend="gloo"),
               enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True,
               callbacks=[ModelCheckpoint(dirpath=ldir, save_last=True)])
m = Sharded()
t.fit(m, data, ckpt_path=None if mode == "save" else "last")
w = m.full()
if t.global_rank == 0:
    with open(out, "w") as f:
        json.dump({"start": m.start, "end": w, "step": t.global_step}, f)
'''


def _run(tmp: Path, mode: str, root: Path, ldir: Path) -> dict:
    script, out = tmp / "fit.py", tmp / f"{mode}.json"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MASTER_PORT=str(29500 + os.getpid() % 1000))
    p = subprocess.run([sys.executable, str(script), mode, str(root), str(ldir), str(out)], capture_output=True,
                       text=True, timeout=540, env=env, cwd=tmp)
    assert p.returncode == 0, p.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(900)       # two Lightning launches of 2 processes each (about 20 s of CPU on an idle machine)
def test_fsdp2_through_model_parallel_strategy_commits_and_resumes_bit_exact(tmp_path: Path) -> None:
    root, ldir = tmp_path / "lustre", tmp_path / "pl" / "ck"
    root.mkdir()
    saved = _run(tmp_path, "save", root, ldir)
    names = [c.name for c in commit.scan(root, "m") if c.committed]
    assert names == ["global_epoch0_step4", "global_epoch1_step8"], names
    m = commit.read_marker(root / "m" / "global_epoch1_step8")
    assert m is not None and m.world_size == 2                   # each rank wrote its shards
    assert json.loads((ldir / "last.ckpt").read_text())["name"] == "global_epoch1_step8"
    resumed = _run(tmp_path, "resume", root, ldir)
    assert resumed["start"]["step"] == 8 and resumed["start"]["w"] == saved["end"]
    assert resumed["step"] == 12
