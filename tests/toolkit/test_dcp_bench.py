"""The DCP benchmark runs end to end at a tiny size and reports every goal; its fixture is a real AdamW state.

No speed is asserted: the point is that `make bench`'s DCP part works on whatever writer/reader the
tree holds, that a load it times really loaded the saved bytes, and that its output parses.
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

from benchmarks import dcp_bench  # noqa: E402
from benchmarks.harness import MANY_BYTES  # noqa: E402

TINY = ["--params", "2MiB", "--small", "12", "--many", "40", "--rounds", "2", "--sizes", "3MiB,12MiB", "--no-drop-caches"]


def test_bench_runs_and_reports_every_goal(tmp_path: Path) -> None:
    args = dcp_bench.parse_args([*TINY, "--dir", str(tmp_path / "bench")])
    lines: list[str] = []
    specs: list[dict[str, Any]] = []

    def in_process(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        # The harness's own child, run here instead of in a fresh interpreter (seconds, not a minute);
        # the fresh-process path is exercised by the test below.
        specs.append(spec)
        return json.loads(json.dumps(dcp_bench._child(spec)))

    res = dcp_bench.run(args, lines.append, runner=in_process)
    # The state saved by TieredWriter alone at --sizes (the larger in round 1 only).
    sized = [s for s in specs if s["kind"] == "save" and s.get("params") != args.params]
    assert [(s["who"], s["params"]) for s in sized] == [("tiered", 1 << 20), ("tiered", 4 << 20), ("tiered", 1 << 20)]
    assert {f"write_{k}_vs_fio" for k in ("1g", "4g")} <= set(res["stats"])
    specs = [s for s in specs if s not in sized]
    # Every measurement of every round, in a different order in the second round.
    per_round = len(specs) // 2
    assert len(specs) == 2 * per_round == 2 * 14 and len(lines) == 2 * 16 + 3
    order = [(s["kind"], s["what"], s["who"], s.get("threads")) for s in specs]
    assert order[:per_round] != order[per_round:] and sorted(order[:per_round]) == sorted(order[per_round:])
    assert {s["who"] for s in specs} == {"tiered", "fsw", "fsr"}
    assert sorted(s["threads"] for s in specs if s["kind"] == "save" and s["what"] == "state" and s["who"] == "fsw") \
        == [1, 1, 4, 4, 8, 8]
    assert all(r["load_tiered"]["verified"] and r["load_fsr"]["verified"] and r["many_load_tiered"]["verified"]
               and r["many_load_fsr"]["verified"] for r in res["rounds_raw"])
    assert set(res["met"]) == set(dcp_bench.GOALS)
    # The profiled runs: a share of the call, and both metadata files measured.
    assert all(0 < r["many_save_prof"]["own_share"] < 1 and 0 < r["many_load_prof"]["own_share"] < 1
               and r["many_save_tiered"]["metadata_bytes"] > 0 and r["many_save_fsw"]["metadata_bytes"] > 0
               for r in res["rounds_raw"])
    assert res["cold_cache"] is False                       # said so, since the smoke run did not drop it
    n_params = sum(1 for _ in dcp_bench.layout(args.params, args.small))
    assert res["state_tensors"] == 4 * n_params             # parameter, exp_avg, exp_avg_sq, step
    assert not (tmp_path / "bench").exists()                 # nothing left behind

    table = dcp_bench.render(res)
    assert "DCP STATE SIZE" in table and "PAGE CACHE NOT DROPPED" in table
    for label in ("write vs FileSystemWriter", "write vs fio", "load vs FileSystemReader", "async_save blocked, 2nd save",
                  "save 40 x 4 KiB", "load 40 x 4 KiB", "save 40 x 4 KiB: share in our code",
                  "load 40 x 4 KiB: share in our code", "metadata, many tensors", "write vs fio, 0.0"):
        row = next(line for line in table.splitlines() if line.startswith(label))
        assert row.endswith((" met", "NOT MET")), row
    json.loads(json.dumps(res))                              # --json prints exactly this


def test_one_measurement_in_a_fresh_process_parses(tmp_path: Path) -> None:
    (tmp_path / "tiered").mkdir()
    spec = {"dir": str(tmp_path), "params": 1 << 20, "small": 5, "many": 10, "kind": "save", "what": "many",
            "who": "tiered", "step": 1, "name": "-"}
    res = dcp_bench._run_child(spec, timeout=300)
    assert res["tensors"] == 10 and res["bytes"] == 10 * MANY_BYTES and res["seconds"] > 0
    assert list((tmp_path / "tiered" / dcp_bench.MODEL).iterdir())          # it really wrote a checkpoint


def test_fixture_has_the_structure_of_a_real_adamw_state() -> None:
    """The bench's state equals, in structure, what get_state_dict returns after a real AdamW step."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    params, small = 1 << 20, 5
    ours = dcp_bench.build_state(params, small)
    model = torch.nn.Module()
    for name, shape in dcp_bench.layout(params, small):       # the same module tree, then one real step
        parent = model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    msd, osd = get_state_dict(model, opt)

    def shape_of(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype)
        if isinstance(x, dict):
            return {k: shape_of(v) for k, v in x.items()}
        if isinstance(x, list):
            return [shape_of(v) for v in x]
        return x

    assert shape_of(ours) == shape_of({"model": msd, "optim": osd})
    assert list(ours["optim"]["state"]) == list(osd["state"])              # same order of parameters
