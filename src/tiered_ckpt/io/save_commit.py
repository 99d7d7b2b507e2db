"""How a save ends, in its checkpoint directory: committed, or failed and cleaned up.

Commit, following commit.py: each rank writes its part manifest (a file under its final
name, listed in the marker like any file, so AMLFS exports it too); after every rank is done
rank 0 writes COMMITTED.json naming every rank's files. No renames anywhere. The part manifest
is also the rank's index (where each buffer lives, the nested structure): the marker points at
it (io/marker.py, format 2) instead of embedding a copy, so rank 0 never re-serializes it.

Without torch.distributed ("file mode") the ranks meet here, in the directory: rank 0 claims
the name and publishes the attempt's nonce in `rank00000.<sid>.claim.json`; every other rank
writes its part manifest carrying the nonce it finds there (and re-binds it if rank 0's claim
changes: a claim left by a crashed earlier attempt that used the same save id is replaced by the
live one), then waits for the marker (or rank 0's note). Rank 0 waits for every rank's part
carrying its nonce, so a part of an earlier attempt that reused the save id is never committed.
A rank that fails leaves `rank{r}.<sid>.failed.json` (with the nonce it knew) so the others stop
at once. Clean-up only ever removes files carrying the rank's own rank and save id, never one
a valid marker lists, and a rank whose part is published leaves its files to rank 0 (whose
commit lists them, or whose next claim of the name removes them) unless rank 0 said it failed.

Every function works on the open checkpoint directory `dfd` (see posix.py: nothing followed).
"""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from tiered_ckpt.distributed import ERROR_CLASSES, as_user_error
from tiered_ckpt.errors import ConflictError, IntegrityError, UserError
from tiered_ckpt.io import fsafe, nested
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.layout import CLAIM, FAILED, PART, FilePlan, file_owner
from tiered_ckpt.io.marker import MARKER, MAX_MARKER_BYTES, FileEntry, InvalidIndex, Manifest, encode_part, part_body, part_header
from tiered_ckpt.io.posix import json_at, open_subdir, read_small, write_small
from tiered_ckpt.io.sources import Source
from tiered_ckpt.naming import CheckpointId


def valid_marker(dfd: int, cid: CheckpointId) -> Manifest | None:
    """The marker of the directory `dfd` if it is valid and of checkpoint `cid`, else None."""
    data = read_small(dfd, MARKER, MAX_MARKER_BYTES)
    if data is None:
        return None
    try:
        m = Manifest.from_json(data)
    except ValueError:
        return None
    return dataclasses.replace(m, naming=cid.naming) if m.id == cid else None


# -- this rank ---------------------------------------------------------------------------
def part_bytes(cid: CheckpointId, save_id: str, nonce: str, rank: int, world_size: int, files: list[FilePlan],
               sources: list[Source], entries: list[FileEntry], structure: dict[str, Any] | None = None,
               replicated: dict[str, Any] | None = None) -> bytes:
    """This rank's part manifest: its files and where every buffer lives in them, bound to the
    attempt's `nonce` (rank 0's claim).

    replicated: buffer name -> {"digest", "kind", "dtype", "shape", "nbytes"} of every buffer the
    save declared replicated (written or not by this rank): rank 0 compares them at commit."""
    segs_of: list[list[list[Any]]] = [[] for _ in sources]
    for fp in files:
        path = fp.path
        for seg in fp.segments:
            segs_of[seg.source].append([path, seg.file_offset, seg.nbytes, seg.src_offset])
    # In the order saved (a dict keeps insertion order; orjson writes it as is): load returns it.
    index = {s.name: {"kind": s.kind, "dtype": s.dtype, "shape": s.shape, "nbytes": s.nbytes, "segments": sg}
             for s, sg in zip(sources, segs_of, strict=True)}
    header: dict[str, Any] = {"save_id": save_id, "nonce": nonce, "rank": rank, "world_size": world_size,
                              "checkpoint": cid.name,
                              "files": [{"path": e.path, "size": e.size, "hash": e.hash, "rank": e.rank}
                                        for e in entries]}
    if replicated:
        header["replicated"] = replicated
    body: dict[str, Any] = {"index": index}
    if structure is not None:      # nested state (io.nested)
        body["structure"] = structure
    return encode_part(header, body)


def write_part(dfd: int, rank: int, save_id: str, data: bytes, *, replace: bool = False) -> None:
    """Publish a part manifest under its final name, fsynced (`replace`: re-bound to a new claim)."""
    name = PART.format(rank=rank, sid=save_id)
    if replace:
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
    write_small(dfd, name, data)
    os.fsync(dfd)


def listed(dfd: int) -> set[str]:
    """Files a valid marker in the directory lists (any save's): clean-up never removes one."""
    data = read_small(dfd, MARKER, MAX_MARKER_BYTES)
    if data is None:
        return set()
    try:
        return {f.path for f in Manifest.from_json(data).files}
    except ValueError:
        return set()


def cleanup_own(dfd: int, rank: int, save_id: str, keep_note: bool) -> None:
    """Remove this rank's files of this save id only: never another save's, never another rank's,
    never one a valid marker lists."""
    removed = False
    try:
        with os.scandir(dfd) as it:
            names = [e.name for e in it]
        keep = listed(dfd)    # a committed checkpoint that reused this save id: its files stay
        for name in names:
            owner = file_owner(name)
            if owner is None or owner[0] != rank or owner[1] != save_id or name in keep:
                continue
            if keep_note and owner[2] == "failed":
                continue
            try:
                os.unlink(name, dir_fd=dfd)
                removed = True
            except FileNotFoundError:
                pass
        if removed:
            os.fsync(dfd)
    except OSError:
        pass   # best effort: the next save of this name removes what is left, under its claim


def note_failure(root: Path, model: str, cid: CheckpointId, rank: int, world_size: int, sid: str,
                 exc: BaseException, dfd: int | None = None, nonce: str | None = None) -> None:
    """File mode: leave `rank{r}.<sid>.failed.json` so the other ranks stop at once (best effort).

    Also for a rank that failed before its save was set up. The directory is made if missing
    (the other ranks wait in it); a note is never added to a committed checkpoint."""
    err = as_user_error(exc, rank, world_size, "saving", cid.name)
    own = dfd is None
    try:
        if dfd is None:
            rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                mfd, _ = open_subdir(rfd, model, Path(root) / model, create=True)
            finally:
                os.close(rfd)
            try:
                dfd, _ = open_subdir(mfd, cid.name, Path(root) / model / cid.name, create=True)
            finally:
                os.close(mfd)
        try:
            m = Manifest.from_json(read_small(dfd, MARKER, MAX_MARKER_BYTES) or b"")
            if m.id == cid:
                return
        except ValueError:
            pass
        if nonce is None and rank != 0:
            nonce = claimed_nonce(dfd, sid)     # the attempt this rank took part in, as far as it knew
        write_small(dfd, FAILED.format(rank=rank, sid=sid),
                    json.dumps({"save_id": sid, "nonce": nonce, "error": str(err), "error_class": type(err).__name__,
                                "exit_code": err.exit_code}).encode())
        os.fsync(dfd)
    except (OSError, UserError):
        pass
    finally:
        if own and dfd is not None:
            os.close(dfd)


def _noted_error(note: dict[str, Any], message: str, tail: str) -> UserError:
    """The error a failure note describes, of its class (a ConflictError stays one)."""
    code = note.get("exit_code")
    code = code if isinstance(code, int) and not isinstance(code, bool) and 0 < code < 128 else None
    cls = ERROR_CLASSES.get(str(note.get("error_class")), UserError)
    return cls(message if "not committed" in message else message + tail, exit_code=code)


def _header(data: bytes | None) -> dict[str, Any]:
    """A part manifest's header (not its index: committing never parses one); {} if not one.

    Also {} for a part still being written (file mode: its name is final from the start): a
    whole part ends with the newline after its index line, and no line holds a raw newline."""
    if data is None or not data.endswith(b"\n") or data.find(b"\n") == len(data) - 1:
        return {}
    try:
        return part_header(data)
    except InvalidIndex:
        return {}


def _header_at(dfd: int, name: str) -> dict[str, Any]:
    return _header(read_small(dfd, name))


# -- file mode: the claim and the waits --------------------------------------------------
def publish_claim(dfd: int, save_id: str, nonce: str) -> None:
    """Rank 0, holding the name's claim (after clearing its own stale files): the attempt's nonce."""
    write_small(dfd, CLAIM.format(rank=0, sid=save_id), json.dumps({"save_id": save_id, "nonce": nonce}).encode())
    os.fsync(dfd)


def claimed_nonce(dfd: int, save_id: str) -> str | None:
    """The nonce of rank 0's claim of this save id in the directory, if there is one."""
    d = json_at(dfd, CLAIM.format(rank=0, sid=save_id))
    if d is None or d.get("save_id") != save_id or not isinstance(d.get("nonce"), str):
        return None
    return str(d["nonce"])


def rank0_failure(dfd: int, cid: CheckpointId, save_id: str, nonce: str | None) -> UserError | None:
    """Rank 0's failure of this attempt, if it noted one: a note of the claim this rank is bound to
    (`nonce`), or, before this rank knows a claim, one without a nonce (rank 0 failed before it
    could claim). A note of another attempt that used the same save id is not this one's."""
    failed = json_at(dfd, FAILED.format(rank=0, sid=save_id))
    if failed is None or failed.get("save_id") != save_id:
        return None
    theirs = failed.get("nonce")
    if theirs is None if nonce is None else theirs == nonce:
        return _noted_error(failed, f"rank 0 could not commit {cid.name}: {failed.get('error')}",
                            "; this rank's files are not committed")
    return None


def wait_for_claim(dfd: int, cid: CheckpointId, save_id: str, barrier_timeout: float) -> str:
    """Rank > 0 without torch: the nonce of rank 0's claim (before publishing this rank's part)."""
    deadline = time.monotonic() + barrier_timeout
    while True:
        nonce = claimed_nonce(dfd, save_id)
        if nonce is not None:
            return nonce
        err = rank0_failure(dfd, cid, save_id, None)
        if err is not None:
            raise err
        if time.monotonic() > deadline:
            raise UserError(f"rank 0 did not claim {cid.name} within {barrier_timeout:.0f} s "
                            f"(no {CLAIM.format(rank=0, sid=save_id)}); nothing was committed")
        time.sleep(0.02)


def wait_for_parts(dfd: int, cid: CheckpointId, save_id: str, nonce: str, world_size: int,
                   barrier_timeout: float) -> None:
    """Rank 0 without torch: until every other rank's part of this attempt is there (or one failed)."""
    deadline = time.monotonic() + barrier_timeout
    missing = set(range(1, world_size))
    while missing:
        for r in sorted(missing):
            failed = json_at(dfd, FAILED.format(rank=r, sid=save_id))
            if failed is not None and failed.get("save_id") == save_id and failed.get("nonce") in (nonce, None):
                raise _noted_error(failed, f"rank {r} failed while writing {cid.name}: {failed.get('error')}",
                                   "; nothing was committed")
            head = _header_at(dfd, PART.format(rank=r, sid=save_id))
            if head.get("save_id") == save_id and head.get("nonce") == nonce:
                missing.discard(r)
        if missing and time.monotonic() > deadline:
            raise UserError(
                f"rank(s) {sorted(missing)} did not finish writing {cid.name} within {barrier_timeout:.0f} s "
                f"(no {PART.format(rank=min(missing), sid=save_id)} of this attempt); nothing was committed"
            )
        if missing:
            time.sleep(0.02)


def wait_for_marker(dfd: int, cid: CheckpointId, save_id: str, rank: int, part: bytes, nonce: str,
                    rebind: Any, barrier_timeout: float) -> None:
    """Rank > 0 without torch: until the marker lists this rank's part (rank 0 waits up to
    barrier_timeout for the slowest rank, then commits or fails).

    `rebind(nonce) -> bytes`: called when rank 0's claim carries another nonce than this rank's
    part (the part was bound to a claim a crashed earlier attempt left): publishes the part again,
    bound to the live claim, and returns its bytes."""
    limit = 2 * barrier_timeout + 5
    deadline = time.monotonic() + limit
    name = PART.format(rank=rank, sid=save_id)
    while True:
        m = valid_marker(dfd, cid)
        if m is not None:
            h = new_hasher()
            h.update(part)
            mine = FileEntry(name, len(part), h.hexdigest(), rank)
            if m.save_id == save_id and any(f == mine for f in m.files):
                return
            raise ConflictError(f"another save (save id {m.save_id!r}) committed {cid.name} while this one was "
                                "writing; this save's files are not part of it — save under another epoch/step")
        now = claimed_nonce(dfd, save_id)
        if now is not None and now != nonce:
            nonce, part = now, rebind(now)
        err = rank0_failure(dfd, cid, save_id, nonce)
        if err is not None:
            raise err
        if time.monotonic() > deadline:
            raise UserError(f"rank 0 did not commit {cid.name} within {limit:.0f} s; it is not committed")
        time.sleep(0.02)


# -- rank 0 ------------------------------------------------------------------------------------
def check_replicated(parts: list[dict[str, Any]], cid: CheckpointId) -> None:
    """Every buffer a rank left to another (an rbuf node) is there, with the same content.

    A rank skips writing a buffer it declared replicated when its owner writes it; if the owner
    did not write it, or wrote other bytes (the ranks' "replicated" data differs), committing
    would lose this rank's data: refused, nothing is committed."""
    for r, p in enumerate(parts):
        tree = p.get("structure")
        if tree is None:
            continue
        mine = p.get("replicated") or {}
        for owner, name in nested.remote_refs(tree):
            theirs = parts[owner].get("replicated") or {} if 0 <= owner < len(parts) else {}
            if name not in mine or name not in theirs or name not in parts[owner]["index"]:
                raise UserError(f"{cid.name} not committed: rank {r} left buffer {name!r} to rank {owner}, which did "
                                "not save it as replicated; every rank must pass the same replicated= keys "
                                "(with the same structure under them)")
            if mine[name] != theirs[name]:
                what = "content" if mine[name].get("digest") != theirs[name].get("digest") else "dtype or shape"
                raise UserError(f"{cid.name} not committed: {name!r} is declared replicated, but its {what} differs "
                                f"between rank {r} and rank {owner}; data that differs per rank must not be in "
                                "replicated= (save it per rank: drop its key from replicated=)")


def marker_of(dfd: int, root: Path, ckpt_dir: Path, cid: CheckpointId, save_id: str, nonce: str,
              world_size: int) -> Manifest:
    """The marker naming every rank's files of this save, once all is checked (rank 0).

    Reads every rank's part (only this save's own), removes anything it does not list, checks
    every listed file's size, and that `ckpt_dir` is still the directory `dfd` written into.
    Raises IntegrityError when any of it fails: nothing is committed.
    """
    parts: list[dict[str, Any]] = []
    datas: list[bytes] = []
    files: list[FileEntry] = []
    for r in range(world_size):
        name = PART.format(rank=r, sid=save_id)
        data = read_small(dfd, name)
        part = _header(data)
        # Only this save's own parts: the id is in the name and inside, and must match both.
        # ... and of this attempt (the nonce of rank 0's claim): a reused save id's old part never counts.
        if part.get("save_id") != save_id or part.get("nonce") != nonce or part.get("rank") != r \
                or part.get("checkpoint") != cid.name:
            raise IntegrityError(f"part manifest of rank {r} ({ckpt_dir / name}) is missing or not of this save; "
                                 "nothing was committed")
        assert data is not None
        parts.append(part)
        datas.append(data)
        files += [FileEntry(**f) for f in part["files"]]
        h = new_hasher()
        h.update(data)
        # The bytes just parsed, hashed: a reader checks its index file against this before use.
        files.append(FileEntry(name, len(data), h.hexdigest(), r))
    if any("replicated" in p for p in parts):
        # Only a save with replicated= needs the ranks' indexes here (which rank wrote what).
        for p, data in zip(parts, datas, strict=True):
            try:
                p.update(part_body(data))
            except InvalidIndex as e:
                raise IntegrityError(f"part manifest of rank {p['rank']} of {cid.name} is damaged ({e}); "
                                     "nothing was committed") from None
    check_replicated(parts, cid)
    m = Manifest(epoch=cid.epoch, step=cid.step, files=files, world_size=world_size, save_id=save_id,
                    naming=cid.naming, index_files=[PART.format(rank=r, sid=save_id) for r in range(world_size)])
    listed = {f.path for f in files}
    removed = False
    with os.scandir(dfd) as it:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in names:
        if name not in listed and name != MARKER and not is_dir:
            try:
                os.unlink(name, dir_fd=dfd)   # left by an earlier attempt or a losing saver; never followed
                removed = True
            except FileNotFoundError:
                pass
    if removed:
        os.fsync(dfd)
    problems = []
    for f in files:
        try:
            st = os.stat(f.path, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            problems.append(f"{ckpt_dir / f.path}: missing")
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
            problems.append(f"{ckpt_dir / f.path}: {st.st_size} bytes, manifest says {f.size}"
                            if stat.S_ISREG(st.st_mode) else f"{ckpt_dir / f.path}: not a regular file")
    if problems:
        raise IntegrityError(f"{cid.name} not committed: " + "; ".join(problems))
    # The marker is written by path: the path must still be the directory written into.
    try:
        now = fsafe.open_dir(ckpt_dir, anchor=root)
    except OSError as e:
        raise IntegrityError(f"{ckpt_dir} was replaced while saving ({e.strerror}); {cid.name} not committed") from None
    try:
        a, b = os.fstat(now), os.fstat(dfd)
    finally:
        os.close(now)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
        raise IntegrityError(f"{ckpt_dir} was replaced by another directory while saving; {cid.name} not committed")
    return m
