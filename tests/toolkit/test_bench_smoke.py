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

from benchmarks import scale_bench  # noqa: E402
from benchmarks.harness import GOALS_MISSED  # noqa: E402

TINY = ["--scale", "0.002", "--small", "10", "--many", "300", "--kept", "5", "--rounds", "1", "--no-drop-caches"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[dict[str, Any]], dict[str, Any], Path]:
    """One tiny run of the whole suite: (args, every measurement's spec, the results, its directory)."""
    work = tmp_path_factory.mktemp("scale") / "bench"
    args = scale_bench.parse_args([*TINY, "--dir", str(work)])
    specs: list[dict[str, Any]] = []

    def runner(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        specs.append(spec)
        if spec["kind"].startswith("async"):
            # A fresh process, as the bench runs every figure: a first async_save in this test
            # process would keep its staging area for the rest of the session.
            return scale_bench._run_child(spec, timeout)
        return json.loads(json.dumps(scale_bench._child(spec)))      # in process: seconds, not a minute

    res = scale_bench.run(args, lambda line: None, runner=runner)
    return args, specs, res, work


def test_scale_bench_reports_every_goal(tiny: tuple[Any, list[dict[str, Any]], dict[str, Any], Path]) -> None:
    args, specs, res, work = tiny
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
    assert not work.exists()                                    # nothing left behind

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


def test_main_prints_one_json_object_with_a_row_per_goal(tiny: tuple[Any, list[dict[str, Any]], dict[str, Any], Path],
                                                         tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--json: the table as data on stdout alone; a missed goal is GOALS_MISSED, not an error."""
    res = json.loads(json.dumps(tiny[2]))
    res["met"]["latest_s"] = False
    monkeypatch.setattr(scale_bench, "run", lambda args, progress, runner=None: res)
    monkeypatch.setattr(scale_bench, "REPO", tmp_path)
    rc = scale_bench.main([*TINY, "--json", "--dir", str(tmp_path / "b")])
    assert rc == GOALS_MISSED
    out = json.loads(capsys.readouterr().out)
    assert [r["met"] for r in out["table"] if r["met"] is not None].count(False) >= 1
    assert len([r for r in out["table"] if r["met"] is not None]) == len(scale_bench.GOALS)
    assert all(r["goal"] and r["measured"] for r in out["table"])
    assert json.loads((tmp_path / ".bench" / "scale_results.json").read_text()) == out
