"""Restore, retention and saves of one checkpoint exclude each other (the checkpoint lock), and
retention re-checks its evidence at the moment it acts. Interleavings are forced: a real
subprocess holds the lock, or the plan is changed under retention's feet; two real restore
processes, one SIGKILLed; a real Azurite frozen with SIGSTOP mid-restore."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from azure.storage.blob import BlobServiceClient

from tests.lifecycle.helpers import REPO, local_cfg, make_checkpoint
from tiered_ckpt.config import dump
from tiered_ckpt.errors import ConflictError, UnavailableError
from tiered_ckpt.io import commit
from tiered_ckpt.io.hashing import hash_path
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.lifecycle import journal, tombstone
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore
from tiered_demo.azurite import Azurite

OLD = "global_epoch0_step10"
ENV = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}


@pytest.fixture
def env(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=1, min_keep=1)
    store = BlobStore(cfg.archive, backoff=0.01)
    for s in (10, 20, 30):
        make_checkpoint(cfg.root, "m", 0, s)
    assert Exporter(cfg, store, status_path=tmp_path / "st.json").iterate().ok
    return cfg, store


POLICY = ret.Policy(keep_last=1, min_keep=1)


def old_dir(cfg) -> Path:
    return Path(cfg.root) / "m" / OLD


def hold_lock(cfg, name: str, purpose: str, then: str = "sys.stdin.readline()") -> subprocess.Popen[str]:
    """A real process holding the checkpoint's lock (as a save or restore would) until told, or `then` ends."""
    code = ("import shutil, sys, time\nfrom tiered_ckpt.io.lock import checkpoint_lock\n"
            f"with checkpoint_lock({cfg.root!r}, 'm', {name!r}, {purpose!r}):\n"
            f"    print('held', flush=True)\n    {then}\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=ENV, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def release(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
    p.wait(timeout=30)


def killed_retention_run(cfg) -> None:
    """What a retention run SIGKILLed mid-delete leaves: a journal entry, no marker, part of the data."""
    journal.add(cfg.root, "m", OLD)
    (old_dir(cfg) / MARKER).unlink()
    (old_dir(cfg) / "rank0_shard1.bin").unlink()


# -- retention vs a new save of a journaled name (finding 4) ------------------------------------

@pytest.mark.parametrize("writer_drops_entry", [True, False])
def test_resume_delete_spares_a_name_saved_again_after_the_plan(env, monkeypatch: pytest.MonkeyPatch,
                                                                writer_drops_entry: bool) -> None:
    cfg, store = env
    killed_retention_run(cfg)
    real_evaluate = ret.evaluate

    def plan_then_resave(*a, **k):
        pl = real_evaluate(*a, **k)
        assert {d.name: d.action for d in pl.decisions}[OLD] == ret.RESUME
        # save() of that name completes between the plan and the act
        make_checkpoint(cfg.root, "m", 0, 10, files={"rank0_shard0.bin": b"new generation"})
        if writer_drops_entry:
            journal.forget(cfg.root, "m", OLD)
        return pl

    monkeypatch.setattr(ret, "evaluate", plan_then_resave)
    res = ret.apply(cfg, LocalBackend(cfg, store), POLICY)
    assert f"delete {OLD}" not in res.done
    info = commit.find(cfg.root, "m", OLD)
    assert info is not None and info.committed and (old_dir(cfg) / "rank0_shard0.bin").read_bytes() == b"new generation"


def test_resume_delete_spares_a_save_in_flight_that_holds_the_lock(env) -> None:
    cfg, store = env
    killed_retention_run(cfg)
    (old_dir(cfg) / "rank0_shard0.bin").write_bytes(b"being written by a new save")
    saver = hold_lock(cfg, OLD, "save")
    try:
        res = ret.apply(cfg, LocalBackend(cfg, store), POLICY)
    finally:
        release(saver)
    decisions = {d.name: d for d in res.decisions}
    assert decisions[OLD].action == ret.BUSY and "holds checkpoint" in decisions[OLD].reason
    assert (old_dir(cfg) / "rank0_shard0.bin").read_bytes() == b"being written by a new save"


# -- retention vs save()/restore of a committed checkpoint --------------------------------------

def test_retention_skips_a_checkpoint_whose_lock_is_held_and_deletes_it_later(env) -> None:
    cfg, store = env
    holder = hold_lock(cfg, OLD, "restore")
    try:
        res = ret.apply(cfg, LocalBackend(cfg, store), POLICY)
    finally:
        release(holder)
    assert f"delete {OLD}" not in res.done and commit.find(cfg.root, "m", OLD).committed  # type: ignore[union-attr]
    assert {d.name: d.action for d in res.decisions}[OLD] == ret.BUSY
    # Next run, nobody holds it: deleted, with a tombstone naming the archived generation.
    res = ret.apply(cfg, LocalBackend(cfg, store), POLICY)
    assert f"delete {OLD}" in res.done and not old_dir(cfg).exists()
    assert tombstone.present(cfg.root, "m", OLD)


def test_retention_does_not_delete_a_checkpoint_saved_again_since_the_plan(env, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, store = env
    real_evaluate = ret.evaluate

    def plan_then_resave(*a, **k):
        pl = real_evaluate(*a, **k)
        assert {d.name: d.action for d in pl.decisions}[OLD] == ret.DELETE
        commit.remove_checkpoint(old_dir(cfg))      # a new generation of that name, committed, not archived
        make_checkpoint(cfg.root, "m", 0, 10, files={"rank0_shard0.bin": b"generation 2"})
        return pl

    monkeypatch.setattr(ret, "evaluate", plan_then_resave)
    res = ret.apply(cfg, LocalBackend(cfg, store), POLICY)
    assert f"delete {OLD}" not in res.done
    assert (old_dir(cfg) / "rank0_shard0.bin").read_bytes() == b"generation 2"
    assert "changed since the plan" in {d.name: d for d in res.decisions}[OLD].reason


def test_restore_waits_for_retention_and_success_means_it_is_there(env) -> None:
    """Retention (a real process holding the lock) deletes the checkpoint while restore is asked for it."""
    cfg, store = env
    deleter = hold_lock(cfg, OLD, "retention",
                        then=f"time.sleep(1.0); shutil.rmtree({str(old_dir(cfg))!r})")
    try:
        r = restore(cfg, LocalBackend(cfg, store), OLD, lock_wait=30)
    finally:
        deleter.wait(timeout=30)
    assert (r.source, r.verified) == ("archive", True)       # decided again under the lock: not "resident"
    info = commit.find(cfg.root, "m", OLD)
    assert info is not None and info.committed


def test_restore_gives_up_after_its_wait_with_a_clear_message(env) -> None:
    cfg, store = env
    holder = hold_lock(cfg, OLD, "retention")
    try:
        with pytest.raises(ConflictError, match=r"retention.*--wait"):
            restore(cfg, LocalBackend(cfg, store), OLD, lock_wait=0.3)
    finally:
        release(holder)


def test_a_restored_checkpoint_is_kept_for_the_restore_grace(env, tmp_path: Path) -> None:
    cfg, store = env
    backend = LocalBackend(cfg, store)
    assert ret.apply(cfg, backend, POLICY).done == [f"delete {OLD}", "delete global_epoch0_step20"]
    assert tombstone.present(cfg.root, "m", OLD)
    restore(cfg, backend, OLD)
    assert not tombstone.present(cfg.root, "m", OLD)
    res = ret.apply(cfg, backend, POLICY)
    assert res.done == [] and "restored" in {d.name: d for d in res.decisions}[OLD].reason
    # Grace over (or off): the usual rules apply again.
    res = ret.apply(cfg, backend, dataclasses.replace(POLICY, restore_grace=0))
    assert res.done == [f"delete {OLD}"]


# -- two restores, one killed (finding 5) --------------------------------------------------------

RESTORER = """
import sys, time
from tiered_ckpt import config
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.lifecycle.restore import restore
cfg = config.load(sys.argv[1])
slow = float(sys.argv[2])
seen = [0]
def on_bytes(what, done, total):
    seen[0] += 1
    if seen[0] == 1:
        print('bytes', flush=True)
    time.sleep(slow)
r = restore(cfg, LocalBackend(cfg), sys.argv[3], progress=on_bytes, lock_wait=60)
print('done', r.source, r.verified, flush=True)
"""


def test_two_restores_one_sigkilled_never_commit_holes(tmp_path: Path, azurite_container: tuple[str, str]) -> None:
    conn, container = azurite_container
    cfg = local_cfg(tmp_path / "lustre", conn, container)
    store = BlobStore(cfg.archive, backoff=0.01)
    files = {f"shard{i}.bin": os.urandom(512 << 10) for i in range(8)}
    make_checkpoint(cfg.root, "m", 0, 10, files=files)
    assert Exporter(cfg, store, status_path=tmp_path / "st.json").iterate().ok
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    d = old_dir(cfg)
    for trial in range(4):
        commit.remove_checkpoint(d)
        a = subprocess.Popen([sys.executable, "-c", RESTORER, str(cfg_file), "0.5", OLD], cwd=REPO, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert a.stdout is not None and a.stdout.readline().strip() == "bytes"
        b = subprocess.Popen([sys.executable, "-c", RESTORER, str(cfg_file), "0", OLD], cwd=REPO, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.1 + 0.1 * trial)
        a.kill()
        a_out, _ = a.communicate()
        out, err = b.communicate(timeout=120)
        assert b.returncode == 0, err
        # A (slow: >= 1 s) is killed mid-restore; B waited for the lock and then restored it itself.
        assert a.returncode == -9 and "done" not in a_out, f"trial {trial}: the first restore finished"
        assert out.split()[-3:] == ["done", "archive", "True"], f"trial {trial}"
        # Committed, and every byte is the archived one: no hole left by the killed restore.
        info = commit.find(cfg.root, "m", OLD)
        assert info is not None and info.committed, f"trial {trial}"
        assert all(hash_path(str(d / f.path)) == f.hash for f in info.manifest.files), f"trial {trial}"  # type: ignore[union-attr]
        assert not [p for p in d.iterdir() if p.name.startswith(".")], f"trial {trial}: temp files left"


# -- a frozen archive mid-restore (finding 13) ---------------------------------------------------

def test_frozen_archive_mid_restore_fails_within_the_retry_budget(tmp_path: Path) -> None:
    server = Azurite().start()
    assert server.proc is not None
    pgid = server.proc.pid
    stopped = [False]
    try:
        BlobServiceClient.from_connection_string(server.connection_string).create_container("ckpts")
        cfg = local_cfg(tmp_path / "lustre", server.connection_string, "ckpts")
        cfg = dataclasses.replace(cfg, archive=dataclasses.replace(cfg.archive, retries=1, timeout=5.0))
        make_checkpoint(cfg.root, "m", 0, 10, files={f"s{i}.bin": os.urandom(1 << 20) for i in range(12)})
        store = BlobStore(cfg.archive, backoff=0.01)
        assert Exporter(cfg, store, status_path=tmp_path / "st.json").iterate().ok
        commit.remove_checkpoint(old_dir(cfg))

        def freeze(what: str, done: int, total: int) -> None:
            if not stopped[0]:
                stopped[0] = True
                os.killpg(pgid, signal.SIGSTOP)          # the server hangs, connections stay open

        t0 = time.monotonic()
        with pytest.raises(UnavailableError, match=r"unreachable.*archive\.timeout 5s, archive\.retries 1"):
            restore(cfg, LocalBackend(cfg, store), OLD, progress=freeze)
        elapsed = time.monotonic() - t0
        assert stopped[0] and elapsed < 60, f"took {elapsed:.0f}s"   # was 241 s with retries: 1
        assert commit.latest_committed(cfg.root, "m") is None
    finally:
        if stopped[0]:
            os.killpg(pgid, signal.SIGCONT)
        server.cleanup()
