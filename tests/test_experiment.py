"""Experiment runner (resumable after SIGKILL), the continue-after-convergence schedule, and the report (`--jobs`:
test_experiment_jobs.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import REPO, run_cli, write_toy_experiment

from flatlm import checkpoint as ckpt
from flatlm.report import spearman_with_ci
from flatlm.train.loop import ConvergenceWatch

TWO_RUNS = [("a", []), ("b", ["--config.model.d_model=32"])]


class _Ckpt:
    after_convergence = True
    convergence_patience = 2
    convergence_tol = 0.02
    log_factor = 2.0


def test_convergence_watch_pins_log_spaced_steps_after_the_kl_plateau(tmp_path):
    pinned = ckpt.PinnedSteps((7,))
    watch = ConvergenceWatch(_Ckpt, 1000, str(tmp_path), pinned)
    for step, kl in [(10, 1.0), (20, 0.5), (30, 0.3), (40, 0.299), (50, 0.2999), (60, 0.1)]:
        watch.update(step, kl)
    assert watch.state["converged_at"] == 50  # two evals in a row without a 2% gain
    assert watch.state["log_steps"] == [50, 100, 200, 400, 800]
    assert pinned.steps == {7, 50, 100, 200, 400, 800}
    again = ckpt.PinnedSteps()
    ConvergenceWatch(_Ckpt, 1000, str(tmp_path), again)  # a resumed run reads its schedule back
    assert again.steps == {50, 100, 200, 400, 800}


class _CkptInBand(_Ckpt):
    convergence_max_kl = 0.02


def test_convergence_watch_with_a_band_waits_for_the_plateau_to_be_inside_it(tmp_path):
    """A plateau above `convergence_max_kl` is not convergence; the first plateaued eval inside the band is."""
    pinned = ckpt.PinnedSteps()
    watch = ConvergenceWatch(_CkptInBand, 1000, str(tmp_path), pinned)
    # plateaued at step 40 above the band; 0.0199 is a gain (stalls back to 0); plateaued again at step 70, but
    # that eval is above the band; step 80 is both
    for step, kl in [(10, 0.05), (20, 0.025), (30, 0.0249), (40, 0.0251), (50, 0.0199), (60, 0.0203), (70, 0.0205)]:
        watch.update(step, kl)
        assert watch.state["converged_at"] is None, step
    assert watch.state["stalls"] == 2
    watch.update(80, 0.0198)
    assert watch.state["converged_at"] == 80 and watch.state["log_steps"] == [80, 160, 320, 640]
    (tmp_path / "plain").mkdir()
    plain = ConvergenceWatch(_Ckpt, 1000, str(tmp_path / "plain"), ckpt.PinnedSteps())
    for step, kl in [(10, 0.05), (20, 0.025), (30, 0.0249), (40, 0.0251)]:
        plain.update(step, kl)
    assert plain.state["converged_at"] == 40  # without the band: the plateau alone (the paper's rule)


def test_spearman_bootstrap_interval():
    rho, lo, hi = spearman_with_ci([1, 2, 3, 4, 5, 6], [2, 4, 5, 7, 8, 20])
    assert rho == pytest.approx(1.0) and lo == pytest.approx(1.0) and hi == pytest.approx(1.0)
    x = np.random.default_rng(0).normal(size=200)
    rho, lo, hi = spearman_with_ci(x, -x + 0.01 * np.random.default_rng(1).normal(size=200))
    assert rho < -0.99 and lo <= rho <= hi


def test_experiment_resumes_after_sigkill_without_redoing_finished_runs(tmp_path):
    cfg = tmp_path / "toy.py"
    write_toy_experiment(cfg, tmp_path / "data", TWO_RUNS)
    wd = tmp_path / "exp"
    proc = run_cli("experiment", "--config", str(cfg), "--workdir", str(wd), "--quiet",
                   env={"FLATLM_DEBUG_SIGKILL_AT_STEP": "15", "FLATLM_DEBUG_SIGKILL_WORKDIR": "runs/b"})
    assert proc.returncode == -9
    assert (wd / "runs" / "a" / "DONE").exists() and not (wd / "runs" / "b" / "DONE").exists()
    a_files = {p: p.stat().st_mtime_ns for p in (wd / "runs" / "a").rglob("*") if p.is_file()}
    proc = run_cli("experiment", "--config", str(cfg), "--workdir", str(wd), "--quiet", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["runs"] == {"a": "done earlier", "b": "finished"}
    assert a_files == {p: p.stat().st_mtime_ns for p in (wd / "runs" / "a").rglob("*") if p.is_file()}
    b_rows = [json.loads(x) for x in (wd / "runs" / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b_rows if "eval/loss" in r] == [10, 20]  # resumed at 10, not restarted
    rep = run_cli("report", str(wd), "--json")
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)
    text = (wd / "report" / "report.md").read_text()
    assert "| a |" in text and "| b |" in text and any(p.endswith("loss_vs_steps.png") for p in report["plots"])


def test_seeds_expand_runs_and_the_report_averages_over_them(tmp_path):
    """experiment_config(seeds=...) makes one run per pre-training seed; seed_table's cells are numpy's mean and
    sample std over those runs' last checkpoints (runs without a -seed<k> twin get no row)."""
    from flatlm.config import base_config
    from flatlm.experiment import experiment_config
    from flatlm.report import RunData, seed_table

    exp = experiment_config("t", base_config(), [("adamw", []), ("adv", ["--config.train.adversarial.lam=1.0"])],
                            seeds=(0, 3))
    assert [(r["name"], r["overrides"]) for r in exp.runs] == [
        ("adamw-seed0", ["--config.seed=0"]), ("adamw-seed3", ["--config.seed=3"]),
        ("adv-seed0", ["--config.train.adversarial.lam=1.0", "--config.seed=0"]),
        ("adv-seed3", ["--config.train.adversarial.lam=1.0", "--config.seed=3"])]
    rng = np.random.default_rng(0)
    vals = rng.uniform(size=(3, 4))  # runs x (loss, kl, probe accuracy at the last step, trace)

    def run(name, v):
        results = [{"kind": "exact_loss", "step": 5, "loss": 9.0, "kl": 9.0},  # an earlier step: ignored
                   {"kind": "exact_loss", "step": 10, "loss": v[0], "kl": v[1]},
                   {"kind": "probe", "step": 10, "task": "A", "accuracy": v[2], "accuracy_std": 0.1},
                   {"kind": "flatness", "step": 10, "trace": v[3]}]
        return RunData(name=name, path=tmp_path, config={}, evals=[], results=results)

    runs = [run("adv-seed0", vals[0]), run("adv-seed1", vals[1]), run("adv-seed2", vals[2]), run("single", vals[0])]
    (row,) = seed_table(runs, ["A"])
    m, s = vals.mean(0), vals.std(0, ddof=1)
    assert row[:2] == ["adv", "3"]
    assert row[2] == f"{m[0]:.4f} ± {s[0]:.4f}" and row[3] == f"{m[1]:.2e} ± {s[1]:.2e}"
    assert row[4] == f"{100 * m[2]:.1f} ± {100 * s[2]:.1f}" and row[5] == "-" and row[6] == f"{m[3]:.4g} ± {s[3]:.4g}"


def test_with_seeds_repeats_each_method_over_other_seeds():
    """--seeds: the same methods (overrides without the old seed) over new seeds, equal to experiment_config's own
    expansion with those seeds; bad seed lists and experiments without seed-repeated runs are one-line errors."""
    from flatlm.config import base_config
    from flatlm.errors import UserError
    from flatlm.experiment import experiment_config, with_seeds

    methods = [("adamw", []), ("adv-lam1", ["--config.train.adversarial.lam=1.0"])]
    exp = experiment_config("t", base_config(), methods, seeds=(0, 1, 2))
    more = with_seeds(exp, (3, 4))
    assert list(more.runs) == list(experiment_config("t", base_config(), methods, seeds=(3, 4)).runs)
    assert len(exp.runs) == 6  # the original is not modified
    for bad in ((), (3, 3), (-1,)):
        with pytest.raises(UserError, match="distinct non-negative"):
            with_seeds(exp, bad)
    with pytest.raises(UserError, match="without a -seed<k> suffix"):
        with_seeds(experiment_config("t", base_config(), methods), (3,))


def test_a_workdir_of_another_experiment_is_refused_naming_the_fields(tmp_path):
    """A preset changed since the workdir was made (here train.steps and the runs' seeds): one line naming the
    fields that differ, and the stored spec is left as it was."""
    from flatlm.config import base_config
    from flatlm.errors import UserError
    from flatlm.experiment import _write_spec, experiment_config

    exp = experiment_config("t", base_config(), [("adamw", [])], seeds=(0, 1))
    _write_spec(exp, tmp_path, str(tmp_path))
    stored = (tmp_path / "experiment.json").read_text()
    _write_spec(exp, tmp_path, str(tmp_path))  # the same experiment: no change, no error
    other = experiment_config("t", base_config(), [("adamw", [])], seeds=(0, 1, 2))
    other.base.train.steps += 1
    with pytest.raises(UserError, match=r"holds a different experiment \(fields base\.train\.steps, runs\); use a new"):
        _write_spec(other, tmp_path, str(tmp_path))
    assert (tmp_path / "experiment.json").read_text() == stored


def test_a_workdir_written_before_a_field_existed_is_the_same_experiment(tmp_path):
    """A stored spec lacking a field flatlm added since (a config field, train.flat.score_forward, or a flatness
    spec field, flatness.preconditioned) is the same experiment when the field is at its default, and another one
    when the field is set otherwise."""
    from flatlm.config import base_config
    from flatlm.errors import UserError
    from flatlm.experiment import _write_spec, experiment_config

    exp = experiment_config("t", base_config(), [("adamw", [])])
    _write_spec(exp, tmp_path, str(tmp_path))
    spec = json.loads((tmp_path / "experiment.json").read_text())
    del spec["base"]["train"]["flat"]["score_forward"], spec["flatness"]["preconditioned"]
    (tmp_path / "experiment.json").write_text(json.dumps(spec))
    _write_spec(exp, tmp_path, str(tmp_path))
    exp.base.train.flat.score_forward = "loss"
    with pytest.raises(UserError, match=r"fields base\.train\.flat\.score_forward\)"):
        _write_spec(exp, tmp_path, str(tmp_path))
    exp.base.train.flat.score_forward = "clean"
    exp.flatness.preconditioned = True
    with pytest.raises(UserError, match=r"fields flatness\.preconditioned\)"):
        _write_spec(exp, tmp_path, str(tmp_path))


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts the process's memory mappings (Linux)")
def test_release_compiled_unmaps_the_programs_of_finished_runs():
    """Each run compiles its own programs (new closures: new cache entries); without `release_compiled` their
    code stays mapped and the process's mappings grow run after run (a 48-run experiment hit vm.max_map_count),
    with it they stay flat."""
    import jax
    import jax.numpy as jnp

    from flatlm.run import release_compiled

    def one_run(i, release):
        w = jnp.full((32 + i, 32 + i), 0.1)
        step = jax.jit(jax.grad(lambda w: jnp.sum(jnp.tanh(jnp.tanh(w @ w) @ w) ** 2)))
        step(w).block_until_ready()
        if release:
            release_compiled()
        return _mappings()

    release_compiled()
    kept = [one_run(i, False) for i in range(6)]
    release_compiled()
    released = [one_run(i, True) for i in range(6, 12)]
    leak = kept[-1] - kept[0]  # the leak the fix is for: mappings grow with every run's programs (3 each here)
    assert leak > 0, kept
    assert released[-1] - released[0] < leak / 2, (released, kept)  # flat, up to an unrelated mapping or two


def test_an_experiment_releases_compiled_programs_after_every_run(tmp_path, monkeypatch):
    """`flatlm experiment` calls `release_compiled` once per run it finishes (none for runs done earlier)."""
    from flatlm import experiment

    exp = experiment.load_experiment(f"{REPO}/configs/experiments/fig2_width_depth.py:tiny")
    calls, done = [], set()
    monkeypatch.setattr(experiment, "train_and_evaluate", lambda config, run_dir, progress: None)
    monkeypatch.setattr(experiment, "evaluate_pending", lambda run_dir, progress: None)
    monkeypatch.setattr(experiment, "_mark_done", lambda run_dir, steps, info: done.add(run_dir.name))
    monkeypatch.setattr(experiment, "_done", lambda run_dir, steps: run_dir.name in done)
    monkeypatch.setattr(experiment.run_lib, "release_compiled", lambda: calls.append(len(done)))
    experiment._run_experiment(exp, tmp_path, exp.runs[:3], progress=False)
    assert calls == [1, 2, 3]
    experiment._run_experiment(exp, tmp_path, exp.runs[:4], progress=False)  # three done earlier
    assert calls == [1, 2, 3, 4]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_flatness_pending_asks_for_the_spectrum_and_adams_sharpness_of_adamw_runs_only(optimizer, tmp_path,
                                                                                       monkeypatch):
    """An experiment's flatness spec reaches the measurement: spectrum_k, density_probes/iters as given, and the
    preconditioned sharpness for an AdamW run, not for another optimizer's (which has no Adam state: measuring it
    would stop the whole experiment); `spectrum_at="last"` limits those to the final checkpoint, and another value
    stops the experiment before it starts."""
    from flatlm import experiment
    from flatlm.config import base_config, save_workdir_config
    from flatlm.errors import UserError

    config = base_config()
    config.train.optimizer = optimizer
    save_workdir_config(config, str(tmp_path))
    monkeypatch.setattr(experiment, "_final_shape_steps", lambda run_dir: [10, 20])
    calls = []
    monkeypatch.setattr(experiment, "flatness_run", lambda workdir, **kw: calls.append(kw))
    fcfg = experiment.experiment_config("t", config, [("a", [])], flatness=dict(
        enabled=True, spectrum_k=3, density_probes=2, density_iters=7, preconditioned=True)).flatness
    experiment.flatness_pending(tmp_path, fcfg, progress=False)
    fcfg.spectrum_at = "last"  # the paper preset's: the final checkpoint only
    experiment.flatness_pending(tmp_path, fcfg, progress=False)
    kw, last = calls
    assert kw["steps"] == [10, 20] and (kw["spectrum_k"], kw["density_probes"], kw["density_iters"]) == (3, 2, 7)
    assert kw["preconditioned"] is (optimizer == "adamw")
    assert kw["spectrum_steps"] is None and last["spectrum_steps"] == [20]
    bad = experiment.experiment_config("t", config, [("a", [])], flatness=dict(spectrum_at="final"))
    with pytest.raises(UserError, match="flatness.spectrum_at must be 'all' or 'last', got 'final'"):
        experiment.validate_experiment(bad)
