"""Test helpers for marker format 2: a checkpoint's marker and its ranks' index files.

The marker lists every rank's index file (its part manifest: a header line and an index line)
with a size and a hash; `rewrite_part` edits one and re-records its size and hash in the
marker, so a test can plant an index that is hostile in content yet matches its marker.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import FORMAT_V1, MARKER


def marker(d: Path) -> dict[str, Any]:
    m: dict[str, Any] = json.loads((d / MARKER).read_bytes())
    return m


def write_marker(d: Path, m: dict[str, Any]) -> None:
    (d / MARKER).unlink()
    (d / MARKER).write_bytes(json.dumps(m).encode())


def part(d: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(header, body) of rank `rank`'s index file."""
    head, body = (d / marker(d)["index_files"][rank]).read_bytes().split(b"\n")[:2]
    return json.loads(head), json.loads(body)


def replace_part(d: Path, rank: int, data: bytes) -> None:
    """Rank `rank`'s index file becomes `data`; the marker lists its new size and hash."""
    m = marker(d)
    name = m["index_files"][rank]
    (d / name).write_bytes(data)
    h = new_hasher()
    h.update(data)
    for f in m["files"]:
        if f["path"] == name:
            f["size"], f["hash"] = len(data), h.hexdigest()
    write_marker(d, m)


def rewrite_part(d: Path, rank: int, fn: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Edit rank `rank`'s (header, body) in place with `fn`; size and hash re-recorded."""
    head, body = part(d, rank)
    fn(head, body)
    replace_part(d, rank, json.dumps(head).encode() + b"\n" + json.dumps(body).encode() + b"\n")


def as_v1(d: Path) -> dict[str, Any]:
    """The checkpoint's marker as format 1 would hold it: every rank's index embedded."""
    m = marker(d)
    ranks, trees = {}, {}
    for r in range(m.get("world_size", 1)):
        _, body = part(d, r)
        ranks[str(r)] = body["index"]
        if "structure" in body:
            trees[str(r)] = body["structure"]
    index: dict[str, Any] = {"save_id": m.get("save_id"), "ranks": ranks}
    if trees:
        index["structure"] = trees
    del m["index_files"]
    return {**m, "format": FORMAT_V1, "index": index}
