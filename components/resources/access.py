"""The way in: Azure Bastion (Standard SKU, native-client SSH) in front of the login VM.

`az network bastion ssh` needs the Standard (or Premium) SKU with native client support, which the API
calls `enableTunneling` (Azure docs, "Connect to a VM using Bastion and the native client"). Bastion
reaches the VM on its private address from the AzureBastionSubnet; the compute NSG admits SSH from that
subnet only. The public-ip alternative (a Standard static IP on the login VM) lives in the cluster component.
"""
from __future__ import annotations

from dataclasses import dataclass

import pulumi
from pulumi_azure_native import network

from components.settings.schema import Settings


@dataclass
class BastionArgs:
    settings: Settings
    resource_group_name: pulumi.Input[str]
    subnet_id: pulumi.Input[str]


class Bastion(pulumi.ComponentResource):
    host_name: pulumi.Output[str]

    def __init__(self, name: str, args: BastionArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("tiered:access:Bastion", name, None, opts)
        s, rg = args.settings, args.resource_group_name
        child = pulumi.ResourceOptions(parent=self)
        # Bastion needs a Standard, static public IP of its own.
        ip = network.PublicIPAddress(f"{name}-ip", resource_group_name=rg, location=s.location,
                                     sku=network.PublicIPAddressSkuArgs(name=network.PublicIPAddressSkuName.STANDARD,
                                                                        tier=network.PublicIPAddressSkuTier.REGIONAL),
                                     public_ip_allocation_method=network.IPAllocationMethod.STATIC, opts=child)
        host = network.BastionHost(
            f"{name}-host", bastion_host_name=f"{s.base_name}-bastion", resource_group_name=rg, location=s.location,
            sku=network.SkuArgs(name=network.BastionHostSkuName.STANDARD),
            enable_tunneling=True,          # native client: az network bastion ssh / tunnel
            ip_configurations=[network.BastionHostIPConfigurationArgs(
                name="ipconfig", subnet=network.SubResourceArgs(id=args.subnet_id),
                public_ip_address=network.SubResourceArgs(id=ip.id))],
            opts=pulumi.ResourceOptions(parent=self, custom_timeouts=pulumi.CustomTimeouts(create="30m", delete="30m")))
        self.host_name = host.name
        self.register_outputs({"host_name": self.host_name})
