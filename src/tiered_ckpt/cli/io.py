"""Subcommands bench, list, verify: checkpoint I/O on the accelerator layer."""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from tiered_ckpt import config as config_mod
from tiered_ckpt.cli.models import require_model
from tiered_ckpt.cli.output import byte_progress, human_bytes, print_error, print_json, print_table, stdout
from tiered_ckpt.distributed import Comm
from tiered_ckpt.errors import EXIT_FAILED, EXIT_OK, UserError
from tiered_ckpt.io import commit, fsafe, pools, reader, writer
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.io.options import IoOptions
from tiered_ckpt.io.sources import SyntheticSource, to_sources
from tiered_ckpt.naming import CheckpointId, require_name


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parent: argparse.ArgumentParser) -> None:
    b = sub.add_parser("bench", parents=[parent], help="write and read a synthetic checkpoint through the save path; report GB/s",
                       description="Writes a synthetic checkpoint exactly as save() does (sharded, inline hash, fsync, "
                                   "commit marker inside the timing), reads it back, reports write and read GB/s.")
    b.add_argument("--dir", help="checkpoint root to benchmark (default: --root / the config's root)")
    b.add_argument("--size", required=True, help="checkpoint size, e.g. 4GiB")
    b.add_argument("--files", type=int, help="shard files (default: {config:io.files_per_rank})")
    b.add_argument("--threads", type=int, help="writer/reader threads (default: {config:io.threads})")
    b.add_argument("--block", help="request size, a multiple of 4 KiB (default: {config:io.block_size})")
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--direct", dest="direct", action="store_true", default=None, help="O_DIRECT for the data files (default: {config:io.direct})")
    mode.add_argument("--buffered", dest="direct", action="store_false", help="through the page cache")
    b.add_argument("--no-hash", dest="hash", action="store_false", help="skip the inline xxh3-128 hash (to measure its cost)")
    b.add_argument("--keep", action="store_true",
                   help=f"leave the benchmark checkpoint in its scratch directory (<dir>/{BENCH_DIR}/<run>/) instead of "
                        "deleting it; it never becomes one of the model's checkpoints")
    b.add_argument("--name", help="with --keep: the checkpoint name inside the scratch directory (default: global_epoch0_step1)")
    b.set_defaults(handler=cmd_bench)

    ls = sub.add_parser("list", parents=[parent], help="checkpoints of the model: epoch, step, committed, bytes, files")
    ls.set_defaults(handler=cmd_list)

    v = sub.add_parser("verify", parents=[parent], help="exit 0 only if a checkpoint is complete and intact")
    v.add_argument("name", help="global_epoch<E>_step<S>")
    v.add_argument("--hash", action="store_true", help="also read every file and compare its xxh3-128 hash")
    v.set_defaults(handler=cmd_verify)


# Bench writes only here: a dot-directory under the root, so no lifecycle command ever sees it
# (list/status/retention/restore look at <root>/<model>/ only; the exporter skips dot-names;
# the teardown scan skips dot-directories), and each run in its own scratch "model" directory.
BENCH_DIR = ".tiered-ckpt-bench"


def _bench_scratch(root: Path) -> tuple[Path, str]:
    """(<root>/.tiered-ckpt-bench, a fresh run directory name) — created, never a symlink."""
    base = root / BENCH_DIR
    try:
        base.mkdir(mode=0o755, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the benchmark's scratch directory {base}: {e.strerror}; "
                        "pass a writable --dir") from None
    if not fsafe.is_real_dir(base):
        raise UserError(f"{base} is not a directory (or is a symlink); remove it, then re-run bench")
    run = f"run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{secrets.token_hex(3)}"
    return base, run


def _remove_scratch(base: Path, run: str) -> None:
    shutil.rmtree(base / run, ignore_errors=True)
    try:
        base.rmdir()          # only when no other run (a --keep, a concurrent bench) is left
    except OSError:
        pass


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def cmd_bench(args: argparse.Namespace, cfg: config_mod.NodeConfig) -> int:
    root = Path(args.dir) if args.dir else Path(cfg.root)
    size = config_mod.parse_size(args.size, "--size")
    if size <= 0:
        raise UserError("--size must be more than 0 bytes, e.g. --size 4GiB")
    block = config_mod.parse_size(args.block, "--block") if args.block else cfg.io.block_size
    if block < pools.ALIGN or block % pools.ALIGN:
        raise UserError(f"--block {args.block}: must be a multiple of 4 KiB (O_DIRECT alignment), e.g. 16MiB")
    for flag, val in (("--files", args.files), ("--threads", args.threads)):
        if val is not None and val < 1:
            raise UserError(f"{flag} {val}: must be >= 1")
    if args.name and not args.keep:
        raise UserError("--name only applies with --keep (without it the benchmark checkpoint is deleted)")
    commit.require_root(root, "--dir")
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    if size > free:     # it would fail with ENOSPC after filling the file system, or never end
        raise UserError(f"--size {args.size}: more than the free space of {root} ({human_bytes(free)}); "
                        "pick a smaller --size or another --dir")
    cid = require_name(args.name) if args.name else CheckpointId(0, 1)
    base, run = _bench_scratch(root)
    try:
        return _bench(args, cfg, base, run, cid, size, block)
    finally:
        if not args.keep:
            _remove_scratch(base, run)


def _bench(args: argparse.Namespace, cfg: config_mod.NodeConfig, base: Path, run: str, cid: CheckpointId,
           size: int, block: int) -> int:
    opts = IoOptions(files=args.files, threads=args.threads, block_size=block, direct=args.direct,
                     hash=args.hash).resolve(cfg.io)
    pool = pools.pool("sync", cfg.io.sync_buffer_bytes, block)
    sources = to_sources({"bench": SyntheticSource(size)})
    show = not args.json
    with byte_progress(f"write {cid.name}", size, enabled=show) as prog:
        t0 = time.perf_counter()
        save = writer.Save(base, run, cid, sources, Comm(0, 1), opts, pool, overwrite_incomplete=False,
                           progress=prog.advance)
        save.prepare()
        save.produce()
        result = save.finish()
        write_s = time.perf_counter() - t0
    info = commit.inspect(run, Path(result.path), cid)   # just this directory, not a scan
    assert info.manifest is not None
    m = info.manifest
    cache_dropped = opts.direct or _drop_page_cache()
    with byte_progress(f"read  {cid.name}", size, enabled=show) as prog:
        t0 = time.perf_counter()
        problems = reader.read_files(info.path, [f for f in m.files if f.path.endswith(".bin")], threads=opts.threads,
                                     block_size=block, direct=opts.direct, check_hash=opts.hash, progress=prog.advance)
        read_s = time.perf_counter() - t0
    if problems:
        raise UserError("read-back failed: " + "; ".join(problems), exit_code=EXIT_FAILED)
    out: dict[str, Any] = {
        "name": cid.name, "path": str(info.path), "kept": bool(args.keep), "bytes": size, "files": result.files,
        "threads": opts.threads, "block": block, "direct": result.direct, "hash": opts.hash,
        "write_seconds": round(write_s, 4), "write_GBps": round(size / write_s / 1e9, 4),
        "read_seconds": round(read_s, 4), "read_GBps": round(size / read_s / 1e9, 4),
        "read_from_page_cache_possible": not cache_dropped,
    }
    prov = cfg.amlfs.provisioned_gbps
    if prov:
        per_node = prov / cfg.nodes
        out.update(provisioned_GBps=prov, nodes=cfg.nodes, node_share_GBps=round(per_node, 4),
                   write_share_of_node_share=round(out["write_GBps"] / per_node, 4),
                   read_share_of_node_share=round(out["read_GBps"] / per_node, 4))
    if args.json:
        print_json(out)
        return EXIT_OK
    rows = [["write", human_bytes(size), f"{write_s:.2f} s", f"{out['write_GBps']:.2f} GB/s"],
            ["read", human_bytes(size), f"{read_s:.2f} s", f"{out['read_GBps']:.2f} GB/s"]]
    if prov:
        rows[0].append(f"{out['write_share_of_node_share']:.0%}")
        rows[1].append(f"{out['read_share_of_node_share']:.0%}")
    cols = ["", "bytes", "time", "rate"] + ([f"share of {prov:g} GB/s / {cfg.nodes} node(s)"] if prov else [])
    print_table(f"{cid.name}: {result.files} files, {opts.threads} threads, block {human_bytes(block)}, "
                f"{'O_DIRECT' if result.direct else 'buffered'}, hash {'on' if opts.hash else 'off'}", cols, rows)
    if not cache_dropped:
        stdout.print("note: buffered read may be served from the page cache (could not drop it)")
    stdout.print(f"kept at {info.path} (a scratch directory, not one of {cfg.model}'s checkpoints; "
                 f"remove it with: rm -r {base / run})" if args.keep else "benchmark checkpoint deleted", highlight=False)
    return EXIT_OK


def _disk_usage(path: Path) -> tuple[int, int]:
    total = count = 0
    try:
        for e in os.scandir(path):
            if e.is_file(follow_symlinks=False):
                total += e.stat(follow_symlinks=False).st_size
                count += 1
    except OSError:         # unreadable or vanished: a listing shows what it can
        pass
    return total, count


def cmd_list(args: argparse.Namespace, cfg: config_mod.NodeConfig) -> int:
    root = commit.require_root(cfg.root)
    require_model(cfg)
    infos = commit.scan(root, cfg.model, cfg.naming)
    done = commit.committed(infos)
    latest = done[-1] if done else None       # scan is oldest first; not a second scan
    rows: list[dict[str, Any]] = []
    for c in infos:
        if c.manifest is not None:
            nbytes, nfiles = c.manifest.total_bytes, len(c.manifest.files)
        else:
            nbytes, nfiles = _disk_usage(c.path)
        rows.append({"name": c.name, "epoch": c.id.epoch, "step": c.id.step, "committed": c.committed,
                     "bytes": nbytes, "files": nfiles, "latest": latest is not None and c.name == latest.name,
                     "path": str(c.path), "problem": c.why_not_committed})
    if args.json:
        print_json({"root": str(root), "model": cfg.model, "checkpoints": rows})
        return EXIT_OK
    print_table(f"{root / cfg.model}", ["name", "epoch", "step", "committed", "bytes", "files"],
                [[r["name"], r["epoch"], r["step"], "yes" if r["committed"] else "NO",
                  human_bytes(r["bytes"]), r["files"]] for r in rows])
    if not rows:
        stdout.print(f"no checkpoints under {root / cfg.model}", highlight=False)
    elif latest is not None:
        stdout.print(f"latest committed: {latest.name}", highlight=False)
    for r in rows:
        if r["problem"]:
            stdout.print(f"{r['name']}: {r['problem']}", highlight=False, markup=False)
    if any(not r["committed"] and not r["problem"] for r in rows):
        stdout.print(f"committed NO: a save in progress or one that never finished (no {MARKER})", highlight=False)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace, cfg: config_mod.NodeConfig) -> int:
    require_name(args.name, cfg.naming)
    root = commit.require_root(cfg.root)
    path = root / cfg.model / args.name
    m = commit.read_marker(path, anchor=root)
    total = m.total_bytes if m is not None else 0
    with byte_progress(f"verify {args.name}", total, enabled=not args.json and args.hash) as prog:
        rep = reader.verify(path, check_hash=args.hash, threads=cfg.io.threads, block_size=cfg.io.block_size,
                            direct=cfg.io.direct, progress=prog.advance, anchor=root)
    out = {"ok": rep.ok, "name": rep.name, "path": rep.path, "committed": rep.committed, "bytes": rep.bytes,
           "files": rep.files, "hash_checked": rep.hashed, "problems": rep.problems, "notes": rep.notes}
    if args.json:
        print_json(out)
    else:
        for n in rep.notes:
            stdout.print(f"note: {n}", highlight=False)
        if rep.ok:
            stdout.print(f"{args.name}: committed, {rep.files} files, {human_bytes(rep.bytes)}, sizes "
                         + ("and hashes " if rep.hashed else "") + "match the manifest", highlight=False)
        else:
            print_error(f"{args.name} is not complete and intact:\n  " + "\n  ".join(rep.problems))
    return EXIT_OK if rep.ok else EXIT_FAILED
