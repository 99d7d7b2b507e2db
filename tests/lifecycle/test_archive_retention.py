"""Retention of the archive against a real Azurite: the keep policy on the checkpoints committed in
Blob, marker first, journaled, and a SIGKILL anywhere in an apply never leaves a checkpoint that a
restore would take for complete."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from tests.lifecycle.helpers import REPO, local_cfg, make_checkpoint
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import dump
from tiered_ckpt.errors import ConfigError, UserError
from tiered_ckpt.lifecycle import archive_retention as ar
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.policy import Policy
from tiered_ckpt.lifecycle.restore import choose
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore

STEPS = (10, 20, 30, 40, 50)


@pytest.fixture
def env(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=2, min_keep=2)
    store = BlobStore(cfg.archive, backoff=0.01)
    for s in STEPS:
        make_checkpoint(root, "m", 0, s)
    Exporter(cfg, store, status_path=tmp_path / "export.json").iterate()
    return cfg, store, ContainerClient.from_connection_string(conn, container)


def free_lustre(cfg, *steps: int) -> None:
    """What Lustre retention does once a checkpoint is proven archived: the directory goes."""
    for s in steps:
        shutil.rmtree(Path(cfg.root) / "m" / f"global_epoch0_step{s}")


def archived(cc: ContainerClient) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for b in cc.list_blobs(name_starts_with="checkpoints/m/"):
        out.setdefault(b.name.split("/")[2], set()).add(b.name.split("/", 3)[3])
    return out


def journal(cc: ContainerClient) -> list[str]:
    return [b.name for b in cc.list_blobs(name_starts_with=ar.JOURNAL_PREFIX)]


def test_plan_and_apply_keep_the_newest_and_delete_the_rest_marker_first(env) -> None:
    cfg, store, cc = env
    free_lustre(cfg, *STEPS[:-1])            # the newest is still on Lustre
    present = ar.on_lustre(cfg)
    ev, _ = ar.evaluate(cfg, store, Policy(keep_last=1, min_keep=2), present)
    got = {d.name: d.action for d in ev.decisions}
    assert got == {"global_epoch0_step10": "delete", "global_epoch0_step20": "delete", "global_epoch0_step30": "delete",
                   "global_epoch0_step40": "keep", "global_epoch0_step50": "keep"}
    assert set(archived(cc)) == {f"global_epoch0_step{s}" for s in STEPS}      # plan changed nothing
    res = ar.apply(cfg, store, Policy(keep_last=1, min_keep=2), present)
    assert res.done == ["delete global_epoch0_step10", "delete global_epoch0_step20", "delete global_epoch0_step30"]
    assert set(archived(cc)) == {"global_epoch0_step40", "global_epoch0_step50"} and journal(cc) == []
    assert res.freed_bytes > 0


def test_a_checkpoint_still_on_lustre_keeps_its_archive_copy(env) -> None:
    cfg, store, cc = env
    free_lustre(cfg, 20, 30, 40)             # step 10 still on Lustre (it may be released: its data only in Blob)
    ev, _ = ar.evaluate(cfg, store, Policy(keep_last=1, min_keep=1), ar.on_lustre(cfg))
    d = {d.name: d for d in ev.decisions}
    assert d["global_epoch0_step10"].action == "keep" and "accelerator layer" in d["global_epoch0_step10"].reason
    assert [n for n, x in d.items() if x.action == "delete"] == ["global_epoch0_step20", "global_epoch0_step30",
                                                                 "global_epoch0_step40"]


def test_incomplete_or_unmarked_archive_directories_are_never_touched(env) -> None:
    cfg, store, cc = env
    free_lustre(cfg, *STEPS)
    cc.delete_blob("checkpoints/m/global_epoch0_step10/rank0_shard1.bin")          # listed file missing
    cc.delete_blob("checkpoints/m/global_epoch0_step20/COMMITTED.json")            # an export in flight
    res = ar.apply(cfg, store, Policy(keep_last=1, min_keep=1), ar.on_lustre(cfg))
    d = {d.name: d for d in res.decisions}
    assert d["global_epoch0_step10"].action == "skip" and "missing" in d["global_epoch0_step10"].reason
    assert d["global_epoch0_step20"].action == "skip" and "no marker" in d["global_epoch0_step20"].reason
    assert set(archived(cc)) == {"global_epoch0_step10", "global_epoch0_step20", "global_epoch0_step50"}


def test_min_keep_is_never_crossed(env) -> None:
    cfg, store, cc = env
    free_lustre(cfg, *STEPS)
    ar.apply(cfg, store, Policy(keep_last=1, min_keep=3), ar.on_lustre(cfg))
    assert set(archived(cc)) == {"global_epoch0_step30", "global_epoch0_step40", "global_epoch0_step50"}


def test_without_the_root_mounted_it_refuses_unless_told_lustre_is_gone(env, tmp_path: Path, capsys) -> None:
    cfg, store, cc = env
    free_lustre(cfg, *STEPS)
    gone = cfg.with_overrides(root=str(tmp_path / "not-mounted"))
    with pytest.raises(ConfigError, match="not mounted here.*--lustre-gone"):
        ar.on_lustre(gone)
    conf = tmp_path / "c.yaml"
    conf.write_text(dump(gone))
    assert cli.main(["archive", "retention", "apply", "--config", str(conf), "--keep-last", "1", "--min-keep", "1"]) != 0
    assert "--lustre-gone" in capsys.readouterr().err and len(archived(cc)) == 5
    assert cli.main(["archive", "retention", "apply", "--config", str(conf), "--keep-last", "1", "--min-keep", "1",
                     "--lustre-gone", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tier"] == "archive" and out["applied"] == [f"delete global_epoch0_step{s}" for s in STEPS[:-1]]
    assert set(archived(cc)) == {"global_epoch0_step50"}


KILLER = r"""
import os, signal, sys
from tiered_ckpt.config import load
from tiered_ckpt.lifecycle import archive_retention as ar
from tiered_ckpt.lifecycle.policy import Policy
from tiered_ckpt.tiers.blob import BlobStore
cfg = load(sys.argv[1]); at_name, at_step = sys.argv[2], sys.argv[3]
def step(name, what):
    if name == at_name and what == at_step:
        os.kill(os.getpid(), signal.SIGKILL)
ar.apply(cfg, BlobStore(cfg.archive, backoff=0.01), Policy(keep_last=1, min_keep=1), ar.on_lustre(cfg), on_step=step)
"""


@pytest.mark.parametrize("at", ["journal", "marker", "data", "done"])
def test_sigkill_mid_apply_then_rerun_completes_and_restore_never_picks_a_half_deleted_one(env, tmp_path: Path, at: str) -> None:
    cfg, store, cc = env
    free_lustre(cfg, *STEPS)
    conf = tmp_path / "c.yaml"
    conf.write_text(dump(cfg))
    victim = "global_epoch0_step20"
    r = subprocess.run([sys.executable, "-c", KILLER, str(conf), victim, at], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    left = archived(cc)
    assert "global_epoch0_step10" not in left                  # finished before the kill
    if at in ("journal", "marker"):
        assert "COMMITTED.json" in left[victim]                # still committed: untouched
        assert bool(journal(cc)) is (at == "marker")           # the journal entry is written first
    else:
        assert "COMMITTED.json" not in left.get(victim, set())  # marker gone first
        assert journal(cc)                                     # and the journal says so
        # A half-deleted checkpoint is not committed anywhere: restore never takes it.
        found = choose(cfg, LocalBackend(cfg, store), None)
        assert found.manifest.name == "global_epoch0_step50" and found.where == "archive"
        with pytest.raises(UserError, match="not committed"):
            choose(cfg, LocalBackend(cfg, store), victim)
    res = ar.apply(cfg, store, Policy(keep_last=1, min_keep=1), ar.on_lustre(cfg))
    assert set(archived(cc)) == {"global_epoch0_step50"} and journal(cc) == []
    assert f"delete {victim}" in res.done or at == "done"


def test_a_stale_journal_entry_of_a_kept_checkpoint_is_dropped(env) -> None:
    cfg, store, cc = env
    free_lustre(cfg, *STEPS)
    cc.upload_blob(f"{ar.JOURNAL_PREFIX}/checkpoints/m/global_epoch0_step50.json", b"{}")
    ar.apply(cfg, store, Policy(keep_last=1, min_keep=1), ar.on_lustre(cfg))
    assert journal(cc) == [] and "COMMITTED.json" in archived(cc)["global_epoch0_step50"]
