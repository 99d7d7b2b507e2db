"""Subcommand convert: a checkpoint to PyTorch's stock formats, or a stock DCP directory into the model."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from tiered_ckpt import config as config_mod
from tiered_ckpt.cli.output import byte_progress, human_bytes, print_json, stdout
from tiered_ckpt.errors import EXIT_OK, UserError
from tiered_ckpt.io import commit
from tiered_ckpt.naming import require_name


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parent: argparse.ArgumentParser) -> None:
    c = sub.add_parser("convert", parents=[parent], help="a DCP checkpoint to a stock DCP directory or a torch.save file, "
                                                        "or a stock DCP directory into the model (needs torch)",
                       description="--to dcp DIR: a directory FileSystemReader, dcp.load(checkpoint_id=DIR) and "
                                   "format_utils.dcp_to_torch_save read. --to torch FILE: the whole state as one "
                                   "torch.save file. --from dcp DIR: a directory FileSystemWriter wrote, saved as the "
                                   "committed checkpoint NAME of the model (migration).")
    c.add_argument("name", help="the checkpoint (global_epoch<E>_step<S>, or the model's naming scheme)")
    way = c.add_mutually_exclusive_group()     # one of them (checked by the command: one clear line)
    way.add_argument("--to", choices=("dcp", "torch"), help="convert NAME into this format at PATH")
    way.add_argument("--from", dest="source", choices=("dcp",), help="make NAME from the stock DCP directory PATH")
    c.add_argument("path", help="the directory (dcp) or file (torch) to write, or to read with --from")
    c.add_argument("--hash", action="store_true", help="also check every file's xxh3-128 hash before converting")
    c.set_defaults(handler=cmd_convert)


def cmd_convert(args: argparse.Namespace, cfg: config_mod.NodeConfig) -> int:
    if importlib.util.find_spec("torch") is None:
        raise UserError("tiered-ckpt convert needs PyTorch: install torch in this environment (pip install torch)")
    from tiered_ckpt import dcp_convert
    from tiered_ckpt.dcp import TieredReader, TieredWriter

    if args.to is None and args.source is None:
        raise UserError("tiered-ckpt convert NAME needs a direction: --to dcp DIR, --to torch FILE, or --from dcp DIR")
    require_name(args.name, cfg.naming)
    root = Path(cfg.root)
    out: dict[str, Any]
    if args.source == "dcp":
        out = dcp_convert.from_dcp(args.path, TieredWriter(root, cfg.model, name=args.name, config=cfg))
    else:
        commit.require_root(root)
        reader = TieredReader(root, cfg.model, name=args.name, config=cfg, verify_hash=args.hash)
        if args.to == "dcp":
            total = reader.manifest.total_bytes
            with byte_progress(f"convert {args.name} to dcp", total, enabled=not args.json) as prog:
                out = dcp_convert.to_dcp(reader, args.path, progress=prog.advance)
        else:
            out = dcp_convert.to_torch(reader, args.path)
    if args.json:
        print_json(out)
        return EXIT_OK
    what = {"dcp": "stock DCP directory", "torch": "torch.save file", "tiered": "committed checkpoint"}[out["format"]]
    size = f", {human_bytes(out['bytes'])}" if "bytes" in out else ""
    stdout.print(f"{out['source']} -> {out['dest']} ({what}, {out['items']} items{size})", highlight=False)
    return EXIT_OK
