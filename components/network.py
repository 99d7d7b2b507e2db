"""Network: VNet, AMLFS subnet, compute subnet (login VM + ND nodes), AzureBastionSubnet, NSGs, NAT gateway."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import network

from .settings import Settings

LUSTRE_PORTS = ["988", "1019-1023"]
# Azure Bastion requires this exact subnet name (Azure docs, "About Azure Bastion configuration settings").
BASTION_SUBNET = "AzureBastionSubnet"
# Azure reserves the first four addresses of a subnet: the login/controller VM takes the first usable one,
# statically, so slurm.conf and the SSH command know it before any VM exists.
FIRST_HOST_OFFSET = 4


def login_private_ip(settings: Settings) -> str:
    return str(ipaddress.ip_network(settings.compute_subnet_cidr)[FIRST_HOST_OFFSET])


def ssh_sources(settings: Settings) -> list[str]:
    """Who may open SSH (22) into the compute subnet, besides the cluster's own hosts.

    bastion: the AzureBastionSubnet only (Bastion connects from its own private addresses). public-ip and
    none: sshSourcePrefix (your CIDR; with none also e.g. VirtualNetwork for VPN/peered networks).
    The compute subnet itself is always allowed (login VM -> nodes, Slurm, torchrun), by its own rule.
    """
    if settings.cluster_mode != "slurm":
        return [settings.ssh_source_prefix]
    if settings.access == "bastion":
        return [settings.bastion_subnet_cidr]
    return [settings.ssh_source_prefix]


@dataclass
class NetworkArgs:
    settings: Settings
    resource_group_name: pulumi.Input[str]


class Network(pulumi.ComponentResource):
    vnet_id: pulumi.Output[str]
    amlfs_subnet_id: pulumi.Output[str]
    compute_subnet_id: pulumi.Output[str]
    bastion_subnet_id: pulumi.Output[str] | None

    def __init__(self, name: str, args: NetworkArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("tiered:network:Network", name, None, opts)
        s, rg = args.settings, args.resource_group_name
        child = pulumi.ResourceOptions(parent=self)

        vnet = network.VirtualNetwork(f"{name}-vnet", resource_group_name=rg, location=s.location,
                                      address_space=network.AddressSpaceArgs(address_prefixes=[s.vnet_cidr]), opts=child)

        Dir, Access, Proto = network.SecurityRuleDirection, network.SecurityRuleAccess, network.SecurityRuleProtocol

        def rule(rname: str, priority: int, direction: network.SecurityRuleDirection, src: str, dst: str, ports: list[str],
                 access: network.SecurityRuleAccess = Access.ALLOW,
                 protocol: network.SecurityRuleProtocol = Proto.TCP) -> network.SecurityRuleArgs:
            return network.SecurityRuleArgs(name=rname, priority=priority, direction=direction, access=access, protocol=protocol,
                                            source_address_prefix=src, source_port_range="*",
                                            destination_address_prefix=dst, destination_port_ranges=ports)

        amlfs, compute = s.amlfs_subnet_cidr, s.compute_subnet_cidr
        # Lustre: TCP 988 and 1019-1023, clients <-> servers in both directions (servers call clients back);
        # SSH (22) between the file system's own nodes inside its subnet (AMLFS prerequisite).
        amlfs_nsg = network.NetworkSecurityGroup(f"{name}-amlfs-nsg", resource_group_name=rg, location=s.location, security_rules=[
            rule("lustre-in-from-compute", 100, Dir.INBOUND, compute, amlfs, LUSTRE_PORTS),
            rule("lustre-in-within-amlfs", 110, Dir.INBOUND, amlfs, amlfs, LUSTRE_PORTS),
            rule("ssh-in-within-amlfs", 120, Dir.INBOUND, amlfs, amlfs, ["22"]),
            rule("lustre-out-to-compute", 100, Dir.OUTBOUND, amlfs, compute, LUSTRE_PORTS),
            rule("lustre-out-within-amlfs", 110, Dir.OUTBOUND, amlfs, amlfs, LUSTRE_PORTS),
            rule("ssh-out-within-amlfs", 120, Dir.OUTBOUND, amlfs, amlfs, ["22"]),
        ], opts=child)
        ssh_rules = [rule(f"ssh-in-from-{'bastion' if src == s.bastion_subnet_cidr and s.access == 'bastion' else 'admin'}",
                          110 + i, Dir.INBOUND, src, compute, ["22"]) for i, src in enumerate(ssh_sources(s))]
        compute_nsg = network.NetworkSecurityGroup(f"{name}-compute-nsg", resource_group_name=rg, location=s.location, security_rules=[
            rule("lustre-in-from-amlfs", 100, Dir.INBOUND, amlfs, compute, LUSTRE_PORTS),
            *ssh_rules,
            # Login VM <-> ND nodes: SSH, Slurm (6817/6818 and srun's ephemeral ports), torchrun rendezvous, NCCL bootstrap.
            rule("cluster-in-within-compute", 120, Dir.INBOUND, compute, compute, ["0-65535"], protocol=Proto.ASTERISK),
            # Azure's default AllowVnetInBound would let any VNet address SSH in: SSH only from the sources above.
            rule("ssh-in-deny-other", 4000, Dir.INBOUND, "*", "*", ["22"], access=Access.DENY),
            rule("lustre-out-to-amlfs", 100, Dir.OUTBOUND, compute, amlfs, LUSTRE_PORTS),
        ], opts=child)

        # New VNets no longer get default outbound access (subnets are private by default), and the nodes
        # have no public IPs; they still need package mirrors, the AMLFS apt repo, PyPI and Azure
        # endpoints. A NAT gateway gives the subnet outbound-only connectivity. The file system subnet
        # needs outbound to the AzureCloud service tag for the same reason, so it shares the gateway.
        nat_ip = network.PublicIPAddress(f"{name}-nat-ip", resource_group_name=rg, location=s.location,
                                         sku=network.PublicIPAddressSkuArgs(name=network.PublicIPAddressSkuName.STANDARD,
                                                                            tier=network.PublicIPAddressSkuTier.REGIONAL),
                                         public_ip_allocation_method=network.IPAllocationMethod.STATIC,
                                         zones=[s.zone], opts=child)
        nat = network.NatGateway(f"{name}-nat", resource_group_name=rg, location=s.location, sku=network.NatGatewaySkuArgs(name=network.NatGatewaySkuName.STANDARD),
                                 zones=[s.zone], public_ip_addresses=[network.SubResourceArgs(id=nat_ip.id)], idle_timeout_in_minutes=10, opts=child)

        # Microsoft.Storage service endpoints: the storage account's firewall denies by default and admits
        # these two subnets (AMLFS import/export and the nodes' blob reads).
        storage_endpoint = network.ServiceEndpointPropertiesFormatArgs(service="Microsoft.Storage")
        # Microsoft.KeyVault: the cluster's vault admits only the compute subnet (munge key reads).
        vault_endpoint = network.ServiceEndpointPropertiesFormatArgs(service="Microsoft.KeyVault")
        amlfs_subnet = network.Subnet(f"{name}-amlfs-subnet", resource_group_name=rg, virtual_network_name=vnet.name,
                                      address_prefix=amlfs, network_security_group=network.NetworkSecurityGroupArgs(id=amlfs_nsg.id),
                                      nat_gateway=network.SubResourceArgs(id=nat.id), default_outbound_access=False,
                                      service_endpoints=[storage_endpoint], opts=child)
        # Subnets of one VNet are written one at a time (ARM rejects concurrent subnet updates).
        compute_subnet = network.Subnet(f"{name}-compute-subnet", resource_group_name=rg, virtual_network_name=vnet.name,
                                        address_prefix=compute, network_security_group=network.NetworkSecurityGroupArgs(id=compute_nsg.id),
                                        nat_gateway=network.SubResourceArgs(id=nat.id), default_outbound_access=False,
                                        service_endpoints=[storage_endpoint, vault_endpoint],
                                        opts=pulumi.ResourceOptions(parent=self, depends_on=[amlfs_subnet]))
        self.bastion_subnet_id = None
        if s.cluster_mode == "slurm" and s.access == "bastion":
            # No NSG (Azure prescribes a fixed rule set for one on this subnet, and Bastion is reached only on
            # 443 through its own public IP) and no NAT gateway (not supported on AzureBastionSubnet).
            bastion_subnet = network.Subnet(f"{name}-bastion-subnet", subnet_name=BASTION_SUBNET, resource_group_name=rg,
                                            virtual_network_name=vnet.name, address_prefix=s.bastion_subnet_cidr,
                                            opts=pulumi.ResourceOptions(parent=self, depends_on=[compute_subnet]))
            self.bastion_subnet_id = bastion_subnet.id

        self.vnet_id = vnet.id
        self.amlfs_subnet_id = amlfs_subnet.id
        self.compute_subnet_id = compute_subnet.id
        self.register_outputs({"vnet_id": self.vnet_id, "amlfs_subnet_id": self.amlfs_subnet_id,
                               "compute_subnet_id": self.compute_subnet_id})
