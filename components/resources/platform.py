"""The whole tiered-checkpoint platform: wires the core storage layer, network, accelerator and cluster.

With `computeEnabled: false` only the core storage layer (archive) is registered, so a `pulumi up`
removes network, file system, auto-export and cluster while the archive stays managed; with it true
again the file system is created afresh and re-imports the checkpoint prefix from the archive.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import pulumi
import pulumi_azuread as azuread
from pulumi_azure_native import authorization, resources

from components.node import toolkit
from components.settings import sizing
from components.settings.schema import Settings

from .accelerator import Accelerator, AcceleratorArgs
from .access import Bastion, BastionArgs
from .cluster import Cluster, ClusterArgs
from .core_storage import CoreStorage, CoreStorageArgs
from .network import Network, NetworkArgs
from .tags import stack_tags, tagging

# appId of "HPC Cache Resource Provider" (same in every tenant; its object ID differs per tenant).
HPC_CACHE_RP_APP_ID = "4392ab71-2ce2-4b0d-8770-b352745c73f5"


class StackOutputs(TypedDict):
    """The stack outputs (`pulumi stack output`); the compute keys are None while computeEnabled is false."""
    subscriptionId: pulumi.Output[str]
    storageResourceGroup: pulumi.Output[str]
    storageAccountName: pulumi.Output[str]
    storageAccountUrl: pulumi.Output[str]
    dataContainer: pulumi.Output[str]
    loggingContainer: pulumi.Output[str]
    dataContainerId: pulumi.Output[str]
    checkpointPrefix: str
    computeEnabled: bool
    sizing: dict[str, Any]
    computeResourceGroup: pulumi.Output[str] | None
    amlfsName: pulumi.Output[str] | None
    autoExportJobName: pulumi.Output[str] | None
    mgsAddress: pulumi.Output[str] | None
    mountCommand: pulumi.Output[str] | None
    provisionedGBps: pulumi.Output[float] | None
    nodeCount: int | None
    scaleSetName: pulumi.Output[str] | None
    nodeIdentityClientId: pulumi.Output[str] | None
    nodeIdentityId: pulumi.Output[str] | None
    computeSubnetId: pulumi.Output[str] | None
    clusterMode: str
    access: str | None
    loginHost: str | None
    loginPrivateIp: str | None
    loginPublicIp: pulumi.Output[str] | None
    bastionName: pulumi.Output[str] | None
    keyVaultName: pulumi.Output[str] | None
    sshCommand: pulumi.Output[str] | None               # the exact command that opens a shell on the login VM
    nodeBootstrapScript: pulumi.Output[str] | None      # clusterMode none: run as root on each node you bring


@dataclass
class PlatformArgs:
    settings: Settings
    repo_root: Path            # where src/tiered_ckpt lives (the toolkit shipped to the nodes)
    build_dir: Path            # where the toolkit tarball is written


class Platform(pulumi.ComponentResource):
    outputs: StackOutputs

    def __init__(self, name: str, args: PlatformArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        s = args.settings
        # stack/project/owner tags on every taggable Azure resource below (components/resources/tags.py).
        tagged = pulumi.ResourceOptions(transformations=[tagging(stack_tags(s, pulumi.get_project()))])
        super().__init__("tiered:platform:Platform", name, None, pulumi.ResourceOptions.merge(opts, tagged))
        invoke = pulumi.InvokeOutputOptions(parent=self)
        client = authorization.get_client_config_output(opts=invoke)
        subscription_id = client.subscription_id
        rp_principal_id: pulumi.Input[str] = (
            s.rp_principal_object_id
            or azuread.get_service_principal_output(client_id=HPC_CACHE_RP_APP_ID, opts=invoke).object_id)
        z = sizing.compute(s)

        network: Network | None = None
        compute_rg: resources.ResourceGroup | None = None
        if s.compute_enabled:
            compute_rg = resources.ResourceGroup(f"{name}-compute-rg", resource_group_name=f"{s.base_name}-compute-rg", location=s.location, opts=pulumi.ResourceOptions(parent=self))
            network = Network(f"{name}-net", NetworkArgs(settings=s, resource_group_name=compute_rg.name),
                              opts=pulumi.ResourceOptions(parent=self))

        core = CoreStorage(f"{name}-archive", CoreStorageArgs(
            settings=s, subscription_id=subscription_id, rp_principal_id=rp_principal_id,
            allowed_subnet_ids=[network.amlfs_subnet_id, network.compute_subnet_id] if network else []),
            opts=pulumi.ResourceOptions(parent=self))

        out: StackOutputs = {
            "subscriptionId": subscription_id,
            "storageResourceGroup": core.resource_group_name,
            "storageAccountName": core.account_name,
            "storageAccountUrl": core.blob_endpoint,
            "dataContainer": core.data_container_name,
            "loggingContainer": core.logging_container_name,
            "dataContainerId": core.data_container_id,
            "checkpointPrefix": s.checkpoint_prefix,
            "computeEnabled": s.compute_enabled,
            "sizing": z.as_dict(),
            "computeResourceGroup": None, "amlfsName": None, "autoExportJobName": None, "mgsAddress": None,
            "mountCommand": None, "provisionedGBps": None, "nodeCount": None, "scaleSetName": None,
            "nodeIdentityClientId": None, "nodeIdentityId": None, "computeSubnetId": None,
            "clusterMode": s.cluster_mode, "access": None, "loginHost": None, "loginPrivateIp": None, "loginPublicIp": None,
            "bastionName": None, "keyVaultName": None, "sshCommand": None, "nodeBootstrapScript": None,
        }
        if s.compute_enabled and network is not None and compute_rg is not None:
            acc = Accelerator(f"{name}-amlfs", AcceleratorArgs(
                settings=s, subscription_id=subscription_id, resource_group_name=compute_rg.name,
                subnet_id=network.amlfs_subnet_id, data_container_id=core.data_container_id,
                logging_container_id=core.logging_container_id, grants_ready=core.grants_ready),
                opts=pulumi.ResourceOptions(parent=self))
            tarball = toolkit.build_toolkit(args.repo_root, args.build_dir)
            bastion: Bastion | None = None
            if network.bastion_subnet_id is not None:
                bastion = Bastion(f"{name}-bastion", BastionArgs(settings=s, resource_group_name=compute_rg.name,
                                                               subnet_id=network.bastion_subnet_id),
                                  opts=pulumi.ResourceOptions(parent=self))
            cluster = Cluster(f"{name}-gpu", ClusterArgs(
                settings=s, subscription_id=subscription_id, resource_group_name=compute_rg.name,
                resource_group_id=compute_rg.id, subnet_id=network.compute_subnet_id,
                archive_blob_endpoint=core.blob_endpoint, data_container_name=core.data_container_name,
                data_container_id=core.data_container_id, filesystem_id=acc.filesystem_id,
                filesystem_name=acc.filesystem_name, autoexport_job_name=acc.autoexport_job_name,
                mgs_address=acc.mgs_address, provisioned_gbps=acc.provisioned_gbps, toolkit=tarball,
                tenant_id=client.tenant_id, bastion_name=bastion.host_name if bastion else None),
                opts=pulumi.ResourceOptions(parent=self))
            out.update({
                "computeResourceGroup": compute_rg.name,
                "amlfsName": acc.filesystem_name,
                "autoExportJobName": acc.autoexport_job_name,
                "mgsAddress": acc.mgs_address,
                "mountCommand": acc.mount_command,
                "provisionedGBps": acc.provisioned_gbps,
                "nodeCount": s.node_count,
                "scaleSetName": cluster.scale_set_name,
                "nodeIdentityClientId": cluster.identity_client_id,
                "nodeIdentityId": cluster.identity_id,
                "computeSubnetId": network.compute_subnet_id,
                "access": s.access if s.cluster_mode == "slurm" else None,
                "loginHost": cluster.login_host,
                "loginPrivateIp": cluster.login_private_ip,
                "loginPublicIp": cluster.login_public_ip,
                "bastionName": bastion.host_name if bastion else None,
                "keyVaultName": cluster.vault_name,
                "sshCommand": cluster.ssh_command,
                "nodeBootstrapScript": cluster.bootstrap_script,
            })
        self.outputs = out
        self.register_outputs(out)
