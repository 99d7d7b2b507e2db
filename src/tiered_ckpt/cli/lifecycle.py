"""Subcommands of the tier lifecycle: retention plan|apply, archive retention plan|apply, restore, status, export.

Wiring and rendering only: the work is in lifecycle/ (retention.py, restore.py, status.py,
exporter.py), which renders nothing and which the demo calls directly from Python.
"""
from __future__ import annotations

import argparse
import logging
import threading
from dataclasses import asdict

from tiered_ckpt.cli import argtypes
from tiered_ckpt.cli import timeline as timeline_commands
from tiered_ckpt.cli.models import require_model
from tiered_ckpt.cli.output import human_bytes, print_json, print_table, progress_bars, stderr, stdout
from tiered_ckpt.config import NodeConfig, format_duration, parse_duration
from tiered_ckpt.errors import EXIT_FAILED, EXIT_OK, ConfigError
from tiered_ckpt.io import commit
from tiered_ckpt.lifecycle import archive_retention as ar
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter, Iteration
from tiered_ckpt.lifecycle.restore import DEFAULT_LOCK_WAIT, HASHES, NO_HASHES, restore
from tiered_ckpt.lifecycle.status import Status, gather
from tiered_ckpt.tiers import memory
from tiered_ckpt.tiers.backends import TierBackend, make_backend
from tiered_ckpt.tiers.blob import BlobStore


def _policy(args: argparse.Namespace, cfg: NodeConfig) -> ret.Policy:
    newer = grace = None
    if args.keep_newer_than is not None:
        newer = parse_duration(args.keep_newer_than, "--keep-newer-than")
    if args.restore_grace is not None:
        grace = parse_duration(args.restore_grace, "--restore-grace")
    return ret.Policy.from_config(
        cfg.retention, keep_last=args.keep_last, keep_every_steps=args.keep_every_steps,
        keep_newer_than=newer, min_keep=args.min_keep, action=args.action, restore_grace=grace,
    )


def _print_decisions(decisions: list[ret.Decision], title: str) -> None:
    rows = [(d.name, d.action, human_bytes(d.bytes), d.reason) for d in decisions]
    print_table(title, ("checkpoint", "decision", "size", "reason"), rows)


def cmd_retention(args: argparse.Namespace, cfg: NodeConfig) -> int:
    policy = _policy(args, cfg)
    if policy.action == ret.RELEASE and cfg.backend != "amlfs":
        raise ConfigError("--action release frees Lustre data with lfs hsm_release and needs backend amlfs; use --action delete locally")
    backend = make_backend(cfg)
    if args.retention_cmd == "plan":
        ev = ret.evaluate(cfg, backend, policy)
        if args.json:
            print_json({"ok": True, **ev.to_json()})
        else:
            _print_decisions(ev.decisions, f"retention plan for {cfg.model} ({cfg.root}), nothing changed")
        return EXIT_OK
    try:
        res = ret.apply(cfg, backend, policy)
    finally:
        # The retention timer is what keeps the node-exporter textfile fresh between saves; a
        # failed run refreshes it too (its check_ok samples then say what could not be read).
        _refresh_textfile(cfg, backend)
    if args.json:
        print_json({"ok": True, **res.to_json()})
    else:
        _print_decisions(res.decisions, f"retention applied to {cfg.model} ({cfg.root})")
        stdout.print(f"done: {', '.join(res.done) or 'nothing'}; freed {human_bytes(res.freed_bytes)}")
    return EXIT_OK


def _refresh_textfile(cfg: NodeConfig, backend: TierBackend) -> None:
    """Rewrite metrics.textfile when it is set; never fails the command that did the work."""
    if not cfg.metrics.textfile:
        return
    from tiered_ckpt.lifecycle import metrics

    try:
        metrics.write_textfile(cfg, backend, cfg.metrics.textfile)
    except Exception as e:  # noqa: BLE001 - metrics are best effort
        logging.getLogger("tiered_ckpt.cli").warning("could not write the metrics textfile %s: %s",
                                                     cfg.metrics.textfile, e)


def _policy_flags(q: argparse.ArgumentParser) -> None:
    q.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N committed (default: {config:retention.keep_last})")
    q.add_argument("--keep-every-steps", type=int, metavar="K", help="keep every checkpoint whose step is a multiple of K; 0 = off "
                   "(default: {config:retention.keep_every_steps})")
    q.add_argument("--keep-newer-than", metavar="DURATION", help="keep checkpoints younger than this, e.g. 6h, 2d "
                   "(default: {config:retention.keep_newer_than})")
    q.add_argument("--min-keep", type=int, metavar="M", help="never touch the newest M committed (default: {config:retention.min_keep})")
    q.add_argument("--restore-grace", metavar="DURATION",
                   help="keep a checkpoint restored less than this ago; 0 = off "
                        "(default: {config:retention.restore_grace})")


def cmd_archive_retention(args: argparse.Namespace, cfg: NodeConfig) -> int:
    policy = _policy(args, cfg)
    store = BlobStore(cfg.archive)
    present = ar.on_lustre(cfg, args.lustre_gone)
    where = f"{cfg.model} in {store.where}"
    if args.retention_cmd == "plan":
        ev, _ = ar.evaluate(cfg, store, policy, present)
        if args.json:
            print_json({"ok": True, **ar.to_json(ev)})
        else:
            _print_decisions(ev.decisions, f"archive retention plan for {where}, nothing changed")
        return EXIT_OK
    res = ar.apply(cfg, store, policy, present)
    if args.json:
        print_json({"ok": True, **ar.to_json(res)})
    else:
        _print_decisions(res.decisions, f"archive retention applied to {where}")
        stdout.print(f"done: {', '.join(res.done) or 'nothing'}; freed {human_bytes(res.freed_bytes)} in the archive")
    return EXIT_OK


def cmd_metrics(args: argparse.Namespace, cfg: NodeConfig) -> int:
    from tiered_ckpt.lifecycle import metrics

    backend = make_backend(cfg)
    textfile = args.textfile or cfg.metrics.textfile
    if args.serve:
        import time

        from prometheus_client import start_http_server

        port = args.port if args.port is not None else cfg.metrics.port
        addr = args.addr or cfg.metrics.addr
        try:
            server, _ = start_http_server(port, addr=addr, registry=metrics.registry(cfg, backend))
        except OSError as e:
            raise ConfigError(f"metrics --serve: cannot listen on {addr}:{port}: {e.strerror or e}; "
                              "pick another --port (metrics.port) or stop what uses it") from None
        stderr.print(f"serving metrics of {cfg.model} on http://{addr}:{server.server_port}/metrics; Ctrl-C to stop")
        if args.json:
            print_json({"ok": True, "serving": f"http://{addr}:{server.server_port}/metrics"})
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            server.shutdown()
        return EXIT_OK
    if textfile:
        from tiered_ckpt.io.fsafe import UnsafePath

        try:
            metrics.write_textfile(cfg, backend, textfile)
        except UnsafePath as e:
            raise ConfigError(f"--textfile / metrics.textfile: {textfile} is {(e.strerror or 'not a regular file').split(',')[0]}, not a file this "
                              "command may replace; point it at a .prom file, e.g. "
                              "/var/lib/node_exporter/textfile_collector/tiered_ckpt.prom") from None
        if args.json:
            print_json({"ok": True, "textfile": textfile})
        else:
            stdout.print(f"wrote {textfile}", highlight=False)
        return EXIT_OK
    if args.json:
        print_json({"ok": True, "model": cfg.model, "samples": metrics.samples(cfg, backend)})
    else:
        import sys

        from prometheus_client import generate_latest

        sys.stdout.write(generate_latest(metrics.registry(cfg, backend)).decode())   # exposition format, as is
    return EXIT_OK


def cmd_restore(args: argparse.Namespace, cfg: NodeConfig) -> int:
    if args.name and args.latest:
        raise ConfigError("give either a checkpoint NAME or --latest, not both")
    wait = DEFAULT_LOCK_WAIT if args.wait is None else parse_duration(args.wait, "--wait")
    backend = make_backend(cfg)
    with progress_bars(enabled=not args.json) as bars:
        res = restore(cfg, backend, args.name, verify=args.verify, progress=bars,
                      lock_wait=wait)
    if args.json:
        print_json(res.to_json())
    else:
        how = {"resident": "already resident, nothing copied", "released": f"{res.prefetched_files} released files restored with lfs hsm_restore",
               "archive": "copied back from the archive"}[res.source]
        checked = {HASHES: "sizes and hashes verified", NO_HASHES: NO_HASHES}.get(res.check, "sizes verified")
        stdout.print(
            f"restored {res.name} at {res.path}: {how}; {human_bytes(res.bytes)} in {res.seconds:.1f}s "
            f"({res.gbps:.2f} GB/s); {checked}"
        )
        for w in res.warnings:
            stderr.print(f"[yellow]warning:[/] {w}")
    return EXIT_OK


def cmd_status(args: argparse.Namespace, cfg: NodeConfig) -> int:
    """Exit code: 0 healthy, 1 a problem found, 3 some part UNKNOWN (lifecycle/status.py)."""
    if timeline_commands.wants_watch(args):
        return timeline_commands.watch(args, cfg)
    st = gather(make_backend(cfg), export_status_path=args.export_status)
    mem = memory.summary(cfg.memory, cfg.model, cfg.naming)
    if args.json:
        print_json({"ok": st.health == "healthy", **st.to_json(), "memory": asdict(mem) if mem else None})
        return st.exit_code()
    print_table(f"checkpoints of {st.model} ({st.backend}, {st.root})", ("checkpoint", "tier", "size", "detail"),
                [(c.name, c.tier, human_bytes(c.bytes), c.detail) for c in st.checkpoints])
    b = st.backlog
    if b.files is None or b.bytes is None:
        stdout.print(f"export backlog: UNKNOWN: {_reason(st, 'backlog')}", highlight=False, markup=False, soft_wrap=True)
    else:
        age = "-" if b.oldest_age_s is None else f"{b.oldest_age_s:.0f}s"
        stdout.print(f"export backlog: {b.files} files, {human_bytes(b.bytes)}, oldest unarchived {age}"
                     f"{'; ' + b.note if b.note else ''}", highlight=False, markup=False, soft_wrap=True)
    e = st.export
    if not st.known("export"):
        stdout.print(f"export job: UNKNOWN: {_reason(st, 'export')}", highlight=False, markup=False, soft_wrap=True)
    else:
        stdout.print(f"export job: {e.get('job')}: state {e.get('state')}, last successful iteration "
                     f"{e.get('last_successful_iteration_utc') or e.get('last_success_utc') or '-'}, "
                     f"files failed {e.get('total_files_failed', '-')}", highlight=False, markup=False, soft_wrap=True)
    if st.capacity:
        c = st.capacity
        stdout.print(f"capacity: {human_bytes(c.used_bytes)} used of {human_bytes(c.total_bytes)}; retention keeps "
                     f"{human_bytes(c.retention_keeps_bytes)} + next checkpoint {human_bytes(c.next_checkpoint_bytes)} "
                     f"= {human_bytes(c.needed_bytes)} ({'fits' if c.fits else 'DOES NOT FIT'})", highlight=False, markup=False, soft_wrap=True)
    if mem is not None:
        n = mem.counters
        budget = f" of memory.budget_bytes {human_bytes(mem.budget_bytes)}" if mem.budget_bytes else ""
        lag = "-" if mem.replica_lag_seconds is None else f"{mem.replica_lag_seconds:.2f}s"
        stdout.print(f"memory tier (this node, {mem.dir}): {mem.own} own copies, {mem.peer} replicas held for a peer, "
                     f"{human_bytes(mem.used_bytes)} used{budget}; newest {mem.newest or '-'}; replicas "
                     f"{n['replicas']:.0f} ({n['replica_failures']:.0f} failed, lag {lag}), persisted "
                     f"{n['persists']:.0f} ({n['persist_failures']:.0f} failed), flushes {n['flushes']:.0f}; "
                     "RAM is not durable: the root and the archive are", highlight=False, markup=False, soft_wrap=True)
    for chk in st.checks:
        stdout.print(f"check {chk.part}: {chk.state}{': ' + chk.reason if chk.reason else ''}", highlight=False,
                     markup=False, soft_wrap=True)
    stdout.print(f"health: {st.health} (exit {st.exit_code()})", highlight=False, markup=False, soft_wrap=True)
    return st.exit_code()


def _reason(st: Status, part: str) -> str:
    return next((c.reason for c in st.checks if c.part == part), "")


def cmd_export(args: argparse.Namespace, cfg: NodeConfig) -> int:
    interval = parse_duration(args.interval, "--interval")
    if interval <= 0:
        raise ConfigError(f"--interval: {args.interval} must be more than 0 seconds, e.g. 5s")
    ex = Exporter(cfg, status_path=args.export_status, models=None if args.all_models else [cfg.model])
    # A mistyped root would otherwise export nothing, report success and write a status file
    # beside a directory that does not exist; a mistyped --model likewise.
    commit.require_root(cfg.root)
    if not args.all_models:
        require_model(cfg)
    ex.store.ensure_container()

    def show(it: Iteration) -> None:
        if args.json:
            print_json({"ok": it.ok, "files_discovered": it.files_discovered, "files_exported": it.files_exported,
                        "files_failed": it.files_failed, "bytes_exported": it.bytes_exported,
                        "completed_utc": it.completed_utc, "errors": it.errors[:5]})
        else:
            stdout.print(f"export iteration: {it.files_discovered} new/changed, {it.files_exported} exported "
                         f"({human_bytes(it.bytes_exported)}), {it.files_failed} failed in {it.seconds:.1f}s")
            for err in it.errors[:5]:
                stderr.print(f"[yellow]failed:[/] {err}")

    if not args.watch:
        it = ex.iterate()
        show(it)
        return EXIT_OK if it.ok else EXIT_FAILED
    if not args.json:
        what = cfg.root if args.all_models else f"{cfg.root}/{cfg.model}"
        stderr.print(f"local exporter (stand-in for AMLFS auto-export): {what} -> {ex.store.where}, "
                     f"every {interval:g}s; Ctrl-C to stop")
    ex.watch(interval, threading.Event(), on_iteration=show)
    return EXIT_OK


def _plan_apply(p: argparse.ArgumentParser, parent: argparse.ArgumentParser, plan: str,
                apply: str) -> list[argparse.ArgumentParser]:
    """The `plan` and `apply` subcommands of a retention command, each with the keep-policy flags."""
    rs = p.add_subparsers(dest="retention_cmd", metavar="plan|apply")
    rs.required = True
    out = []
    for name, text in (("plan", plan), ("apply", apply)):
        q = rs.add_parser(name, parents=[parent], help=text, description=text)
        _policy_flags(q)
        out.append(q)
    return out


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("retention", help="plan or apply the retention policy (frees the accelerator layer)")
    for q in _plan_apply(p, parent, "show every checkpoint's decision and why; changes nothing",
                         "delete/release what the plan allows, under a lock; safe to re-run"):
        q.add_argument("--action", choices=("delete", "release"), help="delete, or release (AMLFS: lfs hsm_release) (default: {config:retention.action})")
        q.set_defaults(handler=cmd_retention)

    p = sub.add_parser("archive", help="the archive (Blob) tier: its own retention")
    asub = p.add_subparsers(dest="archive_cmd", metavar="retention")
    asub.required = True
    p = asub.add_parser("retention", help="plan or apply the keep policy to the checkpoints committed in the archive")
    for q in _plan_apply(p, parent, "show every archived checkpoint's decision and why; changes nothing",
                         "delete from Blob what the plan allows (marker first, journaled); safe to re-run"):
        q.add_argument("--lustre-gone", action="store_true",
                       help="the file system was torn down: do not look for the checkpoints on Lustre (otherwise the "
                            "root must be mounted here, and checkpoints still on it are kept)")
        q.set_defaults(handler=cmd_archive_retention, action=None)

    p = sub.add_parser("restore", parents=[parent], help="make a committed checkpoint readable on the accelerator layer",
                       description="Restore NAME or the newest committed checkpoint on either tier, by the cheapest path.")
    p.add_argument("name", nargs="?", metavar="NAME", help="checkpoint directory name, e.g. global_epoch3_step12000")
    p.add_argument("--latest", action="store_true", help="the newest committed checkpoint on either tier (default)")
    p.add_argument("--verify", action="store_true",
                   help="also hash a resident checkpoint's files (bytes from the archive are always hash-checked)")
    p.add_argument("--wait", metavar="DURATION",
                   help=f"how long to wait for another process working on the checkpoint, e.g. 90s, 5m "
                        f"(default: {format_duration(DEFAULT_LOCK_WAIT)})")
    p.set_defaults(handler=cmd_restore)

    p = sub.add_parser("metrics", parents=[parent], help="Prometheus metrics of the model: print, write a textfile, or serve",
                       description="The model's checkpoint metrics in Prometheus format: printed (default), written "
                                   "atomically as a node-exporter textfile (--textfile, metrics.textfile), or served "
                                   "over HTTP (--serve).")
    p.add_argument("--textfile", metavar="PATH", help="write this .prom file (default: {config:metrics.textfile})")
    p.add_argument("--serve", action="store_true", help="serve /metrics until Ctrl-C (scrapes within 5 s share one collection)")
    p.add_argument("--port", type=argtypes.port, metavar="N", help="port for --serve (default: {config:metrics.port})")
    p.add_argument("--addr", metavar="ADDR", help="address for --serve (default: {config:metrics.addr})")
    p.set_defaults(handler=cmd_metrics)

    p = sub.add_parser("status", parents=[parent], help="tiers of each checkpoint, export backlog, export job, capacity")
    p.add_argument("--export-status", metavar="PATH", help="local exporter status file (default: next to the root)")
    timeline_commands.add_watch_flags(p)
    p.set_defaults(handler=cmd_status)

    p = sub.add_parser("export", parents=[parent],
                       help="local stand-in for AMLFS auto-export: copy new/changed files to Blob in iterations",
                       description="The local stand-in for AMLFS auto-export: copies new and changed files (committed or "
                                   "not) of the model (--model; --all-models: everything under the root, as AMLFS does) "
                                   "to the archive container under the same relative path, in iterations; never "
                                   "deletes blobs, and never uploads again a file a restore brought back unchanged.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--once", action="store_true", help="run one iteration and exit (default)")
    g.add_argument("--watch", action="store_true", help="iterate until Ctrl-C / SIGTERM")
    p.add_argument("--interval", default="5s", metavar="DURATION", help="time between iteration starts (default: 5s)")
    p.add_argument("--export-status", metavar="PATH", help="status file (default: next to the root, outside the exported tree)")
    p.add_argument("--all-models", action="store_true", help="export every model under the root, as AMLFS auto-export does")
    p.set_defaults(handler=cmd_export)
