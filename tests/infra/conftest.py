"""Helpers for the infrastructure tests: run the real program under Pulumi mocks (tiered_ops.mockrun)."""
from __future__ import annotations

import base64
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from components.node import cloud_init
from tiered_ckpt.config import AmlfsConfig, ArchiveConfig, NodeConfig, RetentionConfig
from tiered_ops import mockrun

ROOT = Path(__file__).resolve().parents[2]

# A well-formed OpenSSH public key (the private half was never kept); public keys are not secrets.
SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB3q0iP7c4k5o4S8m6Yt2m1pVdQ3xY9kq7f1mZl0aB2c ops@example"

Plan = Callable[..., mockrun.PreviewResult]


@pytest.fixture
def plan() -> Plan:
    """plan(stack, key=value, ...) -> a fresh run of __main__.py under mocks with those overrides."""

    def run(stack: str, **overrides: object) -> mockrun.PreviewResult:
        sets = {"sshPublicKey": SSH_KEY, **{k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in overrides.items()}}
        return mockrun.run(stack, sets, preview_placeholders=False)

    return run


def custom_data(p: mockrun.PreviewResult) -> bytes:
    """The ND nodes' custom data."""
    vmss = p.one("azure-native:compute:VirtualMachineScaleSet")
    return base64.b64decode(vmss.inputs["virtualMachineProfile"]["osProfile"]["customData"])


def login_data(p: mockrun.PreviewResult) -> bytes:
    return base64.b64decode(p.one("azure-native:compute:VirtualMachine", "login").inputs["osProfile"]["customData"])


def schema_check(text: bytes, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("cloud-init")
    assert exe, "cloud-init is not installed (make install puts it there: apt-get install cloud-init)"
    f = tmp_path / "user-data.yaml"
    f.write_bytes(text)
    return subprocess.run([exe, "schema", "--config-file", str(f)], capture_output=True, text=True, timeout=60)


def node_inputs(*, model: str = "llama3-70b", action: str = "release",
                identity_client_id: str = "00000000-0000-0000-0000-000000000001", **over: object) -> cloud_init.NodeInputs:
    """One VM's inputs with long names everywhere (the largest documents). The config is not validated, so a
    test can hand the boot a value the toolkit would refuse."""
    config = NodeConfig(
        root="/lustrefs/checkpoints", model=model, backend="amlfs", nodes=100,
        archive=ArchiveConfig(account_url="https://a.blob.core.windows.net", container="checkpoints", prefix="checkpoints",
                              managed_identity_client_id=identity_client_id),
        amlfs=AmlfsConfig(mount=cloud_init.MOUNT, subscription_id="s" * 36, resource_group="r" * 90, filesystem="f" * 80,
                          autoexport_job="j" * 80, provisioned_gbps=384.0),
        retention=RetentionConfig(keep_last=10, keep_every_steps=1000, min_keep=5, action=action))
    base: dict[str, object] = dict(config=config, mgs_address="10.42.0.4", schedule="*:0/15",
                                   tools_url="https://t.blob.core.windows.net/tools/" + "x" * 200, tools_sha256="a" * 64)
    base.update(over)
    return cloud_init.NodeInputs(**base)  # type: ignore[arg-type]
