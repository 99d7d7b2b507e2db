"""lfs hsm_state parsing and batching against the fake lfs (shaped like lustre/utils/lfs.c)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.lifecycle.helpers import FAKE_LFS, lfs_calls
from tiered_ckpt.errors import UnavailableError
from tiered_ckpt.tiers.hsm import ARCHIVED, DIRTY, EXISTS, RELEASED, Lfs, parse_batch, parse_line


@pytest.mark.parametrize(
    "line,path,flags,aid",
    [
        ("/lustrefs/a: (0x00000009) exists archived, archive_id:1", "/lustrefs/a", 0x9, 1),
        ("/lustrefs/a: (0x00000009) exists archived, archive_id: 2", "/lustrefs/a", 0x9, 2),
        ("/lustrefs/my file: v2: (0x0000000d) released exists archived, archive_id:1", "/lustrefs/my file: v2", 0xD, 1),
        ("/lustrefs/new: (0x00000000)", "/lustrefs/new", 0, 0),
        ("/x/(0x00000009) y: (0x0000000b) exists dirty archived, archive_id:1", "/x/(0x00000009) y", 0xB, 1),
        ("/l/a: (0x00000069) exists archived never_archive lost_from_hsm, archive_id:1", "/l/a", 0x69, 1),
    ],
)
def test_parse_line_from_the_right(line: str, path: str, flags: int, aid: int) -> None:
    s = parse_line(line)
    assert (s.path, s.flags, s.archive_id) == (path, flags, aid)


def test_archived_means_exists_archived_and_not_dirty_lost_or_noarchive() -> None:
    assert parse_line("/a: (0x00000009) exists archived, archive_id:1").archived
    assert parse_line("/a: (0x0000000d) released exists archived, archive_id:1").archived
    for flags in (0x0, 0x1, 0x8, 0xB, 0x29, 0x49):
        s = parse_line(f"/a: (0x{flags:08x})")
        assert not s.archived, hex(flags)
        assert s.why_not_archived()


def test_parse_batch_uses_the_requested_paths() -> None:
    tricky = "/l/a: (0x00000009) exists archived, archive_id:1"      # a real file name
    out = f"{tricky}: (0x00000000)\n/l/b: (0x00000009) exists archived, archive_id: 1\n"
    got = parse_batch([tricky, "/l/b", "/l/c"], out)
    assert [(s.path, s.flags) for s in got] == [(tricky, 0), ("/l/b", 9)]


def test_states_batches_and_survives_a_missing_file(tmp_path: Path, fake_lfs: Path) -> None:
    files = []
    for i in range(7):
        p = tmp_path / f"f {i}:x"
        p.write_bytes(b"x" * i)
        files.append(str(p))
    subprocess.run([str(FAKE_LFS), "hsm_archive", *files[:3]], check=True)
    fake_lfs.unlink()
    lfs = Lfs(str(FAKE_LFS), batch=3)
    states, errors = lfs.states(files)
    assert lfs_calls(fake_lfs, "hsm_state") == 3 == lfs.processes      # ceil(7/3)
    assert [states[f].flags for f in files] == [EXISTS | ARCHIVED] * 3 + [0] * 4
    # lfs stops at a file it cannot stat: that file is reported, the rest still answered.
    gone = tmp_path / "gone"
    states, errors = lfs.states([files[0], str(gone), files[1]])
    assert set(states) == {files[0], files[1]} and "No such file" in errors[str(gone)]


def test_release_restore_and_dirty_after_write(tmp_path: Path, fake_lfs: Path) -> None:
    p = tmp_path / "a"
    p.write_bytes(b"abc")
    lfs = Lfs(str(FAKE_LFS))
    lfs.archive([str(p)])
    lfs.release([str(p)])
    assert lfs.states([str(p)])[0][str(p)].flags & RELEASED
    lfs.restore([str(p)])
    assert not lfs.states([str(p)])[0][str(p)].released
    p.write_bytes(b"abcd")
    s = lfs.states([str(p)])[0][str(p)]
    assert s.flags & DIRTY and not s.archived


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UnavailableError, match="amlfs.lfs"):
        Lfs(str(tmp_path / "no-lfs")).states([str(tmp_path)])


def test_a_failure_other_than_a_missing_file_stops_at_once(tmp_path: Path) -> None:
    """Not on Lustre: lfs fails for every file; one clear error, not one process per file."""
    lfs_bin = tmp_path / "lfs"
    calls = tmp_path / "calls"
    lfs_bin.write_text(f'#!/bin/sh\necho x >> {calls}\necho "can\'t get hsm state for $2: Inappropriate ioctl for device" >&2\nexit 25\n')
    lfs_bin.chmod(0o755)
    files = [str(tmp_path / f"f{i}") for i in range(50)]
    with pytest.raises(UnavailableError, match="Inappropriate ioctl.*AMLFS mount"):
        Lfs(str(lfs_bin), batch=100, parallel=1).states(files)
    assert len(calls.read_text().splitlines()) == 1
