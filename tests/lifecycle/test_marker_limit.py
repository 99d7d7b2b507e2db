"""One marker, one verdict: every reader (scan/load, restore, retention, teardown's evidence) applies
the same size limit, so a marker is never committed for one command and absent for another."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.lifecycle.helpers import make_checkpoint
from tiered_ckpt.errors import UserError
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER, MAX_MARKER_BYTES
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import choose
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ops.evidence import lustre_checkpoints

# Above the 64 MiB that restore, retention and teardown once used, below the protocol's limit: a
# marker with a large index (hundreds of thousands of entries) is this big.
LARGE = (65 << 20)


def _pad(ckpt_dir: Path, size: int) -> None:
    """Grow the marker to `size` bytes with JSON whitespace: the same document, still valid."""
    p = ckpt_dir / MARKER
    data = p.read_bytes()
    p.write_bytes(data + b" " * (size - len(data)))


def test_a_large_marker_is_committed_for_every_reader(local_env, tmp_path: Path) -> None:
    cfg, store, _ = local_env
    big = make_checkpoint(cfg.root, "m", 0, 10)
    make_checkpoint(cfg.root, "m", 0, 20)
    _pad(big, LARGE)
    assert commit.find(cfg.root, "m", big.name).committed          # type: ignore[union-attr]
    backend = LocalBackend(cfg, store)
    # restore finds it on the accelerator layer (nothing is in the archive yet)
    assert choose(cfg, backend, big.name).where == "accelerator"
    # teardown's evidence counts it as committed, with its whole marker
    records, uncommitted = lustre_checkpoints(tmp_path, "lustre")
    assert {r.name: r.marker_size for r in records}[big.name] == LARGE and not uncommitted
    # retention frees it once archived: the evidence it re-checks under the lock is the same marker
    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    res = ret.apply(cfg, backend, ret.Policy.from_config(cfg.retention))
    assert res.done == [f"delete {big.name}"], res


def test_a_marker_over_the_limit_is_not_committed_for_any_reader(local_env, tmp_path: Path) -> None:
    cfg, store, _ = local_env
    big = make_checkpoint(cfg.root, "m", 0, 10)
    _pad(big, MAX_MARKER_BYTES + 1)
    info = commit.find(cfg.root, "m", big.name)
    assert info is not None and not info.committed and "larger than" in (info.why_not_committed or "")
    with pytest.raises(UserError):
        choose(cfg, LocalBackend(cfg, store), big.name)
    records, uncommitted = lustre_checkpoints(tmp_path, "lustre")
    assert not records and uncommitted == (f"m/{big.name}",)


def test_no_module_reads_a_marker_with_a_limit_of_its_own() -> None:
    # Every read of COMMITTED.json goes through io/commit.py (marker_bytes, read_marker_checked) or
    # passes its limit, MAX_MARKER_BYTES: a second reader with its own limit is how the 64 MiB one came.
    import ast

    src = Path(__file__).resolve().parents[2] / "src"
    readers = {"read_file", "read_small", "read_fd", "read_bytes", "open"}
    found = []
    for py in sorted(src.rglob("*.py")):
        if py.relative_to(src).as_posix() == "tiered_ckpt/io/commit.py":
            continue
        for node in ast.walk(ast.parse(py.read_text())):
            if not isinstance(node, ast.Call):
                continue
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            target = node.func.value if fn == "read_bytes" and isinstance(node.func, ast.Attribute) else node
            names = {n.attr if isinstance(n, ast.Attribute) else n.id
                     for n in ast.walk(target) if isinstance(n, (ast.Name, ast.Attribute))}
            if fn in readers and "MARKER" in names and "MAX_MARKER_BYTES" not in names:
                found.append(f"{py.relative_to(src)}:{node.lineno}")
    assert not found, f"read COMMITTED.json through tiered_ckpt.io.commit.marker_bytes: {found}"


@pytest.mark.parametrize("planted", ["fifo", "symlink", "torn"])
def test_a_planted_or_torn_marker_is_not_committed_for_any_reader_and_blocks_none(local_env, tmp_path: Path,
                                                                                   planted: str) -> None:
    cfg, store, _ = local_env
    real = make_checkpoint(cfg.root, "m", 0, 10)             # a valid marker the symlink points at
    bad = make_checkpoint(cfg.root, "m", 0, 20)
    marker = bad / MARKER
    good = marker.read_bytes()
    marker.unlink()
    if planted == "fifo":
        os.mkfifo(marker)                                    # a reader that opened it plainly would hang
    elif planted == "symlink":
        marker.symlink_to(real / MARKER)
    else:
        marker.write_bytes(good[: len(good) // 2])          # a crash mid-write
    info = commit.find(cfg.root, "m", bad.name)
    assert info is not None and not info.committed
    with pytest.raises(UserError):
        choose(cfg, LocalBackend(cfg, store), bad.name)
    records, uncommitted = lustre_checkpoints(tmp_path, "lustre")
    assert [r.name for r in records] == [real.name] and uncommitted == (f"m/{bad.name}",)
    res = ret.apply(cfg, LocalBackend(cfg, store), ret.Policy.from_config(cfg.retention))
    assert not any(bad.name in d for d in res.done) and bad.exists()
