"""GPU cluster: ND-series scale set on one InfiniBand fabric, its identity, least-privilege roles, cloud-init.

The toolkit reaches the nodes as a private blob in a small "tools" account in the compute resource
group (not in the archive account: that account's firewall denies everything but the two subnets, and
`pulumi up` uploads the blob from the operator's machine over the data plane). Nodes fetch it with
their managed identity and check its sha256 from the custom data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi_azure_native import authorization, compute, managedidentity, storage

from . import cloud_init
from .core_storage import STORAGE_BLOB_DATA_READER, account_name, role_definition_id
from .settings import Settings

TOOLS_CONTAINER = "tools"
IMAGE = compute.ImageReferenceArgs(publisher="microsoft-dsvm", offer="ubuntu-hpc", sku="2204", version="latest")

# What `tiered-ckpt restore` and retention do through ARM on the file system, nothing more:
# read the file system (HSM settings, archive status); create/watch/clean up import jobs for a deleted
# checkpoint's prefix; read and toggle the auto-export job (one blob job at a time, so an import
# disables auto-export and re-enables it). No delete of the file system or the auto-export job,
# no manual archive (teardown runs with the operator's own credentials).
NODE_ACTIONS = [
    "Microsoft.StorageCache/amlFilesystems/read",
    "Microsoft.StorageCache/amlFilesystems/importJobs/read",
    "Microsoft.StorageCache/amlFilesystems/importJobs/write",
    "Microsoft.StorageCache/amlFilesystems/autoExportJobs/read",
    "Microsoft.StorageCache/amlFilesystems/autoExportJobs/write",
]


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
    toolkit: cloud_init.Toolkit


class Cluster(pulumi.ComponentResource):
    scale_set_name: pulumi.Output[str]
    identity_client_id: pulumi.Output[str]
    identity_principal_id: pulumi.Output[str]
    custom_data: pulumi.Output[str]

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
            allow_shared_key_access=True, opts=child)
        tools_container = storage.BlobContainer(f"{name}-tools-container", resource_group_name=rg, account_name=tools.name,
                                                container_name=TOOLS_CONTAINER, public_access=storage.PublicAccess.NONE, opts=child)
        blob = storage.Blob(f"{name}-toolkit", resource_group_name=rg, account_name=tools.name,
                            container_name=tools_container.name, blob_name=args.toolkit.blob_name, type=storage.BlobType.BLOCK,
                            content_type="application/gzip", source=pulumi.FileAsset(str(args.toolkit.path)), opts=child)

        def grant(short: str, scope: pulumi.Input[str], role_id: pulumi.Input[str]) -> authorization.RoleAssignment:
            return authorization.RoleAssignment(
                f"{name}-{short}", principal_id=uami.principal_id, principal_type=authorization.PrincipalType.SERVICE_PRINCIPAL,
                role_definition_id=role_id, scope=scope, opts=child)

        reader = role_definition_id(args.subscription_id, STORAGE_BLOB_DATA_READER)
        # Blob read on the data container only (restore/verify read the archive; AMLFS writes it).
        grants = [grant("archive-reader", args.data_container_id, reader),
                  grant("tools-reader", tools_container.id, reader)]
        # Custom roles cannot list a single resource as assignable scope, so the definition is assignable in
        # the compute resource group and assigned at the file system only.
        role = authorization.RoleDefinition(
            f"{name}-fs-jobs-role",
            role_name=f"tiered-ckpt node jobs ({s.base_name}, {s.location})",
            description="Import jobs and auto-export admin status on one AMLFS file system (tiered-ckpt restore/retention).",
            role_type="CustomRole",
            scope=args.resource_group_id,
            assignable_scopes=[args.resource_group_id],
            permissions=[authorization.PermissionArgs(actions=NODE_ACTIONS, not_actions=[], data_actions=[], not_data_actions=[])],
            opts=child)
        grants.append(grant("fs-jobs", args.filesystem_id, role.id))

        inputs = pulumi.Output.all(
            mgs=args.mgs_address, endpoint=args.archive_blob_endpoint, container=args.data_container_name,
            client_id=uami.client_id, sub=args.subscription_id, rg=rg, fs=args.filesystem_name, job=args.autoexport_job_name,
            gbps=args.provisioned_gbps, tools_endpoint=tools.primary_endpoints.apply(lambda e: e.blob),
            tools_container=tools_container.name, blob_name=blob.name)
        self.custom_data = inputs.apply(lambda v: cloud_init.render(_node_inputs(s, args.toolkit, v)))

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
                    linux_configuration=compute.LinuxConfigurationArgs(
                        disable_password_authentication=True,
                        ssh=compute.SshConfigurationArgs(public_keys=[compute.SshPublicKeyArgs(
                            path=f"/home/{s.admin_username}/.ssh/authorized_keys", key_data=s.ssh_public_key)]),
                    ),
                ),
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
            # Nodes fetch the toolkit and call ARM at first boot: grants first.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[*grants, blob],
                                        custom_timeouts=pulumi.CustomTimeouts(create="60m", update="60m", delete="60m")),
        )

        self.scale_set_name = vmss.name
        self.identity_client_id = uami.client_id
        self.identity_principal_id = uami.principal_id
        self.register_outputs({"scale_set_name": self.scale_set_name, "identity_client_id": self.identity_client_id})


def _node_inputs(s: Settings, toolkit: cloud_init.Toolkit, v: dict[str, Any]) -> cloud_init.NodeInputs:
    return cloud_init.NodeInputs(
        mgs_address=v["mgs"], account_url=v["endpoint"].rstrip("/"), data_container=v["container"],
        blob_prefix=s.blob_prefix, lustre_root=s.lustre_root, model=s.model_name, nodes=s.node_count,
        identity_client_id=v["client_id"], subscription_id=v["sub"], resource_group=v["rg"], filesystem=v["fs"],
        autoexport_job=v["job"], provisioned_gbps=float(v["gbps"]), keep_last=s.retention_keep_last,
        keep_every_steps=s.retention_keep_every_steps, min_keep=s.retention_min_keep, action=s.retention_action,
        schedule=s.retention_schedule,
        tools_url=f"{v['tools_endpoint'].rstrip('/')}/{v['tools_container']}/{v['blob_name']}",
        tools_sha256=toolkit.sha256)
