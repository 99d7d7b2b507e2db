"""Who may do what on Azure: every role definition and role assignment the program creates.

* The ND nodes' identity (`node_grants`): Blob read on the data container (restore/verify read the archive;
  AMLFS writes it) and on the tools container (the toolkit tarball), the custom role NODE_ACTIONS at the
  file system, and Key Vault Secrets User on the cluster's vault (the munge key).
* The login VM's own identity (`login_vault_grant`): Key Vault Secrets Officer on that vault only (it creates
  the munge key at first boot).
* The HPC Cache resource provider, AMLFS's data mover (`resource_provider_grants`): Storage Account
  Contributor and Storage Blob Data Contributor on the archive account, nothing wider.

Teardown and `pulumi up` itself run with the operator's own credentials. docs/arm.md explains each call.
"""
from __future__ import annotations

import hashlib

import pulumi
from pulumi_azure_native import authorization

from components.settings.schema import Settings

# Built-in role definition GUIDs, the same in every tenant (Azure docs: "Azure built-in roles",
# https://learn.microsoft.com/azure/role-based-access-control/built-in-roles).
STORAGE_ACCOUNT_CONTRIBUTOR = "17d1049b-9a84-46fb-8f53-869881c3d3ab"
STORAGE_BLOB_DATA_CONTRIBUTOR = "ba92f5b4-2d11-453d-a403-e96b0029c9fe"
STORAGE_BLOB_DATA_READER = "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1"
# Built-in roles (Azure docs, "Azure built-in roles for Security"): read secret values / manage secrets.
KEY_VAULT_SECRETS_USER = "4633458b-17de-408a-b874-0445c86b69e6"
KEY_VAULT_SECRETS_OFFICER = "b86a8fe4-44ce-4948-aee5-eccb2c155cd7"

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


def role_definition_id(subscription_id: pulumi.Input[str], guid: str) -> pulumi.Output[str]:
    """Full resource ID of a built-in role: ARM rejects a bare GUID in roleDefinitionId."""
    return pulumi.Output.concat("/subscriptions/", subscription_id, "/providers/Microsoft.Authorization/roleDefinitions/", guid)


def node_role_name(s: Settings, subscription_id: str) -> str:
    """Custom role names are unique per tenant (ARM: RoleDefinitionWithSameNameExists): the name carries a
    short hash of the subscription, so the same stack in a second subscription of the tenant gets its own."""
    return f"tiered-ckpt node jobs ({s.base_name}, {s.location}, {hashlib.sha256(subscription_id.lower().encode()).hexdigest()[:8]})"


def _assign(name: str, principal_id: pulumi.Input[str], scope: pulumi.Input[str], role_id: pulumi.Input[str],
            opts: pulumi.ResourceOptions) -> authorization.RoleAssignment:
    return authorization.RoleAssignment(
        name, principal_id=principal_id, principal_type=authorization.PrincipalType.SERVICE_PRINCIPAL,
        role_definition_id=role_id, scope=scope, opts=opts)


def node_grants(name: str, s: Settings, *, principal_id: pulumi.Input[str], subscription_id: pulumi.Input[str],
                resource_group_id: pulumi.Input[str], data_container_id: pulumi.Input[str],
                tools_container_id: pulumi.Input[str], filesystem_id: pulumi.Input[str],
                opts: pulumi.ResourceOptions) -> list[authorization.RoleAssignment]:
    """The ND nodes' identity: Blob read on the data and tools containers, the custom role at the file system."""
    reader = role_definition_id(subscription_id, STORAGE_BLOB_DATA_READER)
    grants = [_assign(f"{name}-archive-reader", principal_id, data_container_id, reader, opts),
              _assign(f"{name}-tools-reader", principal_id, tools_container_id, reader, opts)]
    # Custom roles cannot list a single resource as assignable scope, so the definition is assignable in
    # the compute resource group and assigned at the file system only.
    role = authorization.RoleDefinition(
        f"{name}-fs-jobs-role",
        role_name=pulumi.Output.from_input(subscription_id).apply(lambda sub: node_role_name(s, sub)),
        description="Import jobs and auto-export admin status on one AMLFS file system (tiered-ckpt restore/retention).",
        role_type="CustomRole",
        scope=resource_group_id,
        assignable_scopes=[resource_group_id],
        permissions=[authorization.PermissionArgs(actions=NODE_ACTIONS, not_actions=[], data_actions=[], not_data_actions=[])],
        opts=opts)
    grants.append(_assign(f"{name}-fs-jobs", principal_id, filesystem_id, role.id, opts))
    return grants


def node_vault_grant(name: str, *, principal_id: pulumi.Input[str], subscription_id: pulumi.Input[str],
                     vault_id: pulumi.Input[str], opts: pulumi.ResourceOptions) -> authorization.RoleAssignment:
    """The ND nodes' identity reads the munge key: Key Vault Secrets User on the cluster's vault only."""
    return _assign(f"{name}-vault-reader", principal_id, vault_id, role_definition_id(subscription_id, KEY_VAULT_SECRETS_USER), opts)


def login_vault_grant(name: str, *, principal_id: pulumi.Input[str], subscription_id: pulumi.Input[str],
                      vault_id: pulumi.Input[str], opts: pulumi.ResourceOptions) -> authorization.RoleAssignment:
    """The login VM's own identity creates the munge key: Key Vault Secrets Officer on that vault only."""
    return _assign(f"{name}-vault-officer", principal_id, vault_id, role_definition_id(subscription_id, KEY_VAULT_SECRETS_OFFICER), opts)


def resource_provider_grants(name: str, *, principal_id: pulumi.Input[str], subscription_id: pulumi.Input[str],
                             account_id: pulumi.Input[str], opts: pulumi.ResourceOptions) -> list[authorization.RoleAssignment]:
    """The HPC Cache Resource Provider (AMLFS's data mover) needs both roles on the account, not wider."""
    return [_assign(f"{name}-rp-{short}", principal_id, account_id, role_definition_id(subscription_id, guid), opts)
            for short, guid in (("account-contributor", STORAGE_ACCOUNT_CONTRIBUTOR),
                                ("blob-data-contributor", STORAGE_BLOB_DATA_CONTRIBUTOR))]
