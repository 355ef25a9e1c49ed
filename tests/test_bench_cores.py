"""benchmarks/_cores.py: the cross-core round-trip probe that labels benchmark rounds near / far, and the grouping
of per-round ratios by that label (checked against a grouping written out by hand)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
_spec = importlib.util.spec_from_file_location("_cores", BENCH / "_cores.py")  # not on sys.path: the other tests
_cores = importlib.util.module_from_spec(_spec)  # must not import benchmark scripts by accident
_spec.loader.exec_module(_cores)


def test_by_state_groups_rounds_by_the_sample_before_each():
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    samples = [90.0, 400.0, None, 120.0, 251.0, 250.0]  # 250 is near (the threshold is "above 250 ns")
    groups = _cores.by_state(values, samples)
    assert groups["near"] == {"median": 4.0, "min": 1.0, "max": 6.0, "rounds": 3}
    assert groups["far"] == {"median": 3.5, "min": 2.0, "max": 5.0, "rounds": 2}
    assert _cores.by_state(values[:2], [None, None]) == {}
    assert _cores.by_state_line({}) == "not measured"
    assert _cores.by_state_line(groups) == "near 4.00x [1.00-6.00] (3 rounds); far 3.50x [2.00-5.00] (2 rounds)"
    with pytest.raises(ValueError):  # a sample per round, or the labels would be shifted
        _cores.by_state(values, samples[:-1])


def test_summary_counts_far_samples_and_says_why_not_measured(monkeypatch):
    assert _cores.summary([100.0, 80.0, 300.0, None]) == \
        "cross-core round trip 100 ns [80-300]; far (> 250 ns) before 1 of 3 rounds"
    monkeypatch.setattr(_cores, "_probe", lambda: (None, "no C compiler (cc) to build cross_core.c"))
    assert _cores.round_trip_ns() is None
    assert _cores.summary([None]) == "cross-core round trip: not measured (no C compiler (cc) to build cross_core.c)"


needs_probe = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None or len(os.sched_getaffinity(0)) < 2,
                                 reason="needs a C compiler and two CPUs")


@needs_probe
def test_round_trip_is_measured_and_leaves_the_callers_affinity_alone():
    before = os.sched_getaffinity(0)
    ns = [_cores.round_trip_ns(trips=200, repeats=3) for _ in range(2)]
    assert os.sched_getaffinity(0) == before
    # A cache line's round trip between two cores takes tens to hundreds of ns (73-440 on the project's VM), and up
    # to a scheduler time slice (ms) when another process holds a core (the tests run two at a time): a probe that
    # timed nothing (no partner) falls below, one that lost its partner thread never returns.
    assert all(10 < x < 1e8 for x in ns), ns
    assert np.isfinite(ns).all()


@needs_probe
def test_one_cpu_is_not_measured():
    code = ("import os, sys; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            f"sys.path.insert(0, {str(BENCH)!r}); import _cores; "
            "print(_cores.round_trip_ns(), _cores.not_measured_why())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "None fewer than two CPUs to run on"
