"""GPU cluster: login/controller VM (slurmctld) + ND-series scale set (slurmd) on one InfiniBand fabric, their
identities, least-privilege roles, the Key Vault holding the munge key, cloud-init.

clusterMode none keeps the identity, its roles and the toolkit blob (an existing cluster's nodes use them)
and creates no VM: the component then offers `bootstrap_script`, run as root on each node of that cluster.

The munge key (shared secret of every munged in the cluster) is created by the login VM at its first boot
and written to the vault with the login VM's own identity (Key Vault Secrets Officer on this vault only);
ND nodes read it with theirs (Key Vault Secrets User on this vault only). So the key exists only in Key
Vault and on the VMs: never in custom data, stack outputs, plan output or Pulumi state (a secret created by
the program would sit in the state, encrypted but there). The vault uses RBAC authorization (no access
policies) and admits only the compute subnet.

The toolkit reaches the nodes as a private blob in a small "tools" account in the compute resource
group (not in the archive account: that account's firewall denies everything but the two subnets, and
`pulumi up` uploads the blob from the operator's machine over the data plane). Nodes fetch it with
their managed identity and check its sha256 from the custom data.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import pulumi
import pulumiverse_time as time
from pulumi_azure_native import compute, keyvault, managedidentity, network, storage

from components.node import cloud_init, slurm_conf
from components.node.config import node_config
from components.node.toolkit import Toolkit
from components.settings.azure import MAX_NODES
from components.settings.schema import SLURM_DIR, Settings
from components.settings.vm_security import STANDARD, VmSecurity

from . import identity
from .core_storage import account_name
from .network import login_private_ip

TOOLS_CONTAINER = "tools"
# securityType "Standard": not in the SDK's SecurityTypes enum (TrustedLaunch, ConfidentialVM), but the value
# Microsoft gives to "explicitly bypass default" Trusted Launch (azure-compute-docs
# articles/virtual-machines/trusted-launch.md, "Trusted Launch as default", "New behavior").
STANDARD_SECURITY_TYPE = STANDARD
# Microsoft's Ubuntu-HPC 24.04 image on both VM kinds: its Slurm (Ubuntu 24.04's 23.11) has dynamic nodes
# (Slurm 22.05+; 22.04 ships 21.08), slurmctld and slurmd come from the same release, and the image ships
# the AMLFS Lustre client built for its kernel (plus GPU driver, InfiniBand and the NCCL topology files the
# ND nodes use; on the login VM's general-purpose size those simply stay idle).
IMAGE = compute.ImageReferenceArgs(publisher="microsoft-dsvm", offer="ubuntu-hpc", sku="2404", version="latest")
LOGIN_IMAGE = IMAGE
MUNGE_SECRET = "munge-key"
# slurmctld state on Lustre: a replaced login VM (new custom data) resumes the queue.
SLURM_STATE_DIR = f"{cloud_init.MOUNT}/{SLURM_DIR}/slurmctld"
# Terminate notice the scale set gives each instance (5-15 min; Azure docs, "Terminate notification for
# Azure Virtual Machine Scale Set instances"): time to drain and unmount Lustre cleanly.
TERMINATE_NOTICE = "PT10M"


@dataclass
class ClusterArgs:
    settings: Settings
    subscription_id: pulumi.Input[str]
    resource_group_name: pulumi.Input[str]
    resource_group_id: pulumi.Input[str]
    subnet_id: pulumi.Input[str]
    archive_blob_endpoint: pulumi.Input[str]
    data_container_name: pulumi.Input[str]
    data_container_id: pulumi.Input[str]
    filesystem_id: pulumi.Input[str]
    filesystem_name: pulumi.Input[str]
    autoexport_job_name: pulumi.Input[str]
    mgs_address: pulumi.Input[str]
    provisioned_gbps: pulumi.Input[float]
    toolkit: Toolkit
    tenant_id: pulumi.Input[str]
    bastion_name: pulumi.Input[str] | None = None    # access bastion: the Bastion host's name


class Cluster(pulumi.ComponentResource):
    identity_id: pulumi.Output[str]
    identity_client_id: pulumi.Output[str]
    identity_principal_id: pulumi.Output[str]
    # clusterMode slurm (None otherwise):
    scale_set_name: pulumi.Output[str] | None
    custom_data: pulumi.Output[str] | None          # ND nodes' cloud-config
    login_custom_data: pulumi.Output[str] | None
    login_host: str | None
    login_private_ip: str | None
    login_public_ip: pulumi.Output[str] | None
    vault_name: pulumi.Output[str] | None
    ssh_command: pulumi.Output[str] | None
    # clusterMode none:
    bootstrap_script: pulumi.Output[str] | None

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("tiered:cluster:Cluster", name, None, opts)
        s, rg = args.settings, args.resource_group_name
        child = pulumi.ResourceOptions(parent=self)

        uami = managedidentity.UserAssignedIdentity(f"{name}-identity", resource_group_name=rg, location=s.location, opts=child)

        # Toolkit delivery (see module docstring).
        tools = storage.StorageAccount(
            f"{name}-tools",
            account_name=account_name(s, args.subscription_id, "tl"),
            resource_group_name=rg, location=s.location, kind=storage.Kind.STORAGE_V2,
            sku=storage.SkuArgs(name=storage.SkuName.STANDARD_LRS),
            enable_https_traffic_only=True, minimum_tls_version=storage.MinimumTlsVersion.TLS1_2, allow_blob_public_access=False,
            # Shared key stays on: the provider uploads the blob with the account key.
            allow_shared_key_access=True, network_rule_set=tools_network_rules(s, args.subnet_id), opts=child)
        tools_container = storage.BlobContainer(f"{name}-tools-container", resource_group_name=rg, account_name=tools.name,
                                                container_name=TOOLS_CONTAINER, public_access=storage.PublicAccess.NONE, opts=child)
        blob = storage.Blob(f"{name}-toolkit", resource_group_name=rg, account_name=tools.name,
                            container_name=tools_container.name, blob_name=args.toolkit.blob_name, type=storage.BlobType.BLOCK,
                            content_type="application/gzip", source=pulumi.FileAsset(str(args.toolkit.path)),
                            # The name is content-addressed, so a toolkit change replaces the blob; instances
                            # created from the previous custom data (a scale-set instance not yet on the latest
                            # model, a reimage) still fetch the old name. retainOnDelete: the replaced blob stays
                            # in the account (Pulumi docs, "Resource options: retainOnDelete"); docs/deploy.md
                            # "Old toolkit blobs" says when and how to delete them. Deleting the stack deletes
                            # the tools account and every blob in it.
                            opts=pulumi.ResourceOptions(parent=self, retain_on_delete=True))

        # Every role and grant: components/resources/identity.py.
        grants = identity.node_grants(name, s, principal_id=uami.principal_id, subscription_id=args.subscription_id,
                                      resource_group_id=args.resource_group_id, data_container_id=args.data_container_id,
                                      tools_container_id=tools_container.id, filesystem_id=args.filesystem_id, opts=child)

        # /etc/tiered-ckpt/config.yaml: components/node/config.py maps settings and these outputs, in one apply.
        config = pulumi.Output.all(
            account_url=args.archive_blob_endpoint, container=args.data_container_name, identity_client_id=uami.client_id,
            subscription_id=args.subscription_id, resource_group=rg, filesystem=args.filesystem_name,
            autoexport_job=args.autoexport_job_name, provisioned_gbps=args.provisioned_gbps).apply(lambda v: node_config(s, **v))
        inputs = pulumi.Output.all(
            config=config, mgs=args.mgs_address, client_id=uami.client_id,
            tools_endpoint=tools.primary_endpoints.apply(lambda e: e.blob), tools_container=tools_container.name, blob_name=blob.name)
        self.identity_id = uami.id
        self.identity_client_id = uami.client_id
        self.identity_principal_id = uami.principal_id
        self.scale_set_name = self.custom_data = self.login_custom_data = self.login_public_ip = None
        self.vault_name = self.ssh_command = self.bootstrap_script = None
        self.login_host = self.login_private_ip = None

        if s.cluster_mode != "slurm":
            self.bootstrap_script = inputs.apply(
                lambda v: cloud_init.bootstrap_script(_node_inputs(s, args.toolkit, v, role=cloud_init.ROLE_BYO)))
            self.register_outputs({"identity_client_id": self.identity_client_id})
            return

        # Key Vault for the munge key. Vault names stay reserved while soft-deleted (7-90 days), so a vault
        # re-created after a compute-off/on cycle needs a new name: the stamp changes with each creation.
        stamp = time.Static(f"{name}-vault-stamp", opts=child)
        vault = keyvault.Vault(
            f"{name}-vault",
            vault_name=pulumi.Output.all(args.subscription_id, stamp.unix).apply(lambda v: vault_name(s, str(v[0]), str(v[1]))),
            resource_group_name=rg, location=s.location,
            properties=keyvault.VaultPropertiesArgs(
                tenant_id=args.tenant_id,
                sku=keyvault.SkuArgs(family=keyvault.SkuFamily.A, name=keyvault.SkuName.STANDARD),
                enable_rbac_authorization=True,       # data access by Azure RBAC role assignments only
                soft_delete_retention_in_days=7,
                public_network_access="Enabled",      # the firewall below still denies all but the compute subnet
                network_acls=keyvault.NetworkRuleSetArgs(
                    default_action=keyvault.NetworkRuleAction.DENY, bypass=keyvault.NetworkRuleBypassOptions.NONE,
                    virtual_network_rules=[keyvault.VirtualNetworkRuleArgs(id=args.subnet_id)])),
            opts=child)
        login_uami = managedidentity.UserAssignedIdentity(f"{name}-login-identity", resource_group_name=rg, location=s.location, opts=child)
        grants.append(identity.node_vault_grant(name, principal_id=uami.principal_id, subscription_id=args.subscription_id,
                                                vault_id=vault.id, opts=child))
        login_grant = identity.login_vault_grant(name, principal_id=login_uami.principal_id, subscription_id=args.subscription_id,
                                                 vault_id=vault.id, opts=child)
        vault_url = vault.name.apply(lambda n: f"https://{n}.vault.azure.net")

        self.login_host = f"{s.base_name}-login"
        self.login_private_ip = login_private_ip(s)
        public_ip: network.PublicIPAddress | None = None
        if s.access == "public-ip":
            # The login VM only; the NSG admits SSH from sshSourcePrefix. ND nodes never get a public IP.
            public_ip = network.PublicIPAddress(
                f"{name}-login-ip", resource_group_name=rg, location=s.location, zones=[s.zone],
                sku=network.PublicIPAddressSkuArgs(name=network.PublicIPAddressSkuName.STANDARD, tier=network.PublicIPAddressSkuTier.REGIONAL),
                public_ip_allocation_method=network.IPAllocationMethod.STATIC, opts=child)
            self.login_public_ip = public_ip.ip_address.apply(lambda a: a or "")
        nic = network.NetworkInterface(
            f"{name}-login-nic", resource_group_name=rg, location=s.location, enable_accelerated_networking=True,
            ip_configurations=[network.NetworkInterfaceIPConfigurationArgs(
                name="ipconfig", primary=True, subnet=network.SubnetArgs(id=args.subnet_id),
                private_ip_allocation_method=network.IPAllocationMethod.STATIC, private_ip_address=self.login_private_ip,
                public_ip_address=network.PublicIPAddressArgs(id=public_ip.id) if public_ip else None)],
            opts=child)

        conf = slurm_inputs(s, self.login_host, self.login_private_ip)
        login_inputs = pulumi.Output.all(base=inputs, vault_url=vault_url, login_client=login_uami.client_id)
        self.login_custom_data = login_inputs.apply(lambda v: cloud_init.render(_node_inputs(
            s, args.toolkit, v["base"], role=cloud_init.ROLE_LOGIN,
            slurm=cloud_init.SlurmInputs(conf=conf, vault_url=v["vault_url"], secret_name=MUNGE_SECRET, vault_client_id=v["login_client"]))))
        node_inputs = pulumi.Output.all(base=inputs, vault_url=vault_url)
        self.custom_data = node_inputs.apply(lambda v: cloud_init.render(_node_inputs(
            s, args.toolkit, v["base"], role=cloud_init.ROLE_NODE,
            slurm=cloud_init.SlurmInputs(conf=conf, vault_url=v["vault_url"], secret_name=MUNGE_SECRET, vault_client_id=v["base"]["client_id"]))))

        ssh = compute.SshConfigurationArgs(public_keys=[compute.SshPublicKeyArgs(
            path=f"/home/{s.admin_username}/.ssh/authorized_keys", key_data=s.ssh_public_key)])
        login = compute.VirtualMachine(
            f"{name}-login", vm_name=self.login_host, resource_group_name=rg, location=s.location, zones=[s.zone],
            hardware_profile=compute.HardwareProfileArgs(vm_size=s.login_vm_size),
            identity=compute.VirtualMachineIdentityArgs(type=compute.ResourceIdentityType.USER_ASSIGNED,
                                                        user_assigned_identities=[uami.id, login_uami.id]),
            storage_profile=compute.StorageProfileArgs(
                image_reference=LOGIN_IMAGE,
                os_disk=compute.OSDiskArgs(create_option=compute.DiskCreateOptionTypes.FROM_IMAGE, caching=compute.CachingTypes.READ_WRITE,
                                           managed_disk=compute.ManagedDiskParametersArgs(storage_account_type=compute.StorageAccountTypes.PREMIUM_LRS),
                                           disk_size_gb=128, delete_option=compute.DiskDeleteOptionTypes.DELETE)),
            os_profile=compute.OSProfileArgs(
                computer_name=self.login_host, admin_username=s.admin_username,
                custom_data=self.login_custom_data.apply(cloud_init.encode),
                linux_configuration=compute.LinuxConfigurationArgs(disable_password_authentication=True, ssh=ssh)),
            network_profile=compute.NetworkProfileArgs(network_interfaces=[compute.NetworkInterfaceReferenceArgs(id=nic.id, primary=True)]),
            security_profile=security_profile(s.login_security),
            # Azure cannot change a VM's customData (nor, while it runs, its security type) in place: a changed login configuration is a new VM
            # (slurmctld's state is on Lustre, the queue survives). The NIC is reused, so the old VM goes first.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*grants, login_grant, blob], replace_on_changes=["osProfile.customData", "securityProfile"],
                                        delete_before_replace=True,
                                        custom_timeouts=pulumi.CustomTimeouts(create="30m", update="30m", delete="30m")))

        vmss = compute.VirtualMachineScaleSet(
            f"{name}-vmss",
            resource_group_name=rg,
            location=s.location,
            sku=compute.SkuArgs(name=s.vm_size, tier="Standard", capacity=s.node_count),
            zones=[s.zone],                      # the file system's zone: Lustre at full speed
            orchestration_mode=compute.OrchestrationMode.UNIFORM,
            # One InfiniBand fabric: ND scale sets keep all VMs in a single placement group (<= 100 VMs),
            # one fault domain, no overprovisioned extra VMs (they would join the fabric and be deleted).
            single_placement_group=True,
            platform_fault_domain_count=1,
            overprovision=False,
            # Never reimage training nodes behind the user's back.
            upgrade_policy=compute.UpgradePolicyArgs(mode=compute.UpgradeMode.MANUAL),
            identity=compute.VirtualMachineScaleSetIdentityArgs(type=compute.ResourceIdentityType.USER_ASSIGNED,
                                                               user_assigned_identities=[uami.id]),
            virtual_machine_profile=compute.VirtualMachineScaleSetVMProfileArgs(
                storage_profile=compute.VirtualMachineScaleSetStorageProfileArgs(
                    image_reference=IMAGE,
                    os_disk=compute.VirtualMachineScaleSetOSDiskArgs(
                        create_option=compute.DiskCreateOptionTypes.FROM_IMAGE, caching=compute.CachingTypes.READ_WRITE,
                        managed_disk=compute.VirtualMachineScaleSetManagedDiskParametersArgs(
                            storage_account_type=compute.StorageAccountTypes.PREMIUM_LRS),
                        disk_size_gb=256),
                ),
                os_profile=compute.VirtualMachineScaleSetOSProfileArgs(
                    computer_name_prefix=s.base_name[:9],
                    admin_username=s.admin_username,
                    custom_data=self.custom_data.apply(cloud_init.encode),
                    linux_configuration=compute.LinuxConfigurationArgs(disable_password_authentication=True, ssh=ssh),
                ),
                security_profile=security_profile(s.node_security),
                # A scale-in or delete gives each node notice (Scheduled Events "Terminate"): the watcher
                # drains it and unmounts Lustre before the VM goes.
                scheduled_events_profile=compute.ScheduledEventsProfileArgs(
                    terminate_notification_profile=compute.TerminateNotificationProfileArgs(enable=True, not_before_timeout=TERMINATE_NOTICE)),
                network_profile=compute.VirtualMachineScaleSetNetworkProfileArgs(network_interface_configurations=[
                    compute.VirtualMachineScaleSetNetworkConfigurationArgs(
                        name="nic",
                        primary=True,
                        enable_accelerated_networking=True,
                        # No public_ip_address_configuration: nodes are private; outbound goes via the NAT gateway.
                        ip_configurations=[compute.VirtualMachineScaleSetIPConfigurationArgs(
                            name="ipconfig", primary=True, subnet=compute.ApiEntityReferenceArgs(id=args.subnet_id))],
                    ),
                ]),
            ),
            # Nodes fetch the toolkit and call ARM at first boot: grants first. The login NIC first too, so
            # its static address is taken before any node's dynamic one.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*grants, blob, nic],
                                        custom_timeouts=pulumi.CustomTimeouts(create="60m", update="60m", delete="60m")),
        )

        self.scale_set_name = vmss.name
        self.vault_name = vault.name
        target = self.login_public_ip if self.login_public_ip is not None else self.login_private_ip
        if s.access == "bastion" and args.bastion_name is not None:
            self.ssh_command = pulumi.Output.concat(
                "az network bastion ssh --name ", args.bastion_name, " --resource-group ", rg, " --target-resource-id ", login.id,
                f" --auth-type ssh-key --username {s.admin_username} --ssh-key {private_key_path(s.ssh_public_key)}")
        else:
            self.ssh_command = pulumi.Output.concat(f"ssh -i {private_key_path(s.ssh_public_key)} {s.admin_username}@", target)
        self.register_outputs({"scale_set_name": self.scale_set_name, "identity_client_id": self.identity_client_id,
                               "vault_name": self.vault_name, "ssh_command": self.ssh_command})


def security_profile(sec: VmSecurity) -> compute.SecurityProfileArgs:
    """The VM's securityProfile, always explicit (components/settings/vm_security.py decides it): Trusted Launch with
    vTPM and Secure Boot off where the size supports it (the image's DKMS modules are unsigned), else
    `Standard`, stated, so that Azure's move to Trusted Launch by default cannot change it."""
    if sec.trusted_launch:
        return compute.SecurityProfileArgs(security_type=compute.SecurityTypes.TRUSTED_LAUNCH,
                                           uefi_settings=compute.UefiSettingsArgs(secure_boot_enabled=sec.secure_boot, v_tpm_enabled=sec.vtpm))
    return compute.SecurityProfileArgs(security_type=STANDARD_SECURITY_TYPE)


def boot_security(s: Settings, role: str) -> tuple[tuple[str, str], ...]:
    """What this VM's boot is told about its security profile: VmSecurity.boot_env() (components/settings/vm_security.py
    decides it; nothing for a cluster you bring). The boot checks the real state with `mokutil --sb-state`
    and stops with one message if it contradicts this (scripts/lib/boot-common.sh)."""
    if role == cloud_init.ROLE_BYO:
        return ()
    sec = s.login_security if role == cloud_init.ROLE_LOGIN else s.node_security
    return tuple(sorted(sec.boot_env().items()))


def tools_network_rules(s: Settings, subnet_id: pulumi.Input[str]) -> storage.NetworkRuleSetArgs:
    """The tools account's firewall. `pulumi up` uploads the toolkit blob from the operator's machine over
    the data plane, so with toolsUploadCidr unset it must stay open to every network (the blob is still
    private: no public access, HTTPS only, reads need the nodes' identity). With it set, only that address
    range and the compute subnet (service endpoint; the nodes' downloads) get in (Azure Storage firewall
    docs: IP rules take public ranges; /32 is given as a bare address)."""
    if not s.tools_upload_cidr:
        return storage.NetworkRuleSetArgs(default_action=storage.DefaultAction.ALLOW)
    cidr = s.tools_upload_cidr.removesuffix("/32")
    return storage.NetworkRuleSetArgs(
        default_action=storage.DefaultAction.DENY, bypass=storage.Bypass.NONE,
        ip_rules=[storage.IPRuleArgs(i_p_address_or_range=cidr, action=storage.Action.ALLOW)],
        virtual_network_rules=[storage.VirtualNetworkRuleArgs(virtual_network_resource_id=subnet_id, action=storage.Action.ALLOW)])


def vault_name(s: Settings, subscription_id: str, stamp: str) -> str:
    """3-24 letters/digits, globally unique, starting with a letter (Key Vault naming rules)."""
    stem = (s.name_prefix + re.sub(r"[^a-z0-9]", "", s.stack.lower()))[:14]
    return f"{stem}kv{hashlib.sha256(f'{subscription_id}/{s.stack}/{stamp}'.encode()).hexdigest()[:8]}"


def private_key_path(public_key: str) -> str:
    """The OpenSSH default private key file for the type of `public_key` (ssh-keygen(1) FILES)."""
    kind = public_key.split()[0]
    return "~/.ssh/" + {"ssh-rsa": "id_rsa", "sk-ssh-ed25519@openssh.com": "id_ed25519_sk"}.get(
        kind, "id_ecdsa" if kind.startswith("ecdsa") else "id_ed25519")


def slurm_inputs(s: Settings, controller_host: str, controller_addr: str) -> slurm_conf.SlurmConfInputs:
    """slurm.conf inputs. MaxNodeCount is the stack's node limit, not nodeCount: scaling the ND scale set
    then changes nothing on the controller (dynamic nodes register themselves)."""
    return slurm_conf.SlurmConfInputs(
        cluster_name=re.sub(r"[^a-z0-9]", "", s.base_name.lower())[:40] or "tiered",
        controller_host=controller_host, controller_addr=controller_addr,
        max_nodes=MAX_NODES, node_headroom=0,
        health_check_program=cloud_init.HEALTHCHECK, state_dir=SLURM_STATE_DIR,
        gpus_per_node=slurm_conf.ND_GPUS_PER_NODE, node_feature=node_feature(s.vm_size))


def node_feature(vm_size: str) -> str:
    """The Slurm feature the ND nodes register with (and the partition's NodeSet selects): the size's
    generation, `nd` + its `_v<N>` suffix: ND H100/H200 v5 -> ndv5, ND A100 v4 -> ndv4, so a job's
    `--constraint` never lands on a generation it did not ask for."""
    m = re.search(r"_v(\d+)$", vm_size, re.IGNORECASE)
    return f"ndv{m.group(1)}" if m else "nd"


def _node_inputs(s: Settings, toolkit: Toolkit, v: dict[str, Any], *, role: str,
                 slurm: cloud_init.SlurmInputs | None = None) -> cloud_init.NodeInputs:
    """What one VM receives: the node config (v["config"], components/node/config.py) and the boot's own inputs."""
    return cloud_init.NodeInputs(
        config=v["config"], role=role, slurm=slurm, admin_user=s.admin_username, training_user=s.training_user,
        training_group=s.training_group,
        nccl_topo_file=cloud_init.nccl_topo_file(s.vm_size) if role == cloud_init.ROLE_NODE else "",
        security_env=boot_security(s, role),
        gpus_per_node=slurm_conf.ND_GPUS_PER_NODE,
        mgs_address=v["mgs"], schedule=s.retention_schedule,
        tools_url=f"{v['tools_endpoint'].rstrip('/')}/{v['tools_container']}/{v['blob_name']}",
        tools_sha256=toolkit.sha256)
