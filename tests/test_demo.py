"""`flatlm demo` end to end (slow: PCFG compile, training, probe, lookup table and Fisher trace)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli


@pytest.mark.slow
def test_demo_prints_the_story_as_json(tmp_path):
    proc = run_cli("demo", "--workdir", str(tmp_path / "demo"), "--steps", "40", "--json", "--quiet", timeout=1800)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [r["step"] for r in out["rows"]] == [10, 20, 30, 40]
    for r in out["rows"]:
        assert r["loss"] == pytest.approx(r["entropy"] + r["kl"], abs=1e-9) and r["kl"] > 0
        assert 0 < r["probe"] <= 1 and r["trace"] > 0 and r["trace_stderr"] > 0
    assert 0 < out["lookup_table"]["accuracy"] <= 1
    assert (tmp_path / "demo" / "results.json").exists()
