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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from components.node import cloud_init
from tests.doubles.azure_vm import SECRET, FakeAzure

from .conftest import node_inputs

pytestmark = pytest.mark.timeout(120)
SCRIPTS = cloud_init.SCRIPTS


@pytest.fixture
def azure(tmp_path: Path) -> Iterator[FakeAzure]:
    a = FakeAzure(tmp_path / "calls.log")
    yield a
    a.server.shutdown()


def munge(azure: FakeAzure, mode: str, client: str, key_file: Path, timeout: float = 20, **kw: Any) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(SCRIPTS / "munge-key.py"), mode, "--vault", azure.url, "--imds", azure.url, "--secret", SECRET,
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
        # squeue -h -w NODE -o %i: the node's jobs (a file of job ids; a job ends when the file is emptied).
        "squeue": f'cat {tmp_path}/jobs 2>/dev/null; true',
        "scancel": f'echo "scancel $*" >> {log}; : > {tmp_path}/jobs',
        "systemctl": f'echo "systemctl $*" >> {log}',
    }
    for name, body in scripts.items():
        (bins / name).write_text(f"#!/bin/bash\n{body}\n")
        (bins / name).chmod(0o755)
    if mounted:
        (tmp_path / "mounted").touch()
    return {"PATH": f"{bins}:/usr/bin:/bin"}


def _events(azure: FakeAzure, tmp_path: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPTS / "scheduled-events.py"), "--imds", azure.url, "--once", "--drain",
                           "--mount", "/lustrefs", "--grace", "5", "--job-grace", "5", "--marker", str(tmp_path / "marker"),
                           *extra], capture_output=True, text=True, timeout=60, env=env)


def test_a_terminate_notice_drains_checkpoints_unmounts_deletes_the_node_then_acknowledges(azure: FakeAzure,
                                                                                             tmp_path: Path) -> None:
    log = azure.log
    env = _fake_bins(tmp_path, log)
    (tmp_path / "jobs").write_text("41\n")
    azure.events["Events"] = [
        {"EventId": "other-vm", "EventType": "Terminate", "Resources": ["vm9"], "EventStatus": "Scheduled", "NotBefore": ""},
        {"EventId": "freeze", "EventType": "Freeze", "Resources": ["vm0"], "EventStatus": "Scheduled", "NotBefore": ""},
        {"EventId": "E-1", "EventType": "Terminate", "Resources": ["vm0"], "EventStatus": "Scheduled",
         "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT"},
    ]
    r = _events(azure, tmp_path, env)
    assert r.returncode == 0, r.stdout + r.stderr
    node = os.uname().nodename.split(".")[0]
    calls = log.read_text().splitlines()
    # A dynamic node stays registered until deleted (SchedMD dynamic_nodes.shtml): drained, its job told to
    # checkpoint (examples/train.sbatch traps USR1), Lustre left, slurmd stopped, the node deleted, then ack.
    assert calls == [f"scontrol update nodename={node} state=drain reason=azure scheduled event Terminate E-1",
                     "scancel --signal=USR1 --batch 41", "umount /lustrefs", "systemctl stop slurmd",
                     f"scontrol delete nodename={node}", 'ack {"StartRequests": [{"EventId": "E-1"}]}'], calls


@pytest.mark.parametrize("kind", ["Reboot", "Redeploy"])
def test_a_maintenance_reboot_drains_checkpoints_unmounts_acknowledges_and_resumes_the_node_afterwards(
        azure: FakeAzure, tmp_path: Path, kind: str) -> None:
    """ND H100 v5 does not live-migrate: Reboot and Redeploy take the node down, and it comes back by name."""
    log = azure.log
    env = _fake_bins(tmp_path, log)
    (tmp_path / "jobs").write_text("7\n")
    azure.events["Events"] = [{"EventId": "R-1", "EventType": kind, "Resources": ["vm0"], "EventStatus": "Scheduled"}]
    r = _events(azure, tmp_path, env)
    assert r.returncode == 0, r.stdout + r.stderr
    node = os.uname().nodename.split(".")[0]
    calls = log.read_text().splitlines()
    assert calls == [f"scontrol update nodename={node} state=drain reason=azure scheduled event {kind} R-1",
                     "scancel --signal=USR1 --batch 7", "umount /lustrefs", 'ack {"StartRequests": [{"EventId": "R-1"}]}'], calls
    assert not any("delete" in c for c in calls)          # the VM returns under its name
    # While the event is still listed (the VM has not gone down yet): nothing more. After the reboot (the
    # event gone), the watcher returns the node to service once.
    log.write_text("")
    assert _events(azure, tmp_path, env).returncode == 0 and log.read_text() == ""
    azure.events["Events"] = []
    for _ in range(2):
        assert _events(azure, tmp_path, env).returncode == 0
    assert log.read_text().splitlines() == [f"scontrol update nodename={node} state=resume"]
    assert not (tmp_path / "marker").exists()


def test_the_controller_deletes_dynamic_nodes_that_stay_down_and_keeps_the_rest(tmp_path: Path) -> None:
    """scripts/slurm-cleanup.sh (tiered-ckpt-slurm-cleanup.timer on the login VM): a node DOWN at two runs in a
    row and running nothing is deleted; one DOWN only once (a reboot) or still running a job stays."""
    log = tmp_path / "calls.log"
    env = _fake_bins(tmp_path, log)
    bins = tmp_path / "bin"
    (bins / "sinfo").write_text(f"#!/bin/bash\ncat {tmp_path}/down\n")
    (bins / "squeue").write_text('#!/bin/bash\n[ "$3" = busy ] && echo 12; true\n')
    for b in ("sinfo", "squeue"):
        (bins / b).chmod(0o755)
    env["CLEANUP_STATE"] = str(tmp_path / "state")

    def run(down: str) -> list[str]:
        (tmp_path / "down").write_text(down)
        log.write_text("")
        r = subprocess.run(["bash", str(SCRIPTS / "slurm-cleanup.sh")], capture_output=True, text=True, timeout=30, env=env)
        assert r.returncode == 0, r.stderr
        return log.read_text().splitlines()

    assert run("gone\nbusy\n") == []                                   # first sighting
    assert run("gone\nbusy\nrebooting\n") == ["scontrol delete nodename=gone"]
    assert run("rebooting\n") == ["scontrol delete nodename=rebooting"]
    assert run("") == []


def test_with_the_memory_tier_the_notice_is_written_before_anything_else(azure: FakeAzure, tmp_path: Path) -> None:
    env = _fake_bins(tmp_path, azure.log)
    azure.events["Events"] = [{"EventId": "P-1", "EventType": "Preempt", "Resources": ["vm0"], "EventStatus": "Scheduled",
                               "NotBefore": ""}]
    notice = tmp_path / "run" / "tiered-ckpt" / "preempt"
    r = subprocess.run([sys.executable, str(SCRIPTS / "scheduled-events.py"), "--imds", azure.url, "--once", "--drain",
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
    r = subprocess.run([sys.executable, str(SCRIPTS / "scheduled-events.py"), "--imds", azure.url, "--once", "--mount", "/lustrefs",
                        "--grace", "1"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = log.read_text().splitlines()
    assert not any(c.startswith("scontrol") for c in calls)          # the login VM (no --drain) runs no slurmd
    assert calls.index("fuser -k -TERM -m /lustrefs") < len(calls) - 2 and calls[-2] == "umount /lustrefs"
    assert calls[-1] == 'ack {"StartRequests": [{"EventId": "P-1"}]}'


def _healthcheck(tmp_path: Path, env: dict[str, str]) -> list[str]:
    """The ND nodes' HEALTHCHECK as installed, with the settings of a rendered node's BOOT_ENV."""
    boot_env = tmp_path / "boot.env"
    boot_env.write_text(cloud_init.render_boot_env(node_inputs()))
    env["BOOT_ENV"] = str(boot_env)
    return ["bash", str(SCRIPTS / "healthcheck.sh")]


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
    r = subprocess.run(_healthcheck(tmp_path, env), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert f"scontrol update nodename=node7 state=drain reason={reason}" in log.read_text().splitlines()


def test_health_check_leaves_a_healthy_node_alone(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    env = _fake_bins(tmp_path, log)
    (tmp_path / "bin" / "stat").write_text("#!/bin/bash\nexit 0\n")
    (tmp_path / "bin" / "stat").chmod(0o755)
    r = subprocess.run(_healthcheck(tmp_path, env), capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and not log.exists()
