"""Accelerator layer: the AMLFS file system with blob integration (HSM) and its auto-export job."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
from pulumi_azure_native import storagecache

from components.settings.schema import Settings

from .arm_auth import ArmAuth
from .blob_jobs import ArmCredentialCheck, WaitForBlobJobs, program_auth
from .network import trusted_nids

SQUASH_ID = 65534       # nobody / nogroup


@dataclass
class AcceleratorArgs:
    settings: Settings
    subscription_id: pulumi.Input[str]
    resource_group_name: pulumi.Input[str]
    subnet_id: pulumi.Input[str]
    data_container_id: pulumi.Input[str]
    logging_container_id: pulumi.Input[str]
    grants_ready: pulumi.Resource           # the role-propagation wait of the core storage layer
    arm_auth: ArmAuth | None = None         # the program's own ARM credential (default: the provider's settings)


class Accelerator(pulumi.ComponentResource):
    filesystem_name: pulumi.Output[str]
    filesystem_id: pulumi.Output[str]
    mgs_address: pulumi.Output[str]
    mount_command: pulumi.Output[str]
    provisioned_gbps: pulumi.Output[float]
    autoexport_job_name: pulumi.Output[str]

    def __init__(self, name: str, args: AcceleratorArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("tiered:accelerator:Accelerator", name, None, opts)
        s = args.settings
        # Settings has already checked every value against the API's enums (storagecache
        # stable/2024-03-01/amlfilesystem.json); the SDK's Args classes and enums make a misspelt field
        # a type error here instead of an ARM error at `pulumi up`.
        squash_mode = storagecache.AmlFilesystemSquashMode(s.root_squash)
        if squash_mode == storagecache.AmlFilesystemSquashMode.NONE:
            squash = storagecache.AmlFilesystemRootSquashSettingsArgs(mode=squash_mode)
        else:
            # 65534 = nobody/nogroup. The trusted NIDs (default: the whole compute subnet, i.e. the login VM
            # and the GPU nodes) keep root, so the bootstrap (mkdir/chown of the checkpoint tree) and the
            # root retention service work; root on any other host (peered or VPN networks) is squashed.
            squash = storagecache.AmlFilesystemRootSquashSettingsArgs(
                mode=squash_mode, squash_uid=SQUASH_ID, squash_gid=SQUASH_ID, no_squash_nid_lists=trusted_nids(s))

        # The wait below calls ARM itself: prove its credential, and that the region offers the SKU and zone
        # (components/settings/regions.py: ARM's SKU list is the only authoritative region list), before the file system exists.
        auth = args.arm_auth or program_auth()
        checked = ArmCredentialCheck(f"{name}-arm-credential", auth=auth, subscription_id=args.subscription_id,
                                     resource_group=args.resource_group_name, location=s.location, sku=s.sku.name,
                                     zone=s.zone, vms=preflight_vms(s), opts=pulumi.ResourceOptions(parent=self))

        fs = storagecache.AmlFilesystem(
            f"{name}-fs",
            aml_filesystem_name=s.amlfs_name,
            resource_group_name=args.resource_group_name,
            location=s.location,
            sku=storagecache.SkuNameArgs(name=s.sku.name),
            storage_capacity_ti_b=float(s.capacity_tib),
            zones=[s.zone],
            filesystem_subnet=args.subnet_id,
            maintenance_window=storagecache.AmlFilesystemMaintenanceWindowArgs(
                day_of_week=storagecache.MaintenanceDayOfWeekType(s.maintenance_day),
                time_of_day_utc=s.maintenance_time_utc),
            root_squash_settings=squash,
            hsm=storagecache.AmlFilesystemHsmArgs(settings=storagecache.AmlFilesystemHsmSettingsArgs(
                container=args.data_container_id,
                logging_container=args.logging_container_id,
                # Creation-time import of exactly the checkpoint prefix: on a fresh archive it is empty; when
                # the compute side comes back it re-creates every archived checkpoint as a released stub,
                # so `tiered-ckpt restore --latest` works on the new cluster. (The SDK would send "/".)
                import_prefix=s.checkpoint_prefix,
            )),
            # Creation takes 10-30 min and deletion 5-20 min; the provider default would give up early.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.grants_ready, checked],
                                        custom_timeouts=pulumi.CustomTimeouts(create="90m", update="60m", delete="60m")),
        )

        # One blob-integration job at a time: wait for the creation-time import before auto-export.
        idle = WaitForBlobJobs(
            f"{name}-blob-jobs-idle",
            auth=auth,
            subscription_id=args.subscription_id,
            resource_group=args.resource_group_name,
            filesystem=fs.name,
            filesystem_id=fs.id,
            timeout_s=s.blob_job_wait_minutes * 60,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[fs],
                                        custom_timeouts=pulumi.CustomTimeouts(create=f"{s.blob_job_wait_minutes + 10}m")),
        )

        job = storagecache.AutoExportJob(
            f"{name}-autoexport",
            auto_export_job_name=s.autoexport_job_name,
            aml_filesystem_name=fs.name,
            resource_group_name=args.resource_group_name,
            location=s.location,
            # Exactly one prefix (the API allows at most one): the same path the file system imports.
            auto_export_prefixes=[s.checkpoint_prefix],
            admin_status=storagecache.AutoExportJobAdminStatus.ENABLE,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[idle],
                                        custom_timeouts=pulumi.CustomTimeouts(create="30m", delete="60m")),
        )

        self.filesystem_name = fs.name
        self.filesystem_id = fs.id
        self.mgs_address = fs.client_info.apply(lambda c: c.mgs_address)
        self.mount_command = fs.client_info.apply(lambda c: c.mount_command)
        self.provisioned_gbps = fs.throughput_provisioned_m_bps.apply(lambda m: (m or 0) / 1000.0)
        self.autoexport_job_name = job.name
        self.register_outputs({
            "filesystem_name": self.filesystem_name, "mgs_address": self.mgs_address,
            "mount_command": self.mount_command, "provisioned_gbps": self.provisioned_gbps,
            "autoexport_job_name": self.autoexport_job_name,
        })


def preflight_vms(s: Settings) -> list[dict[str, Any]]:
    """The VM sizes the preflight checks in the compute SKU list before the file system exists: the ND
    nodes' and the login VM's, each with whether the program asks for Trusted Launch (clusterMode none
    creates no VM: nothing to check)."""
    if s.cluster_mode != "slurm":
        return []
    return [{"key": "vmSize", "size": s.vm_size, "trusted_launch": s.node_security.trusted_launch},
            {"key": "loginVmSize", "size": s.login_vm_size, "trusted_launch": s.login_security.trusted_launch}]
