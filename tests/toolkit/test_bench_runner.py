"""`python -m benchmarks`' own table and document: one row per goal of every suite that ran, with
what bounds a goal missed on this machine, written with the command and the machine's facts."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from benchmarks import __main__ as runner  # noqa: E402
from benchmarks.harness import machine  # noqa: E402


def _results() -> dict[str, dict[str, object]]:
    st = {"write_vs_fio": {"median": 0.8}, "many_save_vs_torch": {"median": 0.5},
          "fio_write_GBps": {"median": 2.0}, "fio_read_GBps": {"median": 2.5}}
    return {"scale": {"goals": {"write_vs_fio": [">=", 0.95], "many_save_vs_torch": ["<=", 1.0]},
                      "met": {"write_vs_fio": False, "many_save_vs_torch": True}, "stats": st},
            "dcp": {"goals": {"async_block_vs_dcp": 1.0}, "met": {"async_block_vs_dcp": False},
                    "stats": {"async_block_vs_dcp": {"median": 1.4}}}}


def test_every_goal_gets_a_row_and_a_missed_one_names_its_bound(tmp_path: Path) -> None:
    facts = machine()
    rows = runner.goal_rows(_results(), facts)
    assert [(r["suite"], r["goal"], r["met"]) for r in rows] == [
        ("scale", "write_vs_fio", False), ("scale", "many_save_vs_torch", True), ("dcp", "async_block_vs_dcp", False)]
    by = {r["goal"]: r for r in rows}
    assert by["write_vs_fio"]["op"] == ">=" and by["write_vs_fio"]["threshold"] == 0.95
    assert "write 2.00 GB/s" in by["write_vs_fio"]["bound"] and "read 2.50 GB/s" in by["write_vs_fio"]["bound"]
    assert by["async_block_vs_dcp"]["op"] == "<=" and f"{facts['cores']} cores" in by["async_block_vs_dcp"]["bound"]
    assert by["many_save_vs_torch"]["bound"] == ""
    doc = tmp_path / "benchmarks.md"
    runner.write_doc(doc, "python -m benchmarks", facts, rows, "SCALE table here", 12.0)
    text = doc.read_text()
    assert "`python -m benchmarks`" in text and f"{facts['cores']} cores, load average" in text
    assert "| scale | write_vs_fio | 0.8 | >= 0.95 | NOT MET |" in text and "SCALE table here" in text


def test_a_full_run_prints_every_goal_and_writes_the_document_from_its_own_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    def suite(argv: object) -> int:
        print("SUITE TABLE: write vs fio 0.80x NOT MET")
        (tmp_path / "io_results.json").write_text(json.dumps(
            {"goals": {"write_vs_fio": [">=", 0.95]}, "met": {"write_vs_fio": False}, "ratios": {"write_vs_fio": 0.8},
             "runs_GBps": {"fio_write": [1.5], "fio_read": [2.0]}}))
        return 1                                          # a goal missed: reported, not an error

    monkeypatch.setattr(runner, "SUITES", (("io", "benchmarks.io_bench", suite),))
    monkeypatch.setattr(runner, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(runner, "DOC", tmp_path / "doc.md")
    monkeypatch.setattr(runner, "QUICK_DOC", tmp_path / "quick.md")
    assert runner.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "| io | write_vs_fio | 0.8 | >= 0.95 | NOT MET | disk (fio best: write 1.50 GB/s, read 2.00 GB/s)" in out
    assert not (tmp_path / "doc.md").exists()             # --quick never replaces docs/benchmarks.md
    text = (tmp_path / "quick.md").read_text()
    assert "`python -m benchmarks --quick`" in text and "SUITE TABLE: write vs fio 0.80x NOT MET" in text
