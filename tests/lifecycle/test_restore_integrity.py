"""Restore checks what comes from the archive: hashes always, never two generations, no symlink
followed, and an honest report of what was checked (real Azurite, blobs built directly)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from azure.storage.blob import ContainerClient

from tests.lifecycle.helpers import auto_export, backend_of, import_hook, local_cfg, make_checkpoint
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import dump
from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import commit
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import MARKER, FileEntry, Manifest
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore

NAME = "global_epoch0_step10"
PREFIX = f"checkpoints/m/{NAME}"


@pytest.fixture
def env(tmp_path: Path, azurite_container: tuple[str, str]):
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = local_cfg(root, conn, container)
    return cfg, BlobStore(cfg.archive, backoff=0.01), ContainerClient.from_connection_string(conn, container)


def xxh(data: bytes) -> str:
    h = new_hasher()
    h.update(data)
    return h.hexdigest()


def marker_of(files: dict[str, bytes], *, hashed: bool = True, **extra: object) -> bytes:
    m = Manifest(epoch=0, step=10, files=[FileEntry(p, len(b), xxh(b) if hashed else None) for p, b in files.items()])
    d = json.loads(m.to_json())
    d.update(extra)
    return json.dumps(d, indent=1, sort_keys=True).encode()


def export(cfg, store, tmp_path: Path) -> None:
    assert Exporter(cfg, store, status_path=tmp_path / "st.json").iterate().ok


def ckpt_dir(cfg) -> Path:
    return Path(cfg.root) / "m" / NAME


def assert_nothing_committed(cfg) -> None:
    d = ckpt_dir(cfg)
    assert not os.path.lexists(d / MARKER)
    assert commit.latest_committed(cfg.root, "m") is None
    assert not d.exists() or not [p for p in d.iterdir() if p.name.endswith(".restoring")]


def test_archive_bytes_are_hashed_without_verify_and_zeros_are_refused(env, tmp_path: Path) -> None:
    cfg, store, cc = env
    make_checkpoint(cfg.root, "m", 0, 10, files={"a.bin": os.urandom(200_000), "b.bin": os.urandom(100_000)})
    export(cfg, store, tmp_path)
    shutil.rmtree(cfg.root)
    cc.upload_blob(f"{PREFIX}/b.bin", bytes(100_000), overwrite=True)      # same size, zeros
    with pytest.raises(IntegrityError) as e:
        restore(cfg, LocalBackend(cfg, store), None)       # no --verify
    msg = str(e.value)
    assert "b.bin" in msg and "archive copy itself is damaged" in msg and "restore it again" not in msg
    assert_nothing_committed(cfg)
    assert not (ckpt_dir(cfg) / "b.bin").exists()        # never under its final name (the exporter would upload it)


def test_mixed_generation_in_the_archive_is_refused(env, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Blob as a re-save left it: generation 1's marker, one shard overwritten by generation 2."""
    cfg, _, cc = env
    v1 = {"shard-r00000-000.bin": os.urandom(150_000), "shard-r00001-000.bin": os.urandom(150_000)}
    cc.upload_blob(f"{PREFIX}/{MARKER}", marker_of(v1))
    cc.upload_blob(f"{PREFIX}/shard-r00000-000.bin", v1["shard-r00000-000.bin"])
    cc.upload_blob(f"{PREFIX}/shard-r00001-000.bin", os.urandom(150_000))   # generation 2, same size
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    assert cli.main(["restore", "--latest", "--config", str(cfg_file), "--json"]) == 1
    err = json.loads(capsys.readouterr().out)["error"]
    assert "shard-r00001-000.bin" in err and "damaged" in err
    assert_nothing_committed(cfg)


def test_save_id_names_restore_exactly_the_marker_generation(env, tmp_path: Path) -> None:
    """A re-save that exported its data but died before its marker: the archived marker's own files come back."""
    cfg, store, cc = env
    v1 = {"shard-r00000-000.aaaa1.bin": os.urandom(120_000), "rank00000.aaaa1.part.json": b"{}"}
    # The marker's "save_id" key arrives with the writer's naming; until then the names alone carry it.
    data = marker_of(v1, **({"save_id": "aaaa1"} if "save_id" in Manifest.__dataclass_fields__ else {}))
    cc.upload_blob(f"{PREFIX}/{MARKER}", data)
    for p, b in v1.items():
        cc.upload_blob(f"{PREFIX}/{p}", b)
    cc.upload_blob(f"{PREFIX}/shard-r00000-000.bbbb2.bin", os.urandom(120_000))   # generation 2's data
    r = restore(cfg, LocalBackend(cfg, store), NAME)
    assert (r.source, r.verified, r.check) == ("archive", True, "hashes")
    d = ckpt_dir(cfg)
    assert sorted(p.name for p in d.iterdir()) == sorted([*v1, MARKER])
    assert (d / MARKER).read_bytes() == data          # the archive's marker, byte for byte
    assert all((d / p).read_bytes() == b for p, b in v1.items())


def _unhashed_checkpoint(cfg) -> Path:
    files = {"a.bin": os.urandom(50_000)}
    d = ckpt_dir(cfg)
    d.mkdir(parents=True)
    (d / "a.bin").write_bytes(files["a.bin"])
    (d / MARKER).write_bytes(marker_of(files, hashed=False))
    return d


def test_verify_of_a_checkpoint_saved_without_hashes_says_sizes_only(env, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg, store, _ = env
    _unhashed_checkpoint(cfg)
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(dump(cfg))
    assert cli.main(["restore", NAME, "--verify", "--config", str(cfg_file)]) == 0
    out = capsys.readouterr().out
    assert "sizes only: saved without hashes" in out and "hashes verified" not in out
    assert cli.main(["restore", NAME, "--verify", "--config", str(cfg_file), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["verified"] is False and res["check"] == "sizes only: saved without hashes"
    # Without --verify a resident checkpoint gets its sizes checked (documented), not its hashes.
    assert cli.main(["restore", NAME, "--config", str(cfg_file), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["source"], res["verified"], res["check"]) == ("resident", False, "sizes")
    # From the archive, a checkpoint without hashes is checked against the hash the exporter recorded.
    export(cfg, store, tmp_path)
    shutil.rmtree(cfg.root)
    r = restore(cfg, LocalBackend(cfg, store), NAME, verify=True)
    assert (r.source, r.verified, r.check) == ("archive", False, "sizes only: saved without hashes")
    assert any("without hashes" in w for w in r.warnings)


def test_planted_restoring_symlink_and_final_name_symlink_are_never_followed(env, tmp_path: Path) -> None:
    cfg, store, cc = env
    good = os.urandom(80_000)
    make_checkpoint(cfg.root, "m", 0, 10, files={"a.bin": good})
    export(cfg, store, tmp_path)
    shutil.rmtree(ckpt_dir(cfg))
    victim, victim2 = tmp_path / "victim-key", tmp_path / "victim2"
    victim.write_bytes(b"secret")
    victim2.write_bytes(b"other")
    d = ckpt_dir(cfg)
    d.mkdir()
    (d / ".a.bin.restoring").symlink_to(victim)        # the fixed temp name of earlier versions
    (d / "a.bin").symlink_to(victim2)
    r = restore(cfg, LocalBackend(cfg, store), NAME)
    assert victim.read_bytes() == b"secret" and victim2.read_bytes() == b"other"
    assert r.source == "archive" and r.verified
    assert not (d / "a.bin").is_symlink() and (d / "a.bin").read_bytes() == good
    assert not os.path.lexists(d / ".a.bin.restoring")   # a killed restore's leftover name is cleaned, not followed


@pytest.mark.parametrize("link", ["checkpoint", "model"])
def test_restore_into_a_symlinked_directory_is_refused(env, tmp_path: Path, link: str) -> None:
    cfg, store, _ = env
    make_checkpoint(cfg.root, "m", 0, 10)
    export(cfg, store, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    if link == "checkpoint":
        shutil.rmtree(ckpt_dir(cfg))
        ckpt_dir(cfg).symlink_to(outside)
    else:
        shutil.rmtree(Path(cfg.root) / "m")
        (Path(cfg.root) / "m").symlink_to(outside)
    with pytest.raises(UserError, match="symbolic link") as e:
        restore(cfg, LocalBackend(cfg, store), NAME)
    assert e.value.exit_code == 4
    assert list(outside.iterdir()) == []


# -- AMLFS: the import job and hsm_restore bring bytes from the archive too ---------------------

def test_amlfs_import_of_a_damaged_archive_is_refused_and_its_marker_removed(aml, arm_env) -> None:  # noqa: F811
    from tiered_ckpt.lifecycle import retention as ret

    cfg, store, cc, _ = aml
    cfg = cfg.with_overrides(amlfs=arm_env.config_values())
    for s in (10, 20):
        make_checkpoint(cfg.root, "m", 0, s)
    auto_export(cfg.root, store)
    backend = backend_of(cfg, store)
    assert ret.apply(cfg, backend, ret.Policy(keep_last=1, min_keep=1)).done == [f"delete {NAME}"]
    size = cc.get_blob_client(f"{PREFIX}/rank0_shard1.bin").get_blob_properties().size
    cc.upload_blob(f"{PREFIX}/rank0_shard1.bin", bytes(size), overwrite=True)      # same size, zeros
    arm_env.scenario.import_hook = import_hook(cfg, store)
    with pytest.raises(IntegrityError, match=r"rank0_shard1\.bin.*archive copy itself is damaged"):
        restore(cfg, backend, NAME)                                 # no --verify
    assert (ckpt_dir(cfg) / "rank0_shard0.bin").exists()              # the import did bring the files...
    assert not os.path.lexists(ckpt_dir(cfg) / MARKER)             # ...but nothing looks committed
    assert arm_env.kinds("autoexport.patch")[-1] == "autoexport.patch:Enable"


def test_amlfs_files_back_from_hsm_restore_are_hash_checked_without_verify(aml) -> None:  # noqa: F811
    from tiered_ckpt.lifecycle import retention as ret

    cfg, store, _, _ = aml
    for s in (10, 20):
        make_checkpoint(cfg.root, "m", 0, s, files={"s0.bin": os.urandom(4096), "s1.bin": os.urandom(4096)})
    auto_export(cfg.root, store)
    backend = backend_of(cfg, store)
    assert ret.apply(cfg, backend, ret.Policy(keep_last=1, min_keep=1, action="release")).done == [f"release {NAME}"]
    # What hsm_restore will bring back from the archive: same size, other bytes (the fake lfs
    # keeps a released file's bytes where they are).
    (ckpt_dir(cfg) / "s1.bin").write_bytes(bytes(4096))
    with pytest.raises(IntegrityError, match=r"s1\.bin.*archive copy itself is damaged"):
        restore(cfg, backend, NAME)
