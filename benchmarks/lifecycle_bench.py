"""Lifecycle benchmarks: archive proof with a fake lfs, local restore vs a plain download.

1. Archive proof of N files (default 100,000) through the fake lfs (tests/doubles/bin/lfs),
   which costs a fixed time per process: counts lfs processes (must be <= ceil(N/batch)) and
   times the proof. For contrast, the same proof with one lfs process per file is timed on
   a small sample.
2. Local restore (tiered_ckpt.lifecycle.restore with the local back-end) against a plain parallel
   download of the same blobs with azure-storage-blob, both against a private Azurite
   started here. Reports both rates and their ratio (goal: >= 0.8).

    python -m benchmarks.lifecycle_bench [--proof-files N] [--lfs-cost S] [--restore-mib M] [--quick]
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from azure.storage.blob import ContainerClient

from tiered_ckpt.config import AmlfsConfig, ArchiveConfig, NodeConfig
from tiered_ckpt.io import commit
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import FileEntry, Manifest
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.proof import prove
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.tiers.backends import AmlfsBackend, LocalBackend
from tiered_ckpt.tiers.blob import BlobStore
from tiered_ckpt.tiers.hsm import Lfs
from tiered_demo.azurite import Azurite

REPO = Path(__file__).resolve().parents[1]
FAKE_LFS = REPO / "tests" / "doubles" / "bin" / "lfs"


def _checkpoint(root: Path, step: int, files: dict[str, bytes]) -> None:
    d = root / "m" / f"global_epoch0_step{step}"
    d.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, data in files.items():
        (d / name).write_bytes(data)
        h = new_hasher()
        h.update(data)
        entries.append(FileEntry(name, len(data), h.hexdigest()))
    commit.write_marker(d, Manifest(epoch=0, step=step, files=entries))


def bench_proof(n_files: int, cost: float, batch: int, work: Path) -> dict[str, float]:
    root = work / "lustre"
    per_ckpt = 10_000
    n_ckpt = max(1, math.ceil(n_files / per_ckpt))
    remaining = n_files
    t0 = time.monotonic()
    for i in range(n_ckpt):
        k = min(per_ckpt, remaining) - 1          # the marker is a file too
        remaining -= k + 1
        _checkpoint(root, (i + 1) * 100, {f"shard{j:05d}.bin": b"x" for j in range(max(1, k))})
    setup = time.monotonic() - t0
    count = work / "lfs-count.txt"
    os.environ.update(FAKE_LFS_STATE=str(work / "lfs-state.json"), FAKE_LFS_COUNT=str(count),
                      FAKE_LFS_COST=str(cost), FAKE_LFS_DEFAULT_FLAGS="0x9")
    cfg = NodeConfig(root=str(root), model="m", backend="amlfs", amlfs=AmlfsConfig(lfs=str(FAKE_LFS), hsm_batch=batch))
    backend = AmlfsBackend(cfg, None)
    infos = commit.scan(root, "m")
    files = sum(len(c.manifest.files) + 1 for c in infos if c.manifest)
    t0 = time.monotonic()
    proofs = prove(backend, infos)
    secs = time.monotonic() - t0
    assert all(p.archived for p in proofs.values()), "fake lfs reported files not archived"
    procs = len(count.read_text().splitlines())
    # Contrast: one lfs process per file, on a sample.
    sample = [str(c.path / f.path) for c in infos[:1] if c.manifest for f in c.manifest.files][:20]
    single = Lfs(str(FAKE_LFS), batch=1)
    t1 = time.monotonic()
    single.states(sample)
    per_file = (time.monotonic() - t1) / max(1, len(sample))
    return {"files": files, "processes": procs, "bound": math.ceil(files / batch), "seconds": secs,
            "setup_s": setup, "unbatched_s_per_file": per_file, "sample": len(sample)}


def _plain_download(cc: ContainerClient, names: list[str], dest: Path, concurrency: int) -> None:
    """The baseline: the same blobs, the same client settings, straight into files."""

    def one(name: str) -> None:
        with open(dest / name.replace("/", "_"), "wb") as f:
            cc.download_blob(name, max_concurrency=max(1, concurrency // len(names))).readinto(f)

    with ThreadPoolExecutor(min(concurrency, len(names))) as ex:
        list(ex.map(one, names))


def bench_restore(total_mib: int, n_files: int, rounds: int, work: Path) -> dict[str, float]:
    (work / "azurite").mkdir()
    with Azurite(location=str(work / "azurite")) as az:
        from azure.storage.blob import BlobServiceClient

        BlobServiceClient.from_connection_string(az.connection_string).create_container("ckpts")
        root = work / "restore-root"
        cfg = NodeConfig(root=str(root), model="m", backend="local",
                         archive=ArchiveConfig(connection_string=az.connection_string, container="ckpts", concurrency=8))
        size = total_mib * (1 << 20) // n_files
        _checkpoint(root, 1, {f"rank{i}.bin": os.urandom(size) for i in range(n_files)})
        store = BlobStore(cfg.archive)
        Exporter(cfg, store, status_path=work / "export-status.json").iterate()
        names = [store.name(f"m/global_epoch0_step1/rank{i}.bin") for i in range(n_files)]
        total = size * n_files
        plain: list[float] = []
        ours: list[float] = []
        cc = store.container                      # one warm client for both, like the product's

        def run_plain() -> None:
            d = work / "plain"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            t0 = time.monotonic()
            _plain_download(cc, names, d, cfg.archive.concurrency)
            plain.append(time.monotonic() - t0)
            shutil.rmtree(d)

        def run_ours() -> None:
            shutil.rmtree(root, ignore_errors=True)
            t0 = time.monotonic()
            r = restore(cfg, LocalBackend(cfg, store), None)
            ours.append(time.monotonic() - t0)
            assert r.source == "archive" and r.bytes == total

        for i in range(rounds):                   # alternate which runs first
            for step in ((run_plain, run_ours) if i % 2 == 0 else (run_ours, run_plain)):
                step()
        p, o = statistics.median(plain), statistics.median(ours)
        return {"bytes": total, "files": n_files, "plain_s": p, "restore_s": o,
                "plain_mbps": total / p / 1e6, "restore_mbps": total / o / 1e6, "ratio": p / o, "rounds": rounds}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lifecycle_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proof-files", type=int, default=100_000)
    ap.add_argument("--lfs-cost", type=float, default=0.05, help="fixed seconds per fake lfs process (default 0.05)")
    ap.add_argument("--batch", type=int, default=2000, help="files per lfs call (amlfs.hsm_batch)")
    ap.add_argument("--restore-mib", type=int, default=256)
    ap.add_argument("--restore-files", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    ap.add_argument("--only", choices=("proof", "restore"), help="run one of the two")
    args, _ = ap.parse_known_args(argv)
    if args.quick:
        args.proof_files, args.restore_mib, args.rounds = 10_000, 32, 1
    rc = 0
    # The restore runs first, from a quiet disk: it fsyncs every file (data before the marker),
    # so write-back left over from earlier work (the I/O bench, the proof's 100,000 files)
    # would be charged to it alone, not to the plain download it is compared with.
    if args.only != "proof":
        os.sync()
        with tempfile.TemporaryDirectory(prefix="lifecycle-bench-restore-") as tmp:
            rc |= _report_restore(bench_restore(args.restore_mib, args.restore_files, args.rounds, Path(tmp)))
    if args.only != "restore":
        with tempfile.TemporaryDirectory(prefix="lifecycle-bench-proof-") as tmp:
            rc |= _report_proof(bench_proof(args.proof_files, args.lfs_cost, args.batch, Path(tmp)), args)
    return rc


def _report_proof(pr: dict[str, float], args: argparse.Namespace) -> int:
    ok = pr["processes"] <= pr["bound"]
    print(f"archive proof: {pr['files']:,} files in {pr['seconds']:.2f} s with {pr['processes']} lfs processes "
          f"(bound ceil({pr['files']:,}/{args.batch}) = {pr['bound']}; fake lfs costs {args.lfs_cost:g} s/process) "
          f"{'OK' if ok else 'OVER BOUND'}")
    print(f"  contrast: one lfs process per file costs {pr['unbatched_s_per_file'] * 1000:.0f} ms/file "
          f"(measured on {pr['sample']} files) -> ~{pr['unbatched_s_per_file'] * pr['files'] / 60:.0f} min for {pr['files']:,}")
    return 0 if ok else 1


def _report_restore(rs: dict[str, float]) -> int:
    ok = rs["ratio"] >= 0.8
    print(f"local restore: {rs['bytes'] / 2**20:.0f} MiB in {rs['files']} files: restore {rs['restore_mbps']:.0f} MB/s "
          f"vs plain parallel azure-storage-blob download {rs['plain_mbps']:.0f} MB/s -> ratio {rs['ratio']:.2f} "
          f"(goal >= 0.8; median of {rs['rounds']}) {'OK' if ok else 'BELOW GOAL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
