"""A checkpoint written by torch.distributed.checkpoint through TieredWriter lives the same life as
a native one: committed, exported, proven, deleted by retention, restored from Azurite, and it
loads bit-exact after the restore."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.lifecycle.helpers import local_cfg
from tiered_ckpt.io import commit
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.proof import prove
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed"),
              pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


def _state(seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 33, generator=g), "b": torch.arange(17, dtype=torch.int32) * seed},
            "step": seed, "tag": f"run-{seed}"}


def test_dcp_checkpoint_is_exported_proven_deleted_restored_and_loads_bit_exact(
        tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from tiered_ckpt.dcp import TieredReader, TieredWriter

    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1, restore_grace=0)
    store = BlobStore(cfg.archive, backoff=0.01)
    for step in (1, 2, 3):
        dcp.save(_state(step), storage_writer=TieredWriter(str(root), "m", epoch=0, step=step))
    infos = commit.scan(root, "m")
    assert [c.name for c in infos] == [f"global_epoch0_step{s}" for s in (1, 2, 3)] and all(c.committed for c in infos)

    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    backend = LocalBackend(cfg, store)
    proofs = prove(backend, infos)
    assert all(p.archived for p in proofs.values()), {n: p.blocked_reason() for n, p in proofs.items()}

    res = ret.apply(cfg, backend, ret.Policy.from_config(cfg.retention))
    assert sorted(res.done) == ["delete global_epoch0_step1", "delete global_epoch0_step2"]

    # Lose the accelerator layer; the newest comes back from Azurite, hashes checked, and loads.
    shutil.rmtree(root)
    r = restore(cfg, backend, None)
    assert (r.name, r.source) == ("global_epoch0_step3", "archive")
    want = _state(3)
    got = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0, "tag": ""}
    dcp.load(got, storage_reader=TieredReader(str(root), "m", epoch=0, step=3, verify_hash=True))
    assert all(torch.equal(got["model"][k], v) for k, v in want["model"].items())
    assert (got["step"], got["tag"]) == (3, "run-3")

    # A deleted one restores by name from the archive too.
    r = restore(cfg, backend, "global_epoch0_step1")
    assert r.source == "archive"
    got1 = {"model": {k: torch.zeros_like(v) for k, v in _state(1)["model"].items()}, "step": 0, "tag": ""}
    dcp.load(got1, storage_reader=TieredReader(str(root), "m", epoch=0, step=1))
    assert torch.equal(got1["model"]["w"], _state(1)["model"]["w"])
