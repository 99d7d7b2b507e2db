"""The writer never mistakes or loses a checkpoint: one saver per name, no reuse of a name committed
on either tier, no symlink followed, explicit modes, canonical names, clear errors."""
from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import ArchiveConfig, IoConfig, NodeConfig
from tiered_ckpt.errors import ConflictError, UnavailableError, UserError
from tiered_ckpt.io import commit, layout, writer
from tiered_ckpt.io.marker import MARKER, Manifest
from tiered_ckpt.io.options import IoOptions
from tiered_ckpt.io.reader import verify
from tiered_ckpt.naming import parse_name, require_name

IO = "IoConfig(threads=2, files_per_rank=3, block_size=64 << 10, sync_buffer_bytes=256 << 10, staging_bytes=256 << 10)"

SAVER = r"""
import json, sys
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.errors import UserError
root, step, fill, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
cfg = NodeConfig(root=root, model="m", io=IO_CONFIG)

class Paused:                    # holds the save mid-write until the test says go (on stdin)
    nbytes = 1 << 20
    first = True
    def copy_into(self, offset, view):
        if pause and Paused.first:
            Paused.first = False
            print("paused", flush=True)
            sys.stdin.readline()
        view[:] = bytes([fill]) * len(view)

try:
    r = tc.save({"w": Paused()}, epoch=0, step=step, config=cfg)
    print(json.dumps({"ok": True, "save_id": r.save_id}), flush=True)
except UserError as e:
    print(json.dumps({"ok": False, "cls": type(e).__name__, "error": str(e)}), flush=True)
    sys.exit(e.exit_code)
""".replace("IO_CONFIG", IO)


def _saver(root: Path, step: int, fill: int, pause: bool) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", SAVER, str(root), str(step), str(fill), "1" if pause else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_saving_one_step_exactly_one_commits_its_own_bytes(cfg: NodeConfig, root: Path) -> None:
    a = _saver(root, 5, 0xAA, pause=True)
    assert a.stdout is not None and a.stdin is not None
    assert a.stdout.readline().strip() == "paused", a.communicate(timeout=30)[1][-2000:]
    d = root / "m" / "global_epoch0_step5"
    before = {p.name for p in d.iterdir()}
    b = _saver(root, 5, 0xBB, pause=False)               # starts while A holds the name
    out_b, err_b = b.communicate(timeout=60)
    assert b.returncode == ConflictError.exit_code, (out_b, err_b[-2000:])
    res_b = json.loads(out_b.strip().splitlines()[-1])
    assert res_b["cls"] == "ConflictError" and "global_epoch0_step5" in res_b["error"]
    assert before <= {p.name for p in d.iterdir()}, "the losing save deleted none of the live save's files"
    a.stdin.write("go\n")
    a.stdin.flush()
    out_a, err_a = a.communicate(timeout=60)
    assert a.returncode == 0, err_a[-2000:]
    res_a = json.loads(out_a.strip().splitlines()[-1])
    m = commit.read_marker(d)
    assert m is not None and m.save_id == res_a["save_id"]
    assert verify(d, check_hash=True).ok
    assert bytes(tc.load("global_epoch0_step5", config=cfg, verify_hash=True)["w"]) == b"\xaa" * (1 << 20)
    assert {p.name for p in d.iterdir()} == {f.path for f in m.files} | {MARKER}


def test_every_file_carries_the_save_id_and_the_marker_names_it(cfg: NodeConfig, root: Path) -> None:
    r1 = tc.save({"a": os.urandom(300_000)}, epoch=0, step=1, config=cfg)
    r2 = tc.save({"a": b"x"}, epoch=0, step=2, config=cfg, save_id="job-42.attempt_1")
    assert r1.save_id != r2.save_id and r2.save_id == "job-42.attempt_1"
    for r in (r1, r2):
        m = commit.read_marker(r.path)
        assert m is not None and m.save_id == r.save_id
        for f in m.files:
            assert layout.file_owner(f.path) is not None and layout.file_owner(f.path)[1] == r.save_id  # type: ignore[index]
    for bad in ("", "a/b", "../x", ".hidden", "x" * 65, "new\nline", 5):
        with pytest.raises(UserError, match="save_id"):
            tc.save({"a": b"x"}, epoch=0, step=3, config=cfg, save_id=bad)  # type: ignore[arg-type]
    assert not (root / "m" / "global_epoch0_step3").exists()


def test_a_name_archived_and_deleted_by_retention_is_never_saved_again(cfg: NodeConfig, root: Path) -> None:
    from tiered_ckpt.lifecycle import tombstone

    tc.save({"a": b"v1" * 1000}, epoch=0, step=200, config=cfg)
    d = root / "m" / "global_epoch0_step200"
    m = commit.read_marker(d)
    assert m is not None
    tombstone.record(root, "m", d.name, m)              # what retention does before deleting it
    commit.remove_checkpoint(d)
    assert tombstone.present(root, "m", d.name)
    with pytest.raises(ConflictError, match="committed in the archive.*never overwritten"):
        tc.save({"a": b"v2" * 1000}, epoch=0, step=200, config=cfg)
    assert not d.exists() or commit.read_marker(d) is None
    tombstone.clear(root, "m", d.name)                  # the archived copy was deleted too: the name is free
    tc.save({"a": b"v2" * 1000}, epoch=0, step=200, config=cfg)


def _archive_cfg(root: Path, conn: str, container: str) -> NodeConfig:
    return NodeConfig(root=str(root), model="m", backend="local", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10),
                      archive=ArchiveConfig(connection_string=conn, container=container, prefix="checkpoints", retries=1))


def _archive(cfg: NodeConfig, d: Path) -> None:
    """Upload every file of a checkpoint, as the export does (same relative names)."""
    from tiered_ckpt.tiers.blob import BlobStore

    store = BlobStore(cfg.archive, backoff=0.05)
    for p in sorted(d.iterdir()):
        store.upload_file(str(p), f"m/{d.name}/{p.name}")


def test_a_name_committed_in_blob_is_refused_even_without_a_local_trace(root: Path, azurite_container: tuple[str, str]) -> None:
    cfg = _archive_cfg(root, *azurite_container)
    tc.save({"a": b"v1" * 5000}, epoch=0, step=200, config=cfg)
    d = root / "m" / "global_epoch0_step200"
    _archive(cfg, d)
    commit.remove_checkpoint(d)                              # deleted locally (no tombstone: e.g. by hand)
    with pytest.raises(ConflictError, match="COMMITTED.json exists in Blob"):
        tc.save({"a": b"v2" * 5000}, epoch=0, step=200, config=cfg)
    assert not d.exists() or commit.read_marker(d) is None
    tc.save({"a": b"v3"}, epoch=0, step=201, config=cfg)  # other names are fine


def test_a_name_that_cannot_be_checked_against_the_archive_is_refused_unless_allowed(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    key = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
    conn = f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={key};BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;"
    cfg = _archive_cfg(root, conn, "c")
    d = root / "m" / "global_epoch0_step1"
    with pytest.raises(UnavailableError, match="archive could not be asked whether global_epoch0_step1 is committed "
                                                "there.*Nothing was written.*archive_check='best_effort'") as e:
        tc.save({"a": b"x" * 1000}, epoch=0, step=1, config=cfg)
    assert key not in str(e.value) and e.value.exit_code == 3
    assert not d.exists(), "a refused save leaves nothing behind"
    with pytest.raises(UserError, match="archive_check='sometimes'.*'required'.*'best_effort'"):
        tc.save({"a": b"x"}, epoch=0, step=1, config=cfg, archive_check="sometimes")
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt.lifecycle.reuse"):
        r = tc.save({"a": b"x" * 1000}, epoch=0, step=1, config=cfg, archive_check="best_effort")
    assert commit.read_marker(r.path) is not None
    assert "could not check whether global_epoch0_step1 is committed in the archive" in caplog.text
    assert "COMMITTED.json will be replaced" in caplog.text and key not in caplog.text


ENV_RANK = r"""
import json, sys
import tiered_ckpt as tc
from tiered_ckpt.config import ArchiveConfig, IoConfig, NodeConfig
from tiered_ckpt.errors import UserError
from tiered_ckpt.io.options import IoOptions
root, rank, sid, conn, container, fill = sys.argv[1:7]
cfg = NodeConfig(root=root, model="m", backend="local", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10),
                 archive=ArchiveConfig(connection_string=conn, container=container, prefix="checkpoints", retries=1))
try:
    tc.save({"w": bytes([int(fill)]) * 150_000}, epoch=0, step=200, config=cfg, rank=int(rank), world_size=2,
            save_id=sid, options=IoOptions(barrier_timeout=20))
    print(json.dumps({"ok": True}))
except UserError as e:
    print(json.dumps({"ok": False, "cls": type(e).__name__, "error": str(e)}))
    sys.exit(e.exit_code)
"""


def _env_ranks(root: Path, sid: str, conn: str, container: str, fill: int) -> list[tuple[int, dict[str, object]]]:
    ps = [subprocess.Popen([sys.executable, "-c", ENV_RANK, str(root), str(r), sid, conn, container, str(fill)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (1, 0)]
    outs = []
    for p in ps:
        o, e = p.communicate(timeout=90)
        assert o.strip(), e[-3000:]
        outs.append((p.returncode, json.loads(o.strip().splitlines()[-1])))
    return outs[::-1]


def test_two_env_var_ranks_cannot_resave_a_name_committed_in_the_archive(root: Path, azurite_container: tuple[str, str]) -> None:
    conn, container = azurite_container
    cfg = _archive_cfg(root, conn, container)
    assert all(o["ok"] for _, o in _env_ranks(root, "v1", conn, container, 1))
    d = root / "m" / "global_epoch0_step200"
    _archive(cfg, d)
    from tiered_ckpt.tiers.blob import BlobStore

    store = BlobStore(cfg.archive, backoff=0.05)
    archived = {rel: b.size for rel, b in store.listing("m").items()}
    marker_before = store.get_bytes(f"m/{d.name}/{MARKER}")
    commit.remove_checkpoint(d)                              # retention deleted it locally
    (rc0, o0), (rc1, o1) = _env_ranks(root, "v2", conn, container, 2)
    assert rc0 == ConflictError.exit_code and o0["cls"] == "ConflictError" and "in the archive" in str(o0["error"]), o0
    assert rc1 != 0 and "rank 0" in str(o1["error"]) and "in the archive" in str(o1["error"]), o1
    assert commit.read_marker(d) is None, "nothing committed locally"
    assert not [p.name for p in d.iterdir() if p.name.endswith(".bin")], "rank 1 removed its files"
    assert store.get_bytes(f"m/{d.name}/{MARKER}") == marker_before
    assert {rel: b.size for rel, b in store.listing("m").items()} == archived


def test_a_symlinked_checkpoint_or_model_directory_is_refused_and_its_target_untouched(cfg: NodeConfig, root: Path,
                                                                                        tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious.txt").write_bytes(b"keep me")
    (root / "m").mkdir()
    (root / "m" / "global_epoch0_step1").symlink_to(target)
    with pytest.raises(UserError, match="global_epoch0_step1 is a symbolic link.*refused"):
        tc.save({"a": b"x" * 1000}, epoch=0, step=1, config=cfg)
    assert sorted(p.name for p in target.iterdir()) == ["precious.txt"] and (target / "precious.txt").read_bytes() == b"keep me"
    with pytest.raises(UserError, match="symbolic link"):
        tc.async_save({"a": b"x"}, epoch=0, step=1, config=cfg)
    (root / "other").symlink_to(target)
    with pytest.raises(UserError, match="other is a symbolic link.*refused"):
        tc.save({"a": b"x"}, epoch=0, step=1, config=cfg, model="other")
    assert sorted(p.name for p in target.iterdir()) == ["precious.txt"]


def test_stale_cleanup_never_follows_a_link_nor_removes_a_directory(cfg: NodeConfig, root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not yours")
    d = root / "m" / "global_epoch0_step2"
    d.mkdir(parents=True)
    (d / "shard-r00000-000.bin").symlink_to(outside)     # a planted link under a stale-looking name
    tc.save({"a": b"y" * 1000}, epoch=0, step=2, config=cfg)
    assert outside.read_bytes() == b"not yours" and not (d / "shard-r00000-000.bin").is_symlink()
    d3 = root / "m" / "global_epoch0_step3"
    (d3 / "sub").mkdir(parents=True)
    (d3 / "sub" / "data").write_bytes(b"someone's")
    with pytest.raises(UserError, match="holds a directory 'sub'.*never removed automatically"):
        tc.save({"a": b"z"}, epoch=0, step=3, config=cfg)
    assert (d3 / "sub" / "data").read_bytes() == b"someone's"


def test_modes_are_explicit_even_with_umask_000(cfg: NodeConfig, root: Path) -> None:
    old = os.umask(0)
    try:
        r = tc.save({"a": os.urandom(200_000)}, epoch=0, step=1, config=cfg)
    finally:
        os.umask(old)
    d = Path(r.path)
    assert stat.S_IMODE(d.stat().st_mode) == 0o2775 and stat.S_IMODE(d.parent.stat().st_mode) == 0o2775
    for p in d.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p


def test_the_new_directories_are_fsynced_before_the_marker(cfg: NodeConfig, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync, real_marker = os.fsync, writer.commit.write_marker
    marker_at: list[int] = []

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    def write_marker(d: Path, m: Manifest, **kw: Any) -> Path:
        marker_at.append(len(synced))
        return real_marker(d, m, **kw)

    monkeypatch.setattr(writer.os, "fsync", fsync)
    monkeypatch.setattr(writer.commit, "write_marker", write_marker)
    r = tc.save({"a": b"q" * 5000}, epoch=0, step=1, config=cfg)
    before = set(synced[: marker_at[0]])
    assert root.stat().st_ino in before, "the root, after creating the model directory"
    assert Path(r.path).parent.stat().st_ino in before, "the model directory, after creating the checkpoint directory"


def test_names_are_canonical_and_numbers_are_integers(cfg: NodeConfig, root: Path) -> None:
    assert parse_name("global_epoch0_step5") is not None
    for bad in ("global_epoch0_step05", "global_epoch00_step5", "global_epoch0_step5\n", " global_epoch0_step5",
                "global_epoch0_step" + "9" * 300, f"global_epoch0_step{2**63}"):
        assert parse_name(bad) is None, bad
    with pytest.raises(UserError, match="not canonical.*'global_epoch0_step5'"):
        require_name("global_epoch0_step05")
    with pytest.raises(UserError, match="below 2\\*\\*63"):
        require_name("global_epoch0_step" + "9" * 300)
    with pytest.raises(UserError, match="not canonical"):
        tc.save({"a": b"x"}, name="global_epoch0_step5\n", config=cfg)
    for kw, what in (({"epoch": 0, "step": 1.7}, "step=1.7 is not an integer"), ({"epoch": True, "step": 1}, "epoch=True is a bool"),
                     ({"epoch": 0, "step": 10**300}, "step=a 997-bit number: must be below 2\\*\\*63"),
                     ({"epoch": 0, "step": "5"}, "not an integer"), ({"epoch": -1, "step": 1}, "epoch=-1: must be >= 0")):
        with pytest.raises(UserError, match=what):
            tc.save({"a": b"x"}, config=cfg, **kw)  # type: ignore[arg-type]
    assert not (root / "m").exists() or not any(p.name.startswith("global") for p in (root / "m").iterdir())
    r = tc.save({"a": b"x"}, epoch=np.int64(2), step=np.int64(30), config=cfg)   # numpy integers are integers
    assert r.name == "global_epoch2_step30"


def test_a_new_save_drops_the_retention_journal_entry_of_its_name(cfg: NodeConfig, root: Path) -> None:
    from tiered_ckpt.lifecycle import journal

    (root / "m").mkdir()
    journal.add(root, "m", "global_epoch0_step9")        # left by a killed retention run
    tc.save({"a": b"new"}, epoch=0, step=9, config=cfg)
    assert "global_epoch0_step9" not in journal.journaled(root, "m")


def test_every_failure_releases_the_claim(cfg: NodeConfig, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as mp:
        mp.setattr(writer.os, "fsync", fsync)
        with pytest.raises(UserError, match="not committed"):
            tc.save({"a": os.urandom(1 << 20)}, epoch=0, step=1, config=cfg)
        h = tc.async_save({"a": os.urandom(1 << 20)}, epoch=0, step=2, config=cfg, options=IoOptions(staging_bytes=4 << 20))
        assert isinstance(h.exception(timeout=30), UserError)
    with monkeypatch.context() as mp:
        mp.setattr(writer.commit, "write_marker", lambda d, m, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(UserError, match="RuntimeError\\('boom'\\)"):
            tc.save({"a": b"x" * 100}, epoch=0, step=3, config=cfg)
    for step in (1, 2, 3):
        tc.save({"a": b"ok"}, epoch=0, step=step, config=cfg)   # no ConflictError: the claim is free
        assert bytes(tc.load(f"global_epoch0_step{step}", config=cfg, verify_hash=True)["a"]) == b"ok"


def test_a_pool_that_cannot_be_allocated_is_one_clear_error(cfg: NodeConfig, root: Path) -> None:
    tc.save({"a": b"x" * 5000}, epoch=0, step=1, config=cfg)
    code = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
from tiered_ckpt.errors import UserError
cfg = NodeConfig(root=sys.argv[1], model="m", io=IoConfig(threads=64, block_size=1 << 30))
try:
    tc.load(config=cfg)
except UserError as e:
    print(e)
    sys.exit(e.exit_code)
"""
    p = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "cannot allocate the read buffer pool" in p.stdout and "io.threads" in p.stdout and "io.block_size" in p.stdout


UMASK_077 = r"""
import os, sys
os.umask(0o077)                       # another user's (or a hardened image's) umask
root, ptr = sys.argv[1], sys.argv[2]
import tiered_ckpt as tc
from tiered_ckpt.config import IoConfig, NodeConfig
cfg = NodeConfig(root=root, model="m", io=IoConfig(threads=2, files_per_rank=2, block_size=64 << 10,
                                                   sync_buffer_bytes=256 << 10, staging_bytes=1 << 20))
tc.save({"a": os.urandom(200_000)}, epoch=0, step=1, config=cfg)
tc.async_save({"a": os.urandom(200_000)}, epoch=0, step=2, config=cfg).wait()
try:
    import torch
except ImportError:
    sys.exit(0)
import torch.distributed.checkpoint as dcp
from tiered_ckpt.dcp import TieredWriter
from tiered_ckpt.training import save_training
dcp.save({"w": torch.randn(300, 300), "obj": {"x": 1}}, storage_writer=TieredWriter(config=cfg, epoch=0, step=3),
         no_dist=True)
save_training(torch.nn.Linear(64, 64), epoch=0, step=4, config=cfg)
try:
    from tiered_ckpt.lightning import TieredCheckpointIO
except ImportError:
    sys.exit(0)
TieredCheckpointIO(config=cfg).save_checkpoint({"epoch": 0, "global_step": 5, "state_dict": {"w": torch.ones(9)}}, ptr)
"""


def test_every_writer_sets_explicit_modes_under_umask_077(root: Path, tmp_path: Path) -> None:
    import importlib.util

    p = subprocess.run([sys.executable, "-c", UMASK_077, str(root), str(tmp_path / "lt" / "last.ckpt")],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    want = 5 if importlib.util.find_spec("lightning") else 4 if importlib.util.find_spec("torch") else 2
    names = sorted(c.name for c in commit.scan(root, "m") if c.committed)
    assert names == [f"global_epoch0_step{s}" for s in range(1, want + 1)], names
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root / "m"):
        for dn in dirnames:
            assert stat.S_IMODE((Path(dirpath) / dn).stat().st_mode) == 0o2775, Path(dirpath) / dn
        for fn in filenames:
            f = Path(dirpath) / fn
            mode = stat.S_IMODE(f.stat().st_mode)
            # lock files are opened read-write by every actor (group-writable); everything else 0644
            assert mode == (0o664 if f.suffix == ".lock" else 0o644), (f, oct(mode))
            seen += 1
    assert stat.S_IMODE((root / "m").stat().st_mode) == 0o2775
    assert seen > 4 * want      # markers, shards, part manifests or DCP metadata, locks
