"""Security baseline of the real program under Pulumi mocks: the AMLFS subnet's NSG, root squash, Trusted
Launch, the tenant-unique custom role name, tags on every taggable resource, the tools account firewall."""
from __future__ import annotations

import ipaddress
import re
from functools import cache

import pytest

from components.resources.identity import node_role_name
from components.resources.tags import taggable
from components.settings.schema import load
from components.settings.vm_security import vm_security
from tiered_ops import mockrun

from .conftest import SSH_KEY, Plan

pytestmark = pytest.mark.timeout(120)

T = "azure-native:"
SUB = mockrun.MOCK_SUBSCRIPTION


@cache
def prod() -> mockrun.PreviewResult:
    """The prod stack with its defaults (one mock run shared by the read-only tests below)."""
    return mockrun.run("prod", {"sshPublicKey": SSH_KEY}, preview_placeholders=False)


# --- a first-match NSG evaluator, as Azure applies rules: lowest priority number first, then the defaults ---

DEFAULT_RULES = [   # Azure's default rules (Azure docs, "Network security groups: default security rules")
    {"priority": 65000, "direction": "Inbound", "access": "Allow", "protocol": "*", "sourceAddressPrefix": "VirtualNetwork",
     "destinationAddressPrefix": "VirtualNetwork", "destinationPortRange": "*"},
    {"priority": 65000, "direction": "Outbound", "access": "Allow", "protocol": "*", "sourceAddressPrefix": "VirtualNetwork",
     "destinationAddressPrefix": "VirtualNetwork", "destinationPortRange": "*"},
    {"priority": 65001, "direction": "Outbound", "access": "Allow", "protocol": "*", "sourceAddressPrefix": "*",
     "destinationAddressPrefix": "Internet", "destinationPortRange": "*"},
]
# What each test address counts as for service tags: the VNet plus a peered network (VirtualNetwork covers both).
VNET_LIKE = [ipaddress.ip_network("10.42.0.0/16"), ipaddress.ip_network("192.168.0.0/16")]


def _addr_matches(prefix: str, addr: str) -> bool:
    if prefix == "*":
        return True
    if not re.fullmatch(r"[0-9./]+", addr):                 # the query names a service tag
        return prefix in (addr, "Internet")                  # service tags name public Azure addresses
    ip = ipaddress.ip_address(addr)
    if prefix == "VirtualNetwork":
        return any(ip in n for n in VNET_LIKE)
    if prefix == "Internet":
        return not any(ip in n for n in VNET_LIKE)
    return re.fullmatch(r"[0-9./]+", prefix) is not None and ip in ipaddress.ip_network(prefix)


def _ports(rule: dict) -> list[str]:
    """A rule's destination ports: the single-value field or the list (ARM takes '*' only in the former)."""
    single = rule.get("destinationPortRange")
    return [single] if single else list(rule.get("destinationPortRanges") or [])


def _port_matches(ranges: list[str], port: int) -> bool:
    for r in ranges:
        if r == "*":
            return True
        lo, _, hi = r.partition("-")
        if int(lo) <= port <= int(hi or lo):
            return True
    return False


def verdict(rules: list[dict], direction: str, src: str, dst: str, port: int, protocol: str = "Tcp") -> str:
    for r in sorted([*rules, *DEFAULT_RULES], key=lambda r: r["priority"]):
        if (r["direction"] == direction and r["protocol"] in ("*", protocol) and _addr_matches(r["sourceAddressPrefix"], src)
                and _addr_matches(r["destinationAddressPrefix"], dst) and _port_matches(_ports(r), port)):
            return str(r["access"])
    return "Deny"


def amlfs_nsg(p: mockrun.PreviewResult) -> list[dict]:
    return list(p.one(T + "network:NetworkSecurityGroup", "amlfs-nsg").inputs["securityRules"])


def test_amlfs_nsg_ends_in_deny_all_both_ways_below_every_allow() -> None:
    rules = amlfs_nsg(prod())
    for direction, deny_all in (("Inbound", 120), ("Outbound", 1010)):
        mine = [r for r in rules if r["direction"] == direction]
        d = next(r for r in mine if r["sourceAddressPrefix"] == "*" and r["destinationAddressPrefix"] == "*")
        assert (d["priority"], d["access"], d["protocol"], _ports(d)) == (deny_all, "Deny", "*", ["*"]), direction
        assert all(r["priority"] < d["priority"] for r in mine if r is not d)
        assert len({r["priority"] for r in mine}) == len(mine)          # ARM rejects two rules of one priority


# Microsoft's table, row by row (azure-stack-docs azure-managed-lustre/configure-network-security-group.md):
# (direction, priority, ports, protocol, source, destination, action); AMLFS/CLIENT stand for the two subnets.
MICROSOFT_AMLFS_TABLE = [
    ("Inbound", 110, "*", "*", "AMLFS", "AMLFS", "Allow"),
    ("Inbound", 111, "988,1019-1023", "Tcp", "CLIENT", "AMLFS", "Allow"),
    ("Inbound", 112, "*", "Tcp", "AzureMonitor", "VirtualNetwork", "Allow"),
    ("Inbound", 120, "*", "*", "*", "*", "Deny"),
    ("Outbound", 100, "443", "Tcp", "VirtualNetwork", "AzureMonitor", "Allow"),
    ("Outbound", 101, "443", "Tcp", "VirtualNetwork", "AzureKeyVault.{region}", "Allow"),
    ("Outbound", 102, "443", "Tcp", "VirtualNetwork", "AzureActiveDirectory", "Allow"),
    ("Outbound", 103, "443", "Tcp", "VirtualNetwork", "Storage.{region}", "Allow"),
    ("Outbound", 104, "443", "Tcp", "VirtualNetwork", "GuestAndHybridManagement", "Allow"),
    ("Outbound", 105, "443", "Tcp", "VirtualNetwork", "ApiManagement.{region}", "Allow"),
    ("Outbound", 106, "443", "Tcp", "VirtualNetwork", "AzureDataLake", "Allow"),
    ("Outbound", 107, "443", "Tcp", "VirtualNetwork", "AzureResourceManager", "Allow"),
    ("Outbound", 108, "988,1019-1023", "Tcp", "AMLFS", "CLIENT", "Allow"),
    ("Outbound", 109, "123", "Udp", "AMLFS", "168.61.215.74/32", "Allow"),
    ("Outbound", 110, "443", "Tcp", "VirtualNetwork", "20.34.120.0/21", "Allow"),
    ("Outbound", 111, "*", "*", "AMLFS", "AMLFS", "Allow"),
    ("Outbound", 112, "443", "Tcp", "VirtualNetwork", "EventHub", "Allow"),
    ("Outbound", 1000, "*", "*", "VirtualNetwork", "Internet", "Deny"),
    ("Outbound", 1010, "*", "*", "*", "*", "Deny"),
]


@pytest.mark.parametrize(("location", "region"), [("eastus", "EastUS"), ("westeurope", "WestEurope"), ("southeastasia", "SoutheastAsia")])
def test_amlfs_nsg_is_microsofts_table_verbatim_with_the_stacks_region(plan: Plan, location: str, region: str) -> None:
    p = prod() if location == "eastus" else plan("prod", location=location)
    subs = {"AMLFS": p.config["tiered:amlfsSubnetCidr"], "CLIENT": p.config["tiered:computeSubnetCidr"]}
    got = sorted((r["direction"], r["priority"], ",".join(_ports(r)), r["protocol"], r["sourceAddressPrefix"],
                  r["destinationAddressPrefix"], r["access"]) for r in amlfs_nsg(p))
    want = sorted((d, pr, ports, proto, subs.get(src, src), subs.get(dst, dst).format(region=region), act)
                  for d, pr, ports, proto, src, dst, act in MICROSOFT_AMLFS_TABLE)
    assert got == want


def test_amlfs_nsg_admits_exactly_microsofts_rule_set() -> None:
    rules = amlfs_nsg(prod())
    amlfs_host, node, login = "10.42.0.9", "10.42.5.17", "10.42.4.4"
    # Lustre from its clients (the GPU nodes and the login VM), and the servers' callbacks to them.
    for client in (node, login):
        for port in (988, 1019, 1023):
            assert verdict(rules, "Inbound", client, amlfs_host, port) == "Allow"
            assert verdict(rules, "Outbound", amlfs_host, client, port) == "Allow"
        assert verdict(rules, "Inbound", client, amlfs_host, 22) == "Deny"          # SSH into the file system: no
        assert verdict(rules, "Inbound", client, amlfs_host, 1024) == "Deny"
    # Between the file system's own hosts: anything (SSH 22 for cluster deployment among it).
    for port in (22, 988, 8080):
        assert verdict(rules, "Inbound", "10.42.0.10", amlfs_host, port) == "Allow"
        assert verdict(rules, "Outbound", amlfs_host, "10.42.0.10", port) == "Allow"
    # A peered or VPN-connected host (Azure's AllowVnetInBound would admit it): nothing at all.
    for port in (988, 1021, 22):
        assert verdict(rules, "Inbound", "192.168.7.7", amlfs_host, port) == "Deny"
        assert verdict(rules, "Inbound", "10.42.1.5", amlfs_host, port) == "Deny"   # the Bastion subnet is no client
    # Out: HTTPS to the table's service tags (regional ones in the stack's region), Microsoft's NTP server;
    # nothing else to the internet (AzureCloud as a whole is not in the table) or the VNet.
    for tag in ("AzureMonitor", "AzureKeyVault.EastUS", "Storage.EastUS", "ApiManagement.EastUS", "AzureResourceManager", "EventHub"):
        assert verdict(rules, "Outbound", amlfs_host, tag, 443) == "Allow", tag
    assert verdict(rules, "Outbound", amlfs_host, "Storage.WestEurope", 443) == "Deny"
    assert verdict(rules, "Outbound", amlfs_host, "AzureCloud", 443) == "Deny"
    assert verdict(rules, "Outbound", amlfs_host, "168.61.215.74", 123, protocol="Udp") == "Allow"
    assert verdict(rules, "Outbound", amlfs_host, "203.0.113.9", 123, protocol="Udp") == "Deny"
    assert verdict(rules, "Outbound", amlfs_host, "203.0.113.9", 443) == "Deny"
    assert verdict(rules, "Outbound", amlfs_host, "Storage.EastUS", 80) == "Deny"
    assert verdict(rules, "Outbound", amlfs_host, "192.168.7.7", 988) == "Deny"


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_no_nsg_rule_puts_an_asterisk_in_the_port_list(plan: Plan, stack: str) -> None:
    """The Microsoft.Network spec takes '*' only in destinationPortRange (ARM: SecurityRuleInvalidPortRange)."""
    p = prod() if stack == "prod" else plan(stack, access="public-ip", sshSourcePrefix="203.0.113.0/24")
    for nsg in p.of_type(T + "network:NetworkSecurityGroup"):
        for r in nsg.inputs["securityRules"]:
            assert "*" not in (r.get("destinationPortRanges") or []), (nsg.name, r["name"])
            assert bool(r.get("destinationPortRange")) != bool(r.get("destinationPortRanges")), (nsg.name, r["name"])


def test_compute_subnet_admits_the_cluster_and_denies_other_virtual_network_sources() -> None:
    rules = list(prod().one(T + "network:NetworkSecurityGroup", "compute-nsg").inputs["securityRules"])
    node, login, amlfs_host, bastion, peered = "10.42.5.17", "10.42.4.4", "10.42.0.9", "10.42.1.5", "192.168.7.7"
    for port in (6817, 6818, 29500, 41000):             # slurmctld, slurmd, torchrun, an srun/NCCL port
        assert verdict(rules, "Inbound", login, node, port) == "Allow"
        assert verdict(rules, "Inbound", node, login, port) == "Allow"
        for outsider in (peered, bastion, "10.42.2.9"):  # peered/VPN, the Bastion subnet, elsewhere in the VNet
            assert verdict(rules, "Inbound", outsider, node, port) == "Deny", (outsider, port)
            assert verdict(rules, "Inbound", outsider, login, port) == "Deny", (outsider, port)
    assert verdict(rules, "Inbound", amlfs_host, node, 988) == "Allow"      # Lustre callbacks
    assert verdict(rules, "Inbound", amlfs_host, node, 6818) == "Deny"
    assert verdict(rules, "Inbound", bastion, login, 22) == "Allow"         # the way in (access bastion)
    assert verdict(rules, "Inbound", peered, login, 22) == "Deny"


def _expand_nids(nids: str) -> set[str]:
    """Every IPv4 address a noSquashNidLists value names (octets: n or [lo-hi])."""
    out: set[str] = set()
    for nid in nids.split(";"):
        addr, net = nid.split("@")
        assert net == "tcp", nid
        octets = [range(int(m[1]), int(m[2]) + 1) if (m := re.fullmatch(r"\[(\d+)-(\d+)\]", o)) else [int(o)] for o in addr.split(".")]
        out |= {f"{a}.{b}.{c}.{d}" for a in octets[0] for b in octets[1] for c in octets[2] for d in octets[3]}
    return out


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_root_squash_defaults_to_root_only_with_the_compute_subnet_trusted(plan: Plan, stack: str) -> None:
    p = prod() if stack == "prod" else plan(stack)
    squash = p.one(T + "storagecache:AmlFilesystem").inputs["rootSquashSettings"]
    assert squash["mode"] == "RootOnly" and squash["squashUID"] == 65534 and squash["squashGID"] == 65534
    trusted = _expand_nids(squash["noSquashNidLists"])
    compute = ipaddress.ip_network(p.config["tiered:computeSubnetCidr"])
    # Every address Azure can give a VM in the compute subnet keeps root (bootstrap, retention run as root)...
    hosts = {str(a) for a in list(compute)[4:-1]}
    assert hosts <= trusted
    assert p.outputs["loginPrivateIp"] in trusted
    # ...and nothing outside it does: the AMLFS and Bastion subnets, the rest of the VNet, peered networks.
    assert all(ipaddress.ip_address(a) in compute for a in trusted)
    for outsider in (p.config["tiered:amlfsSubnetCidr"], p.config["tiered:bastionSubnetCidr"]):
        assert not any(ipaddress.ip_address(a) in ipaddress.ip_network(outsider) for a in trusted)


def test_explicit_trusted_nids_pass_through_and_bad_ones_are_refused(plan: Plan) -> None:
    p = plan("dev", rootSquashTrustedNids="10.43.4.4@tcp;10.43.4.[6-8]@tcp")
    assert p.one(T + "storagecache:AmlFilesystem").inputs["rootSquashSettings"]["noSquashNidLists"] == "10.43.4.4@tcp;10.43.4.[6-8]@tcp"
    with pytest.raises(mockrun.PreviewError) as err:
        plan("dev", rootSquashTrustedNids="10.43.4.0/24", trustedLaunch="maybe", owner="a/b", toolsUploadCidr="10.1.2.3")
    msg = str(err.value)
    for key in ("tiered:rootSquashTrustedNids", "tiered:trustedLaunch", "tiered:owner", "tiered:toolsUploadCidr"):
        assert key in msg, key                      # every problem at once, each naming its key


def _security(p: mockrun.PreviewResult) -> tuple[dict | None, dict | None]:
    vmss = p.one(T + "compute:VirtualMachineScaleSet").inputs["virtualMachineProfile"].get("securityProfile")
    login = p.one(T + "compute:VirtualMachine", "login").inputs.get("securityProfile")
    return vmss, login


TRUSTED_NO_SECURE_BOOT = {"securityType": "TrustedLaunch", "uefiSettings": {"secureBootEnabled": False, "vTpmEnabled": True}}
STANDARD = {"securityType": "Standard"}


def test_h100_nodes_and_the_login_vm_get_trusted_launch_with_vtpm_and_secure_boot_off() -> None:
    # Secure Boot off: the Ubuntu-HPC image's NVIDIA, DOCA-OFED and Lustre modules are DKMS-built, unsigned.
    assert _security(prod()) == (TRUSTED_NO_SECURE_BOOT, TRUSTED_NO_SECURE_BOOT)
    login = prod().one(T + "compute:VirtualMachine", "login")
    assert "securityProfile" in login.replace_on_changes       # a running VM cannot change its security type


def test_auto_gives_the_a100_v4_nodes_an_explicit_standard_profile(plan: Plan) -> None:
    # trusted-launch.md: NDm_A100_v4 (dev's Standard_ND96amsr_A100_v4) and NDasrA100_v4 "Currently not supported".
    assert _security(plan("dev")) == (STANDARD, TRUSTED_NO_SECURE_BOOT)
    asr = vm_security("Standard_ND96asr_v4", "auto")
    assert (asr.security_type, asr.secure_boot, asr.lustre_client) == ("Standard", False, "dkms")


def test_off_states_standard_on_every_vm_and_on_applies_to_sizes_the_table_does_not_refuse(plan: Plan) -> None:
    assert _security(plan("prod", trustedLaunch="off")) == (STANDARD, STANDARD)
    # A size the table does not know: auto keeps it Standard, on asks for Trusted Launch (the preflight
    # checks ARM's TrustedLaunchDisabled for it at pulumi up); Secure Boot stays off either way.
    unknown = "Standard_ND40rs_v2"
    assert vm_security(unknown, "auto").security_type == "Standard"
    on = vm_security(unknown, "on")
    assert (on.security_type, on.secure_boot, on.vtpm) == ("TrustedLaunch", False, True)
    assert on.boot_env() == {"TIERED_SECURE_BOOT": "false", "TIERED_LUSTRE_CLIENT": "dkms", "TIERED_SECURITY_TYPE": "TrustedLaunch"}


def test_on_with_an_a100_v4_size_is_refused_before_anything_is_created(plan: Plan) -> None:
    with pytest.raises(mockrun.PreviewError) as err:
        plan("dev", trustedLaunch="on")
    msg = str(err.value)
    assert "tiered:trustedLaunch: 'on' asks for Trusted Launch on tiered:vmSize Standard_ND96amsr_A100_v4" in msg
    assert "NDm_A100_v4-series currently not supported" in msg and "set tiered:trustedLaunch auto" in msg
    assert "loginVmSize" not in msg                              # Standard_D8s_v5 supports it


def test_custom_role_name_is_unique_per_subscription_and_stable() -> None:
    s = load(mockrun.stack_config("prod", {"tiered:sshPublicKey": SSH_KEY}), "prod")
    a, b = "11111111-1111-1111-1111-111111111111", "22222222-2222-2222-2222-222222222222"
    assert node_role_name(s, a) != node_role_name(s, b)
    assert node_role_name(s, a) == node_role_name(s, a) == node_role_name(s, a.upper())
    assert len(node_role_name(s, a)) <= 512 and s.base_name in node_role_name(s, a)
    assert prod().one(T + "authorization:RoleDefinition").inputs["roleName"] == node_role_name(s, SUB)


def test_every_taggable_resource_carries_stack_project_and_owner(plan: Plan) -> None:
    assert taggable(T + "network:VirtualNetwork") and not taggable(T + "network:Subnet") and not taggable("time:index/sleep:Sleep")
    for stack, p, owner in (("prod", prod(), "unassigned"), ("dev", plan("dev", owner="ml-platform"), "ml-platform")):
        azure = [r for r in p.resources if r.custom and r.type.startswith(T)]
        tagged = [r for r in azure if taggable(r.type)]
        assert len(tagged) >= 15            # resource groups, accounts, network, AMLFS, identities, VMs, vault...
        for r in tagged:
            assert r.inputs.get("tags") == {"stack": stack, "project": "tiered", "owner": owner}, r.name


def test_tools_account_is_open_only_until_an_upload_address_is_given(plan: Plan) -> None:
    tools = prod().one(T + "storage:StorageAccount", "tools").inputs
    assert tools["networkRuleSet"]["defaultAction"] == "Allow"       # the documented default (docs/deploy.md)
    assert tools["allowBlobPublicAccess"] is False and tools["enableHttpsTrafficOnly"] is True
    for given, rule in (("203.0.113.7/32", "203.0.113.7"), ("203.0.113.0/28", "203.0.113.0/28")):
        p = plan("dev", toolsUploadCidr=given)
        rules = p.one(T + "storage:StorageAccount", "tools").inputs["networkRuleSet"]
        assert rules["defaultAction"] == "Deny" and rules["bypass"] == "None"
        assert rules["ipRules"] == [{"iPAddressOrRange": rule, "action": "Allow"}]
        assert [v["virtualNetworkResourceId"] for v in rules["virtualNetworkRules"]] == [p.one(T + "network:Subnet", "compute").id]
