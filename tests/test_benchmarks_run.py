"""Every script `make bench` runs, run at toy sizes: CI never runs the benchmarks, so a script broken at run time
(benchmarks/compiles.py exited 2 without a command from f510eb2 on, 2026-11-25 to 11-28, which stopped
`make bench` at its second script) is caught by `make test-all`, not by the next person who needs its numbers.
The figures are not checked (toy sizes, a busy machine); the exit status and each script's summary line are.
Peers absent from the environment are skipped by the scripts themselves (`_util.optional_modules`), so this runs
without the `bench` extra; with it (`make bench`'s venv), peers.py and train_step.py run their peers too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").glob("[a-z]*.py"))  # the Makefile's glob

# script: (toy arguments, a string its output must contain). `{tmp}` is a fresh temporary folder.
TOY: dict[str, tuple[list[str], str]] = {
    "adversarial_step.py": (["--d-model", "32", "--layers", "1", "--batch", "16", "--classes", "4", "--rounds", "1",
                             "--steps", "1"], "goal: adversarial"),
    "compiles.py": ([], "s compiling"),
    "curvature.py": (["--d-model", "32", "--layers", "1", "--batch", "8", "--exact-d-model", "8", "--budgets", "4,8",
                      "--repeats", "2", "--rounds", "1"], "(FLOP floor"),
    "flatness_cost.py": (["--d-models", "32", "--layers", "1", "--batch", "8", "--repeats", "1"], "x one gradient"),
    "gpu.py": (["--small", "--no-hf", "--out", "{tmp}/gpu.json"], "device: "),
    "hmm_conditionals.py": (["--batch", "64", "--repeats", "1"], "max |conditionals - baseline|"),
    "microbatches.py": (["--shape", "L1-H64", "--batch", "16", "--ks", "1,2", "--rounds", "1", "--memory-shape",
                         "L1-H64", "--memory-batch", "16", "--memory-ks", "1,2"], "rows/slice"),
    "opt_conditionals.py": (["--shape", "tiny", "--chunk", "16"], "max |cached - uncached|"),
    "pcfg_conditionals.py": (["--batch", "16", "--dense-length", "8", "--dense-batch", "4", "--sample", "100",
                              "--repeats", "1"], "sentences/s"),
    "peers.py": (["--rounds", "1", "--pcfg-big-batch", "8", "--pcfg-length", "8", "--hmm-batch", "64",
                  "--processes", "2"], "over 2 processes"),
    "probe_cost.py": (["--examples", "256", "--d-model", "32", "--layers", "1", "--epochs", "1", "--seeds", "1",
                       "--extract-batch", "64", "--projections", "none,16"], "goal: the 1-seed probe"),
    "reproduce_suite.py": (["--workdir", "{tmp}/suite", "--preset", "tiny"], "not measured"),
    "startup_pipeline.py": (["--runs", "1", "--batch", "64", "--batches", "2"], "first step"),
    "train_step.py": (["--shapes", "L1-H64", "--batch", "8", "--steps", "1"], "summary (batch 8"),
}


def test_every_script_has_toy_arguments():
    """A new benchmark gets its toy run here (fast: it reads file names only)."""
    assert set(TOY) == set(SCRIPTS), f"add to TOY: {sorted(set(SCRIPTS) - set(TOY))}; " \
                                     f"remove from TOY: {sorted(set(TOY) - set(SCRIPTS))}"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_at_toy_size(script, tmp_path):
    args, expected = TOY[script]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{output[-3000:]}"
    assert expected in output, f"{script}: {expected!r} not in its output:\n{output[-3000:]}"
    for failure in ("Traceback", "FAILED sections"):  # gpu.py reports a failed section and goes on
        assert failure not in output, f"{script}: {failure!r} in its output:\n{output[-3000:]}"
