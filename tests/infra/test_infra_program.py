"""The real program under Pulumi mocks, both stacks: every resource and its security-relevant properties."""
from __future__ import annotations

import base64

import pytest

from components.resources.identity import STORAGE_ACCOUNT_CONTRIBUTOR, STORAGE_BLOB_DATA_CONTRIBUTOR
from tiered_ops import mockrun

from .conftest import SSH_KEY, Plan

pytestmark = pytest.mark.timeout(120)

SUB = mockrun.MOCK_SUBSCRIPTION
STACKS = ["prod", "dev"]
T = "azure-native:"


# The node identity's whole permission set, written here literally (not read from the code's own
# constants) so that widening it in the program fails this test. Built-in role ids from
# https://learn.microsoft.com/azure/role-based-access-control/built-in-roles
ALLOWED_NODE_ACTIONS = [
    "Microsoft.StorageCache/amlFilesystems/read",
    "Microsoft.StorageCache/amlFilesystems/importJobs/read",
    "Microsoft.StorageCache/amlFilesystems/importJobs/write",
    "Microsoft.StorageCache/amlFilesystems/autoExportJobs/read",
    "Microsoft.StorageCache/amlFilesystems/autoExportJobs/write",
]
BLOB_DATA_READER = "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1"      # Storage Blob Data Reader
VAULT_SECRETS_USER = "4633458b-17de-408a-b874-0445c86b69e6"    # Key Vault Secrets User


def role_id(guid: str) -> str:
    return f"/subscriptions/{SUB}/providers/Microsoft.Authorization/roleDefinitions/{guid}"


def component_of(p: mockrun.PreviewResult, r: mockrun.Res) -> str:
    return p.by_urn(r.parent).type if r.parent else ""


@pytest.mark.parametrize("stack", STACKS)
def test_every_resource_is_parented_to_a_component_with_derived_names(plan: Plan, stack: str) -> None:
    p = plan(stack)
    components = {r.type for r in p.resources if not r.custom}
    assert components == {"tiered:platform:Platform", "tiered:network:Network", "tiered:storage:CoreStorage",
                          "tiered:accelerator:Accelerator", "tiered:cluster:Cluster", "tiered:access:Bastion"}
    for r in p.resources:
        if r.type == "tiered:platform:Platform":
            continue
        parent = p.by_urn(r.parent)
        assert not parent.custom, f"{r.name} is parented to a custom resource"
        assert r.name.startswith(parent.name + "-"), f"{r.name} not derived from its component {parent.name}"


@pytest.mark.parametrize("stack", STACKS)
def test_resource_groups_split_archive_from_compute(plan: Plan, stack: str) -> None:
    p = plan(stack)
    groups = {r.inputs["resourceGroupName"]: r for r in p.of_type(T + "resources:ResourceGroup")}
    storage_rg, compute_rg = f"tckpt-{stack}-storage-rg", f"tckpt-{stack}-compute-rg"
    assert set(groups) == {storage_rg, compute_rg}
    assert groups[storage_rg].protect and not groups[compute_rg].protect
    for r in p.resources:
        if not r.custom or "resourceGroupName" not in r.inputs or r.type.endswith("ResourceGroup"):
            continue
        expected = storage_rg if component_of(p, r) == "tiered:storage:CoreStorage" else compute_rg
        assert r.inputs["resourceGroupName"] == expected, r.name
    assert p.outputs["storageResourceGroup"] == storage_rg and p.outputs["computeResourceGroup"] == compute_rg


@pytest.mark.parametrize("stack", STACKS)
def test_storage_account_is_locked_down_but_keeps_shared_key(plan: Plan, stack: str) -> None:
    p = plan(stack)
    acct = p.one(T + "storage:StorageAccount", "archive")
    i = acct.inputs
    assert i["kind"] == "StorageV2" and i["enableHttpsTrafficOnly"] is True and i["minimumTlsVersion"] == "TLS1_2"
    assert i["allowBlobPublicAccess"] is False
    assert i["allowSharedKeyAccess"] is True          # AMLFS mints SAS tokens with the account key
    rules = i["networkRuleSet"]
    assert rules["defaultAction"] == "Deny" and rules["bypass"] == "AzureServices" and rules["ipRules"] == []
    subnet_ids = {s.id for s in p.of_type(T + "network:Subnet") if "bastion" not in s.name}
    assert {v["virtualNetworkResourceId"] for v in rules["virtualNetworkRules"]} == subnet_ids and len(subnet_ids) == 2
    for s in p.of_type(T + "network:Subnet"):
        if "bastion" in s.name:
            continue
        assert {"service": "Microsoft.Storage"} in s.inputs["serviceEndpoints"]
    assert acct.protect
    svc = p.one(T + "storage:BlobServiceProperties")
    assert svc.inputs["deleteRetentionPolicy"]["enabled"] is True and svc.inputs["deleteRetentionPolicy"]["days"] >= 1


@pytest.mark.parametrize("stack", STACKS)
def test_containers_are_private_distinct_and_in_the_same_account(plan: Plan, stack: str) -> None:
    p = plan(stack)
    acct = p.one(T + "storage:StorageAccount", "archive")
    data, logs = p.one(T + "storage:BlobContainer", "archive-data"), p.one(T + "storage:BlobContainer", "archive-logs")
    assert data.inputs["containerName"] != logs.inputs["containerName"]
    for c in (data, logs):
        assert c.inputs["publicAccess"] == "None"
        assert c.inputs["accountName"] == acct.state["name"]
        assert c.id.startswith(acct.id + "/blobServices/default/containers/")
    hsm = p.one(T + "storagecache:AmlFilesystem").inputs["hsm"]["settings"]
    assert hsm["container"] == data.id and hsm["loggingContainer"] == logs.id
    assert p.outputs["dataContainerId"] == data.id and p.outputs["dataContainer"] == "checkpoints"


@pytest.mark.parametrize("stack", STACKS)
def test_lifecycle_policy_targets_the_checkpoint_prefix(plan: Plan, stack: str) -> None:
    p = plan(stack)
    policy = p.one(T + "storage:ManagementPolicy")
    rule = policy.inputs["policy"]["rules"][0]
    assert rule["definition"]["filters"]["prefixMatch"] == ["checkpoints/checkpoints/"]   # <container>/<prefix>/
    actions = rule["definition"]["actions"]["baseBlob"]
    cfg = p.config
    assert "delete" not in actions      # tiering only: an age-based delete would expire the newest checkpoints
    if int(cfg["tiered:coolAfterDays"]):
        assert actions["tierToCool"]["daysAfterModificationGreaterThan"] == int(cfg["tiered:coolAfterDays"])
    else:
        assert "tierToCool" not in actions


@pytest.mark.parametrize("stack", STACKS)
def test_rp_roles_on_the_account_then_a_wait_before_the_file_system(plan: Plan, stack: str) -> None:
    p = plan(stack)
    acct = p.one(T + "storage:StorageAccount", "archive")
    grants = [r for r in p.of_type(T + "authorization:RoleAssignment") if "-rp-" in r.name]
    assert sorted(g.inputs["roleDefinitionId"] for g in grants) == sorted([role_id(STORAGE_ACCOUNT_CONTRIBUTOR), role_id(STORAGE_BLOB_DATA_CONTRIBUTOR)])
    for g in grants:
        assert g.inputs["scope"] == acct.id                     # the account, not the group or subscription
        assert g.inputs["principalId"] == mockrun.MOCK_RP_OBJECT_ID and g.inputs["principalType"] == "ServicePrincipal"
    # The object ID comes from Entra ID by the provider's well-known appId (it differs per tenant).
    assert ("azuread:index/getServicePrincipal:getServicePrincipal", {"clientId": "4392ab71-2ce2-4b0d-8770-b352745c73f5"}) in p.invokes
    sleep = p.one("time:index/sleep:Sleep")
    assert sleep.inputs["createDuration"] == "5m"
    fs = p.one(T + "storagecache:AmlFilesystem")
    assert all(p.depends_on(sleep, g) for g in grants)
    assert p.depends_on(fs, sleep)


def test_rp_object_id_and_wait_are_overridable(plan: Plan) -> None:
    oid = "11111111-2222-3333-4444-555555555555"
    p = plan("dev", rpPrincipalObjectId=oid, roleWaitDuration="90s")
    assert {g.inputs["principalId"] for g in p.of_type(T + "authorization:RoleAssignment") if "-rp-" in g.name} == {oid}
    assert not any(tok.startswith("azuread:") for tok, _ in p.invokes)
    assert p.one("time:index/sleep:Sleep").inputs["createDuration"] == "90s"


@pytest.mark.parametrize("stack", STACKS)
def test_file_system_settings(plan: Plan, stack: str) -> None:
    p = plan(stack)
    fs = p.one(T + "storagecache:AmlFilesystem")
    i, cfg = fs.inputs, p.config
    assert i["sku"]["name"] == cfg["tiered:sku"] and i["storageCapacityTiB"] == float(cfg["tiered:capacityTiB"])
    assert i["zones"] == [cfg["tiered:zone"]]
    assert i["filesystemSubnet"] == p.one(T + "network:Subnet", "amlfs").id
    assert i["maintenanceWindow"] == {"dayOfWeek": "Sunday", "timeOfDayUTC": "02:00"}
    assert i["rootSquashSettings"]["mode"] == "RootOnly"      # test_infra_security checks the trusted NIDs
    assert i["hsm"]["settings"]["importPrefix"] == "/checkpoints"
    assert fs.timeouts["create"] == "90m" and fs.timeouts["delete"] == "60m"
    expected = {"prod": 64.0, "dev": 2.0}[stack]
    assert p.outputs["provisionedGBps"] == expected and p.outputs["sizing"]["provisioned_gbps"] == expected
    assert p.outputs["mgsAddress"] == mockrun.MOCK_MGS and "@tcp:/lustrefs" in p.outputs["mountCommand"]


def test_root_squash_is_configurable(plan: Plan) -> None:
    p = plan("dev", rootSquash="RootOnly", rootSquashTrustedNids="10.43.4.[4-254]@tcp")
    squash = p.one(T + "storagecache:AmlFilesystem").inputs["rootSquashSettings"]
    assert squash["mode"] == "RootOnly" and squash["noSquashNidLists"] == "10.43.4.[4-254]@tcp" and squash["squashUID"] == 65534


@pytest.mark.parametrize("stack", STACKS)
def test_auto_export_exports_exactly_the_imported_prefix(plan: Plan, stack: str) -> None:
    p = plan(stack)
    fs, job = p.one(T + "storagecache:AmlFilesystem"), p.one(T + "storagecache:AutoExportJob")
    assert job.inputs["autoExportPrefixes"] == [fs.inputs["hsm"]["settings"]["importPrefix"]]
    assert job.inputs["adminStatus"] == "Enable"
    assert job.inputs["amlFilesystemName"] == fs.state["name"] == p.outputs["amlfsName"]
    assert p.outputs["autoExportJobName"] == job.inputs["autoExportJobName"]
    wait = p.one(mockrun.WAIT_TYPE)
    assert p.depends_on(job, wait) and p.depends_on(wait, fs)


@pytest.mark.parametrize("stack", STACKS)
def test_network_lustre_ports_ssh_prefix_and_no_public_ip(plan: Plan, stack: str) -> None:
    p = plan(stack, sshSourcePrefix="203.0.113.0/24", access="public-ip")
    cfg = p.config
    amlfs_cidr, compute_cidr = cfg["tiered:amlfsSubnetCidr"], cfg["tiered:computeSubnetCidr"]
    nsgs = {r.name.rsplit("-", 2)[-2]: r.inputs["securityRules"] for r in p.of_type(T + "network:NetworkSecurityGroup")}

    def allows(rules: list[dict], direction: str, src: str, dst: str, port: str) -> bool:
        return any(r["access"] == "Allow" and r["direction"] == direction and r["sourceAddressPrefix"] == src
                   and r["destinationAddressPrefix"] == dst and port in (r.get("destinationPortRanges") or [r.get("destinationPortRange")]) for r in rules)

    for port in ("988", "1019-1023"):
        assert allows(nsgs["amlfs"], "Inbound", compute_cidr, amlfs_cidr, port)
        assert allows(nsgs["compute"], "Inbound", amlfs_cidr, compute_cidr, port)
        assert allows(nsgs["compute"], "Outbound", compute_cidr, amlfs_cidr, port)
        assert allows(nsgs["amlfs"], "Outbound", amlfs_cidr, compute_cidr, port)
    assert allows(nsgs["amlfs"], "Inbound", amlfs_cidr, amlfs_cidr, "*")     # any port within the subnet, SSH among them
    ssh_in = [r for r in nsgs["compute"] if r["direction"] == "Inbound" and "22" in (r.get("destinationPortRanges") or [r.get("destinationPortRange")])]
    allowed = [r for r in ssh_in if r["access"] == "Allow"]
    assert [r["sourceAddressPrefix"] for r in allowed] == ["203.0.113.0/24"]
    deny = [r for r in ssh_in if r["access"] == "Deny"]
    assert deny and all(d["priority"] > a["priority"] for d in deny for a in allowed)
    vmss = p.one(T + "compute:VirtualMachineScaleSet")
    for nic in vmss.inputs["virtualMachineProfile"]["networkProfile"]["networkInterfaceConfigurations"]:
        for ip in nic["ipConfigurations"]:
            assert "publicIPAddressConfiguration" not in ip
            assert ip["subnet"]["id"] == p.one(T + "network:Subnet", "compute").id
    # Outbound without node public IPs: the NAT gateway's, on both subnets; the login VM's is the only other.
    assert sorted(r.name for r in p.of_type(T + "network:PublicIPAddress")) == ["tiered-gpu-login-ip", "tiered-net-nat-ip"]
    nat = p.one(T + "network:NatGateway")
    for s in p.of_type(T + "network:Subnet"):
        assert s.inputs["natGateway"]["id"] == nat.id and s.inputs["defaultOutboundAccess"] is False


@pytest.mark.parametrize("stack", STACKS)
def test_subnets_and_zones_align(plan: Plan, stack: str) -> None:
    p = plan(stack)
    zone = p.config["tiered:zone"]
    assert p.one(T + "network:Subnet", "amlfs").inputs["addressPrefix"] == p.config["tiered:amlfsSubnetCidr"]
    assert p.one(T + "storagecache:AmlFilesystem").inputs["zones"] == [zone]
    assert p.one(T + "compute:VirtualMachineScaleSet").inputs["zones"] == [zone]
    assert p.one(T + "network:NatGateway").inputs["zones"] == [zone]


@pytest.mark.parametrize("stack", STACKS)
def test_scale_set_is_one_infiniband_fabric_with_ssh_key_only(plan: Plan, stack: str) -> None:
    p = plan(stack)
    vmss = p.one(T + "compute:VirtualMachineScaleSet")
    i = vmss.inputs
    assert i["sku"]["name"] == p.config["tiered:vmSize"] and i["sku"]["name"].startswith("Standard_ND")
    assert i["sku"]["capacity"] == int(p.config["tiered:nodeCount"]) == p.outputs["nodeCount"]
    assert i["singlePlacementGroup"] is True and i["platformFaultDomainCount"] == 1 and i["overprovision"] is False
    assert i["orchestrationMode"] == "Uniform"
    vm = i["virtualMachineProfile"]
    assert vm["storageProfile"]["imageReference"] == {"publisher": "microsoft-dsvm", "offer": "ubuntu-hpc", "sku": "2404", "version": "latest"}
    linux = vm["osProfile"]["linuxConfiguration"]
    assert linux["disablePasswordAuthentication"] is True and "adminPassword" not in vm["osProfile"]
    assert [k["keyData"] for k in linux["ssh"]["publicKeys"]] == [SSH_KEY]
    assert vm["networkProfile"]["networkInterfaceConfigurations"][0]["enableAcceleratedNetworking"] is True
    uami = p.one(T + "managedidentity:UserAssignedIdentity", "gpu-identity")
    assert i["identity"] == {"type": "UserAssigned", "userAssignedIdentities": [uami.id]}
    assert base64.b64decode(vm["osProfile"]["customData"]).startswith(b"#cloud-config\n")


@pytest.mark.parametrize("stack", STACKS)
def test_node_identity_has_least_privilege(plan: Plan, stack: str) -> None:
    p = plan(stack)
    uami = p.one(T + "managedidentity:UserAssignedIdentity", "gpu-identity")
    mine = [r for r in p.of_type(T + "authorization:RoleAssignment") if r.inputs["principalId"] == uami.state["principalId"]]
    data = p.one(T + "storage:BlobContainer", "archive-data")
    tools = p.one(T + "storage:BlobContainer", "tools")
    fs = p.one(T + "storagecache:AmlFilesystem")
    role = p.one(T + "authorization:RoleDefinition")
    vault = p.one(T + "keyvault:Vault")
    got = sorted((r.inputs["scope"], r.inputs["roleDefinitionId"]) for r in mine)
    assert got == sorted([(data.id, role_id(BLOB_DATA_READER)), (tools.id, role_id(BLOB_DATA_READER)), (fs.id, role.id),
                          (vault.id, role_id(VAULT_SECRETS_USER))])
    perms = role.inputs["permissions"]
    assert len(perms) == 1 and sorted(perms[0]["actions"]) == sorted(ALLOWED_NODE_ACTIONS), perms
    assert not perms[0]["dataActions"] and not perms[0]["notActions"] and not perms[0]["notDataActions"]
    compute_rg_id = p.one(T + "resources:ResourceGroup", "compute").id
    assert role.inputs["assignableScopes"] == [compute_rg_id] and role.inputs["roleType"] == "CustomRole"
    vmss = p.one(T + "compute:VirtualMachineScaleSet")
    assert all(p.depends_on(vmss, g) for g in mine)


@pytest.mark.parametrize("stack", STACKS)
def test_stack_outputs_teardown_and_toolkit_rely_on(plan: Plan, stack: str) -> None:
    p = plan(stack)
    o = p.outputs
    for key in ("subscriptionId", "storageResourceGroup", "computeResourceGroup", "storageAccountName", "storageAccountUrl",
                "dataContainer", "loggingContainer", "dataContainerId", "checkpointPrefix", "computeEnabled", "amlfsName",
                "autoExportJobName", "mgsAddress", "mountCommand", "provisionedGBps", "nodeCount", "sizing"):
        assert o.get(key) not in (None, ""), key
    acct = p.one(T + "storage:StorageAccount", "archive")
    assert o["subscriptionId"] == SUB and o["storageAccountName"] == acct.state["name"]
    assert o["storageAccountUrl"] == f"https://{acct.state['name']}.blob.core.windows.net/"
    assert o["checkpointPrefix"] == "/checkpoints" and o["computeEnabled"] is True
    assert set(o["sizing"]) >= {"provisioned_gbps", "commit_seconds", "archive_seconds", "archive_keeps_up", "resident_tib"}


def test_running_the_program_leaves_the_pickler_as_it_found_it(plan: Plan) -> None:
    # pulumi's dynamic-provider serializer wraps the pickler once per call and never unwraps it
    # (pulumi/pulumi#17803); without the restore, the suite's hundredth run fails in RecursionError.
    import pickle

    before = pickle._Pickler.__dict__["_batch_setitems"]
    p = plan("dev")
    assert p.of_type("pulumi-python:dynamic/tiered:WaitForBlobJobs"), "the program serializes dynamic providers"
    assert pickle._Pickler.__dict__["_batch_setitems"] is before
