#!/usr/bin/env python3
"""Azure Scheduled Events watcher: leave Lustre cleanly before Azure takes the VM away.

On a Terminate or Preempt notice that names this VM: write the memory tier's notice file (--notice:
the training job persists its newest memory checkpoint at its next memory save), drain the node in Slurm (no new work lands on it),
unmount Lustre (an unclean client eviction stalls every other client of the file system for up to 15
minutes), then acknowledge the event so Azure proceeds without waiting out the notice.

Endpoint, header and acknowledgement follow Microsoft's "Azure Metadata Service: Scheduled Events for Linux
VMs": GET http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01 with `Metadata: true`;
an event lists the affected instance names in `Resources`; POST {"StartRequests": [{"EventId": ...}]} to the
same URL starts it. A Preempt (Spot eviction) gives at least 30 s, a Terminate the scale set's
terminateNotificationProfile delay. Installed by cloud-init; standard library only.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

API = "api-version=2020-07-01"
HANDLED = ("Terminate", "Preempt")
PREEMPT_GRACE_S = 10.0       # of the >= 30 s a Spot eviction leaves


def _get(url: str) -> Any:
    req = urllib.request.Request(url, headers={"Metadata": "true"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body.strip().startswith(b"{") else body.decode().strip()


def _post(url: str, doc: dict[str, Any]) -> None:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST",
                                 headers={"Metadata": "true", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10):
        pass


def _log(msg: str) -> None:
    print(f"tiered-ckpt-scheduled-events: {msg}", flush=True)


def _run(cmd: list[str]) -> int:
    try:
        return subprocess.run(cmd, timeout=120, check=False).returncode
    except (OSError, subprocess.TimeoutExpired) as err:
        _log(f"{cmd[0]}: {err}")
        return 1


def unmount(mount: str, grace_s: float) -> bool:
    """umount; processes still holding the mount after `grace_s` get SIGTERM, then a forced unmount."""
    if _run(["mountpoint", "-q", mount]) != 0:
        return True
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if _run(["umount", mount]) == 0:
            return True
        time.sleep(2)
    _run(["fuser", "-k", "-TERM", "-m", mount])
    time.sleep(5)
    return any(_run(cmd) == 0 for cmd in (["umount", mount], ["umount", "-f", mount], ["umount", "-l", mount]))


def notify(path: str, ev: dict[str, Any]) -> None:
    """Tell the training job first (the toolkit's memory.notice_file): its next memory-tier save is
    persisted to Lustre at once, before this node and its RAM go."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"EventId": ev.get("EventId"), "EventType": ev.get("EventType"), "NotBefore": ev.get("NotBefore")}, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        _log(f"notice written to {path}")
    except OSError as err:
        _log(f"could not write the notice {path}: {err}")


def handle(ev: dict[str, Any], args: argparse.Namespace, node: str) -> None:
    kind, eid = ev.get("EventType"), str(ev.get("EventId"))
    _log(f"{kind} {eid} for {node} (not before {ev.get('NotBefore') or 'now'})")
    if args.notice:
        notify(args.notice, ev)
    if args.drain:
        _run([args.scontrol, "update", f"nodename={node}", "state=drain", f"reason=azure scheduled event {kind} {eid}"])
    grace = min(args.grace, PREEMPT_GRACE_S) if kind == "Preempt" else args.grace
    if unmount(args.mount, grace):
        _log(f"{args.mount} unmounted")
    else:
        _log(f"{args.mount} could not be unmounted; acknowledging anyway")
    _post(f"{args.imds}/metadata/scheduledevents?{API}", {"StartRequests": [{"EventId": eid}]})
    _log(f"acknowledged {eid}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mount", default="/lustrefs")
    ap.add_argument("--drain", action="store_true", help="this VM runs slurmd: drain it first")
    ap.add_argument("--scontrol", default="scontrol")
    ap.add_argument("--grace", type=float, default=60.0, help="seconds processes get to leave the mount")
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--once", action="store_true", help="one poll, then exit (tests)")
    ap.add_argument("--imds", default="http://169.254.169.254")
    ap.add_argument("--notice", default="", help="file to write first (the memory tier's memory.notice_file); empty: none")
    args = ap.parse_args(argv)
    node = socket.gethostname().split(".")[0]
    me = ""
    done: set[str] = set()
    while True:
        try:
            if not me:
                me = str(_get(f"{args.imds}/metadata/instance/compute/name?api-version=2021-02-01&format=text"))
            doc = _get(f"{args.imds}/metadata/scheduledevents?{API}")
            for ev in doc.get("Events", []) if isinstance(doc, dict) else []:
                eid = str(ev.get("EventId"))
                if ev.get("EventType") in HANDLED and me in (ev.get("Resources") or []) and eid not in done:
                    handle(ev, args, node)
                    done.add(eid)
        except (OSError, ValueError) as err:
            _log(f"metadata service: {type(err).__name__}: {err}")
        if args.once:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
