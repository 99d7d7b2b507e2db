"""`tiered-ckpt demo` end to end against a real Azurite: the report, the picture, the faults."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiered_ckpt.errors import ConflictError
from tiered_demo.demo import DemoOptions, run

SMALL = dict(checkpoints=4, size=4 << 20, interval=0.4)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m tiered_demo ARGS` (what `make demo` runs); a leading "demo" is the command's name."""
    rest = list(args[1:]) if args and args[0] == "demo" else list(args)
    return subprocess.run([sys.executable, "-m", "tiered_demo", *rest], cwd=cwd, capture_output=True, text=True, timeout=240)


def procs_mentioning(text: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(int(pid))
    return found


@pytest.mark.timeout(180)
def test_demo_runs_the_whole_lifecycle_and_restores_what_training_saved(tmp_path: Path) -> None:
    report = run(DemoOptions(workdir=tmp_path / "d", **SMALL), say=lambda m: None)  # type: ignore[arg-type]
    names = [c.name for c in report.checkpoints]
    assert names == [f"global_epoch0_step{s}" for s in (100, 200, 300, 400)]
    # The newest checkpoint came back from Blob, hash-verified, identical to the last saved state.
    assert report.restored == names[-1]
    assert report.restore_verified and report.restore_matches_training
    # Every checkpoint was archived; retention removed only archived ones and kept the newest two.
    assert all(c.archived_after_seconds is not None for c in report.checkpoints)
    removed = [c.name for c in report.checkpoints if c.retention == "delete"]
    assert removed == names[:2]
    for c in report.checkpoints:
        if c.retention == "delete":
            deleted_at = next(e["t"] for e in report.retention_log if e["checkpoint"] == c.name and e["decision"] == "delete")
            assert deleted_at >= c.committed_at + c.archived_after_seconds - 0.05
    final = {e["checkpoint"]: e["decision"] for e in report.retention_final}
    assert final[names[2]] == final[names[3]] == "keep"
    assert all(final.get(n, "delete") == "delete" for n in names[:2])
    png = Path(report.timeline_png or "")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Azurite is gone when the demo returns.
    assert procs_mentioning(str(tmp_path / "d" / "azurite")) == []


@pytest.mark.timeout(240)
def test_second_run_in_same_directory_works_and_json_report(tmp_path: Path) -> None:
    args = ["demo", "--dir", str(tmp_path / "d"), "--checkpoints", "3", "--size", "2MiB", "--interval", "0.3s", "--no-png", "--json"]
    first = cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = cli(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    rep = json.loads(second.stdout)
    assert rep["restored"] == "global_epoch0_step300" and rep["restore_matches_training"] is True


@pytest.mark.timeout(60)
def test_concurrent_run_in_same_directory_is_refused(tmp_path: Path) -> None:
    import fcntl

    work = tmp_path / "d"
    work.mkdir()
    fd = os.open(work / "demo.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242")
    try:
        with pytest.raises(ConflictError, match="another demo .*4242"):
            run(DemoOptions(workdir=work, **SMALL), say=lambda m: None)  # type: ignore[arg-type]
        res = cli("demo", "--dir", str(work), cwd=tmp_path)
        assert res.returncode == 4 and "another demo" in res.stderr and "Traceback" not in res.stderr
    finally:
        os.close(fd)


@pytest.mark.timeout(180)
def test_taken_azurite_port_is_replaced(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        said: list[str] = []
        report = run(DemoOptions(workdir=tmp_path / "d", azurite_port=port, png=False, **SMALL), say=said.append)
    assert any(f"port {port} is taken" in m for m in said)
    assert report.azurite != f"127.0.0.1:{port}" and report.restore_matches_training


@pytest.mark.timeout(120)
def test_interrupted_demo_cleans_up_and_leaves_no_processes(tmp_path: Path) -> None:
    work = tmp_path / "d"
    proc = subprocess.Popen([sys.executable, "-m", "tiered_demo", "--dir", str(work), "--checkpoints", "50",
                             "--size", "2MiB", "--interval", "0.5s"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if "saved global_epoch0_step200" in line or time.monotonic() > deadline:
            break
    assert procs_mentioning(str(work / "azurite")), "Azurite should be running mid-demo"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    time.sleep(0.5)
    assert procs_mentioning(str(work / "azurite")) == []


@pytest.mark.timeout(240)
@pytest.mark.skipif(not __import__("shutil").which("strace"), reason="strace (Debian) is installed by make test")
def test_local_mode_connects_to_nothing_but_loopback(tmp_path: Path) -> None:
    """The "without Azure" mode stays on this machine: every connect() of the demo and of the
    Azurite it starts (Node.js: telemetry, DNS) goes to 127.0.0.1 / ::1 or a Unix socket."""
    trace = tmp_path / "connect.trace"
    r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace), sys.executable, "-m", "tiered_demo",
                        "--dir", str(tmp_path / "w"), "--checkpoints", "3", "--size", "2MiB", "--interval", "1s", "--no-png"],
                       capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stderr[-2000:]
    calls = [ln for ln in trace.read_text().splitlines() if "connect(" in ln]
    inet = [ln for ln in calls if "AF_INET" in ln]
    assert inet, "the demo made no TCP connection at all: the trace did not capture it"
    outside = [ln for ln in inet if 'inet_addr("127.0.0.1")' not in ln and 'inet_pton(AF_INET6, "::1"' not in ln
               and "::ffff:127.0.0.1" not in ln]
    assert outside == [], "connections that leave the machine:\n" + "\n".join(outside[:10])


def test_azurite_is_started_without_telemetry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tiered_demo.azurite as az

    seen: list[list[str]] = []

    class Stop(Exception):
        pass

    def popen(argv: list[str], **kw: object) -> object:
        seen.append(argv)
        raise Stop

    monkeypatch.setattr(az.subprocess, "Popen", popen)
    with pytest.raises(Stop):
        az.Azurite(str(tmp_path)).start()
    assert "--disableTelemetry" in seen[0]
