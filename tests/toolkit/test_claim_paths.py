"""One claim path for every writer (io/claim.py): `tc.save`, the DCP writer, `save_training` and
Lightning's TieredCheckpointIO each refuse a name committed in the archive (a real Azurite, the
local exporter), refuse a name the archive cannot be asked about unless told otherwise, and the
loser of a claim race removes nothing of the winner's (real racing processes)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import ArchiveConfig, IoConfig, NodeConfig
from tiered_ckpt.errors import ConflictError, UnavailableError
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.io.reader import verify

HAVE_TORCH = importlib.util.find_spec("torch") is not None
NAME = "global_epoch0_step10"
PATHS = ["tc.save", "dcp", "save_training", "lightning"]


def _cfg(root: Path, conn: str, container: str) -> NodeConfig:
    return NodeConfig(root=str(root), model="m", backend="local",
                      io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10, sync_buffer_bytes=256 << 10),
                      archive=ArchiveConfig(connection_string=conn, container=container, prefix="checkpoints",
                                            retries=1))


def _toolkit_error(e: BaseException) -> BaseException:
    """The toolkit's error inside DCP's CheckpointException (dcp.save wraps what a rank raised)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for exc, _ in failures.values():
            return _toolkit_error(exc)
    return e


def _save(path: str, cfg: NodeConfig, fill: float, tmp: Path, **kw: Any) -> None:
    if path == "tc.save":
        tc.save({"w": np.full(1000, fill, np.float32)}, epoch=0, step=10, config=cfg, **kw)
        return
    import torch
    import torch.distributed.checkpoint as dcp

    if path == "dcp":
        from tiered_ckpt.dcp import TieredWriter

        try:
            dcp.save({"w": torch.full((1000,), fill)}, storage_writer=TieredWriter(config=cfg, epoch=0, step=10, **kw),
                     no_dist=True)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise _toolkit_error(e) from None
    elif path == "save_training":
        from tiered_ckpt.training import save_training

        model = torch.nn.Linear(1000, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(fill)
        try:
            save_training(model, epoch=0, step=10, config=cfg, **kw)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            raise _toolkit_error(e) from None
    else:
        from tiered_ckpt.lightning import TieredCheckpointIO

        # A new plugin, as a requeued job has (one plugin remembers what it committed itself).
        TieredCheckpointIO(config=cfg, **kw).save_checkpoint(
            {"epoch": 0, "global_step": 10, "state_dict": {"w": torch.full((1000,), fill)}}, tmp / "lt" / "last.ckpt")


def _load(path: str, cfg: NodeConfig) -> np.ndarray:
    if path == "tc.save":
        return np.asarray(tc.load(NAME, config=cfg, verify_hash=True)["w"])
    import torch
    import torch.distributed.checkpoint as dcp

    if path == "dcp":
        from tiered_ckpt.dcp import TieredReader

        st = {"w": torch.zeros(1000)}
        dcp.load(st, storage_reader=TieredReader(config=cfg, name=NAME, verify_hash=True), no_dist=True)
        return st["w"].numpy()
    if path == "save_training":
        from tiered_ckpt.training import load_training

        model = torch.nn.Linear(1000, 1, bias=False)
        load_training(model, name=NAME, config=cfg, verify_hash=True)
        return model.weight.detach().reshape(-1).numpy()
    from tiered_ckpt.lightning import TieredCheckpointIO

    return TieredCheckpointIO(config=cfg).load_checkpoint(Path(cfg.root) / "m" / NAME)["state_dict"]["w"].numpy()


@pytest.mark.parametrize("path", PATHS)
def test_every_writer_refuses_a_name_committed_in_the_archive_and_restore_returns_the_original(
        path: str, root: Path, tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    if path != "tc.save" and not HAVE_TORCH:
        pytest.skip("torch not installed")
    if path == "lightning":
        pytest.importorskip("lightning")
    from tiered_ckpt.lifecycle.exporter import Exporter
    from tiered_ckpt.lifecycle.restore import restore
    from tiered_ckpt.tiers.backends import LocalBackend
    from tiered_ckpt.tiers.blob import BlobStore

    cfg = _cfg(root, *azurite_container)
    store = BlobStore(cfg.archive, backoff=0.05)
    _save(path, cfg, 1.0, tmp_path)
    d = root / "m" / NAME
    original = commit.read_marker(d)
    assert original is not None
    assert Exporter(cfg, store, status_path=tmp_path / "export.json").iterate().ok
    archived = store.get_bytes(f"m/{NAME}/{MARKER}")
    commit.remove_checkpoint(d)                          # gone locally (by hand, or a roll-back), no tombstone
    with pytest.raises(ConflictError, match=f"{NAME} is committed in the archive.*never overwritten"):
        _save(path, cfg, 2.0, tmp_path)
    assert commit.read_marker(d) is None, "nothing committed locally"
    Exporter(cfg, store, status_path=tmp_path / "export.json").iterate()
    assert store.get_bytes(f"m/{NAME}/{MARKER}") == archived, "the archive's marker is the original's"
    res = restore(cfg, LocalBackend(cfg, store), NAME, verify=True)
    assert res.source == "archive" and commit.read_marker(d) == original
    assert (_load(path, cfg) == 1.0).all(), "restore NAME returns the original bytes"


@pytest.mark.parametrize("path", PATHS)
def test_every_writer_refuses_a_name_the_archive_cannot_be_asked_about(path: str, root: Path, tmp_path: Path) -> None:
    if path != "tc.save" and not HAVE_TORCH:
        pytest.skip("torch not installed")
    if path == "lightning":
        pytest.importorskip("lightning")
    key = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
    conn = (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={key};"
            "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;")
    cfg = _cfg(root, conn, "c")
    with pytest.raises(UnavailableError, match=f"archive could not be asked whether {NAME}.*archive_check='best_effort'"):
        _save(path, cfg, 1.0, tmp_path)
    assert not (root / "m" / NAME).exists(), "nothing written"
    _save(path, cfg, 1.0, tmp_path, archive_check="best_effort")
    assert verify(root / "m" / NAME, check_hash=True).ok


# -- the loser of a claim race ------------------------------------------------------------------
HOLDER = r"""
import json, sys
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.io import claim
root, hold = sys.argv[1], sys.argv[2] == "1"
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10,
                                                   sync_buffer_bytes=256 << 10))
real = claim.Claim.take.__func__

def take(cls, *a, **kw):
    c = real(cls, *a, **kw)
    if hold:                         # claimed, directory created and still empty: wait for the test
        print("claimed", flush=True)
        sys.stdin.readline()
    return c

claim.Claim.take = classmethod(take)
try:
    r = tc.save({"w": b"\xaa" * 100_000}, epoch=0, step=5, config=cfg)
    print(json.dumps({"ok": True, "save_id": r.save_id}), flush=True)
except Exception as e:
    print(json.dumps({"ok": False, "cls": type(e).__name__, "error": str(e)}), flush=True)
    sys.exit(getattr(e, "exit_code", 1))
"""


def _holder(root: Path, hold: bool) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(root), "1" if hold else "0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_loser_of_a_claim_race_never_removes_the_winners_empty_directory(cfg: NodeConfig, root: Path) -> None:
    winner = _holder(root, hold=True)
    assert winner.stdout is not None and winner.stdin is not None
    assert winner.stdout.readline().strip() == "claimed", winner.communicate(timeout=30)[1][-3000:]
    d = root / "m" / "global_epoch0_step5"
    assert d.is_dir() and not any(d.iterdir())
    with pytest.raises(ConflictError, match="cannot save global_epoch0_step5 now"):
        tc.save({"w": b"\xbb" * 100_000}, epoch=0, step=5, config=cfg)
    if HAVE_TORCH:
        import torch
        import torch.distributed.checkpoint as dcp

        from tiered_ckpt.dcp import TieredWriter

        with pytest.raises(BaseException) as e:
            dcp.save({"w": torch.zeros(10)}, storage_writer=TieredWriter(config=cfg, epoch=0, step=5), no_dist=True)
        assert isinstance(_toolkit_error(e.value), ConflictError)
    assert d.is_dir(), "the losers left the winner's directory where it was"
    winner.stdin.write("go\n")
    winner.stdin.flush()
    out, err = winner.communicate(timeout=60)
    assert winner.returncode == 0, (out, err[-3000:])
    assert json.loads(out.strip().splitlines()[-1])["ok"]
    assert bytes(tc.load("global_epoch0_step5", config=cfg, verify_hash=True)["w"]) == b"\xaa" * 100_000


def test_racing_savers_of_one_step_exactly_one_commits(root: Path) -> None:
    for rnd in range(2):
        procs = [_holder(root, hold=False) for _ in range(4)]
        outs = [p.communicate(timeout=120) for p in procs]
        res = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
        assert sum(r["ok"] for r in res) == 1, (rnd, res, [e[-2000:] for _, e in outs])
        assert all(r["cls"] == "ConflictError" for r in res if not r["ok"]), res
        d = root / "m" / "global_epoch0_step5"
        m = commit.read_marker(d)
        assert m is not None and m.save_id == next(r["save_id"] for r in res if r["ok"])
        assert verify(d, check_hash=True).ok
        commit.remove_checkpoint(d)
