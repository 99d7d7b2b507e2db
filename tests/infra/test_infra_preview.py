"""The offline preview shows what a reviewer checks before `pulumi up`: NSG rules with ports, the InfiniBand VMSS settings."""
from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tiered_ops import mockrun

from .conftest import SSH_KEY

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_preview_json_shows_nsg_ports_both_ways_and_the_scale_set_fabric_settings() -> None:
    r = subprocess.run([sys.executable, "-m", "tiered_ops.preview", "--stack", "prod", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=80)
    assert r.returncode == 0, r.stderr
    props = {x["name"]: x["properties"] for x in json.loads(r.stdout)["resources"]}
    amlfs_nsg, compute_nsg = props["tiered-net-amlfs-nsg"], props["tiered-net-compute-nsg"]
    assert "(I111 Allow Tcp 10.42.4.0/22->10.42.0.0/24:988,1019-1023)" in amlfs_nsg
    assert "(O108 Allow Tcp 10.42.0.0/24->10.42.4.0/22:988,1019-1023)" in amlfs_nsg
    assert "(I100 Allow Tcp 10.42.0.0/24->10.42.4.0/22:988,1019-1023)" in compute_nsg
    assert "(O100 Allow Tcp 10.42.4.0/22->10.42.0.0/24:988,1019-1023)" in compute_nsg
    assert "(I4000 Deny Tcp *->*:22)" in compute_nsg
    # The file system subnet: Microsoft's rule set, then deny everything else both ways.
    for shown in ("deny-all-in(I120 Deny * *->*:*)", "deny-all-out(O1010 Deny * *->*:*)",
                  "https-out-to-storage(O103 Allow Tcp VirtualNetwork->Storage.EastUS:443)",
                  "ntp-out-to-microsoft(O109 Allow Udp 10.42.0.0/24->168.61.215.74/32:123)"):
        assert shown in amlfs_nsg, shown
    assert "rootSquash=RootOnly" in props["tiered-amlfs-fs"]
    # SSH from the Bastion subnet only (plus the cluster's own subnet: login VM -> nodes).
    assert "ssh-in-from-bastion(I110 Allow Tcp 10.42.1.0/26->10.42.4.0/22:22)" in compute_nsg
    assert "cluster-in-within-compute(I120 Allow * 10.42.4.0/22->10.42.4.0/22:0-65535)" in compute_nsg
    assert "deny-other-vnet-in(I4096 Deny * VirtualNetwork->*:*)" in compute_nsg
    assert "name=tckpt-prod-bastion  sku=Standard  nativeClient=True" in props["tiered-bastion-host"]
    assert "rbac=True  network=Deny  subnets=1" in props["tiered-gpu-vault"]
    assert "privateIp=10.42.4.4  allocation=Static  publicIp=False" in props["tiered-gpu-login-nic"]
    for shown in ("size=Standard_D8s_v5", "zones=1", "image=microsoft-dsvm:ubuntu-hpc:2404", "passwordAuth=False"):
        assert shown in props["tiered-gpu-login"], shown
    vmss = props["tiered-gpu-vmss"]
    for shown in ("singlePlacementGroup=True", "faultDomains=1", "overprovision=False", "acceleratedNetworking=True",
                  "image=microsoft-dsvm:ubuntu-hpc:2404", "passwordAuth=False", "publicIp=False"):
        assert shown in vmss, shown


@pytest.mark.timeout(90)
def test_preview_text_prints_the_way_in() -> None:
    r = subprocess.run([sys.executable, "-m", "tiered_ops.preview", "--stack", "prod"],
                       capture_output=True, text=True, cwd=ROOT, timeout=80)
    assert r.returncode == 0, r.stderr
    assert ("way in (bastion): az network bastion ssh --name tckpt-prod-bastion --resource-group tckpt-prod-compute-rg "
            "--target-resource-id /subscriptions/") in r.stdout
    assert "tiered:access:Bastion  tiered-bastion" in r.stdout and "compute:VirtualMachine " in r.stdout


def _q(doc: Any, path: str) -> list[Any]:
    """A jq-like selector over the preview JSON: 'a.b[].c' (a [] fans out over a list)."""
    items = [doc]
    for part in path.split("."):
        fan = part.endswith("[]")
        key = part.removesuffix("[]")
        items = [x.get(key) for x in items if isinstance(x, dict) and key in x]
        if fan:
            items = [y for x in items for y in (x or [])]
    return items


@pytest.mark.timeout(120)
def test_preview_json_has_structured_inputs_and_the_decoded_cloud_init_with_placeholders_labelled() -> None:
    r = subprocess.run([sys.executable, "-m", "tiered_ops.preview", "--stack", "prod", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=110)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    steps = {s["name"]: s for s in doc["steps"]}
    # Inputs as `pulumi preview --json` shows them: nested objects, whole numbers as numbers.
    fs = next(s for s in doc["steps"] if s["type"] == "azure-native:storagecache:AmlFilesystem")
    assert fs["op"] == "create" and fs["inputs"]["storageCapacityTiB"] == 128 and isinstance(fs["inputs"]["storageCapacityTiB"], int)
    assert _q(fs, "inputs.hsm.settings.importPrefix") == ["/checkpoints"]
    blob = steps["tiered-gpu-toolkit"]
    assert blob["retainOnDelete"] is True and blob["inputs"]["source"]["asset"] == "FileAsset"
    # The boot script of the scale set, as jq would pull it out, decoded and parsed.
    vmss = next(c for c in doc["cloudInit"] if c["type"] == "azure-native:compute:VirtualMachineScaleSet")
    assert vmss["input"] == "virtualMachineProfile.osProfile.customData"
    boot = [f["content"] for f in _q(vmss, "cloudConfig.write_files[]") if f["path"] == "/etc/tiered-ckpt/boot.env"]
    lib = [f["content"] for f in _q(vmss, "cloudConfig.write_files[]") if f["path"] == "/usr/local/lib/tiered-ckpt/boot-common.sh"]
    assert len(boot) == 1 and "x-systemd.automount" in boot[0] and len(lib) == 1 and "--require-hashes" in lib[0]
    # The step shows the custom data by size and hash (no long base64 run in plan output); the decoded text
    # is those bytes: the program's own customData, decoded here independently.
    shown = _q(steps["tiered-gpu-vmss"], "inputs.virtualMachineProfile.osProfile.customData")[0]
    assert shown["bytes"] == vmss["bytes"] == len(vmss["text"].encode()) and shown["sha256"] == vmss["sha256"]
    real = mockrun.run("prod").one("azure-native:compute:VirtualMachineScaleSet")
    assert base64.b64decode(real.inputs["virtualMachineProfile"]["osProfile"]["customData"]).decode() == vmss["text"]
    assert {c["name"] for c in doc["cloudInit"]} == {"tiered-gpu-vmss", "tiered-gpu-login"}
    # What the mocks invented is labelled, and each boot script says which of those it holds.
    labels = {p["label"]: p for p in doc["placeholders"]}
    assert labels["mgsAddress"]["value"] == "10.42.0.4" and "known only once AMLFS exists" in labels["mgsAddress"]["what"]
    assert f"MGS={labels['mgsAddress']['value']}\n" in boot[0]
    assert "mgsAddress" in vmss["placeholders"] and "tiered-gpu-identity.clientId" in vmss["placeholders"]
    assert all(s["urn"].startswith("urn:pulumi:prod::") for s in doc["steps"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("stack", "nodes"), [
    ("dev", "tiered-gpu-vmss        scale set (ND nodes) Standard_ND96amsr_A100_v4    securityType=Standard  secureBoot=off  vTPM=off  lustreClient=dkms"),
    ("prod", "tiered-gpu-vmss        scale set (ND nodes) Standard_ND96isr_H100_v5     securityType=TrustedLaunch  secureBoot=off  vTPM=on  lustreClient=dkms"),
])
def test_preview_shows_each_vms_security_type_secure_boot_and_lustre_client_path(stack: str, nodes: str,
                                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from tiered_ops import preview

    assert preview.main(["--stack", stack, "--set", f"sshPublicKey={SSH_KEY}"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "per VM (security profile as sent; boot path that goes with it):" in lines
    assert "  " + nodes in lines
    assert ("  tiered-gpu-login       login VM             Standard_D8s_v5              securityType=TrustedLaunch  "
            "secureBoot=off  vTPM=on  lustreClient=dkms") in lines
    assert "MISMATCH" not in out
    why = "NDm_A100_v4-series currently not supported" if stack == "dev" else "ND-family supported"
    assert any(line.strip().startswith("why: Standard_ND96") and why in line for line in lines)
