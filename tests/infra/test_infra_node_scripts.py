"""The scripts cloud-init installs on the VMs, run for real against a local stand-in for IMDS and Key Vault.

A real HTTP server answers like the Azure Instance Metadata Service (managed identity tokens, Scheduled
Events) and the Key Vault secrets API (GET/PUT, 404 for a missing secret, 403 without a role), with the
role table of the deployment: the login identity may create the secret, node identities may only read it.
System commands the scripts call (scontrol, umount, nvidia-smi, ...) are stand-ins on PATH that log.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest

from components import cloud_init

from .test_infra_cloud_init import _inputs

pytestmark = pytest.mark.timeout(120)
SCRIPTS = Path(cloud_init.__file__).resolve().parent / "node_scripts"
SECRET = "munge-key"


class FakeAzure:
    """IMDS + one Key Vault. `readers`/`writers`: client IDs holding Secrets User / Secrets Officer."""

    def __init__(self, log: Path) -> None:
        self.secrets: dict[str, str] = {}
        self.readers: set[str] = set()
        self.writers: set[str] = set()
        self.puts: list[str] = []
        self.events: dict[str, Any] = {"DocumentIncarnation": 1, "Events": []}
        self.acks: list[Any] = []
        self.log = log
        azure = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any = None) -> None:
                data = (body if isinstance(body, str) else json.dumps(body or {})).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _client(self) -> str:
                return self.headers.get("Authorization", "").removeprefix("Bearer tok-")

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                u = urlparse(self.path)
                q = parse_qs(u.query)
                if u.path.startswith("/metadata/"):
                    if self.headers.get("Metadata") != "true":
                        return self._send(400, {"error": "Metadata header required"})
                    if u.path == "/metadata/identity/oauth2/token":
                        assert q["resource"] == ["https://vault.azure.net"]
                        return self._send(200, {"access_token": "tok-" + q["client_id"][0], "expires_in": "3599"})
                    if u.path == "/metadata/scheduledevents":
                        assert q["api-version"] == ["2020-07-01"]
                        return self._send(200, azure.events)
                    if u.path == "/metadata/instance/compute/name":
                        return self._send(200, "vm0")
                if u.path == f"/secrets/{SECRET}" and q.get("api-version") == ["7.4"]:
                    who = self._client()
                    if who not in azure.readers | azure.writers:
                        return self._send(403, {"error": {"code": "Forbidden"}})
                    if SECRET not in azure.secrets:
                        return self._send(404, {"error": {"code": "SecretNotFound"}})
                    return self._send(200, {"value": azure.secrets[SECRET], "id": "x"})
                self._send(404)

            def do_PUT(self) -> None:  # noqa: N802
                u = urlparse(self.path)
                who = self._client()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                azure.puts.append(who)
                if who not in azure.writers:
                    return self._send(403, {"error": {"code": "Forbidden"}})
                azure.secrets[u.path.rsplit("/", 1)[1]] = body["value"]
                self._send(200, {"value": body["value"]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.headers.get("Metadata") == "true"
                azure.acks.append(body)
                with open(azure.log, "a") as f:
                    f.write(f"ack {json.dumps(body)}\n")
                self._send(200)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def azure(tmp_path: Path) -> Iterator[FakeAzure]:
    a = FakeAzure(tmp_path / "calls.log")
    yield a
    a.server.shutdown()


def munge(azure: FakeAzure, mode: str, client: str, key_file: Path, timeout: float = 20, **kw: Any) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(SCRIPTS / "munge_key.py"), mode, "--vault", azure.url, "--imds", azure.url, "--secret", SECRET,
           "--client-id", client, "--key-file", str(key_file), "--owner", "", "--interval", "0.2", "--timeout", str(timeout)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_the_controller_creates_the_munge_key_once_and_every_node_reads_the_same_bytes(azure: FakeAzure, tmp_path: Path) -> None:
    azure.writers, azure.readers = {"login"}, {"node"}
    ctl = tmp_path / "ctl.key"
    p = munge(azure, "init", "login", ctl)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    key = ctl.read_bytes()
    assert len(key) == 128 and ctl.stat().st_mode & 0o777 == 0o400
    assert base64.b64decode(azure.secrets[SECRET]) == key
    # A second init (a replaced login VM) reuses the stored key; a node reads the same bytes.
    again, node = tmp_path / "again.key", tmp_path / "node.key"
    for mode, client, f in (("init", "login", again), ("fetch", "node", node)):
        q = munge(azure, mode, client, f)
        assert q.communicate(timeout=60) and q.returncode == 0
        assert f.read_bytes() == key
    assert azure.puts == ["login"]                      # created exactly once, by the controller
    # The key never reaches a log line.
    assert base64.b64encode(key).decode() not in out + err and key.hex() not in out + err


def test_a_node_waits_for_the_key_and_never_writes_it(azure: FakeAzure, tmp_path: Path) -> None:
    azure.writers, azure.readers = {"login"}, {"node"}
    node_key = tmp_path / "node.key"
    waiting = munge(azure, "fetch", "node", node_key)
    time.sleep(1.5)
    assert waiting.poll() is None and not node_key.exists()          # nothing yet: still polling
    ctl = munge(azure, "init", "login", tmp_path / "ctl.key")
    assert ctl.communicate(timeout=60) and ctl.returncode == 0
    waiting.communicate(timeout=60)
    assert waiting.returncode == 0 and node_key.read_bytes() == (tmp_path / "ctl.key").read_bytes()
    assert azure.puts == ["login"]


def test_without_a_role_on_the_vault_it_gives_up_with_a_message_naming_the_fix(azure: FakeAzure, tmp_path: Path) -> None:
    azure.writers = {"login"}                         # the node identity has no role (or it has not propagated)
    p = munge(azure, "fetch", "stranger", tmp_path / "k", timeout=2)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and not (tmp_path / "k").exists()
    assert "HTTP 403" in err and "Key Vault role" in err and "Traceback" not in err


def _fake_bins(tmp_path: Path, log: Path, mounted: bool = True, gpus: int = 8) -> dict[str, str]:
    bins = tmp_path / "bin"
    bins.mkdir(exist_ok=True)
    scripts = {
        "scontrol": f'echo "scontrol $*" >> {log}',
        "umount": f'echo "umount $*" >> {log}; rm -f {tmp_path}/mounted',
        "fuser": f'echo "fuser $*" >> {log}',
        "mountpoint": f'[ -e {tmp_path}/mounted ]',
        "findmnt": f'[ -e {tmp_path}/mounted ]',
        "nvidia-smi": f'for i in $(seq 1 {gpus}); do echo "GPU $((i-1)): NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done',
        "hostname": 'echo node7',
        "logger": f'echo "logger $*" >> {log}',
    }
    for name, body in scripts.items():
        (bins / name).write_text(f"#!/bin/bash\n{body}\n")
        (bins / name).chmod(0o755)
    if mounted:
        (tmp_path / "mounted").touch()
    return {"PATH": f"{bins}:/usr/bin:/bin"}


def test_a_terminate_notice_drains_then_unmounts_lustre_then_acknowledges(azure: FakeAzure, tmp_path: Path) -> None:
    log = azure.log
    env = _fake_bins(tmp_path, log)
    azure.events["Events"] = [
        {"EventId": "other-vm", "EventType": "Terminate", "Resources": ["vm9"], "EventStatus": "Scheduled", "NotBefore": ""},
        {"EventId": "freeze", "EventType": "Freeze", "Resources": ["vm0"], "EventStatus": "Scheduled", "NotBefore": ""},
        {"EventId": "E-1", "EventType": "Terminate", "Resources": ["vm0"], "EventStatus": "Scheduled",
         "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"},
    ]
    r = subprocess.run([sys.executable, str(SCRIPTS / "scheduled_events.py"), "--imds", azure.url, "--once", "--drain",
                        "--mount", "/lustrefs", "--grace", "5"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert calls == ["scontrol update nodename=" + os.uname().nodename.split(".")[0] + " state=drain reason=azure scheduled event Terminate E-1",
                     "umount /lustrefs", 'ack {"StartRequests": [{"EventId": "E-1"}]}'], calls


def test_with_the_memory_tier_the_notice_is_written_before_anything_else(azure: FakeAzure, tmp_path: Path) -> None:
    env = _fake_bins(tmp_path, azure.log)
    azure.events["Events"] = [{"EventId": "P-1", "EventType": "Preempt", "Resources": ["vm0"], "EventStatus": "Scheduled",
                               "NotBefore": ""}]
    notice = tmp_path / "run" / "tiered-ckpt" / "preempt"
    r = subprocess.run([sys.executable, str(SCRIPTS / "scheduled_events.py"), "--imds", azure.url, "--once", "--drain",
                        "--mount", "/lustrefs", "--grace", "5", "--notice", str(notice)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(notice.read_text())["EventType"] == "Preempt"      # what memory.notice_file waits for
    out = r.stdout
    assert out.index("notice written") < out.index("unmounted") < out.index("acknowledged P-1"), out


def test_a_busy_mount_gets_its_processes_stopped_before_the_acknowledgement(azure: FakeAzure, tmp_path: Path) -> None:
    log = azure.log
    env = _fake_bins(tmp_path, log)
    busy = tmp_path / "bin" / "umount"                # fails while "processes" hold the mount, until fuser ran
    busy.write_text(f'#!/bin/bash\necho "umount $*" >> {log}\n[ -e {tmp_path}/killed ] && exit 0; exit 32\n')
    (tmp_path / "bin" / "fuser").write_text(f'#!/bin/bash\necho "fuser $*" >> {log}; touch {tmp_path}/killed\n')
    azure.events["Events"] = [{"EventId": "P-1", "EventType": "Preempt", "Resources": ["vm0"], "EventStatus": "Scheduled"}]
    r = subprocess.run([sys.executable, str(SCRIPTS / "scheduled_events.py"), "--imds", azure.url, "--once", "--mount", "/lustrefs",
                        "--grace", "1"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert not any(c.startswith("scontrol") for c in calls)          # the login VM (no --drain) runs no slurmd
    assert calls.index("fuser -k -TERM -m /lustrefs") < len(calls) - 2 and calls[-2] == "umount /lustrefs"
    assert calls[-1] == 'ack {"StartRequests": [{"EventId": "P-1"}]}'


def _healthcheck(tmp_path: Path) -> Path:
    content = cloud_init._healthcheck(_inputs())       # what the ND nodes' custom data installs at HEALTHCHECK
    path = tmp_path / "healthcheck"
    # The stand-ins on PATH replace the system tools; the script's own PATH line would hide them.
    path.write_text(content.replace("PATH=/usr/local/sbin", "PATH=$PATH:/usr/local/sbin"))
    return path


# /lustrefs is an automount point: stat mounts it (or fails when the MGS is unreachable); a stat that
# succeeds without a Lustre mount means the automount is missing.
@pytest.mark.parametrize(("mounted", "responds", "gpus", "reason"), [
    (False, True, 8, "tiered-ckpt health: lustre /lustrefs not mounted"),
    (False, False, 8, "tiered-ckpt health: lustre /lustrefs not responding"),
    (True, True, 7, "tiered-ckpt health: 7 of 8 GPUs visible"),
    (False, True, 0, "tiered-ckpt health: lustre /lustrefs not mounted;0 of 8 GPUs visible"),
])
def test_health_check_drains_a_node_without_lustre_or_gpus(tmp_path: Path, mounted: bool, responds: bool, gpus: int,
                                                          reason: str) -> None:
    log = tmp_path / "calls.log"
    env = _fake_bins(tmp_path, log, mounted=mounted, gpus=gpus)
    (tmp_path / "bin" / "stat").write_text(f"#!/bin/bash\nexit {0 if responds else 1}\n")
    (tmp_path / "bin" / "stat").chmod(0o755)
    r = subprocess.run(["bash", str(_healthcheck(tmp_path))], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert f"scontrol update nodename=node7 state=drain reason={reason}" in log.read_text().splitlines()


def test_health_check_leaves_a_healthy_node_alone(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    env = _fake_bins(tmp_path, log)
    (tmp_path / "bin" / "stat").write_text("#!/bin/bash\nexit 0\n")
    (tmp_path / "bin" / "stat").chmod(0o755)
    r = subprocess.run(["bash", str(_healthcheck(tmp_path))], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and not log.exists()
