"""Keep-pins: a training framework's claim that a checkpoint must stay resident, which retention honours.

`<root>/<model>/.pins/<key>.json` (a dot-name: never exported) holds one pin: the checkpoint's
name, who pinned it, and optionally the *pointer* file that holds it (Lightning's
``epoch=1-step=6.ckpt``, which TieredCheckpointIO writes for a checkpoint ModelCheckpoint keeps
among its best k or as ``last.ckpt``). The key is a hash of what pins (the pointer's path), so
re-pinning the same pointer replaces its pin: ``last.ckpt`` moving on to a newer checkpoint
unpins the older one, and Lightning's top-k pruning (``remove_checkpoint``) unpins.

A pin with a pointer holds only while that pointer still names the checkpoint: a pointer a user
deleted or that names another checkpoint now leaves a stale pin, which `pinned` ignores (so a
removed Lightning directory never holds Lustre forever). Where the pointer's directory cannot be
seen at all (not mounted where retention runs), the pin holds: keeping is the safe mistake.
Unreadable or malformed pin files are ignored, never fatal (a hostile file invalidates itself).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from tiered_ckpt.io import fsafe
from tiered_ckpt.io.commit import fsync_dir

PINS_DIR = ".pins"
_LIMIT = 64 << 10


def pins_dir(root: str | os.PathLike[str], model: str) -> Path:
    return Path(root) / model / PINS_DIR


def _key(what: str) -> str:
    return xxhash.xxh3_64_hexdigest(what.encode()) + ".json"


def pin(root: str | os.PathLike[str], model: str, name: str, *, by: str, pointer: str | os.PathLike[str]) -> None:
    """Pin checkpoint `name` for as long as `pointer` names it (replacing that pointer's earlier pin)."""
    d = pins_dir(root, model)
    dfd = fsafe.make_dirs(d, anchor=root)           # a symlink or file planted there is refused
    try:
        p = str(Path(pointer).absolute())
        body = json.dumps({"name": name, "by": by, "pointer": p}, sort_keys=True).encode()
        # Replaced whole (a dot-directory the exporter skips, so a rename is harmless): retention
        # never reads a half-written pin, which it would ignore, and so free a pinned checkpoint.
        tmp = f".{_key(p)}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        fsafe.write_file(d / tmp, body, exclusive=True, anchor=root)
        os.replace(tmp, _key(p), src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
    finally:
        os.close(dfd)


def unpin(root: str | os.PathLike[str], model: str, pointer: str | os.PathLike[str]) -> None:
    d = pins_dir(root, model)
    if fsafe.is_real_dir(d) and fsafe.unlink(d / _key(str(Path(pointer).absolute())), anchor=root):
        fsync_dir(d)


def _pointer_name(p: Path) -> str | None:
    """The `name` field of a JSON pointer file (TieredCheckpointIO's format), None if it is not one."""
    try:
        d = json.loads(fsafe.read_file(p, limit=_LIMIT))
    except (OSError, ValueError):
        return None
    return d.get("name") if isinstance(d, dict) and isinstance(d.get("name"), str) else None


def pinned(root: str | os.PathLike[str], model: str) -> dict[str, list[str]]:
    """Checkpoint name -> why it is pinned ("lightning: /path/epoch=1-step=6.ckpt"), live pins only."""
    d = pins_dir(root, model)
    out: dict[str, list[str]] = {}
    if not fsafe.is_real_dir(d):
        return out
    for e in os.scandir(d):
        if e.name.startswith("."):
            continue            # a pin being written
        try:
            info = json.loads(fsafe.read_file(Path(e.path), anchor=root, limit=_LIMIT))
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or not isinstance(info.get("name"), str) or not isinstance(info.get("by"), str):
            continue
        ptr = info.get("pointer")
        if isinstance(ptr, str):
            pp = Path(ptr)
            if pp.parent.is_dir() and _pointer_name(pp) != info["name"]:
                continue        # the pointer is gone or names another checkpoint now: a stale pin
        out.setdefault(info["name"], []).append(f"{info['by']}: {ptr}" if isinstance(ptr, str) else info["by"])
    return out
