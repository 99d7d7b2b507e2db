"""The double's data hooks: an import puts the archived blobs back under the mount, an archive
uploads the mount's files, both with AMLFS's name mapping (blob <p> <-> <mount>/<p>)."""
from __future__ import annotations

import pytest
from azure.storage.blob import ContainerClient

from tests.doubles.arm_double import OPERATOR_TOKEN, blob_archive_hook, blob_import_hook
from tiered_ckpt.tiers.arm import ImportJobError

CKPT = "checkpoints/llama/global_epoch1_step100"


def test_import_restores_the_prefix_and_archive_uploads_it(arm_double, arm_jobs, azurite_container, tmp_path):
    conn, container = azurite_container
    src, dst = tmp_path / "before", tmp_path / "after"
    for name, data in {"COMMITTED.json": b"{}", "rank0.bin": b"x" * 1000, "sub dir/a:b.bin": b"y" * 7}.items():
        (src / CKPT / name).parent.mkdir(parents=True, exist_ok=True)
        (src / CKPT / name).write_bytes(data)
    (src / "checkpoints/llama/other/keep.bin").parent.mkdir(parents=True)
    (src / "checkpoints/llama/other/keep.bin").write_bytes(b"z")

    arm_double.scenario.archive_hook = blob_archive_hook(conn, container, src)
    jobs = arm_jobs(token=OPERATOR_TOKEN)     # a manual archive is the operator's (teardown), not the node's
    with jobs.autoexport_paused():
        jobs.start_archive("/" + CKPT)
        jobs.wait_archive("/" + CKPT)
    names = sorted(b.name for b in ContainerClient.from_connection_string(conn, container).list_blobs())
    assert names == [f"{CKPT}/COMMITTED.json", f"{CKPT}/rank0.bin", f"{CKPT}/sub dir/a:b.bin"]

    arm_double.scenario.import_hook = blob_import_hook(conn, container, dst)
    r = jobs.import_prefixes(["/" + CKPT])
    assert (r.blobs_walked, r.blobs_imported, r.errors) == (3, 3, 0)
    assert (dst / CKPT / "rank0.bin").read_bytes() == b"x" * 1000
    assert (dst / CKPT / "sub dir/a:b.bin").read_bytes() == b"y" * 7
    assert not (dst / "checkpoints/llama/other").exists()


def test_import_in_fail_mode_counts_existing_files_as_errors(arm_double, arm_jobs, azurite_container, tmp_path):
    conn, container = azurite_container
    ContainerClient.from_connection_string(conn, container).upload_blob(f"{CKPT}/rank0.bin", b"new")
    (tmp_path / CKPT).mkdir(parents=True)
    (tmp_path / CKPT / "rank0.bin").write_bytes(b"old")
    arm_double.scenario.import_hook = blob_import_hook(conn, container, tmp_path)
    arm_double.scenario.import_result = "CompletedPartial"
    with pytest.raises(ImportJobError, match="0 of 1 blobs imported, 1 errors"):
        arm_jobs().import_prefixes(["/" + CKPT], conflict_mode="Fail")
    assert (tmp_path / CKPT / "rank0.bin").read_bytes() == b"old"
