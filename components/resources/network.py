"""Network: VNet, AMLFS subnet, compute subnet (login VM + ND nodes), AzureBastionSubnet, NSGs, NAT gateway."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import pulumi
from pulumi_azure_native import network

from components.settings.schema import Settings

LUSTRE_PORTS = ["988", "1019-1023"]
# Azure Bastion requires this exact subnet name (Azure docs, "About Azure Bastion configuration settings").
BASTION_SUBNET = "AzureBastionSubnet"
# Azure reserves the first four addresses of a subnet: the login/controller VM takes the first usable one,
# statically, so slurm.conf and the SSH command know it before any VM exists.
FIRST_HOST_OFFSET = 4


def login_private_ip(settings: Settings) -> str:
    return str(ipaddress.ip_network(settings.compute_subnet_cidr)[FIRST_HOST_OFFSET])


# Lowest priority an NSG rule may have (Azure docs, "Network security groups": priorities 100-4096). The
# compute subnet's catch-all denies sit there, above Azure's default 65000 AllowVnetInBound/AllowVnetOutBound.
DENY_ALL_PRIORITY = 4096
ALL_PORTS = ["*"]


def rule(rname: str, priority: int, direction: network.SecurityRuleDirection, src: str, dst: str, ports: list[str],
         access: network.SecurityRuleAccess = network.SecurityRuleAccess.ALLOW,
         protocol: network.SecurityRuleProtocol = network.SecurityRuleProtocol.TCP) -> network.SecurityRuleArgs:
    """One security rule. Any port goes in the single-value `destinationPortRange`: the Microsoft.Network spec
    (specification/network/resource-manager/Microsoft.Network/stable/2024-05-01/networkSecurityGroup.json,
    SecurityRulePropertiesFormat) allows the asterisk only there ("Asterisk '*' can also be used to match all
    ports"), not inside the list `destinationPortRanges`; ARM answers SecurityRuleInvalidPortRange."""
    single = ports == ALL_PORTS
    return network.SecurityRuleArgs(name=rname, priority=priority, direction=direction, access=access, protocol=protocol,
                                    source_address_prefix=src, source_port_range="*", destination_address_prefix=dst,
                                    destination_port_range="*" if single else None,
                                    destination_port_ranges=None if single else ports)


# Region names as the regional service tags spell them (Azure docs, "Azure service tags overview": e.g.
# Storage.WestUS; the AMLFS NSG table: AzureKeyVault.EastUS, Storage.EastUS, ApiManagement.EastUS). The tag
# suffix is the region's display name without spaces; the words below rebuild it from the short name.
_REGION_WORDS = {w: w.capitalize() for w in (
    "southeast", "northeast", "north", "south", "east", "west", "central", "europe", "asia", "india", "japan",
    "korea", "australia", "brazil", "canada", "france", "germany", "norway", "switzerland", "sweden", "qatar",
    "italy", "poland", "israel", "mexico", "spain", "new", "zealand", "africa", "taiwan", "indonesia", "malaysia",
    "chile", "austria", "belgium", "denmark", "finland", "greece", "ireland", "china")}
_REGION_WORDS.update({"us": "US", "uk": "UK", "uae": "UAE", "newzealand": "NewZealand", "southafrica": "SouthAfrica"})


def service_tag_region(location: str) -> str:
    """`eastus` -> `EastUS`, `southeastasia` -> `SoutheastAsia`, `westus3` -> `WestUS3`: the suffix of a
    regional service tag. A name the words do not cover is returned as given (docs/deploy.md gives the
    `az network list-service-tags` check)."""
    rest, out = location.lower(), []
    words = sorted(_REGION_WORDS, key=len, reverse=True)
    while rest:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        if digits:
            out.append(rest[:digits])
            rest = rest[digits:]
            continue
        w = next((w for w in words if rest.startswith(w)), None)
        if w is None:
            return location
        out.append(_REGION_WORDS[w])
        rest = rest[len(w):]
    return "".join(out)


def amlfs_rules(s: Settings) -> list[network.SecurityRuleArgs]:
    """The AMLFS subnet's rules: Microsoft's table verbatim (azure-stack-docs
    `azure-managed-lustre/configure-network-security-group.md`, "Create inbound security rules" and "Create
    outbound security rules", same priorities), with the region of the regional service tags taken from
    `location` and the client subnet = the compute subnet (the login VM and the GPU nodes; clusterMode none:
    the nodes you put there). Without the deny rules Azure's AllowVnetInBound (65000) would admit every
    host of the VNet and of every peered or VPN-connected network."""
    Dir, Access, Proto = network.SecurityRuleDirection, network.SecurityRuleAccess, network.SecurityRuleProtocol
    amlfs, compute, region = s.amlfs_subnet_cidr, s.compute_subnet_cidr, service_tag_region(s.location)
    vnet, https = "VirtualNetwork", ["443"]
    return [
        # Inbound (table "Add the following inbound rules").
        rule("any-in-within-amlfs", 110, Dir.INBOUND, amlfs, amlfs, ALL_PORTS, protocol=Proto.ASTERISK),
        rule("lustre-in-from-clients", 111, Dir.INBOUND, compute, amlfs, LUSTRE_PORTS),
        rule("any-in-from-azuremonitor", 112, Dir.INBOUND, "AzureMonitor", vnet, ALL_PORTS),
        rule("deny-all-in", 120, Dir.INBOUND, "*", "*", ALL_PORTS, access=Access.DENY, protocol=Proto.ASTERISK),
        # Outbound (table "Add the following outbound rules and network service tags").
        rule("https-out-to-azuremonitor", 100, Dir.OUTBOUND, vnet, "AzureMonitor", https),
        rule("https-out-to-keyvault", 101, Dir.OUTBOUND, vnet, f"AzureKeyVault.{region}", https),
        rule("https-out-to-entra-id", 102, Dir.OUTBOUND, vnet, "AzureActiveDirectory", https),
        rule("https-out-to-storage", 103, Dir.OUTBOUND, vnet, f"Storage.{region}", https),
        rule("https-out-to-guest-hybrid-mgmt", 104, Dir.OUTBOUND, vnet, "GuestAndHybridManagement", https),
        rule("https-out-to-apimanagement", 105, Dir.OUTBOUND, vnet, f"ApiManagement.{region}", https),
        rule("https-out-to-datalake", 106, Dir.OUTBOUND, vnet, "AzureDataLake", https),
        rule("https-out-to-arm", 107, Dir.OUTBOUND, vnet, "AzureResourceManager", https),
        rule("lustre-out-to-clients", 108, Dir.OUTBOUND, amlfs, compute, LUSTRE_PORTS),
        rule("ntp-out-to-microsoft", 109, Dir.OUTBOUND, amlfs, "168.61.215.74/32", ["123"], protocol=Proto.UDP),
        rule("https-out-to-telemetry", 110, Dir.OUTBOUND, vnet, "20.34.120.0/21", https),
        rule("any-out-within-amlfs", 111, Dir.OUTBOUND, amlfs, amlfs, ALL_PORTS, protocol=Proto.ASTERISK),
        rule("https-out-to-eventhub", 112, Dir.OUTBOUND, vnet, "EventHub", https),
        rule("deny-internet-out", 1000, Dir.OUTBOUND, vnet, "Internet", ALL_PORTS, access=Access.DENY, protocol=Proto.ASTERISK),
        rule("deny-all-out", 1010, Dir.OUTBOUND, "*", "*", ALL_PORTS, access=Access.DENY, protocol=Proto.ASTERISK),
    ]


def compute_rules(s: Settings) -> list[network.SecurityRuleArgs]:
    """The compute subnet's inbound rules (login VM and ND nodes): Lustre callbacks from the file system,
    SSH from the way in, everything between the cluster's own hosts, then deny the rest of VirtualNetwork
    (the VNet, peered networks, VPN, the Bastion subnet): without it Azure's AllowVnetInBound (65000) would
    open Slurm (6817/6818, srun's ports), torchrun and NCCL to all of them."""
    Dir, Access, Proto = network.SecurityRuleDirection, network.SecurityRuleAccess, network.SecurityRuleProtocol
    amlfs, compute = s.amlfs_subnet_cidr, s.compute_subnet_cidr
    ssh_rules = [rule(f"ssh-in-from-{'bastion' if src == s.bastion_subnet_cidr and s.access == 'bastion' else 'admin'}",
                      110 + i, Dir.INBOUND, src, compute, ["22"]) for i, src in enumerate(ssh_sources(s))]
    return [
        rule("lustre-in-from-amlfs", 100, Dir.INBOUND, amlfs, compute, LUSTRE_PORTS),
        *ssh_rules,
        # Login VM <-> ND nodes: SSH, Slurm (6817/6818 and srun's ephemeral ports), torchrun rendezvous, NCCL bootstrap.
        rule("cluster-in-within-compute", 120, Dir.INBOUND, compute, compute, ["0-65535"], protocol=Proto.ASTERISK),
        # SSH only from the sources above, whatever the source (a public IP's internet too).
        rule("ssh-in-deny-other", 4000, Dir.INBOUND, "*", "*", ["22"], access=Access.DENY),
        rule("deny-other-vnet-in", DENY_ALL_PRIORITY, Dir.INBOUND, "VirtualNetwork", "*", ALL_PORTS, access=Access.DENY,
             protocol=Proto.ASTERISK),
        rule("lustre-out-to-amlfs", 100, Dir.OUTBOUND, compute, amlfs, LUSTRE_PORTS),
    ]


def trusted_nids(settings: Settings) -> str:
    """The Lustre NIDs that keep root under root squash: rootSquashTrustedNids, or every host address of the
    compute subnet (the login VM and the GPU nodes, whose bootstrap and retention run as root), in the
    format of AMLFS's noSquashNidLists (root squash doc: "10.0.2.4@tcp;10.0.2.[6-8]@tcp"): one
    `a.b.c.[lo-hi]@tcp` per /24 of the subnet, from its first usable address (Azure reserves the first
    four) to its last (Azure reserves the broadcast address)."""
    if settings.root_squash_trusted_nids:
        return settings.root_squash_trusted_nids
    net = ipaddress.IPv4Network(settings.compute_subnet_cidr)
    first, last = net[FIRST_HOST_OFFSET], net[-2]
    blocks = [net] if net.prefixlen >= 24 else list(net.subnets(new_prefix=24))
    nids: list[str] = []
    for b in blocks:
        lo, hi = max(b[0], first), min(b[-1], last)
        stem = str(lo).rsplit(".", 1)[0]
        lo_o, hi_o = int(str(lo).rsplit(".", 1)[1]), int(str(hi).rsplit(".", 1)[1])
        nids.append(f"{stem}.{lo_o}@tcp" if lo_o == hi_o else f"{stem}.[{lo_o}-{hi_o}]@tcp")
    return ";".join(nids)


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

        amlfs, compute = s.amlfs_subnet_cidr, s.compute_subnet_cidr
        amlfs_nsg = network.NetworkSecurityGroup(f"{name}-amlfs-nsg", resource_group_name=rg, location=s.location,
                                                 security_rules=amlfs_rules(s), opts=child)
        compute_nsg = network.NetworkSecurityGroup(f"{name}-compute-nsg", resource_group_name=rg, location=s.location,
                                                   security_rules=compute_rules(s), opts=child)

        # New VNets no longer get default outbound access (subnets are private by default), and the nodes
        # have no public IPs; they still need package mirrors, the AMLFS apt repo, PyPI and Azure
        # endpoints. A NAT gateway gives the subnet outbound-only connectivity. The file system subnet's
        # outbound service tags (its NSG above) need the same path, so it shares the gateway.
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
