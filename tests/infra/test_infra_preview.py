"""The offline preview shows what a reviewer checks before `pulumi up`: NSG rules with ports, the InfiniBand VMSS settings."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_preview_json_shows_nsg_ports_both_ways_and_the_scale_set_fabric_settings() -> None:
    r = subprocess.run([sys.executable, "-m", "tiered_ops.preview", "--stack", "prod", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=80)
    assert r.returncode == 0, r.stderr
    props = {x["name"]: x["properties"] for x in json.loads(r.stdout)["resources"]}
    amlfs_nsg, compute_nsg = props["tiered-net-amlfs-nsg"], props["tiered-net-compute-nsg"]
    assert "(I100 Allow Tcp 10.42.4.0/22->10.42.0.0/24:988,1019-1023)" in amlfs_nsg
    assert "(O100 Allow Tcp 10.42.0.0/24->10.42.4.0/22:988,1019-1023)" in amlfs_nsg
    assert "(I100 Allow Tcp 10.42.0.0/24->10.42.4.0/22:988,1019-1023)" in compute_nsg
    assert "(O100 Allow Tcp 10.42.4.0/22->10.42.0.0/24:988,1019-1023)" in compute_nsg
    assert "(I4000 Deny Tcp *->*:22)" in compute_nsg
    # The file system subnet: Microsoft's rule set, then deny everything else both ways.
    for shown in ("deny-all-in(I4096 Deny * *->*:*)", "deny-all-out(O4096 Deny * *->*:*)",
                  "https-out-to-azurecloud(O130 Allow Tcp 10.42.0.0/24->AzureCloud:443)", "ntp-out(O140 Allow Udp 10.42.0.0/24->*:123)"):
        assert shown in amlfs_nsg, shown
    assert "rootSquash=RootOnly" in props["tiered-amlfs-fs"]
    # SSH from the Bastion subnet only (plus the cluster's own subnet: login VM -> nodes).
    assert "ssh-in-from-bastion(I110 Allow Tcp 10.42.1.0/26->10.42.4.0/22:22)" in compute_nsg
    assert "cluster-in-within-compute(I120 Allow * 10.42.4.0/22->10.42.4.0/22:0-65535)" in compute_nsg
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
