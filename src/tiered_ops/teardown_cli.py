"""Operator teardown between training campaigns (docs/teardown.md).

    python -m tiered_ops.teardown_cli --stack prod [--dry-run] [--yes] [--lustre-root /lustrefs | --verify-content]
                               [--manual-export] [--json]
    python -m tiered_ops.teardown_cli delete-archive --stack prod [--dry-run] [--json]

`make teardown STACK=prod ARGS="--dry-run"` runs the first. The teardown proves that Blob holds
every committed checkpoint, disables auto-export, sets tiered:computeEnabled=false and runs
`pulumi up`: the cluster and the file system go, the archive stays under Pulumi's management.
`delete-archive` is the separate, explicit command that deletes the archive itself.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from tiered_ckpt.cli.app import os_error_message
from tiered_ckpt.cli.output import print_error, print_json, redact
from tiered_ckpt.config import parse_duration
from tiered_ckpt.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, ConfigError, UserError
from tiered_ops import PROJECT_ROOT as ROOT
from tiered_ops.delete_archive import delete_archive
from tiered_ops.teardown import Refused, Teardown
from tiered_ops.teardown_state import Options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tiered_ops.teardown_cli",
        description="Remove the compute side of a stack (cluster, AMLFS, network) only after proving the archive holds "
                    "every committed checkpoint; the archive stays. `delete-archive` deletes the archive itself.",
    )
    p.add_argument("action", nargs="?", choices=("teardown", "delete-archive"), default="teardown",
                   help="teardown (default) or delete-archive (separate, explicit; asks you to type the account name)")
    p.add_argument("--stack", required=True, help="the Pulumi stack, e.g. prod")
    p.add_argument("--dry-run", action="store_true",
                   help="print every step and the gate's verdict; change nothing. Like a real run it reads the stack "
                        "through the pulumi CLI: it needs `pulumi` on PATH, logged in to the stack's backend, and the "
                        "stack itself (an offline look at a stack that was never deployed: `make plan`)")
    p.add_argument("--yes", action="store_true",
                   help="skip the ordinary confirmations and the preview (never replaces --force's or delete-archive's typed confirmation)")
    p.add_argument("--force", action="store_true",
                   help="tear down even if the gate fails (checkpoints not in Blob are lost); you must type the stack name")
    p.add_argument("--wait-timeout", default="30m", metavar="DURATION",
                   help="how long to wait for the archive to catch up before refusing (default 30m; 0 = check once)")
    p.add_argument("--poll-interval", default="30s", metavar="DURATION", help="time between gate checks while waiting (default 30s)")
    p.add_argument("--manual-export", action="store_true",
                   help="if the gate fails: disable auto-export and run a manual archive of the checkpoint prefix, then re-check")
    p.add_argument("--lustre-root", type=Path, metavar="PATH",
                   help="mount point of the file system (e.g. /lustrefs) where this runs on a node: scan committed markers "
                        "there and require each checkpoint in Blob (default: use the markers found in Blob)")
    p.add_argument("--verify-content", action="store_true",
                   help="download and hash every file of every committed checkpoint from Blob and compare with its "
                        "manifest (streamed, in parallel). Needed without --lustre-root where the blobs carry no "
                        "exporter hash (AMLFS auto-export writes none): size alone does not prove content")
    p.add_argument("--lfs", default="lfs", metavar="PATH",
                   help="the lfs binary for `lfs hsm_state` with --lustre-root (default: lfs on PATH)")
    p.add_argument("--download-concurrency", type=int, default=8, metavar="N",
                   help="files downloaded at a time by --verify-content (default 8)")
    p.add_argument("--no-blob-check", action="store_true",
                   help="do not list the data container (e.g. its firewall excludes you); rely on the auto-export counters")
    p.add_argument("--connection-string", default=os.environ.get("AZURE_STORAGE_CONNECTION_STRING"), metavar="CS",
                   help="Blob connection string instead of the account URL + DefaultAzureCredential (Azurite; default "
                        "$AZURE_STORAGE_CONNECTION_STRING)")
    p.add_argument("--arm-endpoint", metavar="URL", help="Azure Resource Manager endpoint (default https://management.azure.com)")
    p.add_argument("--disable-timeout", default="30m", metavar="DURATION", help="how long to wait for auto-export to reach Disabled")
    p.add_argument("--state-dir", type=Path, default=ROOT / ".teardown", metavar="DIR",
                   help="where the teardown journal lives (default .teardown/ in the project)")
    p.add_argument("--project-dir", type=Path, default=ROOT, metavar="DIR", help="the Pulumi project (default: this repository)")
    p.add_argument("--json", action="store_true", help="machine-readable steps (\"plan\") and result on stdout; progress stays on stderr")
    return p


def _duration(text: str, flag: str) -> float:
    """'30m', '90s', '2h' or plain seconds (the toolkit's one duration parser)."""
    return parse_duration(text, flag)


def options(args: argparse.Namespace) -> Options:
    return Options(
        stack=args.stack, project_dir=args.project_dir, state_dir=args.state_dir, dry_run=args.dry_run, yes=args.yes,
        force=args.force, as_json=args.json, wait_timeout=_duration(args.wait_timeout, "--wait-timeout"),
        poll_interval=_duration(args.poll_interval, "--poll-interval"), manual_export=args.manual_export,
        lustre_root=args.lustre_root, blob_check=not args.no_blob_check, connection_string=args.connection_string or None,
        arm_endpoint=args.arm_endpoint, disable_timeout=_duration(args.disable_timeout, "--disable-timeout"),
        verify_content=args.verify_content, lfs=args.lfs, download_concurrency=max(1, args.download_concurrency),
    )


def _require_pulumi(opts: Options) -> None:
    """Before any step (the dry run too): the stack is read through the pulumi CLI, so say up front
    what the run needs rather than failing at its first read."""
    if shutil.which("pulumi") is None:
        what = "the dry run" if opts.dry_run else "the teardown"
        raise ConfigError(
            f"{what} reads stack {opts.stack!r} (its outputs and config) through the pulumi CLI, which is not on PATH: "
            "install it (https://www.pulumi.com/docs/install/), log in to the stack's backend (pulumi login), and run "
            f"from the project directory {opts.project_dir}; for an offline look without a deployed stack: make plan "
            f"STACK={opts.stack}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM takes the Ctrl-C path: the journal is already written step by step.
    old = signal.signal(signal.SIGTERM, _interrupt) if threading_main() else None
    try:
        opts = options(args)
        _require_pulumi(opts)
        if args.action == "delete-archive":
            result = delete_archive(opts)
        else:
            result = Teardown(opts).run()
        if args.json:
            print_json(result)
        return EXIT_OK if result.get("ok") else EXIT_FAILED
    except Refused as e:
        if args.json:
            print_json({**e.result, "ok": False, "error": str(e), "exit_code": e.exit_code})
        else:
            # Plain text, not wrapped: a refusal is a list an operator reads line by line.
            sys.stderr.write(redact(f"error: {e}\n"))
        return e.exit_code
    except UserError as e:
        print_error(str(e), as_json=args.json, exit_code=e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        print_error("interrupted; re-run the same command to continue (the journal in --state-dir records what is done)",
                    as_json=args.json, exit_code=EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except OSError as e:
        # e.g. a read-only --state-dir (the journal) or an unreadable --lustre-root
        msg, code = os_error_message(e)
        print_error(msg, as_json=args.json, exit_code=code)
        return code
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
