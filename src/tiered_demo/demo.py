"""`tiered-ckpt demo`: the whole lifecycle on one machine, with the real parts.

Accelerator layer = a local directory; core storage layer = a private Azurite on 127.0.0.1.
A simulated training loop saves checkpoints with the real writer; the local exporter (the
stand-in for AMLFS auto-export) copies new and changed files to Blob in iterations;
retention runs on a timer with the real policy; then the accelerator layer is wiped and the
newest committed checkpoint is restored from Blob, hash-verified, and compared byte for byte
with what training last saved.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiered_ckpt import api
from tiered_ckpt.cli.output import progress_bars
from tiered_ckpt.cli.timeline import draw
from tiered_ckpt.config import ArchiveConfig, IoConfig, NodeConfig, RetentionConfig, validate
from tiered_ckpt.errors import ConflictError, IntegrityError, UnavailableError, UserError
from tiered_ckpt.io import commit
from tiered_ckpt.lifecycle import retention
from tiered_ckpt.lifecycle import timeline as toolkit_timeline
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.proof import prove
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.naming import require_name
from tiered_ckpt.tiers.backends import make_backend
from tiered_ckpt.tiers.blob import BlobStore
from tiered_demo.azurite import Azurite, free_port


@dataclass(frozen=True)
class DemoOptions:
    workdir: Path = Path(".demo")
    checkpoints: int = 6
    size: int = 256 << 20           # bytes per checkpoint
    interval: float = 3.0           # seconds between checkpoint starts
    export_interval: float = 1.0
    retention_interval: float = 2.5
    keep_last: int = 2
    min_keep: int = 2
    azurite_port: int | None = None
    archive_timeout: float = 60.0
    png: bool = True
    progress: bool = True


@dataclass
class CheckpointReport:
    name: str
    bytes: int
    write_seconds: float
    write_GBps: float
    committed_at: float
    archived_after_seconds: float | None = None
    retention: str = ""
    retention_reason: str = ""


@dataclass
class DemoReport:
    workdir: str
    azurite: str
    checkpoints: list[CheckpointReport] = field(default_factory=list)
    retention_log: list[dict[str, Any]] = field(default_factory=list)     # actions and blocks, in order
    retention_final: list[dict[str, Any]] = field(default_factory=list)   # the last plan, every checkpoint
    retention_runs: int = 0
    export_iterations: int = 0
    restored: str | None = None
    restore_seconds: float | None = None
    restore_GBps: float | None = None
    restore_verified: bool = False
    restore_matches_training: bool = False
    timeline_png: str | None = None
    total_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _DemoLock:
    """One demo per work directory: a second concurrent run refuses clearly."""

    def __init__(self, workdir: Path) -> None:
        self.path = workdir / "demo.lock"
        self.fd = -1

    def __enter__(self) -> _DemoLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ConflictError(
                f"another demo (pid {holder}) is running in {self.path.parent}; wait for it, "
                "or run this one elsewhere with --dir OTHER_DIR"
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _state(step: int, size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A model-shaped state: weights plus optimizer moments, `size` bytes in all."""
    weights = size // 2 // 4
    moments = (size - weights * 4) // 2 // 4
    rest = size - weights * 4 - 2 * moments * 4
    state = {
        "model.weight": rng.standard_normal(weights, dtype=np.float32),
        "optim.exp_avg": rng.standard_normal(moments, dtype=np.float32),
        "optim.exp_avg_sq": rng.random(moments, dtype=np.float32),
    }
    if rest:
        state["meta.step"] = np.full(rest, step % 256, dtype=np.uint8)
    return state


def _digest(state: dict[str, Any]) -> dict[str, str]:
    return {k: xxhash.xxh3_128_hexdigest(np.ascontiguousarray(v).data) for k, v in state.items()}


class Demo:
    def __init__(self, opts: DemoOptions) -> None:
        self.o = opts
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.reports: dict[str, CheckpointReport] = {}
        self.retention_log: list[dict[str, Any]] = []
        self.decided: dict[str, str] = {}
        self.retention_runs = 0
        self.final_plan: list[dict[str, Any]] = []
        self.export_iterations = 0
        self.errors: list[BaseException] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- background loops -------------------------------------------------------------------
    def _export_loop(self, cfg: NodeConfig, stop: threading.Event) -> None:
        exporter = Exporter(cfg)
        backend = make_backend(cfg, exporter.store)
        while not stop.is_set():
            t = time.monotonic()
            try:
                exporter.iterate()
                self.export_iterations += 1
                self._stamp_archived(cfg, backend)
            except (UserError, OSError) as e:   # the next iteration retries, like auto-export
                self.errors.append(e)
            stop.wait(max(0.0, self.o.export_interval - (time.monotonic() - t)))

    def _stamp_archived(self, cfg: NodeConfig, backend: Any) -> None:
        with self.lock:
            pending = [r for r in self.reports.values() if r.archived_after_seconds is None]
        if not pending:
            return
        infos = [c for c in commit.scan(cfg.root, cfg.model, cfg.naming) if c.name in {r.name for r in pending}]
        proofs = prove(backend, infos)
        now = self.now()
        with self.lock:
            for name, p in proofs.items():
                r = self.reports[name]
                if p.archived and r.archived_after_seconds is None:
                    r.archived_after_seconds = now - r.committed_at

    def _retention_once(self, cfg: NodeConfig, backend: Any, policy: retention.Policy) -> None:
        res = retention.apply(cfg, backend, policy)
        now = self.now()
        with self.lock:
            self.retention_runs += 1
            self.final_plan = [{"checkpoint": d.name, "decision": d.action, "reason": d.reason} for d in res.decisions]
            for d in res.decisions:
                r = self.reports.get(d.name)
                # Blocked decisions (not yet archived) are the interesting "keep" ones: log each once.
                if d.action == "blocked" and self.decided.get(d.name) != d.reason:
                    self.decided[d.name] = d.reason
                    self.retention_log.append({"t": round(now, 2), "checkpoint": d.name, "decision": d.action, "reason": d.reason})
                if r is not None and d.action in ("delete", "release", "resume-delete"):
                    r.retention, r.retention_reason = d.action, d.reason
                    self.retention_log.append({"t": round(now, 2), "checkpoint": d.name, "decision": d.action, "reason": d.reason})

    def _retention_loop(self, cfg: NodeConfig, policy: retention.Policy, stop: threading.Event) -> None:
        backend = make_backend(cfg)
        while not stop.wait(self.o.retention_interval):
            try:
                self._retention_once(cfg, backend, policy)
            except ConflictError:
                continue   # another actor holds the lock; the timer tries again
            except (UserError, OSError) as e:
                self.errors.append(e)

    # -- the run ------------------------------------------------------------------------------
    def run(self, say: Any) -> DemoReport:
        o = self.o
        work = o.workdir.resolve()
        with _DemoLock(work):
            lustre = work / "lustre"
            # A second run starts from a clean slate; both layers are the demo's own.
            for p in (lustre, work / "azurite", work / "timeline.png"):
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
            (work / "azurite").mkdir(parents=True)
            port = o.azurite_port
            if port is not None and not _port_free(port):
                say(f"port {port} is taken; starting Azurite on another free port")
                port = free_port()
            server = Azurite(location=str(work / "azurite"), port=port)
            server.start()
            try:
                return self._run(work, lustre, server, say)
            finally:
                server.stop()
                say("Azurite stopped")

    def _run(self, work: Path, lustre: Path, server: Azurite, say: Any) -> DemoReport:
        o = self.o
        say(f"Azurite (Blob emulator) on 127.0.0.1:{server.port}; accelerator layer at {lustre}")
        cfg = NodeConfig(
            root=str(lustre / "checkpoints"), model="demo-llm", backend="local",
            io=IoConfig(threads=2, files_per_rank=4, block_size=8 << 20, direct=True,
                        staging_bytes=o.size, sync_buffer_bytes=64 << 20),
            archive=ArchiveConfig(container="checkpoints", prefix="checkpoints",
                                  connection_string=server.connection_string, concurrency=4, retries=3),
            retention=RetentionConfig(keep_last=o.keep_last, min_keep=o.min_keep, action="delete"),
        )
        validate(cfg)
        Path(cfg.root).mkdir(parents=True)
        BlobStore(cfg.archive).ensure_container()
        policy = retention.Policy.from_config(cfg.retention)
        report = DemoReport(workdir=str(work), azurite=f"127.0.0.1:{server.port}")

        stop = threading.Event()
        threads = [threading.Thread(target=self._export_loop, args=(cfg, stop), name="exporter", daemon=True),
                   threading.Thread(target=self._retention_loop, args=(cfg, policy, stop), name="retention", daemon=True)]
        for t in threads:
            t.start()
        rng = np.random.default_rng(0)
        last_digest: dict[str, str] = {}
        try:
            for i in range(o.checkpoints):
                tick = time.monotonic()
                step = (i + 1) * 100
                state = _state(step, o.size, rng)          # "training" produced new weights
                res = api.save(state, epoch=0, step=step, config=cfg)
                end = self.now()
                last_digest = _digest(state)
                gbps = res.bytes / res.seconds / 1e9 if res.seconds else 0.0
                with self.lock:
                    self.reports[res.name] = CheckpointReport(res.name, res.bytes, round(res.seconds, 3), round(gbps, 3), end)
                say(f"step {step}: saved {res.name} ({res.bytes / 2**20:.0f} MiB in {res.seconds:.2f} s, {gbps:.2f} GB/s)")
                time.sleep(max(0.0, o.interval - (time.monotonic() - tick)))
            newest = max(self.reports)
            say(f"training done; waiting until {newest} is archived in Blob")
            self._wait_archived(newest)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        # One last retention pass with everything exported, as the timer would do.
        self._retention_once(cfg, make_backend(cfg), policy)

        # The toolkit's own timeline of the run so far: its records live on the accelerator layer
        # (beside the root), so they go with it; what the toolkit sees afterwards is added below.
        before = toolkit_timeline.gather(make_backend(cfg)) if o.png else None

        # Loss of the accelerator layer (a teardown, a failed file system): Blob is all that is left.
        shutil.rmtree(lustre)
        lost_at = time.time()
        say("accelerator layer wiped: restoring the newest committed checkpoint from Blob")

        with progress_bars(enabled=o.progress) as bars:
            result = restore(cfg, make_backend(cfg), None, verify=True, progress=bars)
        loaded = api.load(result.name, config=cfg, verify_hash=True)
        matches = _digest(loaded) == last_digest and result.name == newest
        if not matches:
            raise IntegrityError(f"restored {result.name} differs from what training last saved ({newest})")

        report.checkpoints = [self.reports[k] for k in sorted(self.reports, key=require_name)]
        report.retention_log = self.retention_log
        report.retention_final = self.final_plan
        report.retention_runs = self.retention_runs
        report.export_iterations = self.export_iterations
        report.restored = result.name
        report.restore_seconds = round(result.seconds, 3)
        report.restore_GBps = round(result.bytes / result.seconds / 1e9, 3) if result.seconds else None
        report.restore_verified = True
        report.restore_matches_training = matches
        if before is not None:
            after = toolkit_timeline.gather(make_backend(cfg))
            # Before the loss: everything the toolkit recorded; after it: the restore, and where each checkpoint is now.
            before.events += [e for e in after.events if e.kind == toolkit_timeline.RESTORE]
            before.tiers, before.generated_unix = after.tiers, after.generated_unix
            report.timeline_png = str(draw(before, work / "timeline.png", title="tiered-ckpt demo",
                                           markers=[(lost_at, "accelerator layer lost")]))
        report.total_seconds = round(self.now(), 2)
        return report

    def _wait_archived(self, name: str) -> None:
        deadline = time.monotonic() + self.o.archive_timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.reports[name].archived_after_seconds is not None:
                    return
            time.sleep(0.2)
        detail = f" (last error: {self.errors[-1]})" if self.errors else ""
        raise UnavailableError(f"{name} was not archived in Blob within {self.o.archive_timeout:.0f} s{detail}")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run(opts: DemoOptions, say: Any = print) -> DemoReport:
    if opts.checkpoints < 2:
        raise UserError(f"--checkpoints {opts.checkpoints}: the demo needs at least 2 to show retention")
    if opts.size < (1 << 20):
        raise UserError(f"--size {opts.size}: use at least 1MiB")
    return Demo(replace(opts, workdir=Path(opts.workdir))).run(say)
