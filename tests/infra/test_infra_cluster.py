"""The way in, Slurm and the munge key under the mock runtime: both cluster modes, the three access choices.

What a user depends on: exactly one way in per choice, SSH admitted only from where it should come from,
no public IP on an ND node, the vault in RBAC mode with each identity's role on that vault only, outputs that
are commands to paste, and no secret value anywhere the program writes (custom data, outputs, plan output).
"""
from __future__ import annotations

import base64
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from components.node import cloud_init, slurm_conf
from components.resources.identity import KEY_VAULT_SECRETS_OFFICER, KEY_VAULT_SECRETS_USER
from tiered_ops import mockrun

from .conftest import ROOT, SSH_KEY, Plan, custom_data, login_data

pytestmark = pytest.mark.timeout(180)
T = "azure-native:"
SUB = mockrun.MOCK_SUBSCRIPTION
ADMIN_CIDR = "203.0.113.0/24"
# Base64 key material (munge key: 172 characters) has runs of 40+ characters without a '/'; nothing the
# program writes does, except hex digests (the toolkit's sha256) and the public SSH key.
KEYISH = re.compile(r"[A-Za-z0-9+]{40,}")


def keyish(text: str) -> list[str]:
    return [m for m in KEYISH.findall(text) if not re.fullmatch(r"[0-9a-f]+", m)]


def role_id(guid: str) -> str:
    return f"/subscriptions/{SUB}/providers/Microsoft.Authorization/roleDefinitions/{guid}"


def ssh_rules(p: mockrun.PreviewResult) -> list[dict[str, Any]]:
    nsg = p.one(T + "network:NetworkSecurityGroup", "compute")
    return [r for r in nsg.inputs["securityRules"] if r["direction"] == "Inbound" and "22" in (r.get("destinationPortRanges") or [r.get("destinationPortRange")])]


def public_ips(p: mockrun.PreviewResult) -> list[str]:
    return sorted(r.name for r in p.of_type(T + "network:PublicIPAddress"))


def files_of(raw: bytes) -> dict[str, str]:
    return {f["path"]: f["content"] for f in yaml.safe_load(raw)["write_files"]}


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_bastion_is_the_default_way_in_with_native_client_and_the_exact_command(plan: Plan, stack: str) -> None:
    p = plan(stack)
    host = p.one(T + "network:BastionHost")
    assert host.inputs["sku"] == {"name": "Standard"} and host.inputs["enableTunneling"] is True
    subnet = p.one(T + "network:Subnet", "bastion")
    assert subnet.inputs["subnetName"] == "AzureBastionSubnet"
    assert int(subnet.inputs["addressPrefix"].split("/")[1]) <= 26
    assert "natGateway" not in subnet.inputs and "networkSecurityGroup" not in subnet.inputs
    (ipconf,) = host.inputs["ipConfigurations"]
    assert ipconf["subnet"]["id"] == subnet.id and ipconf["publicIPAddress"]["id"] == p.one(T + "network:PublicIPAddress", "bastion").id
    # SSH only from the Bastion subnet; the cluster's own subnet by its all-ports rule; everything else denied.
    allowed = [r for r in ssh_rules(p) if r["access"] == "Allow"]
    assert [r["sourceAddressPrefix"] for r in allowed] == [subnet.inputs["addressPrefix"]]
    assert any(r["access"] == "Deny" and r["sourceAddressPrefix"] == "*" and r["priority"] > allowed[0]["priority"] for r in ssh_rules(p))
    login = p.one(T + "compute:VirtualMachine", "login")
    o = p.outputs
    assert o["access"] == "bastion" and o["bastionName"] == host.inputs["bastionHostName"]
    assert o["sshCommand"] == (f"az network bastion ssh --name {host.inputs['bastionHostName']} --resource-group {o['computeResourceGroup']}"
                               f" --target-resource-id {login.id} --auth-type ssh-key --username azureuser --ssh-key ~/.ssh/id_ed25519")
    assert public_ips(p) == ["tiered-bastion-ip", "tiered-net-nat-ip"]     # none on the login VM or a node


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_public_ip_is_on_the_login_vm_only_and_ssh_comes_from_the_admin_prefix(plan: Plan, stack: str) -> None:
    p = plan(stack, access="public-ip", sshSourcePrefix=ADMIN_CIDR)
    assert not p.of_type(T + "network:BastionHost") and not [s for s in p.of_type(T + "network:Subnet") if "bastion" in s.name]
    ip = p.one(T + "network:PublicIPAddress", "login")
    assert ip.inputs["sku"]["name"] == "Standard" and ip.inputs["publicIPAllocationMethod"] == "Static"
    nic = p.one(T + "network:NetworkInterface", "login")
    (ipconf,) = nic.inputs["ipConfigurations"]
    assert ipconf["publicIPAddress"]["id"] == ip.id
    assert [r["sourceAddressPrefix"] for r in ssh_rules(p) if r["access"] == "Allow"] == [ADMIN_CIDR]
    assert p.outputs["sshCommand"] == f"ssh -i ~/.ssh/id_ed25519 azureuser@{mockrun.MOCK_PUBLIC_IP}"
    assert p.outputs["loginPublicIp"] == mockrun.MOCK_PUBLIC_IP and p.outputs["bastionName"] is None


@pytest.mark.parametrize("access", ["bastion", "public-ip", "none"])
def test_nd_nodes_never_get_a_public_ip(plan: Plan, access: str) -> None:
    p = plan("prod", access=access, sshSourcePrefix=ADMIN_CIDR)
    vmss = p.one(T + "compute:VirtualMachineScaleSet")
    for nic in vmss.inputs["virtualMachineProfile"]["networkProfile"]["networkInterfaceConfigurations"]:
        assert all("publicIPAddressConfiguration" not in ip for ip in nic["ipConfigurations"])
    assert not any("gpu" in name and "login" not in name for name in public_ips(p))


def test_access_none_admits_the_vpn_prefix_and_prints_the_private_address(plan: Plan) -> None:
    p = plan("prod", access="none")                # sshSourcePrefix default: VirtualNetwork (VPN/peering)
    assert public_ips(p) == ["tiered-net-nat-ip"]
    assert [r["sourceAddressPrefix"] for r in ssh_rules(p) if r["access"] == "Allow"] == ["VirtualNetwork"]
    assert p.outputs["sshCommand"] == "ssh -i ~/.ssh/id_ed25519 azureuser@10.42.4.4" and p.outputs["loginPrivateIp"] == "10.42.4.4"


def test_login_vm_is_the_controller_in_the_nodes_zone_and_subnet_with_ssh_key_only(plan: Plan) -> None:
    p = plan("prod")
    login = p.one(T + "compute:VirtualMachine", "login")
    i = login.inputs
    assert i["hardwareProfile"]["vmSize"] == "Standard_D8s_v5" and i["zones"] == ["1"]
    linux = i["osProfile"]["linuxConfiguration"]
    assert linux["disablePasswordAuthentication"] is True and "adminPassword" not in i["osProfile"]
    assert [k["keyData"] for k in linux["ssh"]["publicKeys"]] == [SSH_KEY]
    nic = p.one(T + "network:NetworkInterface", "login")
    assert i["networkProfile"]["networkInterfaces"] == [{"id": nic.id, "primary": True}]
    (ipconf,) = nic.inputs["ipConfigurations"]
    assert ipconf["subnet"]["id"] == p.one(T + "network:Subnet", "compute").id
    assert (ipconf["privateIPAllocationMethod"], ipconf["privateIPAddress"]) == ("Static", "10.42.4.4")
    vmss = p.one(T + "compute:VirtualMachineScaleSet")
    assert p.depends_on(vmss, nic)             # the static address is taken before any node's dynamic one
    # The VM carries the node identity (toolkit, archive, retention) and its own (the vault, as officer).
    ids = {r.name: r.id for r in p.of_type(T + "managedidentity:UserAssignedIdentity")}
    assert sorted(i["identity"]["userAssignedIdentities"]) == sorted(ids.values())
    # Azure cannot change customData in place: a new login configuration is a new VM, the old one first (same NIC).
    assert login.replace_on_changes == ["osProfile.customData", "securityProfile"] and login.delete_before_replace
    ev = vmss.inputs["virtualMachineProfile"]["scheduledEventsProfile"]["terminateNotificationProfile"]
    assert ev == {"enable": True, "notBeforeTimeout": "PT10M"}


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_vault_is_rbac_mode_subnet_only_and_each_identity_has_one_role_on_it(plan: Plan, stack: str) -> None:
    p = plan(stack)
    vault = p.one(T + "keyvault:Vault")
    props = vault.inputs["properties"]
    assert props["enableRbacAuthorization"] is True and "accessPolicies" not in props
    assert props["tenantId"] == mockrun.MOCK_TENANT and props["sku"] == {"family": "A", "name": "standard"}
    acl = props["networkAcls"]
    assert acl["defaultAction"] == "Deny" and acl["virtualNetworkRules"] == [{"id": p.one(T + "network:Subnet", "compute").id}]
    assert re.fullmatch(r"[a-z][a-z0-9]{2,23}", vault.inputs["vaultName"])
    assert {"service": "Microsoft.KeyVault"} in p.one(T + "network:Subnet", "compute").inputs["serviceEndpoints"]
    node = p.one(T + "managedidentity:UserAssignedIdentity", "gpu-identity")
    login = p.one(T + "managedidentity:UserAssignedIdentity", "login-identity")
    on_vault = [r for r in p.of_type(T + "authorization:RoleAssignment") if r.inputs["scope"] == vault.id]
    assert sorted((r.inputs["principalId"], r.inputs["roleDefinitionId"]) for r in on_vault) == sorted([
        (node.state["principalId"], role_id(KEY_VAULT_SECRETS_USER)), (login.state["principalId"], role_id(KEY_VAULT_SECRETS_OFFICER))])
    vault_roles = {role_id(KEY_VAULT_SECRETS_USER), role_id(KEY_VAULT_SECRETS_OFFICER)}
    assert all(r.inputs["scope"] == vault.id for r in p.of_type(T + "authorization:RoleAssignment")
               if r.inputs["roleDefinitionId"] in vault_roles)
    # The login identity holds nothing but that role.
    assert [r.inputs["scope"] for r in p.of_type(T + "authorization:RoleAssignment")
            if r.inputs["principalId"] == login.state["principalId"]] == [vault.id]
    assert p.outputs["keyVaultName"] == vault.inputs["vaultName"]


def test_slurm_controller_and_dynamic_nodes_share_one_rendered_config(plan: Plan, tmp_path: Path) -> None:
    p = plan("prod")
    login, node = files_of(login_data(p)), files_of(custom_data(p))
    assert login["/etc/slurm/slurm.conf"] == node["/etc/slurm/slurm.conf"]
    conf = login["/etc/slurm/slurm.conf"]
    assert "SlurmctldHost=tckpt-prod-login(10.42.4.4)" in conf.splitlines()
    assert f"MaxNodeCount={100}" in conf.splitlines()           # the stack's node limit: nodeCount changes nothing here
    assert f"HealthCheckProgram={cloud_init.HEALTHCHECK}" in conf.splitlines()
    assert "GresTypes=gpu" in conf and node["/etc/slurm/gres.conf"] == "Name=gpu File=/dev/nvidia[0-7]\n"
    # ND nodes register themselves as dynamic nodes with 8 GPUs (the options the packaged slurmd unit reads
    # from /etc/default/slurmd); the controller does not run slurmd.
    assert node[cloud_init.SLURMD_DEFAULTS] == "".join(
        ln + "\n" for ln in node[cloud_init.SLURMD_DEFAULTS].splitlines())
    assert "SLURMD_OPTIONS='-Z --conf \"Gres=gpu:8 Feature=ndv5\"'" in node[cloud_init.SLURMD_DEFAULTS]
    assert slurm_conf.node_conf(slurm_conf.SlurmConfInputs("x", "y", 1)) == "Gres=gpu:8 Feature=ndv5"
    assert cloud_init.SLURMD_DEFAULTS not in login
    assert login[cloud_init.BOOTSTRAP] == (cloud_init.SCRIPTS / "bootstrap-login.sh").read_text()
    assert node[cloud_init.BOOTSTRAP] == (cloud_init.SCRIPTS / "bootstrap-node.sh").read_text()
    for raw in (login, node):
        assert f"SLURM_VERSION={slurm_conf.SLURM_VERSION}\n" in raw[cloud_init.BOOT_ENV]
    # Same slurm.conf whatever the node count.
    assert files_of(login_data(plan("prod", nodeCount=40)))["/etc/slurm/slurm.conf"] == conf


def test_each_vm_reads_the_munge_key_from_the_vault_with_its_own_identity(plan: Plan) -> None:
    p = plan("prod")
    vault = p.one(T + "keyvault:Vault").inputs["vaultName"]
    node_id = p.one(T + "managedidentity:UserAssignedIdentity", "gpu-identity").state["clientId"]
    login_id = p.one(T + "managedidentity:UserAssignedIdentity", "login-identity").state["clientId"]
    for raw, client in ((login_data(p), login_id), (custom_data(p), node_id)):
        env = files_of(raw)[cloud_init.BOOT_ENV]
        assert f"VAULT_URL=https://{vault}.vault.azure.net\n" in env and f"VAULT_CLIENT_ID={client}\n" in env
        assert "MUNGE_SECRET=munge-key\n" in env


def test_nodes_get_nccl_health_check_and_event_watcher_and_the_login_gets_retention(plan: Plan) -> None:
    p = plan("prod")
    login, node = files_of(login_data(p)), files_of(custom_data(p))
    nccl = node[cloud_init.NCCL_PROFILE]
    assert "export NCCL_TOPO_FILE=/opt/microsoft/ndv5-topo.xml" in nccl and "export NCCL_IB_PCI_RELAXED_ORDERING=1" in nccl
    assert cloud_init.NCCL_PROFILE not in login
    dev_node = files_of(custom_data(plan("dev")))          # ND A100 v4
    assert "export NCCL_TOPO_FILE=/opt/microsoft/ndv4-topo.xml" in dev_node[cloud_init.NCCL_PROFILE]
    assert cloud_init.HEALTHCHECK in node and cloud_init.HEALTHCHECK not in login
    unit = f"/etc/systemd/system/{cloud_init.EVENTS_UNIT}.service"
    assert unit in node and unit in login           # --drain on nodes only: tests/infra/test_infra_bootstrap.py
    assert f"/etc/systemd/system/{cloud_init.UNIT}.timer" in login and f"/etc/systemd/system/{cloud_init.UNIT}.timer" not in node


def test_training_user_owns_the_checkpoint_tree_setgid_on_every_vm(plan: Plan) -> None:
    # The tree itself is made by scripts/lib/boot-common.sh (executed in test_infra_bootstrap.py).
    p = plan("prod", trainingUser="trainer", trainingGroup="mlteam")
    for raw in (login_data(p), custom_data(p)):
        env = files_of(raw)[cloud_init.BOOT_ENV]
        assert "TRAINING_USER=trainer\n" in env and "TRAINING_GROUP=mlteam\n" in env
        assert f"TRAINING_GID={cloud_init.TRAINING_GID}\n" in env and "LUSTRE_ROOT=/lustrefs/checkpoints\n" in env
        assert "MODEL=default\n" in env
    env = files_of(custom_data(plan("prod")))[cloud_init.BOOT_ENV]
    assert "TRAINING_USER=azureuser\n" in env and "ADMIN_USER=azureuser\n" in env


def test_cluster_mode_none_deploys_storage_and_amlfs_without_vms_and_outputs_a_bootstrap_script(plan: Plan, tmp_path: Path) -> None:
    p = plan("prod", clusterMode="none", sshPublicKey="")       # no VM of ours: no SSH key needed
    for absent in ("compute:VirtualMachine", "compute:VirtualMachineScaleSet", "network:BastionHost", "keyvault:Vault",
                   "network:NetworkInterface"):
        assert not p.of_type(T + absent), absent
    for present in ("storagecache:AmlFilesystem", "storagecache:AutoExportJob", "storage:StorageAccount", "network:Subnet"):
        assert p.of_type(T + present), present
    assert public_ips(p) == ["tiered-net-nat-ip"]
    o = p.outputs
    assert o["clusterMode"] == "none" and o["sshCommand"] is None and o["access"] is None
    assert o["computeSubnetId"] == p.one(T + "network:Subnet", "compute").id
    uami = p.one(T + "managedidentity:UserAssignedIdentity", "gpu-identity")
    assert o["nodeIdentityId"] == uami.id and o["nodeIdentityClientId"] == uami.state["clientId"]
    script = o["nodeBootstrapScript"]
    assert script.startswith("#!/bin/bash\n") and "--retention" in script and "az vmss identity assign" in script
    assert f"MGS={mockrun.MOCK_MGS}\n" in script and "/etc/tiered-ckpt/config.yaml" in script
    assert f"IDENTITY_CLIENT_ID={uami.state['clientId']}\n" in script
    # Their cluster keeps its own scheduler: no Slurm settings, configuration or munge key of ours.
    assert "\nSLURM=0\n" in script and "/etc/slurm/" not in script and cloud_init.MUNGE_KEY_TOOL not in script
    f = tmp_path / "boot.sh"
    f.write_text(script)
    assert subprocess.run(["bash", "-n", str(f)], capture_output=True, timeout=30).returncode == 0
    # The config it installs is the toolkit's own, with this deployment's values.
    cfg = re.search(r"/etc/tiered-ckpt/config.yaml <<'(\w+)'\n(.*?)\n\1\n", script, re.S)
    assert cfg and yaml.safe_load(cfg.group(2))["archive"]["managed_identity_client_id"] == uami.state["clientId"]


def test_bootstrap_script_installs_every_file_and_enables_retention_only_when_asked(plan: Plan, tmp_path: Path) -> None:
    """Run the none-mode script's file-writing part for real (install -D into a scratch root)."""
    script = plan("dev", clusterMode="none").outputs["nodeBootstrapScript"]
    body = script.split("set -euo pipefail\n", 1)[1].rsplit("exec ", 1)[0]
    body = "\n".join(ln for ln in body.splitlines() if not ln.startswith("apt-get "))
    root = tmp_path / "root"
    body = body.replace(" /etc/", f" {root}/etc/").replace(" /usr/", f" {root}/usr/")
    r = subprocess.run(["bash", "-euc", body], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert (root / "etc/tiered-ckpt/config.yaml").is_file()
    assert (root / "etc/systemd/system/tiered-ckpt-retention.timer").is_file()
    boot = root / "usr/local/sbin/tiered-ckpt-bootstrap"
    assert boot.stat().st_mode & 0o777 == 0o755
    text = boot.read_text()
    assert text.splitlines()[-1] == (cloud_init.SCRIPTS / "bootstrap-node.sh").read_text().splitlines()[-1]
    assert '[ "${1:-}" = --retention ] && RETENTION=1' in text and script.endswith('exec /usr/local/sbin/tiered-ckpt-bootstrap "$@"\n')


def test_the_secret_detector_finds_a_munge_key() -> None:
    # Over random 128-byte keys the detector fires 99.4% of the time; a fixed one keeps this test deterministic.
    key = base64.b64encode(random.Random(12).randbytes(128)).decode()
    assert keyish(f"x {key} y")
    assert keyish("/subscriptions/0000/resourceGroups/tckpt-prod-compute-rg/providers/Microsoft.Compute/x " + "ab12" * 16) == []


# The default (slurm + bastion) custom data is schema- and secret-checked in test_infra_cloud_init.py.
@pytest.mark.parametrize(("mode", "access"), [("slurm", "public-ip"), ("none", "bastion")])
def test_no_secret_value_in_custom_data_outputs_or_plan_output(plan: Plan, mode: str, access: str, tmp_path: Path) -> None:
    p = plan("prod", clusterMode=mode, access=access, sshSourcePrefix=ADMIN_CIDR)
    # The program never holds the munge key: no Key Vault secret resource, no generated secret of any kind.
    assert not [r for r in p.resources if r.type in (T + "keyvault:Secret", "random:index/randomPassword:RandomPassword")]
    texts = [json.dumps(p.outputs)]
    for r in p.of_type(T + "compute:VirtualMachine") + p.of_type(T + "compute:VirtualMachineScaleSet"):
        os_profile = r.inputs.get("osProfile") or r.inputs["virtualMachineProfile"]["osProfile"]
        raw = base64.b64decode(os_profile["customData"])
        assert len(raw) <= cloud_init.CUSTOM_DATA_LIMIT
        texts.append(raw.decode())
    run = subprocess.run([sys.executable, "-m", "tiered_ops.preview", "--stack", "prod", "--json", "--set", f"clusterMode={mode}",
                          "--set", f"access={access}", "--set", f"sshSourcePrefix={ADMIN_CIDR}"],
                         capture_output=True, text=True, cwd=ROOT, timeout=150)
    assert run.returncode == 0, run.stderr
    texts.append(run.stdout)
    for text in texts:
        # The public SSH key is the one long base64 run allowed (public by design).
        leftover = text.replace(SSH_KEY.split()[1], "").replace(mockrun.PREVIEW_SSH_KEY.split()[1], "")
        assert keyish(leftover) == []


def test_a100_nodes_register_with_their_own_generation_feature(plan: Plan) -> None:
    """dev's ND A100 v4 nodes are no ndv5: a `--constraint=ndv5` job must not land on them."""
    dev, prod = plan("dev"), plan("prod")
    for p, feature, other in ((dev, "ndv4", "ndv5"), (prod, "ndv5", "ndv4")):
        login, node = files_of(login_data(p)), files_of(custom_data(p))
        conf = login["/etc/slurm/slurm.conf"]
        assert f"NodeSet=gpunodes Feature={feature}" in conf.splitlines()
        assert node["/etc/slurm/slurm.conf"] == conf
        text = "\n".join(node.values())
        assert f"Feature={feature}" in text and f"Feature={other}" not in text
