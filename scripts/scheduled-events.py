#!/usr/bin/env python3
"""Azure Scheduled Events watcher: leave Slurm and Lustre cleanly before Azure takes the VM away.

On a Terminate, Preempt, Reboot or Redeploy notice that names this VM (with --drain: this VM runs slurmd):
  1. drain the node (no new work lands on it);
  2. signal the node's jobs to checkpoint (--signal, USR1 by default: examples/train.sbatch's trap) and give
     them --job-grace seconds to finish;
  3. unmount Lustre (an unclean client eviction stalls every other client for up to 15 minutes);
  4. Terminate/Preempt: stop slurmd and `scontrol delete` the node: a dynamic node stays registered until
     deleted (SchedMD dynamic_nodes.shtml, "Deleting Nodes"), and its successors get new hostnames.
     Reboot/Redeploy: the VM keeps its name (ND H100 v5 does not live-migrate: maintenance reboots it); a
     marker file remembers the drain, and the watcher resumes the node when it runs again after the reboot;
  5. acknowledge the event so Azure proceeds without waiting out the notice.

Endpoint, header and acknowledgement follow Microsoft's "Azure Metadata Service: Scheduled Events for Linux
VMs": GET http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01 with `Metadata: true`;
an event lists the affected instance names in `Resources`; POST {"StartRequests": [{"EventId": ...}]} to the
same URL starts it. A Preempt (Spot eviction) gives at least 30 s, a Terminate the scale set's
terminateNotificationProfile delay, Reboot/Redeploy at least 10/10 minutes. Installed by cloud-init
(scripts/, components/node/cloud_init.py); standard library only.
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
LEAVING = ("Terminate", "Preempt")         # the VM goes away: delete the node
RETURNING = ("Reboot", "Redeploy")         # the VM comes back under the same name: resume it afterwards
HANDLED = LEAVING + RETURNING
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


def _run(cmd: list[str], capture: bool = False) -> tuple[int, str]:
    try:
        r = subprocess.run(cmd, timeout=120, check=False, capture_output=capture, text=True)
        return r.returncode, (r.stdout or "") if capture else ""
    except (OSError, subprocess.TimeoutExpired) as err:
        _log(f"{cmd[0]}: {err}")
        return 1, ""


def unmount(mount: str, grace_s: float) -> bool:
    """umount; processes still holding the mount after `grace_s` get SIGTERM, then a forced unmount."""
    if _run(["mountpoint", "-q", mount])[0] != 0:
        return True
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if _run(["umount", mount])[0] == 0:
            return True
        time.sleep(2)
    _run(["fuser", "-k", "-TERM", "-m", mount])
    time.sleep(5)
    return any(_run(cmd)[0] == 0 for cmd in (["umount", mount], ["umount", "-f", mount], ["umount", "-l", mount]))


def checkpoint_jobs(args: argparse.Namespace, node: str, grace_s: float) -> None:
    """Signal every job on this node (the batch shell: B:, as --signal=B:USR1 in examples/train.sbatch), then
    wait until none is left on the node or grace_s passed."""
    code, out = _run([args.squeue, "-h", "-w", node, "-o", "%i"], capture=True)
    jobs = out.split() if code == 0 else []
    for job in jobs:
        _run([args.scancel, f"--signal={args.signal}", "--batch", job])
    if jobs:
        _log(f"signalled {args.signal} to jobs {' '.join(jobs)}")
    deadline = time.monotonic() + grace_s
    while jobs and time.monotonic() < deadline:
        time.sleep(min(2.0, max(0.1, deadline - time.monotonic())))
        code, out = _run([args.squeue, "-h", "-w", node, "-o", "%i"], capture=True)
        jobs = out.split() if code == 0 else []


def notify(path: str, ev: dict[str, Any]) -> None:
    """Tell the training job first (the toolkit's memory.notice_file): its next memory-tier save is
    persisted to Lustre at once, before this node and its RAM go (docs/memory.md)."""
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"EventId": ev.get("EventId"), "EventType": ev.get("EventType"), "NotBefore": ev.get("NotBefore")}, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)      # whole or absent for the job that polls it (not in the checkpoint tree)
        _log(f"notice written to {path}")
    except OSError as err:
        _log(f"could not write the notice {path}: {err}")


def handle(ev: dict[str, Any], args: argparse.Namespace, node: str) -> None:
    kind, eid = str(ev.get("EventType")), str(ev.get("EventId"))
    _log(f"{kind} {eid} for {node} (not before {ev.get('NotBefore') or 'now'})")
    if args.notice:
        notify(args.notice, ev)
    short = kind == "Preempt"
    if args.drain:
        _run([args.scontrol, "update", f"nodename={node}", "state=drain", f"reason=azure scheduled event {kind} {eid}"])
        if kind in RETURNING:
            with open(args.marker, "w") as f:
                f.write(f"{kind} {eid}\n")
        checkpoint_jobs(args, node, min(args.job_grace, PREEMPT_GRACE_S) if short else args.job_grace)
    grace = min(args.grace, PREEMPT_GRACE_S) if short else args.grace
    if unmount(args.mount, grace):
        _log(f"{args.mount} unmounted")
    else:
        _log(f"{args.mount} could not be unmounted; acknowledging anyway")
    if args.drain and kind in LEAVING:
        _run(["systemctl", "stop", "slurmd"])
        if _run([args.scontrol, "delete", f"nodename={node}"])[0] == 0:
            _log(f"deleted node {node} from Slurm")
        else:
            _log(f"could not delete node {node}; the controller's cleanup timer deletes it once DOWN")
    _post(f"{args.imds}/metadata/scheduledevents?{API}", {"StartRequests": [{"EventId": eid}]})
    _log(f"acknowledged {eid}")


def _marker(args: argparse.Namespace) -> tuple[str, str]:
    """(kind, event id) of the Reboot/Redeploy this node was drained for, ("", "") if none."""
    try:
        with open(args.marker) as f:
            kind, eid = (f.read().split() + ["", ""])[:2]
    except FileNotFoundError:
        return "", ""
    return kind, eid


def resume_after_return(args: argparse.Namespace, node: str, pending: set[str]) -> None:
    """Back from a Reboot/Redeploy we drained for (marker present, that event gone): return to service."""
    kind, eid = _marker(args)
    if not eid or eid in pending:
        return
    if _run([args.scontrol, "update", f"nodename={node}", "state=resume"])[0] == 0:
        _log(f"back from {kind} {eid}: {node} resumed")
        os.unlink(args.marker)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mount", default="/lustrefs")
    ap.add_argument("--drain", action="store_true", help="this VM runs slurmd: drain, checkpoint, delete/resume")
    ap.add_argument("--scontrol", default="scontrol")
    ap.add_argument("--squeue", default="squeue")
    ap.add_argument("--scancel", default="scancel")
    ap.add_argument("--signal", default="USR1", help="the jobs' checkpoint signal")
    ap.add_argument("--job-grace", type=float, default=120.0, help="seconds jobs get to checkpoint and stop")
    ap.add_argument("--grace", type=float, default=60.0, help="seconds processes get to leave the mount")
    ap.add_argument("--marker", default="/var/lib/tiered-ckpt/drained-for-event")
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
            events = [ev for ev in (doc.get("Events", []) if isinstance(doc, dict) else [])
                      if me in (ev.get("Resources") or [])]
            if args.drain:
                resume_after_return(args, node, {str(ev.get("EventId")) for ev in events})
                done.add(_marker(args)[1])     # handled before a restart of the watcher: not again
            for ev in events:
                eid = str(ev.get("EventId"))
                if ev.get("EventType") in HANDLED and eid not in done:
                    handle(ev, args, node)
                    done.add(eid)
        except (OSError, ValueError) as err:
            _log(f"metadata service: {type(err).__name__}: {err}")
        if args.once:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
