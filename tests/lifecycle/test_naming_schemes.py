"""Checkpoint directory naming schemes (`naming:`): native saves name the directory by the
model's scheme, and list / retention / restore (both tiers) order by (epoch, step) parsed from
the name, ignoring directories of other schemes or non-canonical spellings."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import tiered_ckpt as tc
from tests.lifecycle.helpers import local_cfg
from tiered_ckpt import naming
from tiered_ckpt.cli import app as cli
from tiered_ckpt.config import dump, load
from tiered_ckpt.errors import ConfigError, UserError
from tiered_ckpt.io import commit
from tiered_ckpt.io.hashing import new_hasher
from tiered_ckpt.io.marker import MARKER, FileEntry, InvalidMarker, Manifest, parse_marker
from tiered_ckpt.lifecycle import retention as ret
from tiered_ckpt.lifecycle.exporter import Exporter
from tiered_ckpt.lifecycle.restore import restore
from tiered_ckpt.lifecycle.status import gather
from tiered_ckpt.tiers.backends import LocalBackend
from tiered_ckpt.tiers.blob import BlobStore

# scheme -> (epoch, step) saved in this order, the names they get, the newest, and decoys:
# directories with a committed marker that are not checkpoints of a model of that scheme.
CASES = {
    "global_epoch": ([(0, 900), (1, 5), (0, 1000)],
                     ["global_epoch0_step900", "global_epoch0_step1000", "global_epoch1_step5"],
                     {"global_epoch0_step09999": (0, 9999), "step-9999": (0, 9999)}),
    "torchtitan": ([(0, 10), (0, 9), (0, 100)], ["step-9", "step-10", "step-100"],
                   {"step-09999": (0, 9999), "checkpoint-9999": (0, 9999), "global_epoch9_step9": (9, 9)}),
    "huggingface": ([(0, 1000), (0, 900), (0, 20)], ["checkpoint-20", "checkpoint-900", "checkpoint-1000"],
                    {"checkpoint-09999": (0, 9999), "step-9999": (0, 9999)}),
    "megatron": ([(0, 10), (0, 9), (0, 10_000_000)], ["iter_0000009", "iter_0000010", "iter_10000000"],
                 {"iter_9999": (0, 9999), "iter_099999999": (0, 99999999), "step-99999999": (0, 99999999)}),
}


def _decoy(model_dir: Path, name: str, epoch: int, step: int) -> None:
    """A committed-looking directory under a name this model's scheme does not own."""
    d = model_dir / name
    d.mkdir(parents=True)
    data = os.urandom(64)
    (d / "x.bin").write_bytes(data)
    h = new_hasher()
    h.update(data)
    commit.write_marker(d, Manifest(epoch=epoch, step=step, files=[FileEntry("x.bin", len(data), h.hexdigest())]))


@pytest.mark.parametrize("scheme", list(CASES))
def test_scheme_orders_list_retention_and_restore(scheme: str, tmp_path: Path, azurite_container: tuple[str, str],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    saves, ordered, decoys = CASES[scheme]
    conn, container = azurite_container
    root = tmp_path / "lustre"
    root.mkdir()
    cfg = replace(local_cfg(root, conn, container, keep_last=1, min_keep=1), naming=scheme)
    datas = {}
    for epoch, step in saves:
        arr = np.random.default_rng(step).integers(0, 255, 3000, dtype=np.uint8)
        kw = {"epoch": epoch} if scheme == "global_epoch" else {}
        res = tc.save({"w": arr}, step=step, config=cfg, **kw)
        datas[res.name] = arr
    assert sorted(datas) == sorted(ordered)
    for name, (e, s) in decoys.items():
        _decoy(root / "m", name, e, s)
    newest = ordered[-1]

    # native API and the list command: this scheme's names only, (epoch, step) order
    assert [c.name for c in commit.scan(root, "m", scheme)] == ordered
    info = tc.latest(config=cfg)
    assert info is not None and info.name == newest
    assert np.array_equal(np.frombuffer(tc.load(config=cfg)["w"], np.uint8), datas[newest])
    cfg_file = tmp_path / "node.yaml"
    cfg_file.write_text(dump(cfg))
    assert load(str(cfg_file)).naming == scheme
    monkeypatch.setenv("TIERED_CKPT_CONFIG", str(cfg_file))
    capsys.readouterr()
    assert cli.main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [r["name"] for r in rows] == ordered and [r["latest"] for r in rows] == [False] * (len(ordered) - 1) + [True]
    assert all(r["committed"] for r in rows)
    assert cli.main(["verify", ordered[0], "--json"]) == 0
    capsys.readouterr()

    # archive everything (decoys included), then retention keeps only the newest of this scheme
    store = BlobStore(cfg.archive, backoff=0.01)
    Exporter(cfg, store, status_path=tmp_path / "st.json").iterate()
    backend = LocalBackend(cfg, store)
    plan = {d.name: d.action for d in ret.evaluate(cfg, backend, ret.Policy(keep_last=1, min_keep=1)).decisions}
    assert plan == {**{n: ret.DELETE for n in ordered[:-1]}, newest: ret.KEEP}
    assert [c.name for c in gather(backend).checkpoints] == ordered
    assert sorted(ret.apply(cfg, backend, ret.Policy(keep_last=1, min_keep=1)).done) == sorted(f"delete {n}" for n in ordered[:-1])
    for name in decoys:                                  # not this model's checkpoints: never touched
        assert (root / "m" / name / MARKER).exists()

    # all local copies gone: restore --latest picks the archive's newest of this scheme
    commit.remove_checkpoint(root / "m" / newest)
    st = gather(backend)
    assert [(c.name, c.tier) for c in st.checkpoints] == [(n, "only in archive") for n in ordered]
    assert cli.main(["restore", "--latest", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == newest and out["source"] == "archive"
    assert np.array_equal(np.frombuffer(tc.load(config=cfg)["w"], np.uint8), datas[newest])
    # an older one by name, from the archive
    r = restore(cfg, backend, ordered[0], verify=True)
    assert r.name == ordered[0] and r.source == "archive"
    assert np.array_equal(np.frombuffer(tc.load(ordered[0], config=cfg)["w"], np.uint8), datas[ordered[0]])


def test_names_are_canonical_per_scheme() -> None:
    ok = {"global_epoch": ["global_epoch0_step0", "global_epoch3_step12000"],
          "torchtitan": ["step-0", "step-12000"], "huggingface": ["checkpoint-0", "checkpoint-12000"],
          "megatron": ["iter_0000000", "iter_0012000", "iter_12345678"]}
    bad = {"global_epoch": ["global_epoch0_step05", "step-5"], "torchtitan": ["step-05", "step-5 ", "step-", "Step-5"],
           "huggingface": ["checkpoint-007", "checkpoint-5\n"], "megatron": ["iter_5", "iter_00000005", "iter_012345678"]}
    for key, names in ok.items():
        for n in names:
            cid = naming.parse_name(n, key)
            assert cid is not None and cid.name == n and naming.parse_any(n) == cid
    for key, names in bad.items():
        for n in names:
            assert naming.parse_name(n, key) is None, (key, n)
    assert naming.parse_name(f"step-{2**63 - 1}", "torchtitan") is not None
    assert naming.parse_name(f"step-{2**63}", "torchtitan") is None
    with pytest.raises(UserError, match="not canonical.*'iter_0000005'"):
        naming.require_name("iter_5", "megatron")
    with pytest.raises(UserError, match=r"not of the form step-<N> \(for example step-12000\); this model's naming is torchtitan"):
        naming.require_name("global_epoch0_step5", "torchtitan")
    with pytest.raises(UserError, match="has no epoch"):
        naming.make_id(2, 5, "huggingface")
    # the pattern is accepted as the `naming:` value too
    assert naming.scheme("iter_{N:07d}").key == "megatron"
    # the marker must name the directory's epoch/step, whatever the scheme
    m = Manifest(epoch=0, step=9, files=[FileEntry("a", 1, None)])
    assert parse_marker(m.to_json(), "step-9").name == "step-9"
    with pytest.raises(InvalidMarker, match="names checkpoint step-9, but it is in 'step-10'"):
        parse_marker(m.to_json(), "step-10")
    m3 = replace(m, epoch=3)
    with pytest.raises(InvalidMarker, match="names checkpoint epoch 3 step 9, but it is in 'step-9'"):
        parse_marker(m3.to_json(), "step-9")


def test_unknown_scheme_is_refused_with_the_choices(tmp_path: Path) -> None:
    f = tmp_path / "node.yaml"
    f.write_text("root: /tmp\nnaming: deepspeed\n")
    with pytest.raises(ConfigError) as e:
        load(str(f))
    msg = str(e.value)
    assert "naming: 'deepspeed' is not a naming scheme" in msg
    for shown in ("global_epoch (global_epoch{E}_step{S})", "torchtitan (step-{N})", "huggingface (checkpoint-{N})",
                  "megatron (iter_{N:07d})"):
        assert shown in msg
    # the default stays out of a dumped config: configs from before `naming:` are unchanged
    assert "naming" not in dump(local_cfg(tmp_path, "UseDevelopmentStorage=true", "c"))


def test_teardown_gate_scans_every_scheme(tmp_path: Path) -> None:
    """The gate does not know each model's `naming:`: a checkpoint named in any built-in scheme
    is one it must find archived before the file system goes."""
    from tiered_ops.evidence import lustre_checkpoints

    base = tmp_path / "lustrefs" / "checkpoints"
    for model, name, step in (("a", "global_epoch0_step1", 1), ("b", "step-7", 7), ("c", "checkpoint-8", 8),
                              ("d", "iter_0000009", 9), ("d", "iter_9", 9), ("b", "step-07", 7)):
        _decoy(base / model, name, 0, step)
    records, uncommitted = lustre_checkpoints(tmp_path / "lustrefs", "/checkpoints")
    assert sorted((r.model, r.name) for r in records) == [("a", "global_epoch0_step1"), ("b", "step-7"),
                                                          ("c", "checkpoint-8"), ("d", "iter_0000009")]
    assert uncommitted == ()
