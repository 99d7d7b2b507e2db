"""examples/train.sbatch on a real Slurm (tests/cluster/slurm.py): 2 gloo workers under srun torchrun,
checkpoints on a local root archived to Azurite by the local exporter, scancel mid-run, resubmit,
resume from the newest committed checkpoint; then the same after the accelerator layer lost every
checkpoint (only Blob holds them): the job restores the newest from the archive before it loads.

Retention runs as the login node's timer would, from this harness (one `tiered-ckpt retention
apply` per tick); every `tiered-ckpt` call, the job's and the harness's, goes through a logging
shim on PATH, so the test sees who ran what: the job restores once per start (rank 0 only) and
never runs retention.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.cluster.slurm import LocalSlurm, _free_ports
from tiered_ckpt.config import ArchiveConfig, NodeConfig, RetentionConfig, dump
from tiered_ckpt.io import commit
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import archive_committed
from tiered_ckpt.tiers.blob import BlobStore

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "train.sbatch"
TRAIN = REPO / "examples" / "train.py"
MODEL = "tiny"
SAVE_EVERY = 4
JOB_TIMEOUT = 150.0          # seconds for one job on a loaded 2-core machine (torch import x 3 processes)


def wait_for(what: str, ok: Callable[[], bool], timeout: float, why: Callable[[], str] = lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} not within {timeout:.0f}s\n{why()}")


@dataclass
class Harness:
    slurm: LocalSlurm
    tmp: Path
    cfg: NodeConfig
    cfg_path: Path
    shim_log: Path
    env: dict[str, str]
    ticks: list[dict[str, object]] = field(default_factory=list)

    # -- the job -----------------------------------------------------------------------------
    def submit(self, *train_args: str) -> tuple[str, Path]:
        out = self.tmp / f"job-{len(list(self.tmp.glob('job-*.out')))}.out"
        env = dict(self.env, RDZV_PORT=str(_free_ports(1)[0]))
        r = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={out}", f"--chdir={self.tmp}",
             str(SBATCH), *train_args],
            env=env, capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, f"sbatch failed: {r.stderr}\n{self.slurm.logs()}"
        return r.stdout.strip().split(";")[0], out

    def state(self, job: str) -> str:
        r = self.slurm.run("squeue", "-h", "-j", job, "-o", "%T", check=False)
        return r.stdout.strip()

    def wait_gone(self, job: str, out: Path) -> None:
        wait_for(f"job {job} to end", lambda: self.state(job) == "", JOB_TIMEOUT,
                 lambda: out.read_text(errors="replace") + self.slurm.logs())

    # -- the tiers ----------------------------------------------------------------------------
    def local_steps(self) -> list[int]:
        return [c.manifest.step for c in commit.committed(commit.scan(self.cfg.root, MODEL)) if c.manifest]

    def archive_steps(self) -> list[int]:
        return [m.step for m in archive_committed(BlobStore(self.cfg.archive), MODEL)]

    # -- the login node's timer ---------------------------------------------------------------
    def retention_tick(self) -> None:
        r = subprocess.run(["tiered-ckpt", "retention", "apply", "--json", "--config", str(self.cfg_path)],
                           env=self.env, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
        self.ticks.append(json.loads(r.stdout))

    def cli_calls(self) -> list[dict[str, str]]:
        calls = []
        for line in self.shim_log.read_text().splitlines():
            job, procid, rank, *argv = line.split("\t")
            calls.append({"job": job, "procid": procid, "rank": rank, "cmd": " ".join(argv)})
        return calls


def _steps_in(text: str, event: str) -> list[int]:
    return [int(m) for m in re.findall(rf"^tiered-train: {event} step=(\d+)", text, re.M)]


@pytest.fixture
def harness(slurm: LocalSlurm, tmp_path: Path, azurite_container: tuple[str, str]) -> Iterator[Harness]:
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = NodeConfig(root=str(root), model=MODEL, backend="local",
                     archive=ArchiveConfig(connection_string=conn, container=container, prefix="checkpoints",
                                           retries=2, concurrency=4),
                     retention=RetentionConfig(keep_last=2, min_keep=2, restore_grace=0.0))
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(dump(cfg))
    assert yaml.safe_load(cfg_path.read_text())["model"] == MODEL
    # Every `tiered-ckpt` invocation is logged with who ran it, then runs the real command line.
    shim = tmp_path / "bin"
    shim.mkdir()
    shim_log = tmp_path / "tiered-ckpt-calls.log"
    (shim / "tiered-ckpt").write_text(
        "#!/bin/bash\n"
        f"printf '%s\\t%s\\t%s\\t%s\\n' \"${{SLURM_JOB_ID:-}}\" \"${{SLURM_PROCID:-}}\" \"${{RANK:-}}\" \"$*\" >> {shim_log}\n"
        f"exec {sys.executable} -m tiered_ckpt \"$@\"\n")
    (shim / "tiered-ckpt").chmod(0o755)
    shim_log.touch()
    env = slurm.env(
        PATH=f"{shim}:{Path(sys.executable).parent}:{slurm.env()['PATH']}",
        PYTHONPATH=f"{REPO / 'src'}:{REPO}",
        TIERED_CKPT_CONFIG=str(cfg_path), TRAIN_SCRIPT=str(TRAIN), NPROC_PER_NODE="2",
        OMP_NUM_THREADS="1",
    )
    h = Harness(slurm, tmp_path, cfg, cfg_path, shim_log, env)
    # The local exporter: the stand-in for AMLFS auto-export, iterating as the service would.
    stop = threading.Event()
    exporter = Exporter(cfg)
    exporter.store.ensure_container()
    t = threading.Thread(target=exporter.watch, args=(1.0, stop), daemon=True)
    t.start()
    try:
        yield h
    finally:
        stop.set()
        t.join(60)
        slurm.run("scancel", "--user=root", check=False)


def test_job_checkpoints_is_cancelled_resumes_and_restores_from_the_archive(harness: Harness) -> None:
    h = harness
    # 1. A run that would take far longer than we let it: it saves several checkpoints, then scancel.
    job_a, out_a = h.submit("--steps", "400", "--save-every", str(SAVE_EVERY), "--step-sleep", "0.25")

    def four_saved() -> bool:
        if not h.ticks and len(h.local_steps()) >= 3:
            h.retention_tick()            # the timer fires while the job trains
        return len(set(h.local_steps()) | set(h.archive_steps())) >= 4
    wait_for("4 committed checkpoints", four_saved, JOB_TIMEOUT,
             lambda: out_a.read_text(errors="replace") + h.slurm.logs())
    assert h.state(job_a) == "RUNNING"
    h.slurm.run("scancel", job_a)
    h.wait_gone(job_a, out_a)
    log_a = out_a.read_text()
    assert _steps_in(log_a, "fresh start") == [0], log_a
    stopped = _steps_in(log_a, "stopped")
    assert len(stopped) == 1, f"SIGTERM was not handled by a clean stop:\n{log_a}"
    newest = max(set(h.local_steps()) | set(h.archive_steps()))
    # The stop saved the step it stopped at (or the step was a save step already).
    assert newest == stopped[0], (newest, stopped, log_a)
    h.retention_tick()

    # 2. Resubmit: it resumes from the newest committed checkpoint and finishes.
    final = newest + 2 * SAVE_EVERY
    job_b, out_b = h.submit("--steps", str(final), "--save-every", str(SAVE_EVERY))
    h.wait_gone(job_b, out_b)
    log_b = out_b.read_text()
    assert _steps_in(log_b, "resumed") == [newest], log_b
    assert _steps_in(log_b, "done") == [final], log_b
    assert "restore source=resident" in log_b
    h.retention_tick()

    # 3. The accelerator layer loses every checkpoint (a new file system; data only in Blob): the
    #    next start restores the newest from the archive, then loads it.
    wait_for(f"step {final} archived", lambda: final in h.archive_steps(), 60)
    shutil.rmtree(Path(h.cfg.root) / MODEL)
    assert h.local_steps() == []
    job_c, out_c = h.submit("--steps", str(final + SAVE_EVERY), "--save-every", str(SAVE_EVERY))
    h.wait_gone(job_c, out_c)
    log_c = out_c.read_text()
    assert f"restore source=archive name=global_epoch0_step{final}" in log_c, log_c
    assert _steps_in(log_c, "resumed") == [final], log_c
    assert _steps_in(log_c, "done") == [final + SAVE_EVERY], log_c

    # Who ran what: each job start restored once, from one rank; retention only ran from the
    # timer, once per tick; and retention did free checkpoints (keep_last 2 of many).
    calls = h.cli_calls()
    restores = [c for c in calls if c["cmd"].startswith("restore")]
    assert sorted(c["job"] for c in restores) == sorted([job_a, job_b, job_c]), calls
    assert {c["rank"] for c in restores} == {"0"}, calls
    retention = [c for c in calls if c["cmd"].startswith("retention")]
    assert len(retention) == len(h.ticks) >= 3, calls
    assert all(c["job"] == "" for c in retention), calls
    assert any(t["applied"] for t in h.ticks), h.ticks


@pytest.mark.requeue
@pytest.mark.timeout(900)
def test_requeued_job_restarts_and_resumes_where_it_stopped(harness: Harness) -> None:
    """Two ways a running job is requeued, each restarting it from the top under the same id:
    the time-limit warning (`--signal=B:USR1@120`: the batch script's trap stops the workers with
    a checkpoint and runs `scontrol requeue`), and `scontrol requeue` itself, which is what Slurm
    does to a --requeue job whose node failed or that was preempted."""
    h = harness
    job, out = h.submit("--steps", "400", "--save-every", str(SAVE_EVERY), "--step-sleep", "0.25")

    def text() -> str:
        return out.read_text(errors="replace")

    def why() -> str:
        return text() + h.slurm.logs()

    def requeued_and_resumed(restarts: int) -> None:
        # Slurm holds a requeued job back (22.05 sets its begin time ~2 minutes ahead, visible as
        # Reason=BeginTime); the test moves that to now once the job is pending again.
        wait_for("the requeued job to be pending", lambda: h.state(job) == "PENDING", JOB_TIMEOUT, why)

        def resumed() -> bool:
            if len(_steps_in(text(), "resumed")) == restarts:
                return True
            # Still (or again) pending: under load slurmd may refuse the relaunch of a job it has
            # just killed ("already killed, do not launch batch job") and Slurm requeues it once
            # more with a new begin time; move that to now each time.
            if h.state(job) == "PENDING":
                h.slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
            return False

        wait_for(f"restart {restarts} to resume", resumed, JOB_TIMEOUT * 2, why)

    wait_for("2 committed checkpoints", lambda: len(h.local_steps()) >= 2, JOB_TIMEOUT, why)
    h.slurm.run("scancel", "--batch", "--signal=USR1", job)        # what --signal=B:USR1@120 sends
    requeued_and_resumed(1)
    wait_for("a checkpoint after the restart", lambda: max(h.local_steps()) > _steps_in(text(), "resumed")[0],
             JOB_TIMEOUT, why)
    h.slurm.run("scontrol", "requeue", job)
    requeued_and_resumed(2)
    h.slurm.run("scancel", job)
    h.wait_gone(job, out)
    log = text()
    assert "requeueing job" in log, log
    stopped, resumed = _steps_in(log, "stopped"), _steps_in(log, "resumed")
    assert len(stopped) == 3 and resumed == stopped[:2], log
    assert "restarts=1" in log and "restarts=2" in log, log


def test_the_health_check_program_runs_on_the_node(slurm: LocalSlurm) -> None:
    """slurmd runs the configured HealthCheckProgram (at start, then every HealthCheckInterval): the
    hook cloud-init's check (Lustre mounted, GPUs present) uses to drain a broken node."""
    wait_for("a health check run", lambda: slurm.health_log.exists(), 30, slurm.logs)
    assert slurm.health_log.read_text().strip()
