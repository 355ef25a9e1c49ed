"""`flatlm report` names every flatness value by its estimator and never puts two estimators in one column or
plot (issue 16, item 3: an empirical-Fisher value measured last was shown under "Tr(H)")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flatlm import report, results
from flatlm import report_plots as plots


def _run(root, name, hutch, emp, acc):
    wd = root / name
    wd.mkdir(parents=True)
    (wd / "config.json").write_text("{}")
    entries = []
    for i, step in enumerate((10, 20, 30)):
        entries.append({"kind": "probe", "step": step, "task": "A", "accuracy": acc[i], "accuracy_std": 0.01})
        entries.append({"kind": "flatness", "step": step, "method": "hutchinson", "trace": hutch[i],
                        "trace_stderr": 0.5})
    # measured last, at the last step only: the old report showed this in the "Tr(H)" column
    entries.append({"kind": "flatness", "step": 30, "method": "empirical_fisher", "trace": emp, "trace_stderr": 0.0})
    results.append(str(wd), entries)
    return str(wd)


def test_each_estimator_has_its_own_column_and_plots(tmp_path):
    a = _run(tmp_path, "a", [10.0, 20.0, 30.0], 777.0, [0.5, 0.6, 0.7])
    b = _run(tmp_path, "b", [15.0, 25.0, 35.0], 888.0, [0.55, 0.65, 0.8])
    md = report.make_report([a, b], str(tmp_path / "out")).read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[-2:] == ["Tr(H) Hutchinson", "Tr(empirical Fisher), true labels"]
    assert "Tr(H)" not in header
    row_a = [c.strip() for c in table[1].strip("|").split("|")]
    assert row_a[0] == "a" and row_a[-2:] == ["30 ± 0.5", "777 ± 0"]
    # one trace-vs-steps plot per estimator; the correlation uses the Hutchinson pairs only (6, not 8)
    assert (tmp_path / "out" / "trace_vs_steps.png").exists() and (tmp_path / "out" / "trace_vs_steps_2.png").exists()
    x, y = [10, 20, 30, 15, 25, 35], [0.5, 0.6, 0.7, 0.55, 0.65, 0.8]
    rho = report.spearman_with_ci(x, y)[0]
    assert f"## Tr(H) Hutchinson vs accuracy\n\nSpearman's ρ = {rho:.3f}" in md and "over 6 checkpoints" in md
    assert "## Tr(empirical Fisher), true labels vs accuracy" not in md  # 2 points: no correlation
    assert json.loads((tmp_path / "a" / "results.json").read_text())  # the inputs are untouched


def test_estimator_keys_separate_grown_measurements():
    plain = {"kind": "flatness", "method": "fisher", "grown_to": None}
    grown = {"kind": "flatness", "method": "fisher", "grown_to": [4, 256]}
    assert report.estimator_key(plain) != report.estimator_key(grown)
    assert report.estimator_label(report.estimator_key(grown)) == "Tr(F) Fisher, sampled labels (grown to 4x256)"
    runs = [report.RunData("r", None, {}, [], [dict(grown, step=1, trace=2.0), dict(plain, step=1, trace=np.e)])]
    assert report.estimators(runs) == [("fisher", None), ("fisher", (4, 256))]
    assert runs[0].flatness(("fisher", None))[1]["trace"] == np.e


def test_estimator_keys_separate_traces_of_the_training_objective():
    """`flatlm flatness --split train` measures another quantity: its own column, never the validation trace."""
    val = {"kind": "flatness", "method": "fisher", "grown_to": None, "settings": {"seed": 0}, "step": 1, "trace": 3.0}
    train = {**val, "settings": {"seed": 0, "split": "train"}, "trace": 5.0}
    assert report.estimator_key(train) == ("fisher@train", None)
    assert report.estimator_label(("fisher@train", None)) == "Tr(F) Fisher, sampled labels, train objective"
    runs = [report.RunData("r", None, {}, [], [val, train])]  # the train-split entry written last
    assert report.estimators(runs) == [("fisher", None), ("fisher@train", None)]
    assert runs[0].flatness(("fisher", None))[1]["trace"] == 3.0


def test_per_block_panel_from_results_files(tmp_path):
    """`--groups block` entries in results.json -> one grouped bar per run and block, bar = the block's trace,
    error bar = ± its standard error; the report names the sums over blocks (= the totals)."""
    per = {"a": {"embed": 1.5, "layer_0/attn": 4.0, "layer_0/mlp": 2.5, "head": 7.0},
           "b": {"embed": 0.5, "layer_0/attn": 3.0, "layer_0/mlp": 1.0, "head": 5.5}}
    dirs = []
    for name, blocks in per.items():
        wd = tmp_path / name
        wd.mkdir()
        (wd / "config.json").write_text("{}")
        detail = {"mean": sum(blocks.values()), "per_group": blocks,
                  "per_group_stderr": {k: 0.1 * v for k, v in blocks.items()}}
        results.append(str(wd), [{"kind": "flatness", "step": s, "method": "hutchinson", "trace": detail["mean"] + s,
                                  "trace_stderr": 0.1, "detail": detail} for s in (1, 2)])
        if name == "a":  # a spectrum entry as `flatlm flatness --spectrum-k 2 --density-probes 2` writes it
            results.append(str(wd), [{"kind": "spectrum", "step": 2, "settings": {}, "dim": 10, **SPECTRUM}])
            results.append(str(wd), [{"kind": "preconditioned_sharpness", "step": s, "settings": {}, "value": v,
                                      "residual": 0.5, "lr": 0.01, "edge_of_stability": 3800.0, "ratio": v / 3800}
                                     for s, v in ((2, 4750.0), (1, 1900.0))])
            results.append(str(wd), [{"kind": "preconditioned_sharpness", "step": 2, "settings": {"split": "train"},
                                      "value": 3800.0, "residual": 0.5, "lr": 0.01, "edge_of_stability": 3800.0,
                                      "ratio": 1.0}])  # the same step on the training objective: listed apart
        dirs.append(str(wd))
    runs = report.find_runs(dirs)
    rows = [(r.name, e["detail"]["per_group"], e["detail"]["per_group_stderr"])
            for r in runs for e in [r.flatness(("hutchinson", None))[2]]]
    fig = plots.per_group_bars(rows, "Tr(H)")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == list(per["a"])
    bars = [c for c in ax.containers if hasattr(c, "patches")]
    errs = [c for c in ax.containers if hasattr(c, "has_yerr")]
    assert len(bars) == 2 and len(errs) == 2
    for bar, err, name in zip(bars, errs, per):
        np.testing.assert_allclose([p.get_height() for p in bar.patches], list(per[name].values()))
        half = [seg[1, 1] - seg[0, 1] for seg in err.lines[2][0].get_segments()]
        np.testing.assert_allclose(half, [2 * 0.1 * v for v in per[name].values()])
    assert ax.get_yscale() == "linear"  # 1.5 to 7: no need for a log scale
    wide = [(n, {**pg, "head": 1e3 * pg["head"]}, se) for n, pg, se in rows]
    assert plots.per_group_bars(wide, "Tr(H)").axes[0].get_yscale() == "log"  # head 1000x: small blocks visible
    signed = [(n, {**pg, "embed": -1.0, "head": 1e3}, se) for n, pg, se in rows]
    assert plots.per_group_bars(signed, "Tr(H)").axes[0].get_yscale() == "linear"  # a negative trace: linear
    md = report.make_report(dirs, str(tmp_path / "out")).read_text()
    assert (tmp_path / "out" / "trace_per_block.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Tr(H) Hutchinson per block" in md and "a: 15; b: 10" in md
    assert (tmp_path / "out" / "spectrum.png").read_bytes()[:4] == b"\x89PNG"
    assert "- a (step 2): top eigenvalues 9, 4; Tr(H^1) = 12 ± 3; Tr(H^2) = 70 ± 20" in md
    assert ("- a (step 1): 1900 ± 0.5 at lr 0.01; edge 3800, ratio 0.500\n"
            "- a (step 2): 4750 ± 0.5 at lr 0.01; edge 3800, ratio 1.250\n") in md  # step order
    assert "- a, train objective (step 2): 3800 ± 0.5 at lr 0.01; edge 3800, ratio 1.000" in md


SPECTRUM = {"top": {"values": [9.0, 4.0], "residual": [0.01, 0.5], "num_matvecs": 7},
            "density": {"nodes": [[-1.0, 2.0, 9.0], [0.0, 1.0, 4.0]], "weights": [[0.25, 0.5, 0.25], [0.6, 0.2, 0.2]],
                        "dim": 10, "num_matvecs": 6, "moments": [{"p": 1, "value": 12.0, "stderr": 3.0},
                                                                 {"p": 2, "value": 70.0, "stderr": 20.0}]}}


def test_spectrum_panel():
    """Density: the Gaussian-smoothed SLQ nodes (log axis), integrating to 1; top eigenvalues ± Ritz bounds."""
    fig = plots.spectrum_panels([("a", {"step": 2, **SPECTRUM})])
    a, b = fig.axes
    (line,) = a.get_lines()
    x, y = line.get_data()
    assert a.get_yscale() == "log" and np.trapezoid(y, x) == pytest.approx(1.0, abs=1e-3)
    assert x[np.argmax(y)] == pytest.approx(0.0, abs=0.02)  # the heaviest node: weight 0.6 / 2 probes at 0
    (bars,) = b.containers
    np.testing.assert_allclose(np.asarray(bars.lines[0].get_ydata(), float), [9.0, 4.0])
    half = [seg[1, 1] - seg[0, 1] for seg in bars.lines[2][0].get_segments()]
    np.testing.assert_allclose(half, [0.02, 1.0])


def test_accuracies_at_the_majority_rate_are_marked(tmp_path):
    """A head no better than predicting the majority class (within 0.5 pp) is marked and explained; one above it
    is not (`headline` records the rate of each probe / fine-tuning split)."""
    dirs = []
    for name, acc in (("flat", 0.488), ("learns", 0.60)):
        wd = tmp_path / name
        wd.mkdir()
        (wd / "config.json").write_text("{}")
        results.append(str(wd), [{"kind": "finetune", "step": 10, "task": "A", "accuracy": acc,
                                  "accuracy_std": 0.0, "majority": 0.489},
                                 {"kind": "probe", "step": 10, "task": "A", "accuracy": acc, "accuracy_std": 0.0}])
        dirs.append(str(wd))
    md = report.make_report(dirs, str(tmp_path / "out")).read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| flat")
            or line.startswith("| learns")}
    assert "48.8 ± 0.0 †" in rows["flat"] and "60.0 ± 0.0 †" not in rows["learns"]
    assert rows["flat"].count("†") == 1  # the probe entry has no recorded rate: never marked
    assert "at or below the majority-class rate" in md


def test_rates_chosen_at_an_end_of_the_grid_are_counted(tmp_path):
    """Fine-tuning whose validation-chosen rate is the grid's largest or smallest is counted in one note (the
    optimum may lie beyond the grid); an interior choice and a fixed-rate fine-tuning are not."""
    grid = [1e-4, 1e-3, 1e-2]
    chosen = {"top": 1e-2, "top2": 1e-2, "middle": 1e-3, "bottom": 1e-4}
    dirs = []
    for name, lr in chosen.items():
        wd = tmp_path / name
        wd.mkdir()
        (wd / "config.json").write_text("{}")
        tuned = {"kind": "finetune", "step": 10, "task": "A", "accuracy": 0.6, "accuracy_std": 0.0,
                 "detail": {"lr": lr, "lr_selection": {"split": "validation", "grid": grid, "accuracy": []}}}
        fixed = {"kind": "finetune", "step": 5, "task": "A", "accuracy": 0.5, "accuracy_std": 0.0,
                 "detail": {"lr": 1e-2}}  # the fixed rate: no grid, never counted
        results.append(str(wd), [fixed, tuned])
        dirs.append(str(wd))
    md = report.make_report(dirs, str(tmp_path / "out")).read_text()
    assert ("at an end of the grid in 3 of 4 fine-tunings (2 at its largest rate (0.01) and 1 at its smallest "
            "rate (0.0001))") in md
    md = report.make_report(dirs[2:3], str(tmp_path / "out2")).read_text()
    assert "end of the grid" not in md
