"""Marker format 2: a small marker that lists the ranks' index files; old markers still load.

What a user depends on: the marker proves the checkpoint complete without embedding the index;
a damaged or hostile index file makes that one checkpoint not loadable with one clear line
(never a traceback, never wrong bytes); a format 1 checkpoint of an older release loads; the
newest committed checkpoint is found without reading the older ones; keys come back in the
order saved.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tiered_ckpt as tc
from tests.toolkit import index_files
from tiered_ckpt.config import NodeConfig
from tiered_ckpt.errors import IntegrityError
from tiered_ckpt.io import commit, reader
from tiered_ckpt.io.marker import FORMAT_V1, MARKER, MAX_INDEX_BYTES, encode_part

pytestmark = pytest.mark.timeout(180)

NAME = "global_epoch0_step1"


def _state() -> dict[str, Any]:
    # keys deliberately not in sorted order, at every level
    return {"zeta": np.arange(300, dtype=np.float32), "alpha": {"y": b"y" * 10, "b": np.ones(7, dtype=np.int64)},
            "mid": [np.zeros(3, dtype=np.float16), {"k2": 2, "k1": b"one"}], "step": 12}


def _same(a: Any, b: Any) -> bool:
    """Equal and in the same key order at every level."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, bytes):
        return bytes(b) == a
    return bool(a == b)


def test_marker_is_small_and_points_at_hashed_index_files(cfg: NodeConfig, root: Path) -> None:
    many = {f"layer{i}.weight": np.full(16, i, dtype=np.float32) for i in range(2000)}
    tc.save(many, epoch=0, step=1, config=cfg)
    d = root / "m" / NAME
    raw = index_files.marker(d)
    assert raw["format"] == "tiered-ckpt/2" and "index" not in raw
    listed = {f["path"]: f for f in raw["files"]}
    (part,) = raw["index_files"]
    assert listed[part]["hash"] and listed[part]["size"] == (d / part).stat().st_size
    # the marker grows with the files, not with the 2,000 buffers: the index is in the part file
    assert (d / MARKER).stat().st_size < 2000 < (d / part).stat().st_size // 100
    got = tc.load(config=cfg)
    assert list(got) == list(many) and all(np.array_equal(got[k], v) for k, v in many.items())
    assert reader.verify(d, check_hash=True).ok


def test_keys_come_back_in_the_order_saved(cfg: NodeConfig) -> None:
    state = _state()
    tc.save(state, epoch=0, step=1, config=cfg)
    got = tc.load(config=cfg)
    assert _same(state, got), (list(state), list(got))
    flat = OrderedDict((k, np.full(4, i, dtype=np.int32)) for i, k in enumerate(["w9", "a", "w10", "B", "_"]))
    tc.save(flat, epoch=0, step=2, config=cfg)
    assert list(tc.load(config=cfg)) == list(flat)
    # into= a part: the rest is allocated, order still the saved one
    into = {"alpha": {"b": np.empty(7, dtype=np.int64)}}
    got = tc.load(NAME, config=cfg, into=into)
    assert _same(state, got) and got["alpha"]["b"] is into["alpha"]["b"]


def test_a_format_1_checkpoint_still_loads_and_verifies(cfg: NodeConfig, root: Path) -> None:
    state = _state()
    tc.save(state, epoch=0, step=1, config=cfg)
    d = root / "m" / NAME
    v1 = index_files.as_v1(d)
    # as the format 1 writer serialized it (asdict + indent=1, sort_keys=True): keys sorted
    (d / MARKER).unlink()
    (d / MARKER).write_text(json.dumps(v1, indent=1, sort_keys=True))
    m = commit.read_marker(d)
    assert m is not None and m.format == FORMAT_V1 and m.index_files is None
    assert json.loads(m.to_json()) == v1                   # format 1 still serializes as format 1
    got = tc.load(config=cfg)
    assert _same({k: state[k] for k in sorted(state)}, {k: got[k] for k in sorted(got)})
    assert reader.verify(d, check_hash=True).ok


def _spoil(d: Path, how: str, outside: Path) -> str:
    """Spoil rank 0's index file of `d`; the needle load() and verify must name."""
    rel = index_files.marker(d)["index_files"][0]
    data = (d / rel).read_bytes()
    if how == "changed-after-commit":        # same size, other bytes, marker not updated
        (d / rel).write_bytes(data.replace(b'"kind"', b'"kInd"', 1))
        return "content hash differs from the marker"
    if how == "not-json":
        index_files.replace_part(d, 0, data.split(b"\n")[0] + b"\n{not json\n")
        return "index does not parse"
    if how == "one-line":
        index_files.replace_part(d, 0, data.split(b"\n")[0])
        return "has no index (one line"
    if how == "segment-of-an-unlisted-file":
        # Zeros of a file nobody hashed must not load as the saved bytes.
        shard = next(f for f in index_files.marker(d)["files"] if f["path"].endswith(".bin"))
        (d / "other.bin").write_bytes(b"\0" * shard["size"])

        def point(head: dict[str, Any], body: dict[str, Any]) -> None:
            for e in body["index"].values():
                for s in e["segments"]:
                    s[0] = "other.bin"
        index_files.rewrite_part(d, 0, point)
        return "which the marker does not list"
    if how == "segment-past-the-end":
        index_files.rewrite_part(d, 0, lambda h, b: next(iter(b["index"].values()))["segments"][0].__setitem__(1, 1 << 40))
        return "ends at byte"
    if how == "index-of-another-rank":
        index_files.rewrite_part(d, 0, lambda h, b: h.update(rank=1))
        return "is the index of rank 1, not of rank 0"
    if how == "index-of-another-save":
        index_files.rewrite_part(d, 0, lambda h, b: h.update(save_id="other-save"))
        return "is of save 'other-save'"
    if how == "structure-names-a-missing-buffer":
        index_files.rewrite_part(d, 0, lambda h, b: b["structure"]["dict"][0][1].update(buf="nope"))
        return "names buffer 'nope', which the rank's index does not hold"
    if how == "structure-not-a-tree":
        index_files.rewrite_part(d, 0, lambda h, b: b["structure"]["dict"][0].__setitem__(1, {}))
        return "has a node '{}'"
    if how == "rbuf-of-a-rank-that-is-not-there":
        index_files.rewrite_part(d, 0, lambda h, b: b["structure"]["dict"][0].__setitem__(1, {"rbuf": [7, "a"]}))
        return "names buffer 'a' of rank 7, which that rank's index does not hold"
    if how == "symlink-out":
        outside.write_bytes(data)
        (d / rel).unlink()
        (d / rel).symlink_to(outside)
        return "a symbolic link, not a regular file"
    if how == "truncated":
        (d / rel).write_bytes(data[: len(data) // 2])
        return "bytes, manifest says"
    if how == "missing":
        (d / rel).unlink()
        return "missing"
    raise AssertionError(how)


# (how, found by the marker's size checks already (list/latest: not committed) vs only when the index is read)
SPOILS = [("changed-after-commit", False), ("not-json", False), ("one-line", False),
          ("segment-of-an-unlisted-file", False), ("segment-past-the-end", False), ("index-of-another-rank", False),
          ("index-of-another-save", False), ("structure-names-a-missing-buffer", False),
          ("structure-not-a-tree", False), ("rbuf-of-a-rank-that-is-not-there", False), ("symlink-out", True),
          ("truncated", True), ("missing", True)]


@pytest.mark.parametrize("how, by_size", SPOILS, ids=[s[0] for s in SPOILS])
def test_a_damaged_or_hostile_index_file_makes_its_checkpoint_not_loadable(
        how: str, by_size: bool, cfg: NodeConfig, root: Path, tmp_path: Path) -> None:
    good = {"a": np.arange(64, dtype=np.float32), "n": {"x": b"good"}}
    tc.save(good, epoch=0, step=1, config=cfg)
    tc.save({"a": np.zeros(64, dtype=np.float32), "n": {"x": b"bad!"}}, epoch=0, step=2, config=cfg)
    bad = root / "m" / "global_epoch0_step2"
    needle = _spoil(bad, how, tmp_path / "outside.json")

    info = commit.find(root, "m", bad.name)
    assert info is not None and info.committed is not by_size
    if by_size:
        assert needle in (info.why_not_committed or "")
        assert tc.latest(config=cfg).name == "global_epoch0_step1"   # type: ignore[union-attr]
    with pytest.raises(IntegrityError) as err:
        tc.load(bad.name, config=cfg, rank=0)
    msg = str(err.value)
    assert needle in msg and "not committed" in msg and "\n" not in msg, msg
    rep = reader.verify(bad, check_hash=True)
    assert not rep.ok and any(needle in p for p in rep.problems), rep.problems
    # the other checkpoint is untouched by it
    assert _same(good, tc.load("global_epoch0_step1", config=cfg, rank=0))


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.update(index_files=["shard-x.bin"]), "which the marker does not list"),
    (lambda m: m.update(index_files=[]), "not a list of 1 file path(s)"),
    (lambda m: m.update(index_files=[5]), "index_files[0] is 5"),
    (lambda m: m["files"][-1].update(hash=None), "without a hash"),
    (lambda m: m["files"][-1].update(size=MAX_INDEX_BYTES + 1), f"more than {MAX_INDEX_BYTES}"),
    (lambda m: m["files"][-1].update(rank=1) or m.update(world_size=2, index_files=[m["index_files"][0]] * 2),
     "a file of rank 1"),
])
def test_a_marker_whose_index_pointer_is_wrong_is_invalid(edit: Callable[[dict[str, Any]], None], needle: str,
                                                         cfg: NodeConfig, root: Path) -> None:
    tc.save({"a": b"x" * 100}, epoch=0, step=1, config=cfg)
    d = root / "m" / NAME
    m = index_files.marker(d)
    assert m["files"][-1]["path"] == m["index_files"][0]       # the part manifest is listed last
    edit(m)
    index_files.write_marker(d, m)
    info = commit.find(root, "m", NAME)
    assert info is not None and not info.committed and needle in (info.why_not_committed or ""), info
    assert tc.latest(config=cfg) is None


def test_latest_is_the_newest_committed_and_skips_newer_broken_ones(cfg: NodeConfig, root: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for step in range(1, 31):
        tc.save({"s": np.full(8, step, dtype=np.int32)}, epoch=0, step=step, config=cfg)
    mdir = root / "m"
    (mdir / "global_epoch0_step30" / MARKER).write_bytes(b'{"format": "tiered-ckpt/2", "ep')    # torn
    shard = next((mdir / "global_epoch0_step29").glob("shard-*.bin"))
    shard.write_bytes(shard.read_bytes()[:-1])                                                     # short file
    (mdir / "global_epoch0_step28" / MARKER).unlink()                                           # in flight
    (mdir / "global_epoch1_step0").mkdir()                                                         # empty, newer
    (mdir / "not-a-checkpoint").mkdir()

    inspected: list[str] = []
    real = commit.inspect
    monkeypatch.setattr(commit, "inspect", lambda model, path, cid, **kw: inspected.append(cid.name) or real(
        model, path, cid, **kw))
    info = tc.latest(config=cfg)
    assert info is not None and info.name == "global_epoch0_step27"
    # newest first, stopping at the first committed one: the 26 older ones are never read
    assert inspected == ["global_epoch1_step0", "global_epoch0_step30", "global_epoch0_step29",
                         "global_epoch0_step28", "global_epoch0_step27"]
    assert int(tc.load(config=cfg)["s"][0]) == 27

    inspected.clear()
    infos = commit.scan(root, "m")
    assert len(inspected) == 31 and [c.name for c in infos][-5:] == [
        "global_epoch0_step27", "global_epoch0_step28", "global_epoch0_step29", "global_epoch0_step30",
        "global_epoch1_step0"]
    assert [c.committed for c in infos] == [True] * 27 + [False] * 4
    assert "invalid marker" in (infos[-2].why_not_committed or "") and "bytes, manifest says" in (
        infos[-3].why_not_committed or "")


def test_file_mode_commit_waits_for_a_whole_part_not_a_partly_written_one(tmp_path: Path) -> None:
    # Without torch.distributed rank 0 learns a rank is done from its part file, which has its
    # final name while it is written: a part cut anywhere (even right after its header line) is
    # not done yet.
    import os

    from tiered_ckpt.errors import UserError
    from tiered_ckpt.io import save_commit
    from tiered_ckpt.naming import make_id

    cid, sid = make_id(0, 1), "job-1"
    whole = encode_part({"save_id": sid, "nonce": "n1", "rank": 1, "world_size": 2, "checkpoint": cid.name, "files": []},
                           {"index": {"w": {"kind": "bytes", "dtype": None, "shape": None, "nbytes": 0,
                                            "segments": []}}})
    head_end = whole.index(b"\n") + 1
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for cut in (head_end - 1, head_end, head_end + 5, len(whole) - 1):
            (tmp_path / f"rank00001.{sid}.part.json").write_bytes(whole[:cut])
            with pytest.raises(UserError, match="did not finish writing"):
                save_commit.wait_for_parts(dfd, cid, sid, "n1", 2, barrier_timeout=0.2)
        (tmp_path / f"rank00001.{sid}.part.json").write_bytes(whole)
        save_commit.wait_for_parts(dfd, cid, sid, "n1", 2, barrier_timeout=5)
    finally:
        os.close(dfd)
