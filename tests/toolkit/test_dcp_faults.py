"""Faults during multi-rank saves, with real gloo ranks and real signals.

* Any exception on one rank (not only the toolkit's own errors), on the coordinator or another
  rank, in DCP's planning, a custom Stateful, the planner, the writer or the commit: every
  rank's dcp.save fails promptly naming the failing rank, nothing is committed, and the next
  save of the name (the same processes retrying) succeeds. The same for the native tc.save.
* SIGKILL of one rank (coordinator or not) at chosen phases and at seeded random moments of a
  ~24 MiB DCP save: the survivors fail within the process group's timeout; a checkpoint is
  committed only if it is complete (every listed file there with its size and hash); the next
  save of the name in a fresh process group succeeds and loads bit-exact.

Every rank is a real process: one launcher imports torch once, then forks the ranks of each
run (each makes its own gloo process group through a file:// store) and SIGKILLs the victim.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed"),
              pytest.mark.timeout(600)]

PG_TIMEOUT = 30       # the process group's timeout: a collective waiting on a dead or late rank fails after it

LAUNCHER = r"""
import contextlib, gc, io, json, os, random, signal, sys, time, traceback
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
import tiered_ckpt as tc
import tiered_ckpt.io.claim as tclaim   # the one claim-and-commit path (the marker goes through it)
from tiered_ckpt.cli import app as cli
from tiered_ckpt.dcp import TieredReader, TieredWriter
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER
from tiered_ckpt.io import fsafe, pipeline
from tiered_ckpt.io.reader import verify

# No intra-op thread pool before the fork (OpenMP's is not fork-safe): one thread, as a small rank needs.
torch.set_num_threads(1)
A = json.loads(sys.argv[1])
ROOT, TMP, PG = A["root"], A["tmp"], A["pg_timeout"]
runs = 0

def note(path, obj=None):
    with open(path, "w") as f:
        f.write(json.dumps(obj))

def pause(tag):
    # the victim stops here and says so; the launcher SIGKILLs it
    note(os.path.join(TMP, f"at-{tag}"))
    time.sleep(600)

# ~24 MiB: a sharded fp32 and bf16 (uneven rows over the ranks), replicated 1 MiB tensors; made once,
# before the ranks are forked
_g = torch.Generator().manual_seed(3)
FULL = {"big": torch.randn(3 * 2**20 + 5, generator=_g), "half": torch.randn(2**21 + 3, generator=_g).to(torch.bfloat16)}
REPS = {f"r{i}": torch.randn(2**18, generator=_g) for i in range(8)}

def shard(t, mesh):
    # this rank's Shard(0) piece (torch.chunk's split, as DTensor's), no communication
    parts = t.chunk(mesh.size())
    r = mesh.get_local_rank()
    local = parts[r] if r < len(parts) else t[:0]
    return DTensor.from_local(local.clone(), mesh, [Shard(0)], shape=t.shape, stride=t.stride())

def state(mesh, zeros=False):
    f = (lambda t: torch.zeros_like(t)) if zeros else (lambda t: t)
    return {k: shard(f(t), mesh) for k, t in FULL.items()} | {"reps": {k: f(t).clone() for k, t in REPS.items()},
                                                              "step": 0 if zeros else 7, "tag": "" if zeros else "kill"}

def full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x

def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        a, b = full(a), full(b)
        return a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b

def err_text(e):
    return f"{type(e).__name__}: {e}"[:3000]

def committed_names(model="m"):
    return [c.name for c in commit.scan(ROOT, model) if c.committed]

def listed(conf):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["list", "--config", conf, "--json"])
    return rc, {r["name"]: r["committed"] for r in json.loads(buf.getvalue())["checkpoints"]}

def init(store, rank, world):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=PG))

# -- one rank of a run (a forked child); writes its result to a file, never returns ---------------
def child(run, rank, world, fn):
    try:
        init(os.path.join(TMP, f"store-{run}"), rank, world)
        res = fn(rank, world)
    except BaseException as e:
        res = {"crashed": err_text(e), "trace": traceback.format_exc()[-3000:]}
    note(os.path.join(TMP, f"res-{run}-{rank}"), res)
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)

def fork_run(world, fn):
    global runs
    runs += 1
    pids = []
    for r in range(world):
        pid = os.fork()
        if pid == 0:
            child(runs, r, world, fn)
        pids.append(pid)
    return runs, pids

def reap(run, pids, deadline):
    # every rank's result (None: killed, or still running at the deadline and killed then)
    out, hung = [], []
    for r, pid in enumerate(pids):
        while True:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not done:
            hung.append(r)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        p = os.path.join(TMP, f"res-{run}-{r}")
        out.append(json.load(open(p)) if os.path.exists(p) else None)
    return out, hung

def wait_file(p, timeout):
    end = time.monotonic() + timeout
    while not os.path.exists(p):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True

# -- (a) an exception on one rank --------------------------------------------------------------------
class Boom(Stateful):
    def state_dict(self):
        raise RuntimeError("state_dict of a custom Stateful failed")
    def load_state_dict(self, sd):
        pass

def raising(where, bad, conf, step):
    def fn(rank, world):
        # The retry must not depend on when the garbage collector runs (a failed save's traceback
        # holds its writer in a reference cycle): none runs here.
        gc.disable()
        mesh = init_device_mesh("cpu", (world,))
        st = state(mesh)
        planner = None
        undo = []
        def patch(obj, name, new):
            old = getattr(obj, name)
            setattr(obj, name, new)
            undo.append((obj, name, old))
        if rank == bad:
            if where == "stateful":
                st["extra"] = Boom()
            elif where == "resolve":
                class P(DefaultSavePlanner):
                    def resolve_data(self, item):
                        raise RuntimeError(f"resolve_data failed on rank {rank}")
                planner = P()
            elif where == "write":
                def write_data(self, plan, planner):
                    raise RuntimeError(f"write_data failed on rank {rank}")
                patch(TieredWriter, "write_data", write_data)
            elif where == "global":       # the coordinator's global plan
                orig = TieredWriter.prepare_global_plan
                def prepare_global_plan(self, plans):
                    orig(self, plans)          # the claim is taken, then the failure
                    raise RuntimeError("prepare_global_plan failed on the coordinator")
                patch(TieredWriter, "prepare_global_plan", prepare_global_plan)
            elif where == "finish":       # the coordinator, after DCP's metadata, before the marker
                def fsync_parents(*a):
                    raise RuntimeError("the commit failed on the coordinator")
                patch(tclaim, "fsync_parents", fsync_parents)
        t0 = time.monotonic()
        res = {}
        try:
            dcp.save(st, storage_writer=TieredWriter(ROOT, "m", epoch=0, step=step), planner=planner)
            res["first"] = "ok"
        except BaseException as e:
            res["first"] = err_text(e)
        res["seconds"] = time.monotonic() - t0
        if where == "stateful":
            return res          # the failing process exits, as a training script's would
        for obj, name, old in undo:
            setattr(obj, name, old)
        dist.barrier()
        if rank == 0:
            res["marker"] = os.path.exists(os.path.join(ROOT, "m", f"global_epoch0_step{step}", MARKER))
            res["committed"] = committed_names()      # the earlier cases' retries are committed
            res["listed"] = listed(conf)
        dist.barrier()
        try:       # the same processes retry the name at once
            dcp.save(state(mesh), storage_writer=TieredWriter(ROOT, "m", epoch=0, step=step))
            got = state(mesh, zeros=True)
            dcp.load(got, storage_reader=TieredReader(ROOT, "m", epoch=0, step=step, verify_hash=True))
            res["retry"] = "ok" if same(state(mesh), got) else "differs"
        except BaseException as e:
            res["retry"] = err_text(e)
        dist.barrier()
        return res
    return fn

def native(where, bad):
    # tc.save under torch.distributed: a RuntimeError (not a UserError) on one rank
    def fn(rank, world):
        if rank == bad:
            if where == "produce":          # the snapshot never ran (the writers were waiting for it)
                def produce(self):
                    raise RuntimeError(f"snapshot failed on rank {rank}")
                pipeline.Pipeline.produce = produce
            elif where == "export":         # exporting the state's buffers
                import tiered_ckpt.api as api
                def to_sources(flat):
                    raise RuntimeError(f"buffer export failed on rank {rank}")
                api.to_sources = to_sources
        st = {"w": torch.arange(200_000, dtype=torch.float32) * (rank + 1), "step": 3}
        t0 = time.monotonic()
        res = {}
        try:
            tc.save(st, epoch=0, step=1, root=ROOT, model="n")
            res["first"] = "ok"
        except BaseException as e:
            res["first"] = err_text(e)
        res["seconds"] = time.monotonic() - t0
        res["committed"] = committed_names("n")
        return res
    return fn

# -- (b) SIGKILL of one rank -----------------------------------------------------------------------
def killed(step, victim, point):
    def fn(rank, world):
        mesh = init_device_mesh("cpu", (world,))
        st = state(mesh)
        if rank == victim:
            if point == "plan":             # the coordinator holds the claim, nothing written
                orig = TieredWriter.prepare_global_plan
                def prepare_global_plan(self, plans):
                    r = orig(self, plans)
                    pause(point)
                    return r
                TieredWriter.prepare_global_plan = prepare_global_plan
            elif point == "write-start":
                orig_w = TieredWriter.write_data
                def write_data(self, plan, planner):
                    pause(point)
                    return orig_w(self, plan, planner)
                TieredWriter.write_data = write_data
            elif point == "fsync":          # its first fsync of written data: written, not yet durable
                real, orig_w, armed = os.fsync, TieredWriter.write_data, []
                def fsync(fd):
                    if armed:
                        pause(point)
                    real(fd)
                def write_data(self, plan, planner):
                    armed.append(1)
                    return orig_w(self, plan, planner)
                os.fsync, TieredWriter.write_data = fsync, write_data
            elif point == "write-end":      # its items durable, the others not told
                orig_w = TieredWriter.write_data
                def write_data(self, plan, planner):
                    fut = orig_w(self, plan, planner)
                    fut.wait()
                    pause(point)
                    return fut
                TieredWriter.write_data = write_data
            elif point == "before-marker":
                orig_m = commit.write_marker
                def write_marker(*a, **k):
                    pause(point)
                    return orig_m(*a, **k)
                commit.write_marker = write_marker
            elif point == "torn-marker":    # half the marker's bytes written
                orig_wa = fsafe.write_all
                def write_all(fd, data):
                    orig_wa(fd, data[: len(data) // 2])
                    os.fsync(fd)
                    pause(point)
                fsafe.write_all = write_all
            elif point == "after-marker":
                orig_m = commit.write_marker
                def write_marker(*a, **k):
                    r = orig_m(*a, **k)
                    pause(point)
                    return r
                commit.write_marker = write_marker
            note(os.path.join(TMP, f"started-{step}"))
        try:
            dcp.save(st, storage_writer=TieredWriter(ROOT, "m", epoch=0, step=step))
            return {"saved": True}
        except BaseException as e:
            return {"saved": False, "error": err_text(e)}
    return fn

def resave(steps):
    # one fresh process group: each name that the kill left uncommitted is saved again; each loads
    def fn(rank, world):
        mesh = init_device_mesh("cpu", (world,))
        want = state(mesh)
        res = {}
        for step, committed in steps:
            r = res[str(step)] = {}
            if not committed:
                try:
                    dcp.save(want, storage_writer=TieredWriter(ROOT, "m", epoch=0, step=step))
                    r["saved"] = True
                except BaseException as e:
                    r["saved"] = err_text(e)
            got = state(mesh, zeros=True)
            try:
                dcp.load(got, storage_reader=TieredReader(ROOT, "m", epoch=0, step=step, verify_hash=True))
                r["loaded"] = bool(same(want, got))
            except BaseException as e:
                r["loaded"] = err_text(e)
        dist.barrier()
        return res
    return fn

def check_dir(step):
    d = os.path.join(ROOT, "m", f"global_epoch0_step{step}")
    m = commit.read_marker(d)
    if m is None:
        return {"committed": False, "marker_file": os.path.exists(os.path.join(d, MARKER))}
    rep = verify(__import__("pathlib").Path(d), check_hash=True)
    return {"committed": True, "complete": rep.ok, "problems": rep.problems[:3]}

def kill_run(step, victim, point, delay):
    run, pids = fork_run(2, killed(step, victim, point))
    t0 = time.monotonic()
    if point:
        reached = wait_file(os.path.join(TMP, f"at-{point}"), 120)
        os.remove(os.path.join(TMP, f"at-{point}")) if reached else None
    else:
        reached = wait_file(os.path.join(TMP, f"started-{step}"), 120)
        time.sleep(delay)
    os.kill(pids[victim], signal.SIGKILL)
    t_kill = time.monotonic()
    res, hung = reap(run, pids, t_kill + PG + 30)
    out = {"step": step, "victim": victim, "point": point, "delay": delay, "reached": reached, "hung": hung,
           "survivor": res[1 - victim], "survivor_s": time.monotonic() - t_kill, "dir": check_dir(step)}
    return out

results = []
if A["mode"] == "raise":
    for i, (where, bad) in enumerate(A["cases"]):
        run, pids = fork_run(2, raising(where, bad, A["conf"], i + 1))
        res, hung = reap(run, pids, time.monotonic() + PG + 60)
        results.append({"where": where, "bad": bad, "step": i + 1, "ranks": res, "hung": hung})
elif A["mode"] == "native":
    for where, bad in A["cases"]:
        run, pids = fork_run(2, native(where, bad))
        res, hung = reap(run, pids, time.monotonic() + PG + 60)
        results.append({"where": where, "bad": bad, "ranks": res, "hung": hung})
elif A["mode"] == "kill":
    for i, (victim, point, seed) in enumerate(A["cases"]):
        delay = 0.0
        if not point:
            rnd = random.Random(seed)
            victim, delay = rnd.randrange(2), rnd.uniform(0.0, A["max_delay"])
        results.append(kill_run(i + 1, victim, point, delay))
    run, pids = fork_run(2, resave([(r["step"], r["dir"]["committed"]) for r in results]))
    res, hung = reap(run, pids, time.monotonic() + 240)
    for r in results:
        r["resave"], r["resave_hung"] = [x and x.get(str(r["step"])) for x in res], hung
print(json.dumps(results), flush=True)
os._exit(0)
"""


def _launch(tmp: Path, root: Path, mode: str, cases: list[Any], **extra: Any) -> list[dict[str, Any]]:
    conf = tmp / "config.yaml"
    conf.write_text(yaml.safe_dump({"root": str(root), "model": "m", "backend": "local"}))
    work = tmp / "work"
    work.mkdir()
    args = dict(extra, root=str(root), tmp=str(work), pg_timeout=PG_TIMEOUT, mode=mode, cases=cases, conf=str(conf))
    p = subprocess.run([sys.executable, "-c", LAUNCHER, json.dumps(args)], capture_output=True, text=True,
                       timeout=560, env={**__import__("os").environ, "PYTHONPATH": __import__("os").pathsep.join(sys.path)})
    assert p.returncode == 0, p.stderr[-4000:]
    out: list[dict[str, Any]] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


# Where the exception is raised and on which rank (0 is DCP's coordinator).
RAISE_CASES = [("write", 1), ("write", 0), ("resolve", 1), ("global", 0), ("finish", 0)]


def test_an_exception_on_any_rank_fails_every_rank_and_the_retry_succeeds(tmp_path: Path, root: Path) -> None:
    for case in _launch(tmp_path, root, "raise", RAISE_CASES):
        where, bad = case["where"], case["bad"]
        assert not case["hung"], case
        r0, r1 = case["ranks"]
        for r in (r0, r1):
            assert r is not None and "crashed" not in r, case
            # DCP's CheckpointException names the failing rank and carries its error
            assert r["first"].startswith("CheckpointException") and f"(RANK {bad})" in r["first"], (where, r["first"])
            assert "RuntimeError" in r["first"], (where, r["first"])
            assert r["seconds"] < PG_TIMEOUT / 2, (where, r["seconds"])     # promptly, not after a timeout
            assert r["retry"] == "ok", (where, bad, r["retry"])
        name = f"global_epoch0_step{case['step']}"
        assert not r0["marker"] and name not in r0["committed"], case
        rc, rows = r0["listed"]
        assert rc == 0 and rows.get(name) in (None, False), case


def test_a_failing_stateful_on_one_rank_fails_the_others_when_it_exits(tmp_path: Path, root: Path) -> None:
    # DCP calls state_dict() of a Stateful before any collective: the failing rank raises at once,
    # alone; the others learn of it when its process exits (gloo: connection closed)
    (case,) = _launch(tmp_path, root, "raise", [("stateful", 1)])
    r0, r1 = case["ranks"]
    assert not case["hung"] and r0 is not None and r1 is not None, case
    assert "state_dict of a custom Stateful failed" in r1["first"], r1
    assert r0["first"] != "ok" and r0["seconds"] < PG_TIMEOUT, r0
    assert not (root / "m" / "global_epoch0_step1" / "COMMITTED.json").exists()


NATIVE_CASES = [("produce", 0), ("produce", 1), ("export", 0)]


def test_native_save_a_runtime_error_on_one_rank_fails_the_other_promptly(tmp_path: Path, root: Path) -> None:
    for case in _launch(tmp_path, root, "native", NATIVE_CASES):
        where, bad = case["where"], case["bad"]
        assert not case["hung"], case          # before the fix a failed snapshot hung its own rank for good
        for rank, r in enumerate(case["ranks"]):
            assert r is not None and "crashed" not in r, case
            assert r["first"] != "ok" and r["seconds"] < PG_TIMEOUT / 2, (where, bad, rank, r)
            assert f"rank {bad}" in r["first"], (where, bad, rank, r["first"])
            assert r["committed"] == [], case
        other = case["ranks"][1 - bad]
        assert other["first"].startswith("UserError") and "nothing was committed" in other["first"], other


# (victim rank, phase it is killed at, seed): a phase of None is a seeded random moment of the save.
KILL_CASES = [(0, "plan", 0), (1, "write-start", 0), (0, "fsync", 0), (1, "fsync", 0), (1, "write-end", 0),
              (0, "before-marker", 0), (0, "torn-marker", 0), (0, "after-marker", 0), (0, None, 11), (0, None, 12)]
# the save takes a fraction of a second here: random kills land within its first MAX_DELAY s
MAX_DELAY = 0.4


def test_sigkill_of_one_rank_never_leaves_a_committed_but_incomplete_checkpoint(tmp_path: Path, root: Path) -> None:
    for r in _launch(tmp_path, root, "kill", KILL_CASES, max_delay=MAX_DELAY):
        what = (r["step"], r["victim"], r["point"], round(r["delay"], 3))
        assert r["reached"] and not r["hung"], (what, r)
        d = r["dir"]
        if d["committed"]:
            assert d["complete"], (what, d)          # committed means complete: every file, size and hash
        else:
            assert r["point"] != "after-marker", (what, d)
        s = r["survivor"]
        assert s is not None and "crashed" not in s, (what, s)
        if r["point"] is not None:
            # a survivor of a kill before the marker fails, within the group's timeout (bounded by reap)
            assert s["saved"] is (r["point"] == "after-marker" and r["victim"] == 1), (what, s)
        assert r["survivor_s"] < PG_TIMEOUT + 30, what
        assert not r["resave_hung"], (what, r["resave"])
        for x in r["resave"]:
            assert x is not None and x.get("saved", True) is True and x["loaded"] is True, (what, x)
