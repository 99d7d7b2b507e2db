"""Deleting the archive: separate from the teardown, explicit, with a typed confirmation.

    python -m tiered_ops.teardown_cli delete-archive --stack prod [--dry-run] [--json]

Refuses while the stack still has its compute side; lists what goes (account, containers, blobs,
committed checkpoints), then asks for the storage account's name before `pulumi state unprotect`
and `pulumi destroy`. Blob soft delete does not cover a deleted account.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tiered_ckpt.cli.output import human_bytes
from tiered_ops.evidence import StackOutputs, blob_evidence, make_blob_store
from tiered_ops.pulumi_cli import PulumiCli
from tiered_ops.teardown import Refused, ask_stdin
from tiered_ops.teardown_state import Options


def delete_archive(opts: Options, *, pulumi: PulumiCli | None = None, ask: Callable[[str], str] | None = None) -> dict[str, Any]:
    cli = pulumi or PulumiCli(opts.stack, opts.project_dir)
    asker = ask or ask_stdin
    o = StackOutputs(cli.outputs())
    if o.compute_present:
        raise Refused(
            f"stack {opts.stack} still has its compute side (file system {o.get('amlfsName')}); tear it down first "
            f"(make teardown STACK={opts.stack}), then delete the archive; nothing was changed")
    o.require("storageAccountName")
    account = str(o.get("storageAccountName"))
    inventory: dict[str, Any] = {"storageAccountName": account, "storageResourceGroup": o.get("storageResourceGroup"),
                                 "dataContainer": o.get("dataContainer"), "loggingContainer": o.get("loggingContainer")}
    if opts.blob_check:
        listing, ckpts, _ = blob_evidence(make_blob_store(o, opts.connection_string), with_markers=True)
        inventory.update(blobs=len(listing), bytes=sum(listing.values()), checkpoints=sorted(r.key for r in ckpts))
    commands = [cli.text("state", "unprotect", "--all", "--yes"), cli.text("destroy", "--yes")]
    result: dict[str, Any] = {"ok": False, "stack": opts.stack, "dry_run": opts.dry_run, "deletes": inventory, "plan": commands}
    sys.stderr.write(
        f"delete-archive: this PERMANENTLY deletes storage account {account} (resource group {o.get('storageResourceGroup')}), "
        f"its containers {o.get('dataContainer')} and {o.get('loggingContainer')}"
        + (f" with {inventory['blobs']} blob(s), {human_bytes(inventory['bytes'])}, {len(inventory['checkpoints'])} committed "
           f"checkpoint(s)" if "blobs" in inventory else "")
        + ", its lifecycle policy and the file-system role grants. Blob soft delete does not cover a deleted account.\n"
        + "".join(f"  $ {c}\n" for c in commands))
    if opts.dry_run:
        sys.stderr.write("dry run: nothing was changed\n")
        result["ok"] = True
        return result
    typed = asker(f"type the storage account name ({account}) to delete it: ").strip()
    if typed != account:
        raise Refused(f"you typed {typed!r}, not the storage account name {account!r}; nothing was deleted")
    cli.stream("state", "unprotect", "--all", "--yes")
    cli.stream("destroy", "--yes")
    result["ok"] = True
    if not opts.as_json:
        print(f"Archive of stack {opts.stack} deleted (storage account {account}). The stack itself remains: "
              f"pulumi stack rm {opts.stack} removes it.")
    return result
