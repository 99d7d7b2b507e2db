"""DCP metadata is a pickle in a group-writable tree: nothing planted there is ever unpickled.

A member of the shared group can replace ``dcp.<sid>.metadata`` with a file of the same size
whose pickle runs code. Every rank hashes what it unpickles against the marker before
unpickling (with or without verify_hash), a planted marker whose hash matches the planted
pickle meets the allow-list unpickler, and the bytes of non-tensor items (which DCP's planner
torch.load()s) are hashed against the metadata's record. Real gloo ranks for the multi-rank case.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.toolkit import gloo_ranks
from tiered_ckpt.errors import IntegrityError
from tiered_ckpt.io import commit
from tiered_ckpt.io.marker import MARKER

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from tiered_ckpt.dcp import DIGEST, RAW, TieredReader, TieredWriter, metadata_name  # noqa: E402


class _Evil:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.sentinel}",))


def _state() -> dict[str, Any]:
    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8), "tag": "a" * 200, "step": 7}


def _save(root: Path) -> Path:
    dcp.save(_state(), storage_writer=TieredWriter(root, "m", epoch=0, step=1), no_dist=True)
    d = root / "m" / "global_epoch0_step1"
    m = commit.read_marker(d)
    assert m is not None and m.save_id is not None
    return d / metadata_name(m.save_id)


def _plant(meta: Path, sentinel: Path) -> bytes:
    """A same-size metadata file whose pickle runs `touch sentinel` (pickle ignores trailing bytes)."""
    evil = pickle.dumps(_Evil(sentinel))
    size = meta.stat().st_size
    assert len(evil) < size
    data = evil + b"\0" * (size - len(evil))
    meta.write_bytes(data)
    return data


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(8, 8), "tag": "", "step": 0}


LOAD = r"""
import torch.distributed.checkpoint as dcp
from tiered_ckpt.dcp import TieredReader
out = {}
for verify in (False, True):
    st = {"w": torch.zeros(8, 8), "tag": "", "step": 0}
    try:
        dcp.load(st, storage_reader=TieredReader(root, "m", epoch=0, step=1, verify_hash=verify))
        out[str(verify)] = "loaded"
    except BaseException as e:      # DCP's CheckpointException is a BaseException
        out[str(verify)] = type(e).__name__ + ": " + str(e)
report(sentinel=os.path.exists(A["sentinel"]), **out)
leave()
"""


def test_planted_same_size_metadata_pickle_is_refused_on_both_ranks(root: Path, tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    _plant(_save(root), sentinel)
    res = gloo_ranks.run(LOAD, 2, tmp_path / "store", root=str(root), sentinel=str(sentinel), timeout=120)
    for r in res:
        for verify in ("False", "True"):
            assert "does not match its content hash" in r.out[verify], (r.rank, verify, r.out[verify])
        assert r.out["sentinel"] is False
    assert not sentinel.exists()


def test_planted_pickle_with_a_matching_marker_hash_still_runs_nothing(root: Path, tmp_path: Path) -> None:
    """Both files planted (the marker's hash made to match): the allow-list unpickler refuses."""
    sentinel = tmp_path / "pwned"
    meta = _save(root)
    data = _plant(meta, sentinel)
    d = meta.parent
    m = commit.read_marker(d)
    assert m is not None
    from tiered_ckpt.io.hashing import new_hasher
    h = new_hasher()
    h.update(data)
    files = [replace(f, hash=h.hexdigest()) if f.path == meta.name else f for f in m.files]
    (d / MARKER).unlink()
    commit.write_marker(d, replace(m, files=files))
    reader = TieredReader(root, "m", epoch=0, step=1)
    with pytest.raises(IntegrityError, match="refused, not run"):
        reader.checked_metadata()
    assert not sentinel.exists()


def test_load_training_with_verify_hash_never_unpickles_planted_metadata(root: Path, tmp_path: Path) -> None:
    from tiered_ckpt.training import load_training, save_training
    model = torch.nn.Linear(3, 2)
    save_training(model, epoch=0, step=1, root=root, model_name="m")
    m = commit.read_marker(root / "m" / "global_epoch0_step1")
    assert m is not None and m.save_id is not None
    sentinel = tmp_path / "pwned"
    _plant(root / "m" / "global_epoch0_step1" / metadata_name(m.save_id), sentinel)
    with pytest.raises(IntegrityError, match="content hash"):
        load_training(torch.nn.Linear(3, 2), root=root, model_name="m", verify_hash=True)
    assert not sentinel.exists()


def test_bit_flips_in_the_metadata_are_rejected_without_verify_hash(root: Path) -> None:
    """The metadata holds DCP's index (which item is where): verified always, it is small."""
    meta = _save(root)
    good = meta.read_bytes()
    # Flip bits inside names, offsets and the pickle's opcodes: each same-size change is refused.
    positions = [good.index(b"tag") + 1, good.index(b".bin") - 3, len(good) // 3, len(good) // 2, len(good) - 2]
    for pos in positions:
        bad = bytearray(good)
        bad[pos] ^= 0x01
        meta.write_bytes(bytes(bad))
        with pytest.raises(IntegrityError, match="does not match its content hash"):
            TieredReader(root, "m", epoch=0, step=1).checked_metadata()
    meta.write_bytes(good)
    st = _blank()
    dcp.load(st, storage_reader=TieredReader(root, "m", epoch=0, step=1), no_dist=True)
    assert st["tag"] == "a" * 200 and torch.equal(st["w"], _state()["w"])


def test_flipped_bytes_of_a_non_tensor_item_are_refused_before_torch_load(root: Path) -> None:
    """DCP's planner torch.load()s a non-tensor item's bytes: they are hashed first, without verify_hash."""
    meta = _save(root)
    md = TieredReader(root, "m", epoch=0, step=1).checked_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "tag")
    shard = meta.parent / info.relative_path
    data = bytearray(shard.read_bytes())
    at = data.index(b"a" * 200, info.offset)        # the string's bytes inside torch.save's archive
    assert info.offset <= at < info.offset + info.length
    data[at] ^= 0x03                                 # "a" -> "b": a silent wrong value before
    shard.write_bytes(bytes(data))
    st = _blank()
    with pytest.raises(BaseException, match="does not match its content hash"):
        dcp.load(st, storage_reader=TieredReader(root, "m", epoch=0, step=1), no_dist=True)
    assert st["tag"] == ""


def test_a_checkpoint_saved_before_item_digests_hashes_the_items_file_whole(root: Path) -> None:
    """Metadata without per-item digests (older releases): the file holding a non-tensor item is
    checked against the marker before the item is unpickled."""
    from tiered_ckpt.io.hashing import new_hasher
    meta = _save(root)
    d = meta.parent
    md = TieredReader(root, "m", epoch=0, step=1).checked_metadata()
    # Format 2 before digests: BYTE_IO items' _StorageInfo without the tiered_ckpt.xxh3 descriptor.
    assert any(v.transform_descriptors and v.transform_descriptors[0].startswith(DIGEST)
               for v in md.storage_data.values())
    md.storage_data = {k: replace(v, transform_descriptors=None) if v.transform_descriptors != [RAW] else v
                       for k, v in md.storage_data.items()}
    data = pickle.dumps(md)
    h = new_hasher()
    h.update(data)
    m = commit.read_marker(d)
    assert m is not None
    files = [replace(f, size=len(data), hash=h.hexdigest()) if f.path == meta.name else f for f in m.files]
    meta.write_bytes(data)
    (d / MARKER).unlink()
    commit.write_marker(d, replace(m, files=files))
    st = _blank()
    dcp.load(st, storage_reader=TieredReader(root, "m", epoch=0, step=1), no_dist=True)
    assert st["tag"] == "a" * 200                                   # intact: loads
    info = next(v for k, v in md.storage_data.items() if k.fqn == "tag")
    shard = d / info.relative_path
    raw = bytearray(shard.read_bytes())
    raw[raw.index(b"a" * 200, info.offset)] ^= 0x03
    shard.write_bytes(bytes(raw))
    with pytest.raises(BaseException, match="does not match the marker"):
        dcp.load(_blank(), storage_reader=TieredReader(root, "m", epoch=0, step=1), no_dist=True)


def _rewrite(meta: Path, md: Any) -> None:
    """`md` pickled as the checkpoint's metadata, the marker's size and hash made to match."""
    from tiered_ckpt.io.hashing import new_hasher
    data = pickle.dumps(md)
    h = new_hasher()
    h.update(data)
    m = commit.read_marker(meta.parent)
    assert m is not None
    meta.write_bytes(data)
    (meta.parent / MARKER).unlink()
    commit.write_marker(meta.parent, replace(m, files=[replace(f, size=len(data), hash=h.hexdigest())
                                                   if f.path == meta.name else f for f in m.files]))


def test_the_item_digest_is_a_dcp_transform_descriptor_and_our_record_needs_format_1(root: Path) -> None:
    """The digest lives in DCP's own _StorageInfo (metadata of DCP classes only); our _Stored is
    admitted by the allow-list only in format-1 metadata (no version), never beside a version."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from tiered_ckpt import dcp as tdcp
    from tiered_ckpt.io.hashing import new_hasher
    meta = _save(root)
    md = pickle.loads(meta.read_bytes())
    assert all(type(v) is _StorageInfo for v in md.storage_data.values())
    info = next(v for k, v in md.storage_data.items() if k.fqn == "tag")
    h = new_hasher()
    h.update((meta.parent / info.relative_path).read_bytes()[info.offset:info.offset + info.length])
    assert info.transform_descriptors == [DIGEST + h.hexdigest()]
    assert md.version == tdcp.DCP_VERSION
    md.storage_data = {k: tdcp._Stored(v.relative_path, v.offset, v.length) if k.fqn == "tag" else v
                       for k, v in md.storage_data.items()}
    _rewrite(meta, md)
    with pytest.raises(IntegrityError, match="format-1 records"):
        TieredReader(root, "m", epoch=0, step=1).checked_metadata()
    md.version = None
    _rewrite(meta, md)
    st = _blank()
    dcp.load(st, storage_reader=TieredReader(root, "m", epoch=0, step=1), no_dist=True)
    assert st["tag"] == "a" * 200 and st["step"] == 7
