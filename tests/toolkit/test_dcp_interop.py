"""What a TieredWriter checkpoint offers stock PyTorch tools: metadata that unpickles without this
package, checkpoint_id conventions, `tiered-ckpt convert` to and from stock formats, and the
stager on FSDP1's ShardedTensor."""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from tests.toolkit import gloo_ranks
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER, FileEntry, Manifest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")


def _state() -> dict[str, object]:
    import torch

    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(5, dtype=torch.int16),
                      "h": torch.ones(2, 2, dtype=torch.bfloat16)},
            "step": 7, "tag": "run", "hist": [1, "x"]}


def _zeros() -> dict[str, object]:
    import torch

    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.int16),
                      "h": torch.zeros(2, 2, dtype=torch.bfloat16)}, "step": 0, "tag": "", "hist": []}


def _same(a: object, b: object) -> bool:
    import torch

    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def _save(root: Path, step: int = 1) -> Path:
    import torch.distributed.checkpoint as dcp

    from tiered_ckpt.dcp import TieredWriter

    dcp.save(_state(), storage_writer=TieredWriter(root, "m", epoch=0, step=step), no_dist=True)
    return root / "m" / f"global_epoch0_step{step}"


def test_metadata_unpickles_without_this_package_and_carries_version_and_storage_meta(root: Path) -> None:
    d = _save(root)
    m = commit.read_marker(d)
    assert m is not None and m.save_id is not None
    md_file = d / f"dcp.{m.save_id}.metadata"
    # Our names only as transform descriptors (strings): raw tensors, and non-tensor items' digests.
    import re
    assert b"tiered_ckpt." not in re.sub(rb"tiered_ckpt\.xxh3/[0-9a-f]{32}", b"",
                                         md_file.read_bytes().replace(b"tiered_ckpt.raw/1", b""))
    # A Python that cannot import tiered_ckpt (only torch's site-packages on its path).
    site = str(Path(importlib.util.find_spec("torch").origin).parent.parent)  # type: ignore[union-attr, arg-type]
    code = ("import pickle, sys; sys.path[:] = [p for p in sys.path if 'src' not in p]; "
            "import importlib.util; assert importlib.util.find_spec('tiered_ckpt') is None; "
            f"md = pickle.load(open({str(md_file)!r}, 'rb')); "
            "print(md.version, md.storage_meta.checkpoint_id, md.storage_meta.save_id, "
            "sorted({type(v).__name__ for v in md.storage_data.values()}))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env={"PYTHONPATH": site},
                         check=True).stdout.split()
    assert out == ["1.0.0", str(d), m.save_id, "['_StorageInfo']"]


def test_checkpoint_id_mapping_and_validation(root: Path) -> None:
    from tiered_ckpt.dcp import TieredReader, TieredWriter
    from tiered_ckpt.errors import UserError

    w = TieredWriter()
    assert w.checkpoint_id is None
    w.reset(str(root / "m" / "step-5"))                   # torchtitan's folders; any built-in scheme
    assert (w.root, w.model, w.cid.step, w.checkpoint_id) == (root, "m", 5, str(root / "m" / "step-5"))
    assert TieredWriter.validate_checkpoint_id(root / "m" / "global_epoch1_step2")
    assert not TieredWriter.validate_checkpoint_id("/any/dir")
    with pytest.raises(UserError, match=r"checkpoint_id='/any/dir': the tiered backend keeps checkpoints at "
                                        r"<root>/<model>/<name>"):
        w.reset("/any/dir")
    with pytest.raises(UserError, match="TieredWriter\\(\\) was given no checkpoint"):
        TieredWriter().set_up_storage_writer(True)
    d = _save(root)
    assert TieredReader.validate_checkpoint_id(d)
    assert not TieredReader.validate_checkpoint_id(root / "m" / "global_epoch0_step2")   # no marker there


def _cli(root: Path, *args: str) -> tuple[int, dict[str, object]]:
    r = subprocess.run([sys.executable, "-m", "tiered_ckpt", "--root", str(root), "--model", "m", "--json", *args],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    return r.returncode, json.loads(r.stdout)


def test_convert_to_stock_dcp_and_torch_and_back(root: Path, tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tiered_ckpt.dcp import TieredReader

    _save(root)
    out = tmp_path / "stock"
    rc, res = _cli(root, "convert", "global_epoch0_step1", "--to", "dcp", str(out), "--hash")
    assert rc == 0 and res["format"] == "dcp" and res["items"] == 6, res
    got = _zeros()
    dcp.load(got, storage_reader=FileSystemReader(out), no_dist=True)
    assert _same(_state(), got)
    got = _zeros()
    dcp.load(got, checkpoint_id=out, no_dist=True)          # DCP picks FileSystemReader by itself
    assert _same(_state(), got)
    dcp_to_torch_save(out, tmp_path / "stock.pt")
    assert _same(_state(), torch.load(tmp_path / "stock.pt", weights_only=False))
    rc, res = _cli(root, "convert", "global_epoch0_step1", "--to", "dcp", str(out))
    assert rc == 2 and "is not empty" in str(res["error"]), res
    rc, res = _cli(root, "convert", "global_epoch0_step1", "--to", "torch", str(tmp_path / "t.pt"))
    assert rc == 0 and _same(_state(), torch.load(tmp_path / "t.pt", weights_only=False)), res
    # Migration: the stock directory becomes a committed checkpoint of the model.
    rc, res = _cli(root, "convert", "global_epoch0_step2", "--from", "dcp", str(out))
    assert rc == 0 and res["format"] == "tiered", res
    got = _zeros()
    dcp.load(got, storage_reader=TieredReader(root, "m", epoch=0, step=2, verify_hash=True), no_dist=True)
    assert _same(_state(), got)
    rc, res = _cli(root, "convert", "global_epoch0_step9", "--to", "torch", str(tmp_path / "x.pt"))
    assert rc == 1 and "global_epoch0_step9 is not a committed checkpoint" in str(res["error"]), res


STAGED = r"""
import warnings
warnings.filterwarnings("ignore")
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from tiered_ckpt.dcp import TieredReader, TieredWriter
from tiered_ckpt.dcp_stage import TieredStager, addresses
from torch.testing._internal.two_tensor import TwoTensor
spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
st = sharded_tensor.zeros(spec, 6, 4)
for s in st.local_shards():
    s.tensor.copy_(torch.arange(s.tensor.numel(), dtype=torch.float32).reshape(s.tensor.shape) + rank * 100)
n = len(addresses({"st": st, "t": TwoTensor(torch.ones(2), torch.ones(2)), "m": torch.empty(2, device="meta")}))
fut = dcp.async_save({"st": st}, storage_writer=TieredWriter(root, "m", epoch=0, step=1), async_stager=TieredStager(1 << 20))
for s in st.local_shards():
    s.tensor.zero_()          # after async_save returned: the staged copy is what gets saved
fut.result()
got = sharded_tensor.zeros(spec, 6, 4)
dcp.load({"st": got}, storage_reader=TieredReader(root, "m", epoch=0, step=1, verify_hash=True))
ok = all(torch.equal(s.tensor, torch.arange(s.tensor.numel(), dtype=torch.float32).reshape(s.tensor.shape) + rank * 100)
         for s in got.local_shards())
# use_collectives=False: DTensor shards of both ranks end up in one checkpoint (the coordinator
# merges the ranks' metadata) that loads with collectives; a second save of the name is refused
# on every rank (none waits for the other).
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
mesh = init_device_mesh("cpu", (world,))
full = torch.arange(7 * 3, dtype=torch.float64).reshape(7, 3)
dcp.save({"d": distribute_tensor(full, mesh, [Shard(0)]), "n": 5}, storage_writer=TieredWriter(root, "m", epoch=0, step=2),
         use_collectives=False)
back = {"d": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "n": 0}
dcp.load(back, storage_reader=TieredReader(root, "m", epoch=0, step=2, verify_hash=True))
merged = bool(torch.equal(back["d"].full_tensor(), full)) and back["n"] == 5
try:
    dcp.save({"d": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=TieredWriter(root, "m", epoch=0, step=2),
             use_collectives=False)
    again = "saved"
except BaseException as e:
    again = type(e).__name__
report(ok=ok, addresses=n, merged=merged, again=again)
leave()
"""


def test_stager_and_writer_take_sharded_tensors_and_no_collectives(root: Path, tmp_path: Path) -> None:
    runs = gloo_ranks.run(STAGED, 2, tmp_path / "store", timeout=240, root=str(root), pg_timeout=60)
    assert [r.out for r in runs] == [{"ok": True, "addresses": 1, "merged": True, "again": "ConflictError"}] * 2, runs
    assert [c.name for c in commit.scan(root, "m") if c.committed] == ["global_epoch0_step1", "global_epoch0_step2"]


def test_a_format_1_checkpoint_still_loads(root: Path) -> None:
    """Checkpoints saved before the metadata held DCP types only (storage_data of _Stored) load as before."""
    import torch.distributed.checkpoint as dcp

    from tiered_ckpt import dcp as tdcp
    from tiered_ckpt.io.hashing import new_hasher

    d = _save(root)
    m = commit.read_marker(d)
    assert m is not None and m.save_id is not None
    name = tdcp.metadata_name(m.save_id)
    md = pickle.loads((d / name).read_bytes())
    loc = tdcp._locations(md)
    md.storage_data = {i: (s if s.dtype is not None else tdcp._Stored(s.relative_path, s.offset, s.length))
                       for i, s in loc.items()}
    md.version = None             # format 1 pickled the planner's Metadata, which carries no version
    data = pickle.dumps(md)
    (d / name).write_bytes(data)
    h = new_hasher()
    h.update(data)
    files = [f if f.path != name else FileEntry(name, len(data), h.hexdigest(), 0) for f in m.files]
    (d / MARKER).unlink()
    commit.write_marker(d, Manifest(epoch=0, step=1, files=files, world_size=1, index={}, save_id=m.save_id))
    got = _zeros()
    dcp.load(got, storage_reader=tdcp.TieredReader(root, "m", epoch=0, step=1, verify_hash=True), no_dist=True)
    assert _same(_state(), got)
