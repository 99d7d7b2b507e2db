"""Lustre HSM through the `lfs` binary: hsm_state parsing and batched hsm_* calls.

`lfs hsm_state FILE...` prints, per file, ``<path>: (0x%08x)`` followed by the flag words
(``released exists dirty archived never_release never_archive lost_from_hsm``) and, when
an archive is set, ``, archive_id:<n>`` (some builds print ``archive_id: <n>``). File names
may hold spaces and colons, so a line is parsed from the right; in a batch we also know
which path each line belongs to. The hex value is the truth; the words are only a
rendering of it. On a file it cannot stat, `lfs hsm_state` prints to stderr and stops, so
the rest of that batch is asked again in a new process.

Every call takes many files: one process per file would make proving 100,000 files take
minutes (github.com/aws/aws-parallelcluster/issues/2393 is the same lesson for lazy reads).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tiered_ckpt.errors import EXIT_FAILED, UnavailableError, UserError

EXISTS = 0x1
DIRTY = 0x2
RELEASED = 0x4
ARCHIVED = 0x8
NORELEASE = 0x10
NOARCHIVE = 0x20
LOST = 0x40

FLAG_NAMES = (
    (RELEASED, "released"), (EXISTS, "exists"), (DIRTY, "dirty"), (ARCHIVED, "archived"),
    (NORELEASE, "never_release"), (NOARCHIVE, "never_archive"), (LOST, "lost_from_hsm"),
)

# Parsed from the right: the path is whatever precedes the last ": (0x........)".
_LINE = re.compile(
    r"^(?P<path>.*): \((?P<hex>0x[0-9a-fA-F]+)\)(?P<words>(?: [a-z_]+)*)(?:, archive_id:\s*(?P<aid>\d+))?\s*$"
)
_TAIL = re.compile(r"^\((?P<hex>0x[0-9a-fA-F]+)\)(?P<words>(?: [a-z_]+)*)(?:, archive_id:\s*(?P<aid>\d+))?\s*$")


@dataclass(frozen=True)
class HsmState:
    path: str
    flags: int
    archive_id: int = 0

    @property
    def exists(self) -> bool:
        return bool(self.flags & EXISTS)

    @property
    def archived(self) -> bool:
        """Exported and unchanged since: exists + archived, not dirty, lost or noarchive."""
        f = self.flags
        return bool(f & EXISTS and f & ARCHIVED) and not f & (DIRTY | LOST | NOARCHIVE)

    @property
    def released(self) -> bool:
        return bool(self.flags & RELEASED)

    def words(self) -> list[str]:
        return [name for bit, name in FLAG_NAMES if self.flags & bit]

    def why_not_archived(self) -> str:
        f = self.flags
        if f & LOST:
            return "lost from the archive (lost_from_hsm)"
        if f & NOARCHIVE:
            return "marked never_archive"
        if f & DIRTY:
            return "changed since it was exported (dirty)"
        if not f & EXISTS or not f & ARCHIVED:
            return f"not exported yet (hsm state 0x{f:08x})"
        return ""


def parse_line(line: str) -> HsmState:
    """One `lfs hsm_state` line; raises ValueError for anything else."""
    m = _LINE.match(line.rstrip("\n"))
    if not m:
        raise ValueError(f"unrecognised lfs hsm_state line: {line!r}")
    return HsmState(m.group("path"), int(m.group("hex"), 16), int(m.group("aid") or 0))


def parse_batch(paths: Sequence[str], stdout: str) -> list[HsmState]:
    """States for a prefix of `paths`, in order, from one `lfs hsm_state` run.

    Each line must start with the path we asked about, so names holding ': (0x' or
    newlines cannot shift the parse. Stops at the first line that does not match.
    """
    out: list[HsmState] = []
    pos = 0
    for p in paths:
        head = p + ": "
        if not stdout.startswith(head, pos):
            break
        nl = stdout.find("\n", pos + len(head))
        end = len(stdout) if nl < 0 else nl
        m = _TAIL.match(stdout[pos + len(head):end])
        if not m:
            break
        out.append(HsmState(p, int(m.group("hex"), 16), int(m.group("aid") or 0)))
        pos = end + 1
    return out


def chunks(items: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


class Lfs:
    """Batched `lfs hsm_*` calls. `processes` counts the lfs processes started."""

    def __init__(self, binary: str = "lfs", batch: int = 2000, timeout: float = 600.0, parallel: int = 4) -> None:
        self.binary = binary
        self.batch = max(1, batch)
        self.timeout = timeout
        self.parallel = max(1, parallel)
        self.processes = 0
        self._count_lock = threading.Lock()

    def _exe(self) -> str:
        found = self.binary if os.sep in self.binary else shutil.which(self.binary)
        if not found or not os.access(found, os.X_OK):
            raise UnavailableError(
                f"the lfs binary {self.binary!r} (setting amlfs.lfs) was not found or is not executable; "
                "install the Lustre client (amlfs-lustre-client) or set amlfs.lfs to its path"
            )
        return found

    def _run(self, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        with self._count_lock:
            self.processes += 1
        try:
            return subprocess.run(
                [self._exe(), *args], capture_output=True, text=True, timeout=self.timeout,
                errors="surrogateescape",
            )
        except subprocess.TimeoutExpired:
            raise UnavailableError(
                f"`lfs {args[0]}` did not answer within {self.timeout:.0f}s; check the Lustre mount (lfs df) and try again"
            ) from None

    def states(self, paths: Sequence[str]) -> tuple[dict[str, HsmState], dict[str, str]]:
        """(states by path, errors by path): at most ceil(n/batch) processes when all files exist.

        Batches run `parallel` at a time: the cost of an lfs call is mostly process start-up
        and metadata round trips, not CPU.
        """
        states: dict[str, HsmState] = {}
        errors: dict[str, str] = {}
        batches = [list(b) for b in chunks(list(paths), self.batch)]
        if not batches:
            return states, errors
        with ThreadPoolExecutor(max(1, min(self.parallel, len(batches)))) as ex:
            for got, errs in ex.map(self._states_batch, batches):
                states.update(got)
                errors.update(errs)
        return states, errors

    def _states_batch(self, batch: list[str]) -> tuple[dict[str, HsmState], dict[str, str]]:
        states: dict[str, HsmState] = {}
        errors: dict[str, str] = {}
        todo = batch
        while todo:
            r = self._run(["hsm_state", *todo])
            got = parse_batch(todo, r.stdout)
            for s in got:
                states[s.path] = s
            todo = todo[len(got):]
            if not todo:
                break
            if r.returncode == 0:
                raise UnavailableError(
                    f"`lfs hsm_state` printed output this tool cannot parse near {todo[0]!r}: "
                    f"{r.stdout[:200]!r}; report the Lustre client version (lfs --version)"
                )
            # lfs stops at the first file it cannot stat; note it and ask about the rest. Any
            # other failure (not Lustre, no HSM) would repeat for every file: stop at once.
            msg = (r.stderr.strip().splitlines() or [f"lfs exit {r.returncode}"])[-1]
            if "No such file" not in msg:
                raise UnavailableError(
                    f"`lfs hsm_state` failed on {todo[0]}: {msg}; check that the checkpoint root is on the "
                    "AMLFS mount with HSM (blob integration) and that amlfs.lfs is the Lustre client's lfs"
                )
            errors[todo[0]] = msg
            todo = todo[1:]
        return states, errors

    def _request(self, action: str, paths: Sequence[str]) -> None:
        for batch in chunks(list(paths), self.batch):
            r = self._run([action, *batch])
            if r.returncode != 0:
                raise UserError(
                    f"`lfs {action}` failed for a batch of {len(batch)} files starting with {batch[0]}: "
                    f"{r.stderr.strip() or 'exit ' + str(r.returncode)}",
                    exit_code=EXIT_FAILED,
                )

    def release(self, paths: Sequence[str]) -> None:
        self._request("hsm_release", paths)

    def restore(self, paths: Sequence[str]) -> None:
        self._request("hsm_restore", paths)

    def archive(self, paths: Sequence[str]) -> None:
        self._request("hsm_archive", paths)

    def wait_resident(self, paths: Sequence[str], timeout: float, poll: float = 1.0,
                      on_resident: Callable[[list[str]], None] | None = None) -> None:
        """Poll hsm_state until no file is released; hsm_restore only queues the copy."""
        pending = list(paths)
        deadline = time.monotonic() + timeout
        while pending:
            states, errors = self.states(pending)
            if errors:
                p, e = next(iter(errors.items()))
                raise UserError(f"cannot read the HSM state of {p}: {e}", exit_code=EXIT_FAILED)
            done = [p for p in pending if not states[p].released]
            if done and on_resident is not None:
                on_resident(done)
            pending = [p for p in pending if states[p].released]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise UnavailableError(
                    f"{len(pending)} files are still released after {timeout:.0f}s of hsm_restore "
                    f"(first: {pending[0]}); check the AMLFS blob integration and retry restore"
                )
            time.sleep(poll)
