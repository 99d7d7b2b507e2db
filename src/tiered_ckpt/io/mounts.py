"""Which mount a path is on, and whether flock(2) on it is coherent across nodes.

The per-checkpoint claim and retention's run lock are flocks (io/lock.py). On Lustre they are
coherent across client nodes only when the client is mounted with ``-o flock``; with
``-o localflock`` each node grants locks on its own (two nodes can both "hold" a name), and with
``-o noflock`` flock(2) fails (mount.lustre(8): "flock: Enable full flock support, coherent
across all client nodes. localflock: Enable local flock support, using only client-local flock
... for applications that ... do not run on multiple nodes. noflock: Disable flock support
entirely."). The Lustre client lists the flock mode among the mount's options in /proc/mounts
(llite's ll_show_options prints ",flock" or ",localflock" when set). Other file systems (a local
directory in local mode, tmpfs, ext4, xfs) have node-local locks, which is right for them: one
node uses them.

MOUNTS_FILE is /proc/mounts; $TIERED_CKPT_MOUNTS_FILE points it elsewhere, for tests only.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MOUNTS_FILE = "/proc/mounts"
MOUNTS_ENV = "TIERED_CKPT_MOUNTS_FILE"
LUSTRE = "lustre"


@dataclass(frozen=True)
class Mount:
    source: str
    point: str
    fstype: str
    options: tuple[str, ...]

    @property
    def flock_mode(self) -> str | None:
        """Lustre: "flock", "localflock" or "noflock" (none shown: flock is not enabled); None elsewhere."""
        if self.fstype != LUSTRE:
            return None
        for mode in ("localflock", "noflock", "flock"):
            if mode in self.options:
                return mode
        return "noflock"


def _unescape(field: str) -> str:
    """/proc/mounts escapes space, tab, newline and backslash as octal (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def parse(text: str) -> list[Mount]:
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        out.append(Mount(_unescape(parts[0]), _unescape(parts[1]), parts[2], tuple(parts[3].split(","))))
    return out


def mounts_file() -> str:
    return os.environ.get(MOUNTS_ENV) or MOUNTS_FILE


def mount_of(path: str | os.PathLike[str], mounts: list[Mount] | None = None) -> Mount | None:
    """The mount holding `path` (the longest mount point that contains its real path; the last
    such mount wins, as the kernel's stacking does), or None when the mounts cannot be read."""
    if mounts is None:
        try:
            with open(mounts_file(), encoding="utf-8", errors="replace") as f:
                mounts = parse(f.read(1 << 22))
        except OSError:
            return None
    real = Path(os.path.realpath(path))
    best: Mount | None = None
    for m in mounts:
        mp = Path(m.point)
        if (real == mp or mp in real.parents) and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def not_lustre(path: str | os.PathLike[str], mounts: list[Mount] | None = None) -> Mount | None:
    """The mount that a missing `path` would be created on when that is not Lustre (None: it is
    Lustre, or the mounts cannot be read): on a node whose AMLFS is not mounted, the mount point is
    an empty directory of the OS disk, and checkpoints created there would never be archived."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    m = mount_of(p, mounts)
    return m if m is not None and m.fstype != LUSTRE else None


def flock_problem(path: str | os.PathLike[str], mounts: list[Mount] | None = None) -> str | None:
    """Why flocks under `path` would not exclude other nodes (None: they do, or it is not Lustre)."""
    m = mount_of(path, mounts)
    mode = m.flock_mode if m is not None else None
    if m is None or mode in (None, "flock"):
        return None
    what = ("each node grants locks on its own, so two nodes could claim the same checkpoint name or run "
            "retention at once" if mode == "localflock" else "flock(2) is disabled on it")
    return (f"{path} is on the Lustre mount {m.point} mounted with {mode} ({what}); remount it with -o flock "
            f"(the cluster's fstab line for {m.point}: options 'flock,...'), then re-run")
