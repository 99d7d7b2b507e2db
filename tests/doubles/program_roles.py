"""The node identity's role assignments as the Pulumi program makes them, for the ARM double.

The double must refuse what ARM would refuse the node, so its grants are not written by hand:
the real program runs under Pulumi's mocks (tiered_ops.mockrun, once per test process), and the
management actions of every role assigned to the identity the ND scale set runs as are taken
with their scopes, translated from the program's resource ids to the double's.
"""
from __future__ import annotations

import functools
from typing import Any

from tests.doubles.arm_double import ArmDouble, Grant

# A well-formed OpenSSH public key (the private half was never kept); public keys are not secrets.
_SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB3q0iP7c4k5o4S8m6Yt2m1pVdQ3xY9kq7f1mZl0aB2c ops@example"
# Built-in roles the program assigns, by id: their management actions (data actions never reach
# ARM's management endpoint). https://learn.microsoft.com/azure/role-based-access-control/built-in-roles
_BUILT_IN: dict[str, tuple[str, ...]] = {
    "2a2b9908-6ea1-4ae2-8e65-a410df84e7d1": (   # Storage Blob Data Reader
        "Microsoft.Storage/storageAccounts/blobServices/containers/read",
        "Microsoft.Storage/storageAccounts/blobServices/generateUserDelegationKey/action"),
    "4633458b-17de-408a-b874-0445c86b69e6": ("Microsoft.KeyVault/vaults/read",),   # Key Vault Secrets User (data actions)
}


@functools.lru_cache(maxsize=4)
def _program(stack: str) -> Any:
    from tiered_ops import mockrun

    return mockrun.run(stack, {"sshPublicKey": _SSH_KEY}, preview_placeholders=False)


def program_node_grants(stack: str = "prod") -> tuple[list[Grant], str]:
    """(grants of the ND nodes' identity with the program's scopes, the program's AMLFS id)."""
    r = _program(stack)
    vmss = [x for x in r.resources if x.type.lower().endswith(":virtualmachinescaleset")]
    assert len(vmss) == 1, f"expected one scale set in the program, found {[x.name for x in vmss]}"
    uami_ids = list((vmss[0].inputs.get("identity") or {}).get("userAssignedIdentities") or {})
    assert uami_ids, "the ND scale set runs with no user-assigned identity"
    principals = {x.state.get("principalId") for x in r.resources
                  if x.type.lower().endswith(":userassignedidentity") and x.id in uami_ids}
    roles = {x.id.lower(): x for x in r.resources if x.type.lower().endswith(":roledefinition")}
    grants: list[Grant] = []
    for a in r.resources:
        if not a.type.lower().endswith(":roleassignment") or a.inputs.get("principalId") not in principals:
            continue
        rid = str(a.inputs["roleDefinitionId"])
        custom = roles.get(rid.lower())
        if custom is not None:
            for p in custom.inputs.get("permissions") or []:
                grants.append(Grant(tuple(p.get("actions") or ()), str(a.inputs["scope"]), tuple(p.get("notActions") or ())))
        else:
            guid = rid.rsplit("/", 1)[-1]
            assert guid in _BUILT_IN, f"the program assigns built-in role {guid}: add its management actions here"
            grants.append(Grant(_BUILT_IN[guid], str(a.inputs["scope"])))
    amlfs = [x for x in r.resources if x.type.lower().endswith(":amlfilesystem")]
    assert len(amlfs) == 1
    return grants, amlfs[0].id


def node_grants(double: ArmDouble, stack: str = "prod") -> list[Grant]:
    """The program's node grants with scopes moved onto the double's subscription, group and file system."""
    grants, fs_id = program_node_grants(stack)
    sub = fs_id.split("/")[2]
    rg_prefix = fs_id.split("/providers/")[0]
    double_rg = f"/subscriptions/{double.subscription_id}/resourceGroups/{double.resource_group}"

    def move(scope: str) -> str:
        low = scope.lower()
        if low.startswith(fs_id.lower()):
            return double.filesystem_id + scope[len(fs_id):]
        if low.startswith(rg_prefix.lower()):
            return double_rg + scope[len(rg_prefix):]
        return scope.replace(f"/subscriptions/{sub}", f"/subscriptions/{double.subscription_id}", 1)

    return [Grant(g.actions, move(g.scope), g.not_actions) for g in grants]
