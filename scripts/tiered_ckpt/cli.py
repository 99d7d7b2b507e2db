"""`tiered-ckpt`: the node toolkit's command line.

Each command lives in the module that does its job; this file only wires them and turns
user errors into one clear line and an exit code (see errors.py), never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Callable, Sequence

from . import config as config_mod
from .errors import EXIT_INTERRUPTED, UserError
from .output import print_error

# Modules that contribute subcommands through `register(subparsers, parent)`.
COMMAND_MODULES = (
    "tiered_ckpt.cmd_io",         # bench, list, verify
    "tiered_ckpt.cmd_lifecycle",  # retention, restore, status, export
    "tiered_ckpt.cmd_demo",       # demo
)

Handler = Callable[[argparse.Namespace, config_mod.NodeConfig], int]


def common_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", help=f"node config file (default: ${config_mod.ENV_VAR} or {config_mod.DEFAULT_PATH})")
    p.add_argument("--root", help="checkpoint root on the accelerator layer (default: from the config)")
    p.add_argument("--model", help="model directory under the root (default: from the config)")
    p.add_argument("--backend", choices=("amlfs", "local"), help="tier back-end (default: from the config)")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered-ckpt",
        description="Checkpoint I/O, archive proof, retention and restore on the accelerator layer (AMLFS) and Blob.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parent = common_parser()
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub, parent)
    return parser


def load_config(args: argparse.Namespace) -> config_mod.NodeConfig:
    cfg = config_mod.load(args.config)
    return cfg.with_overrides(
        root=getattr(args, "root", None),
        model=getattr(args, "model", None),
        backend=getattr(args, "backend", None),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # SIGTERM (systemd stop, kill) takes the same clean-up path as Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        cfg = load_config(args)
        handler: Handler = args.handler
        return int(handler(args, cfg) or 0)
    except UserError as e:
        print_error(str(e), as_json=getattr(args, "json", False), exit_code=e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        print_error("interrupted; nothing committed was changed", as_json=getattr(args, "json", False), exit_code=EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
