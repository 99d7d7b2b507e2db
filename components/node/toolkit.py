"""The toolkit tarball (pure): what `pulumi up` uploads to the tools account and every VM installs.

A deterministic tar.gz of pyproject.toml + src/tiered_ckpt; the cluster component uploads it as a
content-addressed blob and the custom data carries its sha256, which the boot checks before install.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Toolkit:
    path: Path          # the built tarball
    sha256: str
    blob_name: str


def build_toolkit(repo_root: Path, out_dir: Path) -> Toolkit:
    """A deterministic tar.gz of pyproject.toml + src/tiered_ckpt (same input -> same bytes -> same hash).

    Only the node toolkit: the operator (tiered_ops) and demo (tiered_demo) packages never reach a node.

    pip installs it on the node with the dependency pins of pyproject.toml, the one place they live.
    """
    members: list[tuple[str, Path]] = [("pyproject.toml", repo_root / "pyproject.toml")]
    pkg = repo_root / "src" / "tiered_ckpt"
    for p in sorted(pkg.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".typed", ".yaml", ".json", ".txt"):
            members.append((f"src/tiered_ckpt/{p.relative_to(pkg).as_posix()}", p))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, path in members:
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    blob = gzip.compress(raw.getvalue(), compresslevel=9, mtime=0)
    sha = hashlib.sha256(blob).hexdigest()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"tiered-ckpt-{sha[:16]}.tar.gz"
    if not path.exists() or path.read_bytes() != blob:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        os.replace(tmp, path)
    for old in out_dir.glob("tiered-ckpt-*.tar.gz"):
        if old != path:
            old.unlink(missing_ok=True)   # earlier builds; the Pulumi state keeps only their hashes
    return Toolkit(path=path, sha256=sha, blob_name=path.name)
