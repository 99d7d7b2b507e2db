"""Core storage layer: the archive. Its own resource group, never removed by a teardown of compute.

Storage account (StorageV2), private data + logging containers, lifecycle policy on the checkpoint
prefix, blob soft delete, and the role grants the AMLFS resource provider needs before any file
system can use the containers, followed by an explicit propagation wait.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumiverse_time
from pulumi_azure_native import resources, storage

from components.settings.schema import Settings

from . import identity

DATA_CONTAINER = "checkpoints"
LOGGING_CONTAINER = "amlfs-logs"


def account_name(settings: Settings, subscription_id: pulumi.Input[str], kind: str) -> pulumi.Output[str]:
    """A storage account name (3-24 lowercase alphanumerics, globally unique), stable for a stack.

    Deterministic, so the archive keeps its name (and its blob URLs) across compute-off/on cycles.
    """
    stem = (settings.name_prefix + re.sub(r"[^a-z0-9]", "", settings.stack.lower()))[:14]
    return pulumi.Output.from_input(subscription_id).apply(
        lambda sub: f"{stem}{kind}{hashlib.sha256(f'{sub}/{settings.stack}/{kind}'.encode()).hexdigest()[:8]}")


@dataclass
class CoreStorageArgs:
    settings: Settings
    subscription_id: pulumi.Input[str]
    rp_principal_id: pulumi.Input[str]
    # Subnets admitted by the firewall; empty while the compute side is off (nothing reads the archive then
    # except Azure services, which the AzureServices bypass covers).
    allowed_subnet_ids: Sequence[pulumi.Input[str]] = field(default_factory=list)


class CoreStorage(pulumi.ComponentResource):
    resource_group_name: pulumi.Output[str]
    account_name: pulumi.Output[str]
    account_id: pulumi.Output[str]
    blob_endpoint: pulumi.Output[str]
    data_container_name: pulumi.Output[str]
    data_container_id: pulumi.Output[str]
    logging_container_name: pulumi.Output[str]
    logging_container_id: pulumi.Output[str]
    grants_ready: pulumiverse_time.Sleep

    def __init__(self, name: str, args: CoreStorageArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("tiered:storage:CoreStorage", name, None, opts)
        s = args.settings
        child = pulumi.ResourceOptions(parent=self)
        # The archive must never disappear with a stack change: protect the group, account and data
        # container (deleting the archive is a separate, explicit operation: `pulumi state unprotect`).
        keep = pulumi.ResourceOptions(parent=self, protect=True)

        rg = resources.ResourceGroup(f"{name}-rg", resource_group_name=f"{s.base_name}-storage-rg", location=s.location, opts=keep)
        account = storage.StorageAccount(
            f"{name}-account",
            account_name=account_name(s, args.subscription_id, "st"),
            resource_group_name=rg.name,
            location=s.location,
            kind=storage.Kind.STORAGE_V2,
            # Settings admits only names of storage.SkuName (REST spec storage/stable/2024-01-01/storage.json).
            sku=storage.SkuArgs(name=storage.SkuName(s.storage_sku)),
            access_tier=storage.AccessTier.HOT,
            enable_https_traffic_only=True,
            minimum_tls_version=storage.MinimumTlsVersion.TLS1_2,
            allow_blob_public_access=False,
            # AMLFS needs shared key access: the service mints SAS tokens from the account key for its
            # import/export data movers. Disabling it breaks blob integration.
            allow_shared_key_access=True,
            network_rule_set=storage.NetworkRuleSetArgs(
                default_action=storage.DefaultAction.DENY,
                bypass=storage.Bypass.AZURE_SERVICES,
                virtual_network_rules=[storage.VirtualNetworkRuleArgs(virtual_network_resource_id=sid, action=storage.Action.ALLOW)
                                       for sid in args.allowed_subnet_ids],
                ip_rules=[],
            ),
            opts=keep,
        )
        storage.BlobServiceProperties(
            f"{name}-blob-service",
            resource_group_name=rg.name,
            account_name=account.name,
            blob_services_name="default",
            delete_retention_policy=storage.DeleteRetentionPolicyArgs(enabled=True, days=s.soft_delete_days),
            container_delete_retention_policy=storage.DeleteRetentionPolicyArgs(enabled=True, days=s.soft_delete_days),
            opts=child,
        )
        data = storage.BlobContainer(f"{name}-data", resource_group_name=rg.name, account_name=account.name,
                                     container_name=DATA_CONTAINER, public_access=storage.PublicAccess.NONE, opts=keep)
        logs = storage.BlobContainer(f"{name}-logs", resource_group_name=rg.name, account_name=account.name,
                                     container_name=LOGGING_CONTAINER, public_access=storage.PublicAccess.NONE, opts=child)

        # Lustre deletes never reach Blob: without this policy the archive only grows.
        def after(days: int) -> storage.DateAfterModificationArgs | None:   # 0 = never (Settings)
            return storage.DateAfterModificationArgs(days_after_modification_greater_than=days) if days else None

        # Tiering only, never an age-based delete: a rule knows blob ages, not which checkpoint is the
        # newest, so a delete would expire a paused campaign's only checkpoints (settings refuse
        # deleteAfterDays). Expiry is `tiered-ckpt archive retention`, which keeps the newest ones.
        base_blob = storage.ManagementPolicyBaseBlobArgs(
            tier_to_cool=after(s.cool_after_days), tier_to_cold=after(s.cold_after_days))
        if s.cool_after_days or s.cold_after_days:
            storage.ManagementPolicy(
                f"{name}-lifecycle",
                resource_group_name=rg.name,
                account_name=account.name,
                management_policy_name="default",
                policy=storage.ManagementPolicySchemaArgs(rules=[storage.ManagementPolicyRuleArgs(
                    name="checkpoint-tiering",
                    enabled=True,
                    type=storage.RuleType.LIFECYCLE,
                    definition=storage.ManagementPolicyDefinitionArgs(
                        filters=storage.ManagementPolicyFilterArgs(blob_types=["blockBlob"],
                                                                   prefix_match=[f"{DATA_CONTAINER}/{s.blob_prefix}/"]),
                        actions=storage.ManagementPolicyActionArgs(base_blob=base_blob),
                    ),
                )]),
                opts=pulumi.ResourceOptions(parent=self, depends_on=[data]),
            )

        # AMLFS's data mover needs its roles on the account (components/resources/identity.py).
        grants = identity.resource_provider_grants(name, principal_id=args.rp_principal_id, subscription_id=args.subscription_id,
                                                   account_id=account.id, opts=child)
        # Role assignments take up to 5 minutes to apply; a file system created earlier fails with
        # "container not found or inaccessible". Everything that creates a file system depends on this.
        self.grants_ready = pulumiverse_time.Sleep(f"{name}-role-propagation", create_duration=s.role_wait_duration,
                                       triggers={"account": account.id},
                                       opts=pulumi.ResourceOptions(parent=self, depends_on=grants))

        self.resource_group_name = rg.name
        self.account_name = account.name
        self.account_id = account.id
        self.blob_endpoint = account.primary_endpoints.apply(lambda e: e.blob)
        self.data_container_name = data.name
        self.data_container_id = data.id
        self.logging_container_name = logs.name
        self.logging_container_id = logs.id
        self.register_outputs({
            "resource_group_name": self.resource_group_name, "account_name": self.account_name,
            "blob_endpoint": self.blob_endpoint, "data_container_id": self.data_container_id,
            "logging_container_id": self.logging_container_id,
        })
