#!/usr/bin/env python3
"""A fake `lfs` for the HSM subcommands, shaped like Lustre's own (lustre/utils/lfs.c).

Only what cannot run here is faked: there is no Lustre on a CI machine. Output and error
behaviour follow the real tool:

* `lfs hsm_state FILE...`: one line per file, ``<path>: (0x%08x)`` then the flag words in
  lfs.c's order (released exists dirty archived never_release never_archive lost_from_hsm)
  and ``, archive_id:<n>`` when an archive id is set. A file it cannot stat prints
  ``can't get hsm state for <path>: No such file or directory`` on stderr and ends the
  command with a non-zero status (the remaining files are not printed, as in lfs.c).
* `lfs hsm_archive|hsm_release|hsm_restore [-a N] FILE...`: every file is stat'ed first
  ("Cannot stat <path>: ..." ends the whole request, nothing done); release of a file that
  is not archived, or dirty, or never_release fails the request ("Cannot send HSM request").
  Archive and restore complete at once here (on AMLFS they are queued).
* `lfs hsm_set|hsm_clear [--exists --archived --dirty --lost --noarchive --norelease]
  [--archive-id N] FILE...` as in lfs.c: how tests put files into a given state.

State lives in a JSON file ($FAKE_LFS_STATE): path -> flags, archive id, and the size and
mtime at archive time; a file changed since is reported dirty, as Lustre does on write.
$FAKE_LFS_DEFAULT_FLAGS gives the flags of files never seen (default 0: new).
$FAKE_LFS_COST (seconds) is a fixed cost per process; $FAKE_LFS_COUNT names a file that
gets one line per process (the process counter). $FAKE_LFS_RESTORE_POLLS: a restored file
still reads as released for that many hsm_state calls (restore is asynchronous on AMLFS).
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time

EXISTS, DIRTY, RELEASED, ARCHIVED, NORELEASE, NOARCHIVE, LOST = 0x1, 0x2, 0x4, 0x8, 0x10, 0x20, 0x40
WORDS = ((RELEASED, "released"), (EXISTS, "exists"), (DIRTY, "dirty"), (ARCHIVED, "archived"),
         (NORELEASE, "never_release"), (NOARCHIVE, "never_archive"), (LOST, "lost_from_hsm"))
SET_FLAGS = {"--exists": EXISTS, "--archived": ARCHIVED, "--dirty": DIRTY, "--lost": LOST,
             "--noarchive": NOARCHIVE, "--norelease": NORELEASE}


class State:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = open(path + ".lock", "a+")
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        try:
            with open(path) as f:
                self.files: dict[str, dict] = json.load(f)
        except (FileNotFoundError, ValueError):
            self.files = {}
        self.default = int(os.environ.get("FAKE_LFS_DEFAULT_FLAGS", "0"), 0)
        self.changed = False

    def get(self, p: str) -> dict:
        key = os.path.abspath(p)
        e = self.files.get(key)
        if e is None:
            return {"flags": self.default, "archive_id": 1 if self.default & ARCHIVED else 0}
        return e

    def put(self, p: str, e: dict) -> None:
        self.files[os.path.abspath(p)] = e
        self.changed = True

    def save(self) -> None:
        if self.changed:
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.files, f)
            os.replace(tmp, self.path)
        fcntl.flock(self.lock, fcntl.LOCK_UN)


def _dirty_check(p: str, e: dict) -> dict:
    if e["flags"] & ARCHIVED and "size" in e:
        st = os.stat(p)
        if (st.st_size, st.st_mtime_ns) != (e["size"], e["mtime_ns"]) and not e["flags"] & RELEASED:
            e = {**e, "flags": e["flags"] | DIRTY}
    return e


def hsm_state(st: State, files: list[str]) -> int:
    out = sys.stdout
    for p in files:
        try:
            os.stat(p)
        except OSError as err:
            out.flush()
            sys.stderr.write(f"can't get hsm state for {p}: {os.strerror(err.errno or 2)}\n")
            return 2
        e = _dirty_check(p, st.get(p))
        pending = int(e.get("restore_polls", 0))
        if pending > 0:
            e = {**e, "restore_polls": pending - 1}
            if pending - 1 == 0:
                e["flags"] &= ~RELEASED
            st.put(p, e)
        elif e["flags"] & DIRTY and not st.get(p)["flags"] & DIRTY:
            st.put(p, e)
        flags = e["flags"]
        line = f"{p}: (0x{flags:08x})" + "".join(" " + w for bit, w in WORDS if flags & bit)
        if e.get("archive_id"):
            # Some client builds print "archive_id: 1"; $FAKE_LFS_SPACED selects that form.
            sep = " " if os.environ.get("FAKE_LFS_SPACED") else ""
            line += f", archive_id:{sep}{e['archive_id']}"
        out.write(line + "\n")
    return 0


def _stat_all(files: list[str]) -> bool:
    for p in files:
        try:
            os.lstat(p)
        except OSError as err:
            sys.stderr.write(f"Cannot stat {p}: {os.strerror(err.errno or 2)}\n")
            return False
    return True


def hsm_request(st: State, action: str, args: list[str]) -> int:
    archive_id = 1
    files: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in ("-a", "--archive"):
            archive_id = int(args[i + 1])
            i += 2
            continue
        files.append(args[i])
        i += 1
    if not files:
        sys.stderr.write(f"usage: lfs {action} [--archive|-a <id>] <file> ...\n")
        return 2
    if not _stat_all(files):
        return 2
    updates = []
    for p in files:
        e = _dirty_check(p, st.get(p))
        f = e["flags"]
        if action == "hsm_archive":
            s = os.stat(p)
            e = {"flags": (f | EXISTS | ARCHIVED) & ~(DIRTY | LOST), "archive_id": archive_id,
                 "size": s.st_size, "mtime_ns": s.st_mtime_ns}
        elif action == "hsm_release":
            if not (f & ARCHIVED and f & EXISTS) or f & (DIRTY | NORELEASE | LOST):
                sys.stderr.write(f"Cannot send HSM request (use of {files[0]}): Operation not permitted\n")
                return 1
            s = os.stat(p)
            e = {**e, "flags": f | RELEASED, "size": s.st_size, "mtime_ns": s.st_mtime_ns}
        elif action == "hsm_restore":
            if f & RELEASED:
                polls = int(os.environ.get("FAKE_LFS_RESTORE_POLLS", "0"))
                e = {**e, "restore_polls": polls} if polls else {**e, "flags": f & ~RELEASED}
        updates.append((p, e))
    for p, e in updates:
        st.put(p, e)
    return 0


def hsm_change(st: State, mode: str, args: list[str]) -> int:
    mask, archive_id, files = 0, None, []
    i = 0
    while i < len(args):
        a = args[i]
        if a in SET_FLAGS:
            mask |= SET_FLAGS[a]
        elif a in ("--archive-id", "-i"):
            archive_id = int(args[i + 1])
            i += 1
        else:
            files.append(a)
        i += 1
    if not mask or not files:
        sys.stderr.write(f"usage: lfs {mode} [--norelease] [--noarchive] [--exists] [--archived] [--lost] <file> ...\n")
        return 2
    for p in files:
        if not os.path.exists(p):
            sys.stderr.write(f"Can't change hsm flags for {p}: No such file or directory\n")
            return 2
        e = dict(st.get(p))
        e["flags"] = e["flags"] | mask if mode == "hsm_set" else e["flags"] & ~mask
        if archive_id is not None and mode == "hsm_set":
            e["archive_id"] = archive_id
        if mode == "hsm_set" and mask & ARCHIVED:
            s = os.stat(p)
            e.update(size=s.st_size, mtime_ns=s.st_mtime_ns)
        st.put(p, e)
    return 0


def main(argv: list[str]) -> int:
    count = os.environ.get("FAKE_LFS_COUNT")
    if count:
        with open(count, "a") as f:
            f.write(f"{os.getpid()} {argv[0] if argv else ''} {max(0, len(argv) - 1)}\n")
    cost = float(os.environ.get("FAKE_LFS_COST", "0"))
    if cost:
        time.sleep(cost)
    if not argv:
        sys.stderr.write("usage: lfs <command> ...\n")
        return 2
    state_path = os.environ.get("FAKE_LFS_STATE")
    if not state_path:
        sys.stderr.write("fake lfs: set FAKE_LFS_STATE to a state file path\n")
        return 2
    cmd, args = argv[0], argv[1:]
    st = State(state_path)
    try:
        if cmd == "hsm_state":
            if not args:
                return 2
            return hsm_state(st, args)
        if cmd in ("hsm_archive", "hsm_release", "hsm_restore"):
            return hsm_request(st, cmd, args)
        if cmd in ("hsm_set", "hsm_clear"):
            return hsm_change(st, cmd, args)
        sys.stderr.write(f"lfs: unknown command '{cmd}' (this fake implements hsm_* only)\n")
        return 2
    finally:
        sys.stdout.flush()
        st.save()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
