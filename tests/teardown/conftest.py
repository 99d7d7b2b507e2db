"""Teardown test harness: the fake pulumi CLI on PATH, the ARM double, Azurite as the archive,
and a local directory standing in for the Lustre mount (/lustrefs)."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import xxhash
from azure.storage.blob import ContainerClient

from tests.doubles.arm_double import OPERATOR_TOKEN, ArmDouble, blob_archive_hook
from tests.doubles.arm_fixtures import use_identity
from tests.doubles.fake_pulumi import parse
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import FileEntry, Manifest

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "tests" / "doubles" / "pulumi_bin"
LFS = ROOT / "tests" / "doubles" / "bin" / "lfs"        # the fake lfs (HSM state in $FAKE_LFS_STATE)
STACK = "prod"
ACCOUNT = "tckptprodst7f3a"


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("teardown_script", ROOT / "src" / "tiered_ops" / "teardown_cli.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SCRIPT = _load_script()


def iso(t: datetime) -> str:
    return t.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class Result:
    rc: int
    out: str
    err: str

    @property
    def flat(self) -> str:
        """stderr with line wrapping undone (rich wraps error lines at the console width)."""
        return " ".join(self.err.split())

    def json(self) -> Any:
        return json.loads(self.out)


@dataclass
class Env:
    arm: ArmDouble
    conn: str
    container: str
    state: Path        # fake pulumi state folder
    mount: Path        # stands in for /lustrefs
    journal_dir: Path
    project: Path
    events: list[str] = field(default_factory=list)
    # Runs without --lustre-root prove content by downloading (AMLFS auto-export, like the
    # archive hook here, writes no hash metadata); a test that wants no proof turns this off.
    verify_content: bool = True

    # -- the fake pulumi ---------------------------------------------------------------------
    def stacks(self) -> dict[str, Any]:
        return json.loads((self.state / "stacks.json").read_text())

    def outputs(self) -> dict[str, Any]:
        return self.stacks()[STACK]["outputs"]

    def calls(self) -> list[list[str]]:
        p = self.state / "calls.jsonl"
        if not p.exists():
            return []
        return [json.loads(line)["argv"] for line in p.read_text().splitlines()]

    def commands(self) -> list[str]:
        """Each pulumi call as its command words (no flags): 'stack output', 'config set', 'up', ..."""
        out = []
        for argv in self.calls():
            words, _ = parse(argv)
            out.append(" ".join(words[:2]) if words[:1] in (["stack"], ["config"], ["state"]) else words[0])
        return out

    def mutating(self) -> list[list[str]]:
        return [a for a in self.calls() if a[:1] in (["up"], ["destroy"], ["state"]) or a[:2] in (["config", "set"], ["config", "rm"])]

    def fail_next(self, cmd: str, exit: int = 1, stderr: str = "error: update failed", apply: bool = False) -> None:
        p = self.state / "faults.json"
        faults = json.loads(p.read_text()) if p.exists() else {}
        faults.setdefault(cmd, []).append({"exit": exit, "stderr": stderr, "apply": apply})
        p.write_text(json.dumps(faults))

    # -- ARM ---------------------------------------------------------------------------------
    def arm_changes(self) -> list[str]:
        return [k for k in self.arm.kinds() if ".patch" in k or ".post" in k or ".put" in k or ".delete" in k]

    def last_success(self, t: datetime) -> None:
        self.arm.scenario.autoexport["lastSuccessfulIterationCompletionTimeUTC"] = iso(t)

    # -- checkpoints -------------------------------------------------------------------------
    def write_ckpt(self, epoch: int, step: int, files: dict[str, int] | None = None, model: str = "llama",
                   fill: int | None = None) -> Path:
        """A committed checkpoint as save() writes it: data files, then the marker with their hashes."""
        d = self.mount / "checkpoints" / model / f"global_epoch{epoch}_step{step}"
        d.mkdir(parents=True)
        entries = []
        for name, size in (files or {"rank0.bin": 4096, "rank1.bin": 3000}).items():
            data = bytes([(step if fill is None else fill) % 251]) * size
            (d / name).write_bytes(data)
            entries.append(FileEntry(name, size, xxhash.xxh3_128(data).hexdigest()))
        commit.write_marker(d, Manifest(epoch=epoch, step=step, files=entries))
        return d

    def archive(self, ckpt: Path) -> None:
        """What auto-export does: the checkpoint's files under the same relative path in Blob, and
        the HSM state of each file exported becomes exists + archived."""
        blob_archive_hook(self.conn, self.container, self.mount)("/" + ckpt.relative_to(self.mount).as_posix())
        self.lfs("hsm_set", "--exists", "--archived", "--archive-id", "1", *(str(p) for p in sorted(ckpt.rglob("*"))
                                                                             if p.is_file()))

    def archive_hook(self) -> Any:
        """scenario.archive_hook for a manual archive (HSM archive): upload, then mark archived."""
        def hook(filesystem_path: str) -> None:
            self.archive(self.mount / filesystem_path.lstrip("/"))
        return hook

    def lfs(self, *argv: str) -> None:
        subprocess.run([str(LFS), *argv], check=True, capture_output=True)

    def blobs(self) -> dict[str, int]:
        cc = ContainerClient.from_connection_string(self.conn, self.container)
        return {b.name: int(b.size) for b in cc.list_blobs()}

    def put_blob(self, name: str, data: bytes) -> None:
        ContainerClient.from_connection_string(self.conn, self.container).upload_blob(name, data, overwrite=True)

    # -- run the script ----------------------------------------------------------------------
    def args(self, *extra: str) -> list[str]:
        verify = ["--verify-content"] if self.verify_content and "--lustre-root" not in extra else []
        return ["--stack", STACK, "--arm-endpoint", self.arm.endpoint, "--connection-string", self.conn,
                "--state-dir", str(self.journal_dir), "--project-dir", str(self.project),
                "--wait-timeout", "2", "--poll-interval", "0", "--lfs", str(LFS), *verify, *extra]

    def run(self, *extra: str, stdin: str = "") -> Result:
        out, err = io.StringIO(), io.StringIO()
        old_in = sys.stdin
        sys.stdin = io.StringIO(stdin)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = SCRIPT.main(self.args(*extra))
        finally:
            sys.stdin = old_in
        return Result(rc, out.getvalue(), err.getvalue())

    def journal(self) -> dict[str, Any]:
        return json.loads((self.journal_dir / f"{STACK}.json").read_text())


def outputs_on(arm: ArmDouble, container: str) -> dict[str, Any]:
    """The stack outputs of a deployed stack, names as the program exports them."""
    sa = f"/subscriptions/{arm.subscription_id}/resourceGroups/tckpt-prod-storage-rg/providers/Microsoft.Storage/storageAccounts/{ACCOUNT}"
    return {
        "subscriptionId": arm.subscription_id,
        "storageResourceGroup": "tckpt-prod-storage-rg",
        "computeResourceGroup": arm.resource_group,
        "storageAccountName": ACCOUNT,
        "storageAccountUrl": f"https://{ACCOUNT}.blob.core.windows.net/",
        "dataContainer": container,
        "loggingContainer": "logs",
        "dataContainerId": f"{sa}/blobServices/default/containers/{container}",
        "checkpointPrefix": "/checkpoints",
        "computeEnabled": True,
        "amlfsName": arm.filesystem,
        "autoExportJobName": arm.autoexport_job,
        "mgsAddress": "10.42.0.4",
        "mountCommand": "mount -t lustre -o noatime,flock 10.42.0.4@tcp:/lustrefs /lustrefs",
        "provisionedGBps": 2.0,
        "nodeCount": 2,
        "sizing": {"capacityTiB": 4},
    }


@pytest.fixture
def env(arm_env: ArmDouble, azurite_container: tuple[str, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    conn, container = azurite_container
    use_identity(monkeypatch, OPERATOR_TOKEN)   # teardown runs on the operator's workstation
    state = tmp_path / "pulumi-state"
    state.mkdir()
    on = outputs_on(arm_env, container)
    (state / "stacks.json").write_text(json.dumps({STACK: {"config": {}, "outputs_on": on, "outputs": on, "protected": True}}))
    monkeypatch.setenv("FAKE_PULUMI_STATE", str(state))
    monkeypatch.setenv("FAKE_PULUMI_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_LFS_STATE", str(tmp_path / "lfs-state.json"))
    monkeypatch.setenv("FAKE_LFS_PYTHON", sys.executable)
    monkeypatch.delenv("FAKE_LFS_DEFAULT_FLAGS", raising=False)
    monkeypatch.setenv("PATH", f"{BIN}:{__import__('os').environ.get('PATH', '')}")
    project = tmp_path / "project"
    project.mkdir()
    # Auto-export keeps iterating while enabled, as on AMLFS (the gate without --lustre-root waits
    # for two iterations that started after the teardown began).
    arm_env.scenario.iterate_on_get = True
    e = Env(arm_env, conn, container, state, tmp_path / "lustrefs", tmp_path / "journal", project)
    (e.mount / "checkpoints").mkdir(parents=True)

    # One event log across ARM and pulumi, to assert the order of the steps.
    import tiered_ckpt.tiers.arm as arm
    import tiered_ops.pulumi_cli as pc

    orig_disable, orig_capture, orig_stream = arm.AmlfsJobs.disable_autoexport, pc.PulumiCli.capture, pc.PulumiCli.stream

    def disable(self: Any, *a: Any, **k: Any) -> Any:
        e.events.append("disable-autoexport")
        return orig_disable(self, *a, **k)

    def capture(self: Any, *a: str, **k: Any) -> Any:
        e.events.append("pulumi " + " ".join(a))
        return orig_capture(self, *a, **k)

    def stream(self: Any, *a: str) -> Any:
        e.events.append("pulumi " + " ".join(a))
        return orig_stream(self, *a)

    monkeypatch.setattr(arm.AmlfsJobs, "disable_autoexport", disable)
    monkeypatch.setattr(pc.PulumiCli, "capture", capture)
    monkeypatch.setattr(pc.PulumiCli, "stream", stream)
    yield e


def now() -> datetime:
    return datetime.now(timezone.utc)


def later(seconds: float = 60) -> datetime:
    return now() + timedelta(seconds=seconds)


def archived_ckpts(env: Env, n: int = 2) -> list[str]:
    """n committed checkpoints on 'Lustre', all exported, auto-export caught up after them."""
    names = []
    for i in range(1, n + 1):
        d = env.write_ckpt(1, 10 * i)
        env.archive(d)
        names.append(f"llama/{d.name}")
    env.last_success(later())
    return names
