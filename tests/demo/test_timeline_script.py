"""The README's timeline picture comes from the toolkit's commands on a real run (`make timeline-png`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tiered_demo.timeline import run


@pytest.mark.timeout(300)
def test_the_documented_run_draws_every_kind_of_event(tmp_path: Path) -> None:
    png = tmp_path / "docs" / "timeline.png"
    got = run(png, tmp_path / "w", checkpoints=6, size=1 << 20, interval=0.0, say=lambda m: None)
    assert got["png"] == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ev = [(e["kind"], e["checkpoint"], e["action"]) for e in got["events"]]
    names = [f"global_epoch0_step{s}" for s in (100, 200, 300, 400, 500, 600)]
    assert [n for k, n, _ in ev if k == "write"] == names
    # The exporter held back for the last three rounds: the oldest of those was blocked, then freed.
    assert ("retention", names[3], "blocked") in ev and ("retention", names[3], "delete") in ev
    assert ev.index(("retention", names[3], "blocked")) < ev.index(("retention", names[3], "delete"))
    assert [(n, a) for k, n, a in ev if k == "restore"] == [(names[1], "download"), (names[5], "resident")]
