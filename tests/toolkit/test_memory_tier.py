"""The memory tier with real processes: simulated nodes (their own launches and memory directories,
gloo on 127.0.0.1), killed ranks, wiped and corrupted memory, a full budget, a world-size change,
SIGTERM and a preemption notice. Each ends bit-exact from the right tier, or with a clear error."""
from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from tests.toolkit import memory_ranks as M
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER

pytest.importorskip("torch")
# Each test is two or three launches of real processes (each imports torch): seconds on an idle
# machine, minutes on a loaded one. A ceiling, not a target.
pytestmark = pytest.mark.timeout(900)

NAME = "global_epoch0_step{}"


def _nodes(tmp_path: Path, n: int) -> list[Path]:
    mems = [tmp_path / f"node{i}-shm" for i in range(n)]
    for m in mems:
        m.mkdir()
    return mems


def _ok(res: list[M.Ranked]) -> None:
    for r in res:
        assert r.rc == 0, f"rank {r.rank} exited {r.rc}: {r.err[-3000:]}"
        assert not r.out.get("errors"), f"rank {r.rank}: {r.out.get('errors')} {r.err[-2000:]}"


def _loaded(res: list[M.Ranked], step: int, tiers: list[str]) -> None:
    _ok(res)
    for r in res:
        assert (r.out["step"], r.out["tier"]) == (step, tiers[r.rank]), (r.rank, r.out, r.err[-2000:])
        assert r.out["digest"] == r.out["expected"] == M.expected_digest(step)      # bit-exact
        assert r.out["extra"] == {"rank": r.rank, "step": step}                    # this rank's own extras


def _on_root(root: Path) -> list[str]:
    return [i.name for i in commit.committed(commit.scan(root, "m"))]


def test_two_nodes_restore_from_memory_then_a_wiped_node_from_its_peer(root: Path, tmp_path: Path) -> None:
    mems = _nodes(tmp_path, 2)
    _ok(M.run(2, 1, root, mems, [["save", 1], ["save", 2]]))
    assert _on_root(root) == [NAME.format(1)]          # the first memory save is persisted; the second is not
    _loaded(M.run(2, 1, root, mems, [["load"]]), 2, ["memory", "memory"])
    shutil.rmtree(mems[1])                             # node 1 replaced: its RAM is empty
    mems[1].mkdir()
    _loaded(M.run(2, 1, root, mems, [["load"]]), 2, ["memory", "peer"])
    # The replacement node got its copy back: a process restart now loads from its own memory.
    assert (mems[1] / "w2" / "r1" / "m" / NAME.format(2) / MARKER).is_file()


def test_three_nodes_a_corrupt_replica_byte_falls_back_to_the_previous_step_in_one_record(
        root: Path, tmp_path: Path) -> None:
    mems = _nodes(tmp_path, 3)
    _ok(M.run(3, 1, root, mems, [["save", 1], ["save", 2]]))
    shutil.rmtree(mems[2])
    mems[2].mkdir()
    # Node 0 holds node 2's replica (ring, distance 1): flip one byte of its newest data file.
    rep = mems[0] / "peer" / "w3" / "r2" / "m" / NAME.format(2)
    shard = next(p for p in rep.iterdir() if p.name.startswith("shard-"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    res = M.run(3, 1, root, mems, [["load"]])
    _loaded(res, 1, ["memory", "memory", "peer"])      # never step 2 with one rank's bytes wrong
    records = [ln for r in res for ln in r.err.splitlines() if "failed verification" in ln]
    assert len(records) == 1 and "rank 2" in records[0], [r.err[-1500:] for r in res]


def test_sigkill_mid_save_every_rank_resumes_the_step_all_of_them_committed(root: Path, tmp_path: Path) -> None:
    mems = _nodes(tmp_path, 2)
    res = M.run(2, 1, root, mems, [["save", 1], ["save", 2], ["save", 3]], kill=[1, 3, "save"], timeout=10)
    assert res[1].rc == -signal.SIGKILL
    assert res[0].rc == 0 and res[0].out["saved"] == [1, 2]
    assert any("not every rank took part" in e for e in res[0].out["errors"]), res[0].out
    # Rank 0 committed step 3 in its memory, rank 1 did not: both resume step 2, never a mix.
    assert (mems[0] / "w2" / "r0" / "m" / NAME.format(3) / MARKER).is_file()
    _loaded(M.run(2, 1, root, mems, [["load"]]), 2, ["memory", "memory"])


def test_sigkill_mid_replica_then_a_lost_node_resumes_from_the_last_whole_replica(root: Path, tmp_path: Path) -> None:
    mems = _nodes(tmp_path, 2)
    res = M.run(2, 1, root, mems, [["save", 1], ["save", 2], ["save", 3]], kill=[1, 3, "replica"], timeout=10)
    assert res[1].rc == -signal.SIGKILL
    assert res[0].rc == 0 and res[0].out["saved"] == [1, 2, 3]
    assert any("replica" in e for e in res[0].out["errors"]), res[0].out      # logged, training went on
    half = mems[0] / "peer" / "w2" / "r1" / "m" / NAME.format(3)
    assert not (half / MARKER).exists()
    shutil.rmtree(mems[1])           # the killed rank's node is gone with its RAM
    mems[1].mkdir()
    _loaded(M.run(2, 1, root, mems, [["load"]]), 2, ["memory", "peer"])


def test_a_full_memory_budget_evicts_older_copies_then_refuses_clearly(root: Path, tmp_path: Path) -> None:
    mems = _nodes(tmp_path, 1)
    # A copy is ~9.3 kB here: two fit in 23 kB, three do not (memory.keep would allow five).
    acts = [["save", 1], ["save", 2], ["save", 3], ["save", 4, "memory", None, 4096]]
    r = M.run(1, 1, root, mems, acts, keep=5, budget=23_000)[0]
    assert r.rc == 0 and r.out["saved"] == [1, 2, 3], (r.out, r.err[-2000:])
    (err,) = r.out["errors"]         # the 0.5 MB state: one clear error, training goes on
    assert "memory tier full" in err and "memory.budget_bytes=23000" in err and "tier='lustre'" in err, err
    own = [i.name for i in commit.committed(commit.scan(mems[0] / "w1" / "r0", "m"))]
    assert own == [NAME.format(2), NAME.format(3)]       # step 1 evicted to fit step 3; the refusal evicted nothing
    _loaded(M.run(1, 1, root, mems, [["load"]], keep=5, budget=23_000), 3, ["memory"])


def test_a_world_size_change_skips_memory_and_reshards_from_the_root(root: Path, tmp_path: Path) -> None:
    mems = _nodes(tmp_path, 2)
    _ok(M.run(2, 1, root, mems, [["save", 1], ["save", 2], ["save", 3], ["save", 4]], persist_every=2))
    assert _on_root(root) == [NAME.format(1), NAME.format(3)]      # every 2nd save, from the memory copies
    res = M.run(1, 1, root, mems[:1], [["load"]], persist_every=2)
    _ok(res)
    out = res[0].out
    # Step 4 lives only in the two-rank job's memory: one rank loads the root's newest (DCP).
    assert (out["step"], out["tier"]) == (3, "lustre")
    assert out["digest"] == M.expected_digest(3) and out["extra"] == {"rank": 0, "step": 3}


def test_sigterm_flushes_the_newest_memory_checkpoint_to_the_root(root: Path, tmp_path: Path) -> None:
    mems = _nodes(tmp_path, 2)
    t0, procs = M.start(2, 1, root, mems, [["save", 1], ["save", 2], ["flush_on_term"]])
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            while line and '"ready"' not in line:
                line = p.stdout.readline()
            assert line, "a rank ended before installing the flush"
        assert _on_root(root) == [NAME.format(1)]
        for p in procs:
            p.send_signal(signal.SIGTERM)           # what Slurm sends every task before it kills the job
        res = M.collect(t0, procs, timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [r.rc for r in res] == [143, 143], [r.err[-2000:] for r in res]
    assert _on_root(root) == [NAME.format(1), NAME.format(2)]
    _loaded(M.run(1, 1, root, mems[:1], [["load"]]), 2, ["lustre"])     # a whole, reshardable checkpoint


def test_a_preemption_notice_makes_the_next_memory_save_persist(root: Path, tmp_path: Path) -> None:
    mems = _nodes(tmp_path, 1)
    notice = tmp_path / "preempt"
    _ok(M.run(1, 1, root, mems, [["save", 1], ["save", 2], ["touch", str(notice)], ["save", 3]],
              notice=str(notice)))
    assert _on_root(root) == [NAME.format(1), NAME.format(3)]
