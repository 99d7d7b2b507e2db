"""TieredStager's staging copy: host tensors copied by several threads (GIL-free memmoves in
pieces), bit-exact, non-contiguous ones by torch; the copy is done when stage() returns."""
from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tiered_ckpt.dcp_stage import TieredStager  # noqa: E402
from tiered_ckpt.io import pools  # noqa: E402


def test_host_tensors_are_staged_by_several_threads_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(3, 1 << 18, generator=g).to(torch.bfloat16),
             "t": torch.randn(64, 32, generator=g).t(),          # not contiguous: torch's copy
             "i": torch.arange(1001, dtype=torch.int64), "e": torch.empty(0), "n": 3}
    calls: list[tuple[int, int]] = []
    real = pools.parallel

    def spy(items: list[Any], fn: Any, nthreads: int) -> None:
        calls.append((len(items), nthreads))
        real(items, fn, nthreads)

    monkeypatch.setattr(pools, "parallel", spy)
    monkeypatch.setattr(pools, "COPY_CHUNK", 1 << 20)       # the 4 MiB tensor in 4 pieces
    st = TieredStager(budget_bytes=64 << 20, threads=2)
    staged = st.stage(state)
    for k in ("a", "b", "t", "i", "e"):
        assert staged[k].dtype == state[k].dtype and torch.equal(staged[k], state[k]), k
        if state[k].numel():
            assert staged[k].data_ptr() != state[k].data_ptr(), k     # a copy, not the caller's memory
    assert staged["n"] == 3
    # One parallel call for the contiguous host tensors: a's 4 pieces, b's 2, i's 1.
    assert calls == [(7, min(2, os.cpu_count() or 1))], calls
    state["a"].add_(1)                                        # the caller may change its tensors at once
    assert not torch.equal(staged["a"], state["a"])
    st.close()
