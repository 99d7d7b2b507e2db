"""The scale benchmark runs end to end at a tiny size and reports every goal it was asked to measure.

No speed is asserted: the point is that `make bench`'s scale suite works on whatever save/load path
the tree holds, that every goal gets a row with a measured figure, a threshold and a verdict, that
the loads it times really returned what was saved, and that its latest() fixture is made of
committed checkpoints (else latest() would not find the newest).
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed"),
    pytest.mark.skipif(shutil.which("fio") is None, reason="fio not installed (make debs installs it)"),
]

from benchmarks import GOALS_MISSED, scale_bench  # noqa: E402

TINY = ["--scale", "0.002", "--small", "10", "--many", "300", "--kept", "5", "--rounds", "1", "--no-drop-caches"]


def test_scale_bench_reports_every_goal(tmp_path: Path) -> None:
    args = scale_bench.parse_args([*TINY, "--dir", str(tmp_path / "bench")])
    specs: list[dict[str, Any]] = []

    def runner(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        specs.append(spec)
        if spec["kind"].startswith("async"):
            # A fresh process, as the bench runs every figure: a first async_save in this test
            # process would keep its staging area for the rest of the session.
            return scale_bench._run_child(spec, timeout)
        return json.loads(json.dumps(scale_bench._child(spec)))      # in process: seconds, not a minute

    lines: list[str] = []
    res = scale_bench.run(args, lines.append, runner=runner)

    kinds = sorted((s["kind"], s.get("who", ""), s.get("what", "")) for s in specs)
    assert kinds.count(("save", "ours", "many")) == 2          # the latest() fixture's save and the timed one
    for who in ("ours", "torch"):
        for what in ("state", "many"):
            assert ("save", who, what) in kinds and ("load", who, what) in kinds
    assert ("latest", "", "") in kinds and ("async", "", "") in kinds and ("async_small", "", "") in kinds
    rd = res["rounds_raw"][0]
    assert rd["latest"]["found"] == "global_epoch0_step5"       # the copies are committed; the newest wins
    assert all(rd[f"{w}_load_{who}"]["verified"] for w in ("state", "many") for who in ("ours", "torch"))
    assert rd["state_load_ours"]["tensors"] == rd["state_save_ours"]["tensors"] == res["state_tensors"]
    assert res["state_tensors"] == 4 * len(scale_bench.layout(args.scale, args.small))   # param, 2 moments, step
    assert set(res["met"]) == set(scale_bench.GOALS) and res["cache"] == "warm"
    assert not (tmp_path / "bench").exists()                    # nothing left behind

    table = scale_bench.render(res)
    assert "PAGE CACHE NOT DROPPED" in table and "SCALED DOWN" in table
    body = table.splitlines()[3:-1]
    verdicts = [line for line in body if line.endswith((" met", "NOT MET"))]
    assert len(verdicts) == len(scale_bench.GOALS), table        # one row with a verdict per goal
    for label in ("write vs fio", "load into new tensors vs fio", "save 300 x 4 KiB", "load 300 x 4 KiB",
                  "RSS added saving", "marker size", "latest() among 5", "memcpy floor", "training loop",
                  "first async_save", "order saved"):
        assert any(label in line for line in verdicts), label
    json.loads(json.dumps(res))                                  # --json prints exactly this


def test_main_prints_one_json_object_and_a_missed_goal_is_not_an_error(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {"met": {k: k != "latest_s" for k in scale_bench.GOALS}}
    monkeypatch.setattr(scale_bench, "run", lambda args, progress, runner=None: fake)
    monkeypatch.setattr(scale_bench, "REPO", tmp_path)
    rc = scale_bench.main([*TINY, "--json", "--dir", str(tmp_path / "b")])
    assert rc == GOALS_MISSED
    assert json.loads(capsys.readouterr().out) == fake
