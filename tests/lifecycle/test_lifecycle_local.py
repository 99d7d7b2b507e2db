"""Local back-end against a real Azurite: exporter, proof, retention apply, restore, CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from tests.lifecycle.helpers import REPO, local_cfg, make_checkpoint
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import dump
from tiered_ckpt.errors import ConflictError, IntegrityError
from tiered_ckpt.io import commit
from tiered_ckpt.io.lock import exclusive, lock_path
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter, read_status
from tiered_ckpt.lifecycle.proof import prove
from tiered_ckpt.lifecycle.restore import choose, restore
from tiered_ckpt.lifecycle.status import gather
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import META_HASH, BlobStore


@pytest.fixture
def env(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container, keep_last=2, min_keep=2)
    store = BlobStore(cfg.archive, backoff=0.01)
    return cfg, store, ContainerClient.from_connection_string(conn, container)


def blob_names(cc: ContainerClient) -> set[str]:
    return {b.name for b in cc.list_blobs()}


def test_exporter_copies_new_and_changed_files_and_never_deletes(env, tmp_path: Path) -> None:
    cfg, store, cc = env
    d = make_checkpoint(cfg.root, "m", 0, 10)
    inflight = make_checkpoint(cfg.root, "m", 0, 20, commit=False)     # committed or not: exported
    ex = Exporter(cfg, store, status_path=tmp_path / "st.json")
    it = ex.iterate()
    assert it.ok and it.files_discovered == it.files_exported == 5
    names = blob_names(cc)
    assert "checkpoints/m/global_epoch0_step10/COMMITTED.json" in names
    assert "checkpoints/m/global_epoch0_step20/rank0_shard0.bin" in names
    props = cc.get_blob_client("checkpoints/m/global_epoch0_step10/rank0_shard0.bin").get_blob_properties()
    assert props.metadata[META_HASH] == commit.read_marker(d).files[0].hash   # type: ignore[union-attr]
    assert ex.iterate().files_discovered == 0                          # nothing changed
    # A file still being written: exported as it was, then again once it changed.
    (inflight / "rank0_shard0.bin").write_bytes(b"longer content now")
    it = ex.iterate()
    assert it.exported == ["m/global_epoch0_step20/rank0_shard0.bin"]
    assert cc.download_blob("checkpoints/m/global_epoch0_step20/rank0_shard0.bin").readall() == b"longer content now"
    # Deletes are not propagated.
    commit.remove_checkpoint(d)
    ex.iterate()
    assert "checkpoints/m/global_epoch0_step10/rank0_shard0.bin" in blob_names(cc)
    st = read_status(tmp_path / "st.json")
    assert st is not None and st.iterations == 4 and st.last_successful_iteration_utc and st.total_files_failed == 0


def test_local_proof_size_and_hash(env) -> None:
    cfg, store, cc = env
    d = make_checkpoint(cfg.root, "m", 0, 10)
    backend = LocalBackend(cfg, store)
    infos = commit.scan(cfg.root, "m")
    assert not prove(backend, infos)["global_epoch0_step10"].archived      # nothing exported yet
    Exporter(cfg, store, status_path=Path(cfg.root).parent / "s.json").iterate()
    assert prove(backend, infos)["global_epoch0_step10"].archived
    # Same size, different bytes in the archive: the stored hash no longer matches.
    cc.upload_blob("checkpoints/m/global_epoch0_step10/rank0_shard1.bin", os.urandom(500), overwrite=True,
                   metadata={META_HASH: "0" * 32})
    p = prove(backend, infos)["global_epoch0_step10"]
    assert not p.archived and p.first_problem and p.first_problem.rel.endswith("rank0_shard1.bin")
    cc.delete_blob("checkpoints/m/global_epoch0_step10/rank0_shard1.bin")
    assert "missing" in prove(backend, infos)["global_epoch0_step10"].blocked_reason()
    assert d.exists()


def test_retention_apply_end_to_end_and_restore_latest_after_wipe(env, tmp_path: Path) -> None:
    cfg, store, cc = env
    for s in (10, 20, 30, 40):
        make_checkpoint(cfg.root, "m", 0, s)
    make_checkpoint(cfg.root, "m", 0, 50, commit=False)                  # in flight
    ex = Exporter(cfg, store, status_path=tmp_path / "st.json")
    ex.iterate()
    make_checkpoint(cfg.root, "m", 0, 5)                                 # committed, not yet exported
    backend = LocalBackend(cfg, store)
    policy = ret.Policy.from_config(cfg.retention)
    pl = {d.name: d for d in ret.evaluate(cfg, backend, policy).decisions}
    assert pl["global_epoch0_step5"].action == "blocked" and "rank0_shard0.bin" in pl["global_epoch0_step5"].reason
    assert pl["global_epoch0_step50"].action == "skip"
    res = ret.apply(cfg, backend, policy)
    assert sorted(res.done) == ["delete global_epoch0_step10", "delete global_epoch0_step20"]
    left = {c.name for c in commit.scan(cfg.root, "m")}
    assert left == {"global_epoch0_step5", "global_epoch0_step30", "global_epoch0_step40", "global_epoch0_step50"}
    assert "checkpoints/m/global_epoch0_step10/COMMITTED.json" in blob_names(cc)  # archive keeps everything
    assert ret.apply(cfg, backend, policy).done == []                    # idempotent
    # Restoring the deleted one by name comes from the archive, marker last, hashes verified.
    r = restore(cfg, backend, "global_epoch0_step10", verify=True)
    assert r.source == "archive" and commit.find(cfg.root, "m", "global_epoch0_step10").committed  # type: ignore[union-attr]
    # Lose the accelerator layer, then restore the newest committed anywhere.
    import shutil

    shutil.rmtree(cfg.root)
    r = restore(cfg, backend, None, verify=True)
    assert (r.name, r.source, r.verified) == ("global_epoch0_step40", "archive", True)
    assert commit.latest_committed(cfg.root, "m").name == "global_epoch0_step40"  # type: ignore[union-attr]
    assert restore(cfg, backend, None).source == "resident"
    # Nothing restored is uploaded again: data files keep their exported mtime, and the marker (rewritten
    # with the archive's bytes) is recognised by its hash.
    assert Exporter(cfg, store, status_path=tmp_path / "st.json").discover() == []


def test_restore_never_picks_a_checkpoint_whose_archive_marker_is_gone_or_incomplete(env, tmp_path: Path) -> None:
    cfg, store, cc = env
    for s in (10, 20, 30):
        make_checkpoint(cfg.root, "m", 0, s)
    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    import shutil

    shutil.rmtree(cfg.root)
    cc.delete_blob("checkpoints/m/global_epoch0_step30/COMMITTED.json")          # half-deleted in Blob
    cc.delete_blob("checkpoints/m/global_epoch0_step20/rank0_shard1.bin")        # incomplete in Blob
    assert choose(cfg, LocalBackend(cfg, store), None).manifest.name == "global_epoch0_step10"


def test_hash_mismatch_on_restore_names_the_file_and_leaves_no_marker(env, tmp_path: Path) -> None:
    cfg, store, cc = env
    make_checkpoint(cfg.root, "m", 0, 10)
    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    cc.upload_blob("checkpoints/m/global_epoch0_step10/rank0_shard1.bin", os.urandom(500), overwrite=True)
    import shutil

    shutil.rmtree(cfg.root)
    with pytest.raises(IntegrityError, match="rank0_shard1.bin"):
        restore(cfg, LocalBackend(cfg, store), None, verify=True)
    assert not (Path(cfg.root) / "m" / "global_epoch0_step10" / MARKER).exists()
    assert commit.latest_committed(cfg.root, "m") is None


def test_lock_held_by_another_process_is_a_conflict(env) -> None:
    cfg, store, _ = env
    make_checkpoint(cfg.root, "m", 0, 10)
    lp = lock_path(cfg.root, "m")
    code = ("import time; from tiered_ckpt.io.lock import exclusive\n"
            f"with exclusive({str(lp)!r}, 'test holder'):\n print('held', flush=True); time.sleep(30)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConflictError, match="test holder"):
            ret.apply(cfg, LocalBackend(cfg, store), ret.Policy())
    finally:
        holder.kill()
        holder.wait()
    with exclusive(lp, "after"):     # released by the kernel when its holder died
        pass


def test_sigkill_mid_apply_then_rerun_finishes(env, tmp_path: Path) -> None:
    cfg, store, cc = env
    for s in (10, 20, 30):
        make_checkpoint(cfg.root, "m", 0, s, files={f"f{i}.bin": b"x" * 100 for i in range(20)})
    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    cfg_file = tmp_path / "cfg.yaml"
    cfg_file.write_text(dump(cfg.with_overrides(retention={"keep_last": 1, "min_keep": 1})))
    # The child dies by SIGKILL after the marker and half of the data of the first victim are gone.
    code = (
        "import os, signal, shutil, sys\n"

        "from tiered_ckpt.io import commit as manifest\nfrom tiered_ckpt.cli import app as cli\n"
        "def half(p, *a, **k):\n"
        "    for n in sorted(os.listdir(p))[:10]: os.unlink(os.path.join(p, n))\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "manifest.shutil.rmtree = half\n"
        f"cli.main(['retention', 'apply', '--config', {str(cfg_file)!r}])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == -9
    victim = Path(cfg.root) / "m" / "global_epoch0_step10"
    assert victim.exists() and not (victim / MARKER).exists()
    backend = LocalBackend(cfg, store)
    assert commit.latest_committed(cfg.root, "m").name == "global_epoch0_step30"  # type: ignore[union-attr]
    assert choose(cfg, backend, "global_epoch0_step10").where == "archive"        # never taken as resident
    # Restoring it instead of finishing the delete: the journal entry goes, and retention
    # no longer sees an interrupted delete (it is committed again).
    restore(cfg, backend, "global_epoch0_step10", verify=True)
    assert not (Path(cfg.root) / "m" / ".retention-journal" / "global_epoch0_step10.deleting").exists()
    commit.remove_checkpoint(victim)     # as it was: half-deleted, journal entry back
    (victim / "f0.bin").parent.mkdir(parents=True, exist_ok=True)
    (victim / "f0.bin").write_bytes(b"x" * 100)
    (Path(cfg.root) / "m" / ".retention-journal" / "global_epoch0_step10.deleting").write_text("t")
    plan = {d.name: d.action for d in ret.evaluate(cfg, backend, ret.Policy(keep_last=1, min_keep=1)).decisions}
    assert plan["global_epoch0_step10"] == "resume-delete"
    rc = cli.main(["retention", "apply", "--config", str(cfg_file), "--json"])
    assert rc == 0
    assert {c.name for c in commit.scan(cfg.root, "m")} == {"global_epoch0_step30"}
    assert not any((Path(cfg.root) / "m" / ".retention-journal").iterdir())


def test_cli_with_only_the_config_file(env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What the cluster's systemd timer runs: `tiered-ckpt retention apply --json`, config from the file."""
    cfg, store, cc = env
    for s in (10, 20, 30, 40):
        make_checkpoint(cfg.root, "m", 0, s)
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    monkeypatch.setenv("TIERED_CKPT_CONFIG", str(cfg_file))
    st_file = tmp_path / "exp.json"
    assert cli.main(["export", "--once", "--json", "--export-status", str(st_file)]) == 0
    assert json.loads(capsys.readouterr().out)["files_exported"] == 12
    assert cli.main(["retention", "plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [c["decision"] for c in plan["checkpoints"]] == ["delete", "delete", "keep", "keep"]
    assert cli.main(["retention", "apply", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and len(out["applied"]) == 2
    assert cli.main(["status", "--json", "--export-status", str(st_file)]) == 0
    st = json.loads(capsys.readouterr().out)
    tiers = {c["name"]: c["tier"] for c in st["checkpoints"]}
    assert tiers == {"global_epoch0_step10": "only in archive", "global_epoch0_step20": "only in archive",
                     "global_epoch0_step30": "archived", "global_epoch0_step40": "archived"}
    assert st["export"]["iterations"] == 1 and st["backlog"]["files"] == 0 and st["capacity"]["fits"]
    assert cli.main(["restore", "global_epoch0_step10", "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["source"] == "archive"
    assert cli.main(["restore", "nope", "--json"]) == 2
    assert "global_epoch" in json.loads(capsys.readouterr().out)["error"]


def test_status_reports_backlog_and_not_yet_archived(env, tmp_path: Path) -> None:
    cfg, store, _ = env
    make_checkpoint(cfg.root, "m", 0, 10)
    make_checkpoint(cfg.root, "m", 0, 20, commit=False)
    st = gather(LocalBackend(cfg, store), export_status_path=tmp_path / "none.json")
    tiers = {c.name: c.tier for c in st.checkpoints}
    assert tiers == {"global_epoch0_step10": "not yet archived", "global_epoch0_step20": "in flight"}
    assert st.backlog.files == 5 and st.backlog.bytes > 0 and st.backlog.oldest_age_s is not None
    assert st.export["state"] == "never ran"


def test_exporter_tolerates_files_deleted_under_it(env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retention may delete a checkpoint while an export iteration runs: not a failure."""
    cfg, store, cc = env
    d = make_checkpoint(cfg.root, "m", 0, 10)
    ex = Exporter(cfg, store, status_path=tmp_path / "st.json")
    real = ex.discover

    def discover_then_delete():
        todo = real()
        commit.remove_checkpoint(d)
        return todo

    monkeypatch.setattr(ex, "discover", discover_then_delete)
    it = ex.iterate()
    assert it.ok and it.files_discovered == 3 and it.files_exported == 0


def test_human_output_and_restore_progress(env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg, store, _ = env
    for s in (10, 20, 30):
        make_checkpoint(cfg.root, "m", 0, s, files={"a.bin": os.urandom(200_000)})
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    monkeypatch.setenv("TIERED_CKPT_CONFIG", str(cfg_file))
    st_file = str(tmp_path / "exp.json")
    assert cli.main(["export", "--export-status", st_file]) == 0
    assert cli.main(["retention", "plan", "--keep-last", "1", "--min-keep", "1"]) == 0
    out = capsys.readouterr().out
    assert "global_epoch0_step10" in out and "delete" in out and "newest committed" in out
    assert cli.main(["status", "--export-status", st_file]) == 0
    out = capsys.readouterr().out
    assert "archived" in out and "export backlog: 0 files" in out and "capacity:" in out
    import shutil

    shutil.rmtree(cfg.root)
    monkeypatch.setenv("TIERED_CKPT_PROGRESS", "1")
    assert cli.main(["restore", "--latest", "--verify"]) == 0
    cap = capsys.readouterr()
    assert "restored global_epoch0_step30" in cap.out and "hashes verified" in cap.out
    assert "restore global_epoch0_step30" in cap.err and "195.3" in cap.err    # bytes done of total


def test_export_watch_runs_until_sigterm(env, tmp_path: Path) -> None:
    import signal
    import time

    cfg, store, cc = env
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    st_file = tmp_path / "exp.json"
    proc = subprocess.Popen([sys.executable, "-m", "tiered_ckpt", "export", "--watch", "--interval", "0.2",
                             "--config", str(cfg_file), "--export-status", str(st_file)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        make_checkpoint(cfg.root, "m", 0, 10)
        deadline = time.monotonic() + 20
        # Exported, and that iteration recorded (a SIGTERM mid-iteration records nothing).
        while "checkpoints/m/global_epoch0_step10/COMMITTED.json" not in blob_names(cc) or not (
                (s := read_status(st_file)) and s.last_iteration and s.last_iteration["files_exported"]):
            assert time.monotonic() < deadline, "the exporter did not export within 20 s"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "Traceback" not in err
    assert "stand-in for AMLFS auto-export" in err
    st = read_status(st_file)
    assert st is not None and st.iterations >= 1 and st.last_successful_iteration_utc


def test_status_lists_the_archive_once(env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Proof, archive-only checkpoints and backlog share one listing (each is many pages on a large model)."""
    cfg, store, _ = env
    make_checkpoint(cfg.root, "m", 0, 10)
    calls: list[str] = []
    real = store.listing

    def counted(prefix: str):
        calls.append(prefix)
        return real(prefix)

    monkeypatch.setattr(store, "listing", counted)
    st = gather(LocalBackend(cfg, store), export_status_path=tmp_path / "none.json")
    assert calls == ["m"]
    assert [c.tier for c in st.checkpoints] == ["not yet archived"] and st.backlog.files == 3


def test_restore_onto_a_full_disk_is_one_user_error(env, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local write failure while downloading (ENOSPC) names the file and the fix; nothing looks restored."""
    import errno

    from tiered_ckpt.errors import UserError

    cfg, store, _ = env
    d = make_checkpoint(cfg.root, "m", 0, 10)
    Exporter(cfg, store, status_path=Path(cfg.root).parent / "st.json").iterate()
    commit.remove_checkpoint(d)
    real = store.download_file

    def full(rel: str, dest: str, *a, **k):
        if rel.endswith(".bin"):
            raise OSError(errno.ENOSPC, "No space left on device", dest)
        return real(rel, dest, *a, **k)

    monkeypatch.setattr(store, "download_file", full)
    with pytest.raises(UserError, match=r"no space left writing .*global_epoch0_step10.*retention"):
        restore(cfg, LocalBackend(cfg, store))
    assert commit.read_marker(d) is None and commit.latest_committed(cfg.root, "m") is None


def test_export_of_a_missing_root_is_refused(env, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped --root must not report a successful export of nothing."""
    cfg, _, _ = env
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    missing = tmp_path / "typo" / "lustre"
    rc = cli.main(["export", "--once", "--json", "--config", str(cfg_file), "--root", str(missing)])
    assert rc == 2 and str(missing) in json.loads(capsys.readouterr().out)["error"]
    assert not missing.parent.exists()


def test_exporter_never_uploads_a_checkpoint_while_restore_downloads_it(env, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A half-downloaded file must not overwrite its good blob: the archive is the only copy left."""
    cfg, store, cc = env
    d = make_checkpoint(cfg.root, "m", 0, 10, files={"a.bin": os.urandom(300_000)})
    ex = Exporter(cfg, store, status_path=tmp_path / "st.json")
    ex.iterate()
    good = cc.download_blob("checkpoints/m/global_epoch0_step10/a.bin").readall()
    commit.remove_checkpoint(d)
    real = store.download_file
    seen: list[int] = []

    def slow(rel: str, dest: str, *a, **k):
        if rel.endswith("a.bin"):
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            Path(dest).write_bytes(good[:1000])          # part of it has arrived
            seen.append(ex.iterate().files_exported)     # an export iteration runs meanwhile
        return real(rel, dest, *a, **k)

    monkeypatch.setattr(store, "download_file", slow)
    res = restore(cfg, LocalBackend(cfg, store), verify=True)
    assert res.source == "archive" and seen == [0]
    assert cc.download_blob("checkpoints/m/global_epoch0_step10/a.bin").readall() == good
