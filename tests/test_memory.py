"""The resident-set measurement agrees with the dispatch-mode tracker where both see everything (an
eager step), so it can stand in where the tracker is blind (Inductor's own buffers)."""
from __future__ import annotations

import pytest

from benchmarks.rss_check import measure_case
from remat_compiler.memory import ResidentPeak


def test_resident_peak_agrees_with_the_tracker_on_an_eager_step():
    r = measure_case("mlp-wide")
    assert r["tracker_bytes"] > 16 * 2**20  # big enough that pages and arenas are noise
    assert abs(r["rss_bytes"] - r["tracker_bytes"]) <= 0.02 * r["tracker_bytes"], r


def test_resident_peak_refuses_a_process_without_the_mmap_threshold(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with pytest.raises(RuntimeError, match="MALLOC_MMAP_THRESHOLD_"):
        with ResidentPeak():
            pass
