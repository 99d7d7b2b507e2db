"""Resume across tiers: load_training finds the newest checkpoint on the accelerator layer OR in the
archive (Azurite), restores it when only the archive holds it (one rank restores, the others wait),
and says "nothing to resume" (None) on a first start. Real gloo ranks, a real Azurite."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from tests.toolkit import gloo_ranks
from tiered_ckpt import records
from tiered_ckpt.config import ArchiveConfig, NodeConfig
from tiered_ckpt.lifecycle.exporter import Exporter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

BODY = r"""
from tiered_ckpt.config import ArchiveConfig, NodeConfig
from tiered_ckpt.training import load_training, save_training
cfg = NodeConfig(root=root, model="m", backend="local",
                 archive=ArchiveConfig(connection_string=A["conn"], container=A["container"], prefix="checkpoints",
                                       retries=1, concurrency=2))
torch.manual_seed(0)                    # replicated (as DDP keeps it): one copy is saved
m = torch.nn.Linear(8, 4)
opt = torch.optim.AdamW(m.parameters(), lr=0.1)
if A["mode"] == "save":
    for step in (10, 20):
        m(torch.randn(2, 8)).sum().backward(); opt.step()
        save_training(m, opt, epoch=0, step=step, config=cfg, extra={"rank": rank})
    report(w=m.weight.detach().flatten().tolist())
else:
    st = load_training(m, opt, config=cfg, new_rank_extras=A.get("extras", "rank0"))
    report(none=st is None, name=None if st is None else st.name, extra=None if st is None else st.extra,
           tier=None if st is None else st.tier, w=m.weight.detach().flatten().tolist())
leave()
"""


def _cfg(root: Path, conn: str, container: str) -> NodeConfig:
    return NodeConfig(root=str(root), model="m", backend="local",
                      archive=ArchiveConfig(connection_string=conn, container=container, prefix="checkpoints",
                                            retries=1, concurrency=2))


def test_first_start_is_nothing_to_resume_then_the_archive_only_checkpoint_is_restored_once(
        tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    conn, container = azurite_container
    root = tmp_path / "lustre"
    args = dict(root=str(root), conn=conn, container=container)
    # A first start: no checkpoint on either tier (and no local root yet): None on every rank, no traceback.
    first = gloo_ranks.run(BODY, 2, tmp_path / "s0", mode="load", **args)
    assert [r.out["none"] for r in first] == [True, True]

    root.mkdir()
    saved = gloo_ranks.run(BODY, 2, tmp_path / "s1", mode="save", **args)
    it = Exporter(_cfg(root, conn, container)).iterate()
    assert it.ok and it.files_exported > 0
    shutil.rmtree(root)                     # the local tier is lost; steps 10 and 20 sit in Blob only

    loaded = gloo_ranks.run(BODY, 2, tmp_path / "s2", mode="load", **args)
    assert [r.out["name"] for r in loaded] == ["global_epoch0_step20"] * 2       # not step 0, not step 10
    assert [r.out["w"] for r in loaded] == [r.out["w"] for r in saved]           # the saved weights, bit-exact
    assert [r.out["extra"] for r in loaded] == [{"rank": 0}, {"rank": 1}]
    assert [r.out["tier"] for r in loaded] == ["archive"] * 2                  # every rank says where from
    assert (root / "m" / "global_epoch0_step20" / "COMMITTED.json").is_file()
    # Exactly one download: rank 0 restored, rank 1 waited for its answer.
    rec = records.read(str(root), "m", records.RESTORE)
    assert rec is not None and rec["totals"] == {"download": 1}, rec


def test_the_newer_archive_checkpoint_wins_over_an_older_local_one_and_new_ranks_extras_are_chosen(
        tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    args = dict(root=str(root), conn=conn, container=container)
    gloo_ranks.run(BODY, 1, tmp_path / "s1", mode="save", **args)
    Exporter(_cfg(root, conn, container)).iterate()
    shutil.rmtree(root / "m" / "global_epoch0_step20")     # e.g. deleted by retention once archived
    # 2 ranks resume a 1-rank save: rank 1 gets rank 0's extras by default, none on request.
    (a, b) = gloo_ranks.run(BODY, 2, tmp_path / "s2", mode="load", **args)
    assert a.out["name"] == b.out["name"] == "global_epoch0_step20"
    assert a.out["extra"] == b.out["extra"] == {"rank": 0}
    assert a.out["tier"] == b.out["tier"] == "archive"
    assert "saved by fewer ranks" in b.err and "saved by fewer ranks" not in a.err
    (a, b) = gloo_ranks.run(BODY, 2, tmp_path / "s3", mode="load", extras="none", **args)
    assert a.out["extra"] == {"rank": 0} and b.out["extra"] is None
    assert a.out["tier"] == b.out["tier"] == "lustre"          # restored by the previous run: local now
