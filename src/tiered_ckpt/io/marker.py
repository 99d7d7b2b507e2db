"""The commit marker's format: what `COMMITTED.json` holds and the strict schema it must pass.

Pure (no I/O): `parse_marker(bytes)` / `validate(dict)` turn a marker read from disk or from
Blob into a Manifest, or raise InvalidMarker with a one-line reason. The shared checkpoint tree
and the archive may hold malformed or hostile markers (a path with NUL or '..', `"created_utc":
5`): each one makes its one checkpoint "not committed (invalid marker: why)". Markers written by
every earlier release validate. The protocol around the marker (write it last, read it, delete
it first) is io/commit.py.

Two formats:
  tiered-ckpt/2 (written now): the marker holds what proves the checkpoint complete (every file
    with its size and hash, the save id) and `index_files`: per rank, the file holding that
    rank's index (where each buffer lives, and the nested structure). Those are the ranks' part
    manifests, listed in `files` like any data file (so they are sized, hashed, exported,
    proven and restored with the rest); the marker stays a few hundred bytes per file, whatever
    the tensor count, so finding the newest checkpoint never parses an index.
  tiered-ckpt/1 (older releases): the marker embeds every rank's index under `index`.
`parse_index` validates one rank's index file (the same hostile-input rules the embedded index
had: safe names, segments inside listed files of that rank, bounds); InvalidIndex says why.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from functools import cached_property
from typing import Any

import orjson

from tiered_ckpt.errors import IntegrityError
from tiered_ckpt.io.hashing import ALGORITHM
from tiered_ckpt.io.layout import SAVE_ID as _SAVE_ID
from tiered_ckpt.io.nested import check_tree
from tiered_ckpt.naming import DEFAULT as DEFAULT_NAMING
from tiered_ckpt.naming import CheckpointId, parse_any, scheme

MARKER = "COMMITTED.json"
FORMAT_V1 = "tiered-ckpt/1"     # index embedded in the marker (older releases; still read)
FORMAT = "tiered-ckpt/2"        # index in per-rank files the marker lists (written now)
# A marker is small (a few KiB per rank); anything far larger is not one of ours, and reading
# it whole would let a planted file exhaust memory. (Format 1 markers embed the index: the
# bound is theirs.)
MAX_MARKER_BYTES = 256 << 20
# One rank's index file: ~200 bytes per buffer, so this bound is ~1.3 million buffers per rank.
# A listed size above it is refused before anything is read (a planted size must not make a
# reader allocate without bound).
MAX_INDEX_BYTES = 256 << 20
_MAX_INT = 2 ** 63 - 1                 # sizes and offsets: what a file offset (off_t) can hold
_NAME_MAX = 255                        # bytes per path component (Linux NAME_MAX, Lustre too)
_PATH_MAX = 4096                       # bytes per path (Linux PATH_MAX)
_HEX = {ALGORITHM: re.compile(r"[0-9a-f]{32}")}        # xxh3-128: 128 bits, lowercase hex
_RANK_KEY = re.compile(r"0|[1-9][0-9]*")
_KEYS = {"epoch", "step", "files", "world_size", "hash_algo", "created_utc", "index", "format", "save_id"}
_KEYS_V2 = (_KEYS - {"index"}) | {"index_files"}
# One rank's index file (its part manifest, io/save_commit.write_part): two JSON lines, a small
# header (what rank 0 needs to commit: which save, which rank, its files) and the body (the
# index), so committing never parses a rank's whole index. orjson never writes a raw newline
# (inside strings it is escaped), so the first b"\n" ends the header.
_PART_HEADER_KEYS = {"save_id", "nonce", "rank", "world_size", "checkpoint", "files", "replicated"}
_PART_BODY_KEYS = {"index", "structure"}
_REQUIRED = {"epoch", "step", "files", "format"}
_FILE_KEYS = {"path", "size", "hash", "rank"}
_BUFFER_KEYS = {"kind", "dtype", "shape", "nbytes", "segments"}


class InvalidMarker(IntegrityError, ValueError):
    """A marker that is not a valid manifest; str(err) says why (one line). An IntegrityError (exit
    code 1) like every damaged checkpoint; still a ValueError for callers that catch that."""


class InvalidIndex(InvalidMarker):
    """A rank's index file that is not valid for its marker; str(err) says why (one line)."""


@dataclass(frozen=True)
class FileEntry:
    path: str            # relative to the checkpoint directory, '/'-separated
    size: int
    hash: str | None     # hex xxh3-128 of the content, computed inline while writing
    rank: int = 0


@dataclass
class Manifest:
    epoch: int
    step: int
    files: list[FileEntry]
    world_size: int = 1
    hash_algo: str = ALGORITHM
    created_utc: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    # Format 1 only: the embedded description of where each saved buffer lives
    # ({"ranks": {rank: {name: entry}}, "structure": {rank: tree}}). Format 2: empty.
    index: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    save_id: str | None = None   # which save wrote it (every file name of that save carries it)
    # Format 2: index_files[r] is the listed file holding rank r's index (parse_index); None when
    # the checkpoint has no index of the toolkit's own (a DCP checkpoint: DCP's metadata file).
    index_files: list[str] | None = None
    # The directory naming scheme (tiered_ckpt.naming) the checkpoint is found under: not in the
    # marker's bytes (the directory name says it), not part of equality.
    naming: str = field(default=DEFAULT_NAMING, compare=False, repr=False)

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.epoch, self.step, self.naming)

    @cached_property
    def name(self) -> str:
        # Cached: a load names the checkpoint in per-buffer messages (the fields never change
        # after construction; dataclasses.replace builds a new object).
        return self.id.name

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @cached_property
    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    def to_json(self) -> bytes:
        if self.format == FORMAT_V1:
            d = asdict(self)
            for k in ("naming", "index_files"):
                del d[k]
            if d["save_id"] is None:
                del d["save_id"]      # byte-compatible with markers of the released version
            return json.dumps(d, indent=1, sort_keys=True).encode()
        # Built by hand, not asdict (which deep-copies); compact (no indent, no key sort).
        out: dict[str, Any] = {"format": self.format, "epoch": self.epoch, "step": self.step,
                               "world_size": self.world_size, "hash_algo": self.hash_algo,
                               "created_utc": self.created_utc}
        if self.save_id is not None:
            out["save_id"] = self.save_id
        out["files"] = [{"path": f.path, "size": f.size, "hash": f.hash, "rank": f.rank} for f in self.files]
        if self.index_files is not None:
            out["index_files"] = self.index_files
        return orjson.dumps(out)

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Parse and validate a marker; InvalidMarker (a ValueError) says why it is not one."""
        return parse_marker(data)


# -- validation ---------------------------------------------------------------------------------

def _show(v: Any, limit: int = 80) -> str:
    """A value for a message: repr (so NUL, newlines and odd characters are visible), bounded."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def _int(v: Any, what: str, lo: int = 0) -> int:
    # bool is an int subclass in Python; JSON true/false is not a size or a step.
    if type(v) is not int:
        raise InvalidMarker(f"{what} is {_show(v)}, not an integer")
    if not lo <= v <= _MAX_INT:
        raise InvalidMarker(f"{what} is {v}, outside {lo}..{_MAX_INT}")
    return v


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str):
        raise InvalidMarker(f"{what} is {_show(v)}, not a string")
    return v


def path_problem(p: str) -> str | None:
    """Why `p` is not a safe file path inside a checkpoint directory, or None."""
    if not p:
        return "is empty"
    if "\0" in p:
        return "contains a NUL character"
    try:
        raw = p.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if len(raw) > _PATH_MAX:
        return f"is {len(raw)} bytes long (more than {_PATH_MAX})"
    if p.startswith("/"):
        return "is absolute (must be relative to the checkpoint directory)"
    parts = p.split("/")
    for c in parts:
        if c in ("", "."):
            return "has an empty or '.' component (not normalized)"
        if c == "..":
            return "has a '..' component (points outside the checkpoint directory)"
        if len(c.encode("utf-8")) > _NAME_MAX:
            return f"has a component of {len(c.encode('utf-8'))} bytes (more than {_NAME_MAX})"
    if parts[0] == MARKER:
        return f"names the marker {MARKER} itself"
    return None


def _file_entry(d: Any, i: int, hash_re: re.Pattern[str], world_size: int) -> FileEntry:
    what = f"files[{i}]"
    if not isinstance(d, dict):
        raise InvalidMarker(f"{what} is {_show(d)}, not a mapping")
    missing, extra = {"path", "size", "hash"} - set(d), set(d) - _FILE_KEYS
    if missing or extra:
        raise InvalidMarker(f"{what} " + (f"lacks {sorted(missing)}" if missing else f"has unknown keys {_show(sorted(extra))}"))
    path = _str(d["path"], f"{what}.path")
    why = path_problem(path)
    if why:
        raise InvalidMarker(f"file path {_show(path)} {why}")
    size = _int(d["size"], f"size of {_show(path)}")
    h = d["hash"]
    if h is not None and not (isinstance(h, str) and hash_re.fullmatch(h)):
        raise InvalidMarker(f"hash of {_show(path)} is {_show(h)}, not null or a {hash_re.pattern} hex digest")
    rank = _int(d.get("rank", 0), f"rank of {_show(path)}")
    if rank >= world_size:
        raise InvalidMarker(f"rank of {_show(path)} is {rank}, but world_size is {world_size}")
    return FileEntry(path, size, h, rank)


def _check_tree(files: list[FileEntry]) -> None:
    """No duplicates, and no listed file is also a directory of another listed file."""
    paths: set[str] = set()
    for f in files:
        if f.path in paths:
            raise InvalidMarker(f"file path {_show(f.path)} is listed twice")
        paths.add(f.path)
    for f in files:
        parts = f.path.split("/")
        for i in range(1, len(parts)):
            d = "/".join(parts[:i])
            if d in paths:
                raise InvalidMarker(f"{_show(d)} is listed as a file and as a directory of {_show(f.path)}")


def _buffer_ok(e: Any, rank: int, files: Mapping[str, FileEntry]) -> bool:
    """Whether an index entry is valid, checked without building messages (it runs once per
    buffer: 100,000 of them in a large state). Accepts only what _check_buffer accepts, and
    only segments in source order (what the writer records); anything else goes to
    _check_buffer, which says why it is invalid or accepts it."""
    if type(e) is not dict or len(e) != 5:
        return False
    try:
        kind, dtype, shape, nbytes, segs = e["kind"], e["dtype"], e["shape"], e["nbytes"], e["segments"]
    except KeyError:
        return False
    if type(kind) is not str or (dtype is not None and type(dtype) is not str) or type(nbytes) is not int \
            or not 0 <= nbytes <= _MAX_INT:
        return False
    if shape is not None:
        if type(shape) is not list:
            return False
        count = 1
        for n in shape:
            if type(n) is not int or not 0 <= n <= _MAX_INT:
                return False
            count *= n
        if count > nbytes or (count and nbytes % count) or (not count and nbytes):
            return False
    if type(segs) is not list:
        return False
    covered = 0
    for s in segs:
        if type(s) is not list or len(s) != 4:
            return False
        path, off, n, src = s
        f = files.get(path) if type(path) is str else None
        if f is None or f.rank != rank or type(off) is not int or type(n) is not int or type(src) is not int:
            return False
        if off < 0 or n < 0 or src != covered or off + n > f.size:
            return False
        covered += n
    return covered == nbytes


def _check_buffer(e: Any, where: str, rank: int, files: Mapping[str, FileEntry]) -> None:
    if not isinstance(e, dict):
        raise InvalidMarker(f"{where} is {_show(e)}, not a mapping")
    if set(e) != _BUFFER_KEYS:
        raise InvalidMarker(f"{where} has keys {_show(sorted(e))}, expected {sorted(_BUFFER_KEYS)}")
    _str(e["kind"], f"{where}.kind")
    if e["dtype"] is not None:
        _str(e["dtype"], f"{where}.dtype")
    nbytes = _int(e["nbytes"], f"{where}.nbytes")
    shape = e["shape"]
    if shape is not None:
        if not isinstance(shape, list):
            raise InvalidMarker(f"{where}.shape is {_show(shape)}, not a list or null")
        count = 1
        for k, n in enumerate(shape):
            count *= _int(n, f"{where}.shape[{k}]")
            count = min(count, _MAX_INT + 1)
        # Each element takes a whole number of bytes (>= 1): a shape that disagrees would make
        # load() allocate far more (or less) than the bytes it reads.
        if count > nbytes or (count and nbytes % count) or (not count and nbytes):
            raise InvalidMarker(f"{where}.shape {_show(shape)} does not fit its {nbytes} bytes")
    segs = e["segments"]
    if not isinstance(segs, list):
        raise InvalidMarker(f"{where}.segments is {_show(segs)}, not a list")
    checked: list[tuple[int, int, int, str]] = []
    for k, s in enumerate(segs):
        sw = f"{where}.segments[{k}]"
        if not isinstance(s, list) or len(s) != 4:
            raise InvalidMarker(f"{sw} is {_show(s)}, not [path, file_offset, nbytes, src_offset]")
        path = _str(s[0], f"{sw} path")
        f = files.get(path)
        if f is None:
            raise InvalidMarker(f"{sw} points at {_show(path)}, which the marker does not list")
        if f.rank != rank:
            raise InvalidMarker(f"{sw} points at {_show(path)}, a file of rank {f.rank}")
        off, n, src = (_int(v, f"{sw}[{j}]") for j, v in ((1, s[1]), (2, s[2]), (3, s[3])))
        if off + n > f.size:
            raise InvalidMarker(f"{sw} ends at byte {off + n} of {_show(path)}, which has {f.size}")
        checked.append((src, n, off, path))
    covered = 0
    for src, n, _, _ in sorted(checked):
        if src != covered:
            raise InvalidMarker(f"{where}: segments leave a gap or overlap at byte {min(src, covered)}")
        covered += n
    if covered != nbytes:
        raise InvalidMarker(f"{where}: segments cover {covered} bytes, nbytes says {nbytes}")


def _check_index(index: Any, files: list[FileEntry], world_size: int) -> None:
    if not isinstance(index, dict):
        raise InvalidMarker(f"index is {_show(index)}, not a mapping")
    extra = set(index) - {"save_id", "ranks", "structure"}
    if extra:
        raise InvalidMarker(f"index has unknown keys {_show(sorted(extra))}")
    sid = index.get("save_id")
    if sid is not None:
        _str(sid, "index.save_id")
    ranks = index.get("ranks", {})
    if not isinstance(ranks, dict):
        raise InvalidMarker(f"index.ranks is {_show(ranks)}, not a mapping")
    by_path = {f.path: f for f in files}
    for rk, bufs in ranks.items():
        if not _RANK_KEY.fullmatch(rk) or int(rk) >= world_size:
            raise InvalidMarker(f"index.ranks has key {_show(rk)}, not a rank 0..{world_size - 1}")
        if not isinstance(bufs, dict):
            raise InvalidMarker(f"index of rank {rk} is {_show(bufs)}, not a mapping")
        r = int(rk)
        for name, e in bufs.items():
            if not _buffer_ok(e, r, by_path):
                _check_buffer(e, f"buffer {_show(name)} of rank {rk}", r, by_path)
    # Nested state's tree per rank (io.nested); absent for a flat state (and in older markers).
    trees = index.get("structure", {})
    if not isinstance(trees, dict):
        raise InvalidMarker(f"index.structure is {_show(trees)}, not a mapping")
    for rk, tree in trees.items():
        if rk not in ranks:
            raise InvalidMarker(f"index.structure has key {_show(rk)}, not a rank of index.ranks")
        try:
            check_tree(tree, f"index.structure of rank {rk}", ranks[rk], rank=int(rk), ranks=ranks)
        except ValueError as e:
            raise InvalidMarker(str(e)) from None


def _created(v: Any) -> str:
    s = _str(v, "created_utc")
    try:
        if len(s) > 64:
            raise ValueError
        datetime.fromisoformat(s)
    except ValueError:
        raise InvalidMarker(f"created_utc is {_show(s)}, not an ISO-8601 time") from None
    return s


def validate(d: Any) -> Manifest:
    """A Manifest from a decoded marker, or InvalidMarker saying why it is not one.

    Accepts every marker the released writers produced (all of these hold for them); anything
    else that a reader, a restore or retention could trip over or be misled by is refused.
    """
    fmt = d.get("format") if isinstance(d, dict) else None
    if fmt not in (FORMAT, FORMAT_V1):
        raise InvalidMarker(f"not a {FORMAT} (or {FORMAT_V1}) manifest")
    assert isinstance(d, dict)
    missing, extra = _REQUIRED - set(d), set(d) - (_KEYS if fmt == FORMAT_V1 else _KEYS_V2)
    if missing:
        raise InvalidMarker(f"lacks {sorted(missing)}")
    if extra:
        raise InvalidMarker(f"has unknown keys {_show(sorted(extra))}")
    epoch, step = _int(d["epoch"], "epoch"), _int(d["step"], "step")
    world_size = _int(d.get("world_size", 1), "world_size", lo=1)
    algo = _str(d.get("hash_algo", ALGORITHM), "hash_algo")
    hash_re = _HEX.get(algo)
    if hash_re is None:
        raise InvalidMarker(f"hash_algo is {_show(algo)}; this version knows {sorted(_HEX)}")
    created = _created(d["created_utc"]) if "created_utc" in d else datetime.now(timezone.utc).isoformat()
    sid = d.get("save_id")
    if sid is not None and not (isinstance(sid, str) and _SAVE_ID.fullmatch(sid)):
        raise InvalidMarker(f"save_id is {_show(sid)}, not null or a name matching {_SAVE_ID.pattern}")
    raw_files = d["files"]
    if not isinstance(raw_files, list):
        raise InvalidMarker(f"files is {_show(raw_files)}, not a list")
    if not raw_files:
        raise InvalidMarker("files is empty (a save always lists at least its part manifest)")
    files = [_file_entry(f, i, hash_re, world_size) for i, f in enumerate(raw_files)]
    _check_tree(files)
    if fmt == FORMAT_V1:
        index = d.get("index", {})
        _check_index(index, files, world_size)
        return Manifest(epoch=epoch, step=step, files=files, world_size=world_size, hash_algo=algo,
                        created_utc=created, index=index, save_id=sid, format=FORMAT_V1)
    index_files = _index_files(d.get("index_files"), files, world_size)
    return Manifest(epoch=epoch, step=step, files=files, world_size=world_size, hash_algo=algo,
                    created_utc=created, save_id=sid, index_files=index_files)


def _index_files(v: Any, files: list[FileEntry], world_size: int) -> list[str] | None:
    """Format 2's pointer: one listed, hashed file of rank r per rank r (or none at all)."""
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != world_size:
        raise InvalidMarker(f"index_files is {_show(v)}, not a list of {world_size} file path(s), one per rank")
    by_path = {f.path: f for f in files}
    for r, p in enumerate(v):
        f = by_path.get(p) if isinstance(p, str) else None
        if f is None:
            raise InvalidMarker(f"index_files[{r}] is {_show(p)}, which the marker does not list")
        if f.rank != r:
            raise InvalidMarker(f"index_files[{r}] is {_show(p)}, a file of rank {f.rank}")
        if f.hash is None:
            raise InvalidMarker(f"index_files[{r}] is {_show(p)}, which the marker lists without a hash")
        if f.size > MAX_INDEX_BYTES:
            raise InvalidMarker(f"index_files[{r}] is {_show(p)} of {f.size} bytes, more than {MAX_INDEX_BYTES}")
    return list(v)


@dataclass(frozen=True)
class RankIndex:
    """One rank's index: buffer name -> entry (in the order saved), and its structure tree
    (io.nested; None for a flat state)."""

    buffers: dict[str, Any]
    structure: dict[str, Any] | None


def encode_part(header: dict[str, Any], body: dict[str, Any]) -> bytes:
    """A rank's part manifest / index file: header line, body line (compact, key order kept).

    TypeError when something is not JSON orjson can write (a str with a lone surrogate)."""
    return orjson.dumps(header) + b"\n" + orjson.dumps(body) + b"\n"


def _loads(data: bytes, what: str) -> dict[str, Any]:
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise InvalidIndex(f"{what} does not parse ({e})") from None
    if not isinstance(d, dict):
        raise InvalidIndex(f"{what} is {_show(d)}, not a mapping")
    return d


def part_header(data: bytes) -> dict[str, Any]:
    """The header of a part manifest (not its index); InvalidIndex when it is not one."""
    head = _loads(data.split(b"\n", 1)[0], "header")
    extra = set(head) - _PART_HEADER_KEYS
    if extra:
        raise InvalidIndex(f"header has unknown keys {_show(sorted(extra))}")
    return head


def part_body(data: bytes) -> dict[str, Any]:
    """The body (index, structure) of a part manifest; InvalidIndex when it is not one."""
    _, nl, rest = data.partition(b"\n")
    if not nl:
        raise InvalidIndex("has no index (one line, expected a header and an index)")
    body = _loads(rest, "index")
    extra = set(body) - _PART_BODY_KEYS
    if extra:
        raise InvalidIndex(f"has unknown keys {_show(sorted(extra))}")
    return body


def parse_index(data: bytes, m: Manifest, rank: int) -> RankIndex:
    """Validate rank `rank`'s index file of the format 2 marker `m` (its bytes already checked
    against the marker's size and hash); InvalidIndex says why not.

    Rbuf nodes of the structure (buffers of other ranks) are checked by check_structure, once
    the ranks they name are read too."""
    head = part_header(data)
    if head.get("rank") != rank or type(head.get("rank")) is not int:
        raise InvalidIndex(f"is the index of rank {_show(head.get('rank'))}, not of rank {rank}")
    if head.get("save_id") != m.save_id:
        raise InvalidIndex(f"is of save {_show(head.get('save_id'))}, not of save {_show(m.save_id)}")
    d = part_body(data)
    bufs = d.get("index")
    if not isinstance(bufs, dict):
        raise InvalidIndex(f"index is {_show(bufs)}, not a mapping")
    files = m.by_path
    try:
        for name, e in bufs.items():
            if not _buffer_ok(e, rank, files):
                _check_buffer(e, f"buffer {_show(name)}", rank, files)
    except InvalidMarker as e:
        raise InvalidIndex(str(e)) from None
    tree = d.get("structure")
    if tree is not None and not isinstance(tree, dict):
        raise InvalidIndex(f"structure is {_show(tree)}, not a mapping")
    return RankIndex(bufs, tree)


class _AnyBuffer:
    def __contains__(self, name: object) -> bool:
        return True


class _AnyRank(dict[str, Any]):
    """Every other rank holds every buffer: for checking a tree's shape before the ranks its
    rbuf nodes name are read."""

    def get(self, key: str, default: Any = None) -> Any:
        return _AnyBuffer()

    def __bool__(self) -> bool:     # empty, yet not "no ranks given" (check_tree: `ranks or {}`)
        return True


def check_structure(idx: RankIndex, rank: int, ranks: Mapping[str, Mapping[str, Any]] | None) -> None:
    """Rank `rank`'s structure tree against its own buffers and those of the other ranks it names
    (`ranks`: rank (str) -> buffers, at least every rank an rbuf node names); InvalidIndex.

    ranks=None: the tree's shape and its own buffers only (then io.nested may walk it to find
    the ranks it names)."""
    if idx.structure is None:
        return
    try:
        check_tree(idx.structure, "structure", idx.buffers, rank=rank, ranks=_AnyRank() if ranks is None else ranks)
    except ValueError as e:
        raise InvalidIndex(str(e)) from None


def parse_marker(data: bytes | str, name: str | None = None) -> Manifest:
    """Validate a marker's bytes (from disk or from Blob); InvalidMarker says why not.

    `name`: the checkpoint directory the marker was found in; its epoch/step must match it (the
    name's scheme is whichever built-in one it is canonical in: their patterns are disjoint), and
    the manifest's `naming` is that scheme.
    """
    try:
        d = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidMarker(f"does not parse ({e})") from None
    except RecursionError:
        raise InvalidMarker("does not parse (nested too deeply)") from None
    m = validate(d)
    if name is not None:
        return with_name(m, name)
    return m


def with_name(m: Manifest, name: str) -> Manifest:
    """`m` as found in directory `name`; InvalidMarker when its epoch/step are not that name's."""
    cid = parse_any(name)
    if cid is None or (cid.epoch, cid.step) != (m.epoch, m.step):
        s = scheme(cid.naming if cid is not None else DEFAULT_NAMING)
        shown = CheckpointId(m.epoch, m.step, s.key).name if s.has_epoch or m.epoch == 0 else \
            f"epoch {m.epoch} step {m.step}"
        raise InvalidMarker(f"names checkpoint {shown}, but it is in {_show(name)}")
    if cid.naming != m.naming:
        m = replace(m, naming=cid.naming)
    return m
