"""AMLFS back-end: fake lfs (shaped like lfs.c), a real Azurite as the blob container, and the
ARM double with the real azure-mgmt-storagecache client for import jobs."""
from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests.doubles.arm_double import NODE_TOKEN, OPERATOR_TOKEN
from tests.doubles.arm_fixtures import use_identity
from tests.lifecycle.helpers import FAKE_LFS, amlfs_cfg, auto_export, backend_of, import_hook, lfs_calls, make_checkpoint
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import dump
from tiered_ckpt.errors import UnavailableError
from tiered_ckpt.io import commit
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.proof import prove
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.lifecycle.status import gather
from tiered_ckpt.tiers.blob import BlobStore
from tiered_ckpt.tiers.hsm import Lfs


def test_proof_is_batched_and_needs_lfs_and_blob(aml) -> None:
    cfg, store, cc, count = aml
    for s in (10, 20):
        make_checkpoint(cfg.root, "m", 0, s, files={f"r{i} x:y.bin": os.urandom(100) for i in range(5)})
    auto_export(cfg.root, store)
    count.unlink()
    infos = commit.scan(cfg.root, "m")
    proofs = prove(backend_of(cfg, store), infos)
    assert all(p.archived for p in proofs.values())
    assert lfs_calls(count, "hsm_state") == math.ceil(12 / 4)           # 2 x (5 data + marker), batch 4
    # lfs says archived but the blob is gone: not deletable, and reported.
    cc.delete_blob("checkpoints/m/global_epoch0_step10/r3 x:y.bin")
    p = prove(backend_of(cfg, store), infos)["global_epoch0_step10"]
    assert not p.archived and "missing although lfs hsm_state says archived" in p.blocked_reason()
    d = {x.name: x for x in ret.evaluate(cfg, backend_of(cfg, store), ret.Policy(keep_last=1, min_keep=1)).decisions}
    assert d["global_epoch0_step10"].action == "blocked" and "r3 x:y.bin" in d["global_epoch0_step10"].reason


@pytest.mark.parametrize("flag,why", [("--dirty", "dirty"), ("--lost", "lost"), ("--noarchive", "never_archive")])
def test_dirty_lost_noarchive_block(aml, flag: str, why: str) -> None:
    cfg, store, _, _ = aml
    d = make_checkpoint(cfg.root, "m", 0, 10)
    make_checkpoint(cfg.root, "m", 0, 20)
    auto_export(cfg.root, store)
    subprocess.run([str(FAKE_LFS), "hsm_set", flag, str(d / "rank0_shard1.bin")], check=True)
    res = ret.apply(cfg, backend_of(cfg, store), ret.Policy(keep_last=1, min_keep=1))
    assert res.done == [] and d.exists()
    blocked = {x.name: x.reason for x in res.decisions}["global_epoch0_step10"]
    assert "rank0_shard1.bin" in blocked and why in blocked


def test_unreachable_archive_proves_nothing_and_unconfigured_archive_uses_lfs_only(aml, tmp_path: Path) -> None:
    cfg, store, _, _ = aml
    for s in (10, 20):
        make_checkpoint(cfg.root, "m", 0, s)
    auto_export(cfg.root, store)
    dead = cfg.with_overrides(archive={"connection_string": store.cfg.connection_string.replace(
        store.service.url.split(":")[2].split("/")[0], "1")})
    with pytest.raises(UnavailableError):
        ret.apply(dead, backend_of(dead, BlobStore(dead.archive, backoff=0.01)), ret.Policy(keep_last=1, min_keep=1))
    assert len(commit.committed(commit.scan(cfg.root, "m"))) == 2
    lfs_only = amlfs_cfg(Path(cfg.root), None, batch=4)
    res = ret.apply(lfs_only, backend_of(lfs_only, None), ret.Policy(keep_last=1, min_keep=1))
    assert res.done == ["delete global_epoch0_step10"]


def test_release_then_restore_released_with_hsm_restore(aml, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    cfg, store, _, count = aml
    for s in (10, 20, 30):
        make_checkpoint(cfg.root, "m", 0, s, files={f"s{i}.bin": os.urandom(64) for i in range(6)})
    auto_export(cfg.root, store)
    backend = backend_of(cfg, store)
    res = ret.apply(cfg, backend, ret.Policy(keep_last=1, min_keep=1, action="release"))
    assert sorted(res.done) == ["release global_epoch0_step10", "release global_epoch0_step20"]
    assert lfs_calls(count, "hsm_release") == math.ceil(12 / 4)
    tiers = {c.name: c.tier for c in gather(backend).checkpoints}
    assert tiers["global_epoch0_step10"] == "released" and tiers["global_epoch0_step30"] == "archived"
    assert ret.apply(cfg, backend, ret.Policy(keep_last=1, min_keep=1, action="release")).done == []
    monkeypatch.setenv("FAKE_LFS_RESTORE_POLLS", "2")                 # restore completes asynchronously
    r = restore(cfg, backend, "global_epoch0_step10", verify=True)
    assert (r.source, r.prefetched_files) == ("released", 6)
    states, _ = Lfs(str(FAKE_LFS)).states([str(Path(r.path) / f"s{i}.bin") for i in range(6)])
    assert not any(s.released for s in states.values())


@pytest.mark.parametrize("token", [NODE_TOKEN, OPERATOR_TOKEN], ids=["node-identity", "operator"])
def test_restore_deleted_checkpoint_through_an_import_job(aml, arm_env, capsys, monkeypatch, token) -> None:
    # Retention, restore and status with the node's managed identity (the roles the program
    # assigns, enforced by the double) and with an operator's Contributor role.
    use_identity(monkeypatch, token)
    cfg, store, _, _ = aml
    cfg = cfg.with_overrides(amlfs=arm_env.config_values())
    for s in (10, 20):
        make_checkpoint(cfg.root, "m", 0, s)
    auto_export(cfg.root, store)
    backend = backend_of(cfg, store)
    assert ret.apply(cfg, backend, ret.Policy(keep_last=1, min_keep=1)).done == ["delete global_epoch0_step10"]
    arm_env.scenario.import_hook = import_hook(cfg, store)
    r = restore(cfg, backend, "global_epoch0_step10", verify=True)
    assert r.source == "archive" and commit.find(cfg.root, "m", r.name).committed  # type: ignore[union-attr]
    jobs = list(arm_env.import_jobs().values())
    assert jobs[0]["properties"]["importPrefixes"] == ["/checkpoints/m/global_epoch0_step10/"]
    assert arm_env.kinds("autoexport.patch") == ["autoexport.patch:Disable", "autoexport.patch:Enable"]
    states, _ = Lfs(str(FAKE_LFS)).states([str(Path(r.path) / "rank0_shard0.bin")])
    assert not any(s.released for s in states.values())
    st = gather(backend)
    assert st.export["state"] == "InProgress" and st.export["last_success_utc"] is not None
    assert "asyncop.get" not in arm_env.kinds()     # no subscription-scoped LRO poll


@pytest.mark.parametrize("result", ["CompletedPartial", "Failed"])
def test_import_that_does_not_complete_fails_restore_and_reenables_autoexport(aml, arm_env, tmp_path: Path,
                                                                               capsys, result: str) -> None:
    cfg, store, _, _ = aml
    cfg = cfg.with_overrides(amlfs=arm_env.config_values())
    for s in (10, 20):
        make_checkpoint(cfg.root, "m", 0, s)
    auto_export(cfg.root, store)
    ret.apply(cfg, backend_of(cfg, store), ret.Policy(keep_last=1, min_keep=1))
    arm_env.scenario.import_result = result
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    rc = cli.main(["restore", "global_epoch0_step10", "--config", str(cfg_file), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc != 0 and result in out["error"]
    assert arm_env.kinds("autoexport.patch")[-1] == "autoexport.patch:Enable"
    assert commit.find(cfg.root, "m", "global_epoch0_step10") is None or not commit.find(cfg.root, "m", "global_epoch0_step10").committed  # type: ignore[union-attr]


def test_release_on_local_backend_is_refused_clearly(aml, capsys) -> None:
    cfg, _, _, _ = aml
    rc = cli.main(["retention", "plan", "--action", "release", "--root", cfg.root, "--backend", "local", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 2 and "needs backend amlfs" in out["error"]
