"""The shard layout of one save: which bytes of a rank go into which file, under which name.

One rank's bytes are laid out as a concatenation of its buffers, cut into `files` shards of
equal, 4 KiB-aligned size (a buffer may span shards; the part manifest records every segment).
Pure: no I/O here.

Every file of a save carries the save's id (``shard-r00000-000.<sid>.bin``,
``rank00000.<sid>.part.json``, ``rank00000.<sid>.failed.json``, file mode's
``rank00000.<sid>.claim.json``; the marker records it as
``save_id``). AMLFS auto-export never propagates deletes, so the archive may still hold files
of an earlier save of the same name; with unique names a later save can never overwrite one of
them, and a marker only ever names files of its own save.
"""
from __future__ import annotations

import bisect
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tiered_ckpt.errors import UserError
from tiered_ckpt.io.pools import ALIGN

SHARD = "shard-r{rank:05d}-{i:03d}.{sid}.bin"
PART = "rank{rank:05d}.{sid}.part.json"
FAILED = "rank{rank:05d}.{sid}.failed.json"
# File mode: rank 0's claim of this save, holding the attempt's nonce (io/claim.py, save_commit.py).
CLAIM = "rank{rank:05d}.{sid}.claim.json"
SAVE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_OWNED = re.compile(r"shard-r(?P<r1>[0-9]{5})-[0-9]{3}\.(?P<s1>.+)\.bin|rank(?P<r2>[0-9]{5})\.(?P<s2>.+)\.(?P<kind>part|failed|claim)\.json")


def file_owner(name: str) -> tuple[int, str, str] | None:
    """(rank, save id, kind) of a file a save writes ("shard", "part", "failed", "claim"), else None."""
    m = _OWNED.fullmatch(name)
    if m is None:
        return None
    if m.group("r1") is not None:
        return int(m.group("r1")), m.group("s1"), "shard"
    return int(m.group("r2")), m.group("s2"), m.group("kind")


def require_save_id(save_id: Any) -> str:
    if not isinstance(save_id, str) or SAVE_ID.fullmatch(save_id) is None:
        raise UserError(f"save_id={save_id!r}: must match [A-Za-z0-9][A-Za-z0-9_.-]{{0,63}} (it is part of every file "
                        "name of the save), e.g. save_id=f'{job_id}-{attempt}'")
    return save_id


def new_save_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Segment:
    source: int          # index into the rank's sources
    src_offset: int
    file_offset: int
    nbytes: int


@dataclass
class FilePlan:
    path: str
    size: int
    segments: list[Segment] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._starts: list[int] = []

    def locate(self, file_offset: int) -> int:
        if len(self._starts) != len(self.segments):
            self._starts = [s.file_offset for s in self.segments]
        return max(0, bisect.bisect_right(self._starts, file_offset) - 1)


def plan(sizes: Sequence[int], nfiles: int, rank: int, sid: str) -> list[FilePlan]:
    """Cut the concatenation of the buffers into <= nfiles shards of equal, 4 KiB-aligned size."""
    total = sum(sizes)
    nfiles = max(1, min(nfiles, -(-total // ALIGN)))
    per_file = -(-total // nfiles)
    per = -(-per_file // ALIGN) * ALIGN if total else 0
    files = [FilePlan(SHARD.format(rank=rank, i=i, sid=sid), 0) for i in range(nfiles)]
    fi = 0
    for si, size in enumerate(sizes):
        done = 0
        while done < size:
            f = files[fi]
            if per and f.size >= per and fi < nfiles - 1:
                fi += 1
                continue
            take = size - done if fi == nfiles - 1 else min(size - done, per - f.size)
            f.segments.append(Segment(si, done, f.size, take))
            f.size += take
            done += take
    return files
