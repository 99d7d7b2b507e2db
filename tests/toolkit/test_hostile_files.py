"""Malformed and hostile files in the checkpoint tree: each makes its one checkpoint invalid
(reported as "not committed (invalid marker: why)"), never a crash, a hang or wrong bytes.

Every CLI command runs as a real process (`python -m tiered_ckpt ... --json`) under a timeout,
so a FIFO that blocks an open fails the test instead of hanging it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

import tiered_ckpt as tc
from tests.toolkit import index_files
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import IntegrityError, UserError
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER, FileEntry, InvalidMarker, Manifest, parse_marker, validate

pytestmark = pytest.mark.timeout(180)

GOOD, BAD = "global_epoch0_step1", "global_epoch0_step2"
GOOD_BYTES = b"good" * 5000
BAD_BYTES = b"bad!" * 5000


def _marker(d: Path) -> dict[str, Any]:
    return json.loads((d / MARKER).read_bytes())


def _rewrite(d: Path, m: dict[str, Any]) -> None:
    (d / MARKER).unlink()
    (d / MARKER).write_bytes(json.dumps(m).encode())


def _shard(m: dict[str, Any]) -> dict[str, Any]:
    return next(f for f in m["files"] if f["path"].endswith(".bin"))


def _edit(fn: Callable[[dict[str, Any]], None]) -> Callable[[Path, Path], None]:
    def go(d: Path, outside: Path) -> None:
        m = _marker(d)
        fn(m)
        _rewrite(d, m)
    return go


def _set(**kv: Any) -> Callable[[Path, Path], None]:
    return _edit(lambda m: m.update(kv))


def _nul(m: dict[str, Any]) -> None:
    _shard(m)["path"] = "shard\0.bin"


def _long(m: dict[str, Any]) -> None:
    _shard(m)["path"] = "a" * 300


def _under_listed_file(m: dict[str, Any]) -> None:
    f = _shard(m)
    m["files"].append({"path": f["path"] + "/x", "size": 0, "hash": None, "rank": 0})


def _path_int(m: dict[str, Any]) -> None:
    _shard(m)["path"] = 5


def _under_regular_file(d: Path, outside: Path) -> None:
    # Valid marker naming "stray.bin/x", while stray.bin is a regular file: NotADirectoryError
    # on the stat, which must read as "missing", not crash.
    (d / "stray.bin").write_bytes(b"x")
    m = _marker(d)
    m["files"].append({"path": "stray.bin/x", "size": 1, "hash": None, "rank": 0})
    _rewrite(d, m)


def _marker_dir(d: Path, outside: Path) -> None:
    (d / MARKER).unlink()
    (d / MARKER).mkdir()


def _marker_fifo(d: Path, outside: Path) -> None:
    (d / MARKER).unlink()
    os.mkfifo(d / MARKER)


def _data_symlink(d: Path, outside: Path) -> None:
    # Same size as the shard, so only the file type can tell.
    m = _marker(d)
    shard = d / _shard(m)["path"]
    outside.write_bytes(b"SECRET!!" * (shard.stat().st_size // 8) + b"S" * (shard.stat().st_size % 8))
    shard.unlink()
    shard.symlink_to(outside)


def _data_fifo(d: Path, outside: Path) -> None:
    shard = d / _shard(_marker(d))["path"]
    shard.unlink()
    os.mkfifo(shard)


# (case, how to spoil the checkpoint, what `verify` must say, is it an invalid marker (vs. files not matching))
CASES: list[tuple[str, Callable[[Path, Path], None], str, bool]] = [
    ("nul-in-path", _edit(_nul), "contains a NUL", True),
    ("300-char-component", _edit(_long), "component of 300 bytes", True),
    ("path-under-a-listed-file", _edit(_under_listed_file), "listed as a file and as a directory", True),
    ("path-under-a-regular-file", _under_regular_file, "stray.bin/x: missing", False),
    ("path-is-an-int", _edit(_path_int), "path is 5, not a string", True),
    ("created-utc-int", _set(created_utc=5), "created_utc is 5", True),
    ("index-oops", _set(index_files="oops"), "index_files is 'oops', not a list of 1 file path(s)", True),
    ("embedded-index-in-format-2", _set(index={}), "has unknown keys ['index']", True),
    ("files-empty", _set(files=[]), "files is empty", True),
    ("marker-is-a-directory", _marker_dir, "a directory", True),
    ("marker-is-a-fifo", _marker_fifo, "a FIFO", True),
    ("data-file-is-a-symlink-out", _data_symlink, "a symbolic link, not a regular file", False),
    ("data-file-is-a-fifo", _data_fifo, "a FIFO, not a regular file", False),
]


@pytest.fixture
def conf(tmp_path: Path, root: Path, azurite_container: tuple[str, str]) -> Path:
    conn, container = azurite_container
    p = tmp_path / "config.yaml"
    p.write_text(yaml.safe_dump({
        "root": str(root), "model": "m", "backend": "local",
        "io": {"threads": 2, "files_per_rank": 2, "block_size": "256KiB", "sync_buffer_bytes": "1MiB",
               "staging_bytes": "1MiB"},
        "archive": {"connection_string": conn, "container": container, "prefix": "checkpoints", "retries": 0},
        "retention": {"keep_last": 1, "min_keep": 1, "action": "delete"},
    }))
    return p


def cli_json(conf: Path, *argv: str) -> tuple[int, Any, str]:
    """The real CLI in its own process; a hang is a failure (timeout), not a stuck test run."""
    p = subprocess.run([sys.executable, "-m", "tiered_ckpt", *argv, "--config", str(conf), "--json"],
                       capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr, p.stderr
    return p.returncode, json.loads(p.stdout) if p.stdout.strip() else None, p.stderr


def cli_many(conf: Path, *argvs: tuple[str, ...]) -> list[tuple[int, Any, str]]:
    """cli_json for several commands at once (each its own process, all under one timeout)."""
    procs = [subprocess.Popen([sys.executable, "-m", "tiered_ckpt", *argv, "--config", str(conf), "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in argvs]
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=60)
            assert "Traceback" not in se, se
            out.append((p.returncode, json.loads(so) if so.strip() else None, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.parametrize("case, spoil, needle, invalid_marker", CASES, ids=[c[0] for c in CASES])
def test_one_hostile_checkpoint_is_invalid_and_nothing_else_breaks(
        case: str, spoil: Callable[[Path, Path], None], needle: str, invalid_marker: bool,
        cfg: NodeConfig, root: Path, conf: Path, tmp_path: Path) -> None:
    tc.save({"a": GOOD_BYTES}, epoch=0, step=1, config=cfg)
    tc.save({"a": BAD_BYTES}, epoch=0, step=2, config=cfg)
    bad = root / "m" / BAD
    spoil(bad, tmp_path / "outside.bin")

    runs = cli_many(conf, ("list",), ("verify", BAD, "--hash"), ("verify", GOOD, "--hash"), ("retention", "plan"),
                    ("status",))
    rc, out, _ = runs[0]
    assert rc == 0
    rows = {r["name"]: r for r in out["checkpoints"]}
    assert not rows[BAD]["committed"] and not rows[BAD]["latest"]
    assert rows[BAD]["problem"].startswith("not committed (invalid marker: " if invalid_marker
                                           else "not committed (files do not match the marker: ")
    assert needle in rows[BAD]["problem"]
    assert rows[GOOD]["committed"] and rows[GOOD]["latest"] and rows[GOOD]["problem"] is None

    rc, out, _ = runs[1]
    assert rc == 1 and not out["ok"] and needle in " ".join(out["problems"]), out
    rc, out, _ = runs[2]
    assert rc == 0 and out["ok"], out

    rc, out, _ = runs[3]
    assert rc == 0, out
    plan = {c["name"]: c for c in out["checkpoints"]}
    assert plan[BAD]["decision"] == "skip" and "not committed" in plan[BAD]["reason"]
    assert plan[GOOD]["decision"] == "keep"

    rc, out, _ = runs[4]
    # status reports, and says so in its exit code: an invalid marker is a problem (1); otherwise the
    # one part it could not check is the export job (this test runs no exporter): UNKNOWN (3).
    checks = {c["part"]: c["state"] for c in out["checks"]}
    assert (rc, checks["markers"]) == ((1, "PROBLEM") if invalid_marker else (3, "ok")), out
    tiers = {c["name"]: c for c in out["checkpoints"]}
    assert tiers[BAD]["tier"] == ("invalid" if invalid_marker else "in flight") and needle in tiers[BAD]["detail"]
    assert tiers[GOOD]["tier"] == "not yet archived"

    # load(): the invalid one is refused with the toolkit's own error; the newest valid one loads.
    with pytest.raises(UserError) as err:
        tc.load(BAD, config=cfg, rank=0)
    assert isinstance(err.value, IntegrityError) and needle in str(err.value)
    assert bytes(tc.load(config=cfg, rank=0)["a"]) == GOOD_BYTES
    assert tc.latest(config=cfg).name == GOOD   # type: ignore[union-attr]


def test_markers_of_the_released_format_still_validate() -> None:
    # Byte for byte what the released writer produced (hash=False shard, one part file, no save_id).
    old = {
        "created_utc": "2024-05-01T10:00:00.123456+00:00", "epoch": 3, "format": "tiered-ckpt/1", "hash_algo": "xxh3_128",
        "step": 120, "world_size": 2,
        "files": [{"hash": None, "path": "shard-r00000-000.bin", "rank": 0, "size": 8192},
                  {"hash": "0123456789abcdef0123456789abcdef", "path": "rank00000.part.json", "rank": 0, "size": 300},
                  {"hash": "fedcba9876543210fedcba9876543210", "path": "shard-r00001-000.bin", "rank": 1, "size": 4096},
                  {"hash": "00000000000000000000000000000000", "path": "rank00001.part.json", "rank": 1, "size": 300}],
        "index": {"save_id": None, "ranks": {
            "0": {"w": {"kind": "numpy", "dtype": "<f4", "shape": [2, 1024], "nbytes": 8192,
                        "segments": [["shard-r00000-000.bin", 0, 8192, 0]]},
                  "empty": {"kind": "bytes", "dtype": None, "shape": None, "nbytes": 0, "segments": []}},
            "1": {"t": {"kind": "torch", "dtype": "bfloat16", "shape": [2048], "nbytes": 4096,
                        "segments": [["shard-r00001-000.bin", 0, 4096, 0]]}}}},
    }
    m = parse_marker(json.dumps(old, indent=1, sort_keys=True), "global_epoch3_step120")
    assert m.name == "global_epoch3_step120" and m.world_size == 2 and m.save_id is None
    assert json.loads(m.to_json()) == old                 # round-trips, no new key when there is no save_id
    assert parse_marker(Manifest(epoch=0, step=1, files=[FileEntry("a", 1, None)]).to_json()).index == {}
    with_sid = json.loads(Manifest(epoch=0, step=1, files=[FileEntry("a", 1, None)], save_id="job-7.a").to_json())
    assert validate(with_sid).save_id == "job-7.a"


def _valid() -> dict[str, Any]:
    return {"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "created_utc": "2024-01-01T00:00:00+00:00",
            "files": [{"path": "a.bin", "size": 4, "hash": "0123456789abcdef0123456789abcdef", "rank": 0}],
            "index": {"save_id": None, "ranks": {"0": {"b": {"kind": "bytes", "dtype": None, "shape": None, "nbytes": 4,
                                                             "segments": [["a.bin", 0, 4, 0]]}}}}}


def _with(path: str, value: Any) -> bytes:
    d = _valid()
    *keys, last = path.split(".")
    node: Any = d
    for k in keys:
        node = node[int(k)] if isinstance(node, list) else node[k]
    node[int(last) if isinstance(node, list) else last] = value
    return json.dumps(d).encode()


@pytest.mark.parametrize("data, needle", [
    (json.dumps(_valid()).encode(), ""),
    (_with("files.0.size", True), "not an integer"),
    (_with("files.0.size", "4"), "not an integer"),
    (_with("epoch", -1), "outside 0.."),
    (_with("files.0.hash", "not-hex"), "hex digest"),
    (_with("files.0.hash", "0123456789ABCDEF0123456789ABCDEF"), "hex digest"),
    (_with("files.0.path", "../global_epoch0_step2/a.bin"), "'..'"),
    (_with("files.0.path", "./a.bin"), "not normalized"),
    (_with("files", [{"path": "a.bin", "size": 4, "hash": None}] * 2), "listed twice"),
    (_with("created_utc", "yesterday"), "not an ISO-8601"),
    (_with("save_id", "../x"), "save_id"),
    (_with("hash_algo", "md5"), "hash_algo"),
    (_with("index.ranks.0.b.segments", [["a.bin", 0, 2, 0], ["a.bin", 0, 2, 1]]), "gap or overlap"),
    (_with("index.ranks.1", {}), "not a rank 0..0"),
    (_with("index.ranks.0.b.segments", [["a.bin", 0, 4]]), "not [path, file_offset, nbytes, src_offset]"),

    (b"\xff\xfe", "does not parse"),
    (b"[" * 100_000, "does not parse"),
    (b'{"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "files": [{"path": "a", "size": 1, "hash": null}], "x": 1}',
     "unknown keys"),
    (b'{"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "files": [{"path": "a", "size": 1, "hash": null}], '
     b'"index": {"ranks": {"0": {"b": {"kind": "bytes", "dtype": null, "shape": null, "nbytes": 4, '
     b'"segments": [["a", 0, 1, 0]]}}}}}', "segments cover 1 bytes, nbytes says 4"),
    (b'{"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "files": [{"path": "a", "size": 1, "hash": null}], '
     b'"index": {"ranks": {"0": {"b": {"kind": "bytes", "dtype": null, "shape": null, "nbytes": 2, '
     b'"segments": [["a", 0, 2, 0]]}}}}}', "ends at byte 2"),
    (b'{"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "files": [{"path": "a", "size": 8, "hash": null}], '
     b'"index": {"ranks": {"0": {"b": {"kind": "torch", "dtype": "float32", "shape": [1000000000000], "nbytes": 8, '
     b'"segments": [["a", 0, 8, 0]]}}}}}', "does not fit its 8 bytes"),
    (b'{"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "world_size": 1, "files": [{"path": "a", "size": 1, '
     b'"hash": null, "rank": 3}]}', "world_size is 1"),
    (b'{"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "files": [{"path": "/etc/passwd", "size": 1, "hash": null}]}',
     "absolute"),
    (b'{"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "files": [{"path": "a//b", "size": 1, "hash": null}]}',
     "not normalized"),
    (b'{"format": "tiered-ckpt/1", "epoch": 0, "step": 1, "files": [{"path": "COMMITTED.json", "size": 1, "hash": null}]}',
     "marker"),
])
def test_parse_marker_refuses_with_one_line_why(data: bytes, needle: str) -> None:
    if not needle:
        assert parse_marker(data, "global_epoch0_step1").name == "global_epoch0_step1"
        with pytest.raises(InvalidMarker, match="names checkpoint global_epoch0_step1, but it is in 'global_epoch0_step2'"):
            parse_marker(data, "global_epoch0_step2")
        return
    with pytest.raises(InvalidMarker) as err:
        parse_marker(data)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_dtype_the_array_library_does_not_know_is_an_integrity_error(cfg: NodeConfig, root: Path) -> None:
    tc.save({"a": b"x" * 64}, epoch=0, step=1, config=cfg)
    d = root / "m" / "global_epoch0_step1"
    index_files.rewrite_part(d, 0, lambda head, body: body["index"]["a"].update(kind="torch", dtype="load", shape=[16]))
    with pytest.raises(IntegrityError, match="cannot be allocated"):
        tc.load(config=cfg, rank=0)


def test_symlinked_model_and_checkpoint_directories_are_not_scanned(cfg: NodeConfig, root: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tc.save({"a": b"x" * 64}, epoch=0, step=1, config=cfg.with_overrides(root=str(elsewhere)))
    (root / "m").symlink_to(elsewhere / "m")
    assert commit.scan(root, "m") == []
    (root / "m").unlink()
    (root / "m").mkdir()
    (root / "m" / "global_epoch0_step1").symlink_to(elsewhere / "m" / "global_epoch0_step1")
    (root / "m" / "global_epoch0_step05").mkdir()          # a non-canonical alias of step5: not a checkpoint
    assert commit.scan(root, "m") == []
    with pytest.raises(UserError):
        tc.load("global_epoch0_step1", config=cfg, rank=0)
