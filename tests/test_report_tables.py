"""`flatlm report`'s tables: fine-tuning at the last checkpoint, the rate chosen on validation, and the fine-tuned
initialisation (`eval.finetune.from_init`) in columns of its own, per run and over pre-training seeds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flatlm import report, results


def _run(root, name, tuned, init):
    wd = root / name
    wd.mkdir(parents=True)
    (wd / "config.json").write_text("{}")
    grid = {"lr": 0.01, "lr_selection": {"split": "validation", "grid": [1e-3, 1e-2], "accuracy": []}}
    results.append(str(wd), [
        {"kind": "finetune", "step": 10, "task": "k4", "accuracy": 0.30, "accuracy_std": 0.01, "detail": {}},
        {"kind": "finetune", "step": 20, "task": "k4", "accuracy": tuned, "accuracy_std": 0.02, "detail": grid},
        {"kind": "finetune_init", "step": None, "task": "k4", "accuracy": init, "accuracy_std": 0.03,
         "detail": grid}])
    return str(wd)


def _table(md: str, title: str) -> list[list[str]]:
    lines = md.split(title, 1)[1].splitlines()[1:]
    end = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    rows = [line for line in lines[:end] if line.startswith("| ")]
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows if not row.startswith("|---")]


def test_fine_tuning_from_init_has_its_own_columns(tmp_path):
    dirs = [_run(tmp_path, "m-seed0", 0.58, 0.50), _run(tmp_path, "m-seed1", 0.56, 0.54)]
    md = report.make_report(dirs, str(tmp_path / "out")).read_text()
    head, *rows = _table(md, "## Table (last checkpoint")
    col, init = head.index("fine-tune k4 (%)"), head.index("fine-tune k4 from init (%)")
    assert [r[col] for r in rows] == ["58.0 ± 2.0 (lr 0.01)", "56.0 ± 2.0 (lr 0.01)"]  # step 20's, not 10's
    assert [r[init] for r in rows] == ["50.0 ± 3.0 (lr 0.01)", "54.0 ± 3.0 (lr 0.01)"]
    head, *rows = _table(md, "## Table over pre-training seeds")
    (row,) = rows
    sd = lambda *v: np.std(v, ddof=1)  # noqa: E731
    assert row[head.index("fine-tune k4 (%)")] == f"57.0 ± {100 * sd(0.58, 0.56):.1f}"
    assert row[head.index("fine-tune k4 from init (%)")] == f"52.0 ± {100 * sd(0.50, 0.54):.1f}"


def test_no_init_column_without_the_control(tmp_path):
    wd = tmp_path / "r"
    wd.mkdir()
    (wd / "config.json").write_text("{}")
    results.append(str(wd), [{"kind": "finetune", "step": 5, "task": "A", "accuracy": 0.7, "accuracy_std": 0.0}])
    md = report.make_report([str(wd)], str(tmp_path / "out")).read_text()
    head, row = _table(md, "## Table (last checkpoint")
    assert "from init" not in " ".join(head) and row[head.index("fine-tune A (%)")] == "70.0 ± 0.0"


def _run_data(name, loss, probe, tuned, init=None):
    from flatlm.report import RunData

    res = [{"kind": "exact_loss", "step": 50, "loss": loss, "kl": 0.01, "loss_std": 0.002},
           {"kind": "probe", "step": 50, "task": "k4", "accuracy": probe},
           {"kind": "finetune", "step": 50, "task": "k4", "accuracy": tuned}]
    if init is not None:
        res.append({"kind": "finetune_init", "step": None, "task": "k4", "accuracy": init})
    return RunData(name=name, path=None, config={}, evals=[], results=res)


def _ci(d, scale=100.0):
    from scipy import stats

    d = np.asarray(d)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    return f"{scale * d.mean():+.3g} [{scale * (d.mean() - half):+.3g}, {scale * (d.mean() + half):+.3g}]"


def test_arms_against_the_first_arm_and_the_gain_over_init():
    """Paired effects by hand (scipy's t quantile): every arm against the first arm in run order, and fine-tuning
    minus the fine-tuned initialisation within each arm."""
    from flatlm import report_paired

    tuned = {"adamw": [0.50, 0.55, 0.52], "sam": [0.53, 0.56, 0.50]}
    init = {"adamw": [0.49, 0.50, 0.47], "sam": [0.49, 0.50, 0.47]}
    loss = {"adamw": [1.000, 1.001, 1.002], "sam": [1.001, 1.030, 1.002]}  # sam seed 1: not the same loss
    runs = [_run_data(f"{arm}-seed{s}", loss[arm][s], 0.4 + 0.01 * s, tuned[arm][s], init[arm][s])
            for arm in ("adamw", "sam") for s in range(3)]
    md = report_paired.arms_vs_control(runs)
    assert "## Paired against adamw" in md[0]
    (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in md if line.startswith("| sam")]
    assert row[1:3] == ["3", "2 of 3"]
    assert row[3] == _ci(np.subtract(loss["sam"], loss["adamw"]), 1.0)
    assert row[5] == _ci(np.subtract(tuned["sam"], tuned["adamw"]))
    assert row[4] == "+0 [+0, +0]" and row[6] == "-"  # equal probes; no trace measured
    gain = report_paired.pretraining_gain(runs)
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.strip("|").split("|")] for r in gain
            if r.startswith("| ") and not r.startswith("| arm")}
    for arm in ("adamw", "sam"):
        assert rows[arm][1:5] == ["k4", "3", f"{100 * np.mean(tuned[arm]):.1f}", f"{100 * np.mean(init[arm]):.1f}"]
        assert rows[arm][5] == _ci(np.subtract(tuned[arm], init[arm]))
    assert report_paired.pretraining_gain([_run_data("x-seed0", 1.0, 0.4, 0.5)]) == []  # no control measured
    assert report_paired.arms_vs_control(runs[:3]) == []  # one arm: nothing to compare
    # `flatlm report --control sam`: the first arm is paired against the one named, sign and all
    md = report_paired.arms_vs_control(runs, "sam")
    assert "## Paired against sam" in md[0] and not any(line.startswith("| sam") for line in md)
    (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in md if line.startswith("| adamw")]
    assert row[5] == _ci(np.subtract(tuned["adamw"], tuned["sam"]))


def test_report_control_must_be_an_arm(tmp_path, capsys):
    """`flatlm report --control` names an arm of the runs (the paired table's reference); another name is a
    one-line error listing the arms, exit 2, and writes no report."""
    from flatlm.cli.main import main

    dirs = [_run(tmp_path, f"{arm}-seed{s}", 0.5, 0.4) for arm in ("a", "b") for s in (0, 1)]
    assert main(["report", *dirs, "--out", str(tmp_path / "out"), "--control", "c"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("'c' is not an arm of these runs; use one of a, b"), err
    assert not (tmp_path / "out").exists()
    md = report.make_report(dirs, str(tmp_path / "out"), control="b").read_text()
    assert "## Paired against b" in md


def test_paired_traces_split_into_encoder_and_head_blocks():
    """With per-group traces (top-level names of a BiLSTM run, or BERT's block names) the paired table adds the
    encoder's part (every group but the head's) and the head's, each paired by hand."""
    from flatlm import report_paired

    groups = {"adamw": [{"tok_embed": 0.3, "bilstm_0": 0.2, "head": 18.0}, {"tok_embed": 0.4, "bilstm_0": 0.1,
                                                                           "head": 17.0}],
              "pen": [{"tok_embed": 0.1, "bilstm_0": 0.1, "head": 16.0}, {"tok_embed": 0.05, "bilstm_0": 0.15,
                                                                          "head": 16.5}]}
    runs = []
    for arm, per_seed in groups.items():
        for s, g in enumerate(per_seed):
            r = _run_data(f"{arm}-seed{s}", 1.0, 0.5, 0.5)
            r.results.append({"kind": "flatness", "step": 50, "method": "fisher", "trace": sum(g.values()),
                              "detail": {"per_group": g}})
            runs.append(r)
    md = report_paired.arms_vs_control(runs)
    head = [c.strip() for c in md[2].strip("|").split("|")]
    assert head[-2:] == ["encoder blocks", "head"]
    (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in md if line.startswith("| pen")]
    part = lambda arm, head_part: [sum(v for k, v in g.items() if (k == "head") == head_part)  # noqa: E731
                                   for g in groups[arm]]
    assert row[-2] == _ci(np.subtract(part("pen", False), part("adamw", False)), 1.0)
    assert row[-1] == _ci(np.subtract(part("pen", True), part("adamw", True)), 1.0)
    bert = {"embed": 1.0, "layer_0/attn": 2.0, "layer_0/mlp": 3.0, "head": 4.0}
    assert report_paired.split_trace({"detail": {"per_group": bert}}) == (6.0, 4.0)
    assert report_paired.split_trace({"detail": {"per_group": {"final_ln": 1.0, "head_bias": 2.0, "layer_0": 3.0,
                                                               "tok_embed": 4.0}}}) == (7.0, 3.0)
    assert report_paired.split_trace({"detail": {"per_group": {"head": 1.0}}}) == (None, None)


def test_the_lookup_table_row_is_the_mean_over_runs(tmp_path):
    """Several runs each probe the exact conditionals (their own probe seeds): one row, mean ± std over runs."""
    dirs = []
    for k, acc in enumerate((0.50, 0.54)):
        wd = tmp_path / f"m-seed{k}"
        wd.mkdir()
        (wd / "config.json").write_text("{}")
        results.append(str(wd), [{"kind": "probe", "step": 10, "task": "k4", "accuracy": 0.6, "accuracy_std": 0.0},
                                 {"kind": "lookup_table", "task": "k4", "accuracy": acc, "accuracy_std": 0.01}])
        dirs.append(str(wd))
    head, *rows = _table(report.make_report(dirs, str(tmp_path / "out")).read_text(), "## Table (last checkpoint")
    (look,) = [r for r in rows if r[0].startswith("lookup table")]
    assert look[0] == "lookup table (k4, mean over 2 runs)"
    assert look[head.index("probe k4 (%)")] == f"52.0 ± {100 * np.std([0.50, 0.54], ddof=1):.1f}"
    head, *rows = _table(report.make_report(dirs[:1], str(tmp_path / "one")).read_text(), "## Table (last check")
    assert [r for r in rows if r[0].startswith("lookup")][0][head.index("probe k4 (%)")] == "50.0 ± 1.0"
    for d, acc in zip(dirs, (0.60, 0.64)):  # the table with the words (eval.lookup_words): its own row after it
        results.append(d, [{"kind": "lookup_words", "task": "k4", "accuracy": acc, "accuracy_std": 0.01}])
    head, *rows = _table(report.make_report(dirs, str(tmp_path / "words")).read_text(), "## Table (last checkpoint")
    look, words = [r for r in rows if r[0].startswith("lookup table")]
    assert (look[0], words[0]) == ("lookup table (k4, mean over 2 runs)", "lookup table + words (k4, mean over 2 runs)")
    assert words[head.index("probe k4 (%)")] == f"62.0 ± {100 * np.std([0.60, 0.64], ddof=1):.1f}"
    assert (look[head.index("KL")], words[head.index("KL")]) == ("0", "-")  # the words' table is no language model


def test_probe_by_layer_tables_by_hand():
    """Per-layer probe means with scipy's t-interval, and the paired layer - own last / layer - control's last
    differences; arms without layer probes get no row; no layer probes at all: no section."""
    from scipy import stats

    from flatlm import report_paired

    last = {"L1": [0.50, 0.52, 0.55], "L2": [0.45, 0.47, 0.44]}
    first = {"L1": [0.50, 0.52, 0.55], "L2": [0.53, 0.50, 0.57]}
    runs = []
    for arm in ("L1", "L2", "other"):
        for s in range(3):
            run = _run_data(f"{arm}-seed{s}", 1.0, last.get(arm, [0.4] * 3)[s], 0.5)
            if arm in first:
                run.results.append({"kind": "layer_probe", "layer": 1, "step": 50, "task": "k4",
                                    "accuracy": first[arm][s]})
            if arm == "L2":
                run.results.append({"kind": "layer_probe", "layer": 2, "step": 50, "task": "k4",
                                    "accuracy": last[arm][s]})
                run.results.append({"kind": "layer_probe", "layer": 1, "step": 10, "task": "k4", "accuracy": 0.0})
            runs.append(run)
    md = "\n".join(report_paired.probe_by_layer(runs))
    head, *rows = _table(md, "## Linear probe by layer")
    assert head == ["arm", "seeds", "layer 1", "layer 2", "last"]

    def mean_ci(v):
        m, h = 100 * np.mean(v), 100 * stats.t.ppf(0.975, len(v) - 1) * np.std(v, ddof=1) / np.sqrt(len(v))
        return f"{m:.1f} [{m - h:.1f}, {m + h:.1f}]"

    table = {r[0]: r for r in rows if len(r) == len(head)}
    assert set(table) == {"L1", "L2"}  # "other" has no layer probes
    assert table["L2"][1:] == ["3", mean_ci(first["L2"]), mean_ci(last["L2"]), mean_ci(last["L2"])]
    assert table["L1"][2:4] == [mean_ci(first["L1"]), "-"]
    paired = {(r[0], r[1]): r for r in rows if len(r) == 4 and r[1] in ("1", "2")}
    assert paired[("L2", "1")][2] == _ci(np.subtract(first["L2"], last["L2"]))
    assert paired[("L2", "1")][3] == _ci(np.subtract(first["L2"], last["L1"]))  # against the first arm's last
    assert paired[("L1", "1")][2] == "+0 [+0, +0]"  # one layer: layer 1 is the last
    assert report_paired.probe_by_layer(runs, "L2") and report_paired.probe_by_layer(runs[6:]) == []


def test_probe_by_layer_figure_draws_each_arms_means_by_hand():
    """The per-layer figure: one line per arm with layer probes, at layers 1..depth (depth from the run's config,
    the last layer being the recorded probe), y the mean over seeds and the error bar scipy's t half-width."""
    from scipy import stats

    from flatlm import report_paired

    first, last = [0.53, 0.50, 0.57], [0.45, 0.47, 0.44]
    runs = []
    for s in range(3):
        for arm, depth in (("L2", 2), ("L1", 1)):
            run = _run_data(f"{arm}-seed{s}", 1.0, last[s] if arm == "L2" else 0.5 + 0.01 * s, 0.5)
            run.config = {"model": {"num_layers": depth}}
            run.results.append({"kind": "layer_probe", "layer": 1, "step": 50, "task": "k4",
                                "accuracy": first[s] if arm == "L2" else 0.5 + 0.01 * s})
            runs.append(run)
    fig = report_paired.probe_by_layer_figure(runs)
    (l2, l1) = fig.axes[0].containers
    x, y = l2.lines[0].get_data()
    np.testing.assert_allclose(np.round(np.asarray(x, float)), [1, 2])
    np.testing.assert_allclose(np.asarray(y, float), [100 * np.mean(first), 100 * np.mean(last)])
    half = [100 * stats.t.ppf(0.975, 2) * np.std(v, ddof=1) / np.sqrt(3) for v in (first, last)]
    caps = np.asarray(l2.lines[1][0].get_ydata(), float)  # the lower caps: mean - half-width
    np.testing.assert_allclose(caps, np.asarray(y, float) - np.asarray(half))
    x1, y1 = l1.lines[0].get_data()
    assert len(x1) == 1 and round(x1[0]) == 1 and y1[0] == pytest.approx(51.0)  # one layer: layer 1 is the last
    assert report_paired.probe_by_layer_figure([_run_data("x-seed0", 1.0, 0.4, 0.5)]) is None


def test_paired_table_adds_the_spectrum_figures_where_measured():
    """With `flatness.spectrum_k`, `density_probes` and `preconditioned` (flatness_seeking's presets) the paired
    table adds the top Hessian eigenvalue, Tr(H^2) (the SLQ moment p = 2) and Adam's preconditioned sharpness,
    each paired by hand; a grown view's spectrum (Figure 5) is not the model's own and is passed over."""
    from flatlm import report_paired

    top = {"adamw": [5.0, 6.0, 5.5], "sam": [3.0, 3.5, 4.5]}
    h2 = {"adamw": [40.0, 44.0, 41.0], "sam": [20.0, 25.0, 21.0]}
    pre = {"adamw": [300.0, 320.0, 310.0], "sam": [250.0, 330.0, 270.0]}
    runs = []
    for arm in ("adamw", "sam"):
        for s in range(3):
            r = _run_data(f"{arm}-seed{s}", 1.0, 0.5, 0.5)
            moments = [{"p": 1, "value": 9.0, "stderr": 1.0}, {"p": 2, "value": h2[arm][s], "stderr": 2.0}]
            r.results += [{"kind": "spectrum", "step": 50, "grown_to": None, "top": {"values": [top[arm][s], 1.0]},
                           "density": {"moments": moments}},
                          {"kind": "spectrum", "step": 50, "grown_to": [2, 64], "top": {"values": [99.0]},
                           "density": {"moments": [{"p": 2, "value": 99.0}]}},
                          {"kind": "preconditioned_sharpness", "step": 50, "value": pre[arm][s]},
                          {"kind": "preconditioned_sharpness", "step": 40, "value": -1.0}]  # not the last step
            runs.append(r)
    md = report_paired.arms_vs_control(runs)
    head = [c.strip() for c in md[2].strip("|").split("|")]
    assert head[-3:] == ["top eigenvalue", "Tr(H^2)", "P^-1 H top (Adam)"] and "head" not in head
    assert md[3].count("---") == len(head)
    (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in md if line.startswith("| sam")]
    for col, values in zip(row[-3:], (top, h2, pre)):
        assert col == _ci(np.subtract(values["sam"], values["adamw"]), 1.0)
    assert md[-1] == (f"\nFor scale, adamw's own values (mean over its seeds): top eigenvalue "
                      f"{np.mean(top['adamw']):.4g}; Tr(H^2) {np.mean(h2['adamw']):.4g}; P^-1 H top (Adam) "
                      f"{np.mean(pre['adamw']):.4g}.")
    bare = [_run_data(f"{arm}-seed{s}", 1.0, 0.5, 0.5) for arm in ("adamw", "sam") for s in range(2)]
    md = report_paired.arms_vs_control(bare)
    assert "top eigenvalue" not in md[2] and "For scale" not in md[-1]  # not measured: no column, no scale


def test_spectrum_panels_show_one_run_per_arm_when_there_are_more_than_six():
    from flatlm.report_curvature import _one_per_arm

    named = [(f"{arm}-seed{s}", {"step": s}) for arm in ("adamw", "sam", "pen") for s in range(3)] + [("x", {})]
    assert [n for n, _ in _one_per_arm(named)] == ["adamw-seed0", "sam-seed0", "pen-seed0", "x"]


def test_paired_table_compares_one_estimator_on_the_validation_split():
    """A trace or spectrum another command added at the last step (`flatlm flatness --method fisher`, `--split
    train`) on some seeds never enters a paired difference: the table takes the estimator most control seeds have
    (here Hutchinson, measured on every seed) and the validation split's spectrum and sharpness. Found by an audit:
    seed 0's extra Fisher trace (3.0) was subtracted from the other arm's Hutchinson trace."""
    from flatlm import report_paired

    hutch = {"adamw": [10.0, 11.0, 12.5], "sam": [10.1, 11.1, 12.6]}
    top = {"adamw": [5.0, 6.0, 7.0], "sam": [5.1, 6.1, 7.1]}
    runs = []
    for arm in ("adamw", "sam"):
        for s in range(3):
            r = _run_data(f"{arm}-seed{s}", 1.0, 0.5, 0.5)
            r.results += [{"kind": "flatness", "step": 50, "method": "hutchinson", "trace": hutch[arm][s]},
                          {"kind": "spectrum", "step": 50, "top": {"values": [top[arm][s]]}},
                          {"kind": "preconditioned_sharpness", "step": 50, "value": top[arm][s]}]
            if arm == "adamw" and s == 0:  # added afterwards by other commands
                r.results += [{"kind": "flatness", "step": 50, "method": "fisher", "trace": 3.0},
                              {"kind": "spectrum", "step": 50, "settings": {"split": "train"},
                               "top": {"values": [50.0]}},
                              {"kind": "preconditioned_sharpness", "step": 50, "settings": {"split": "train"},
                               "value": 9.0}]
            runs.append(r)
    md = report_paired.arms_vs_control(runs)
    head = [c.strip() for c in md[2].strip("|").split("|")]
    assert head[6] == "trace (hutchinson)"
    (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in md if line.startswith("| sam")]
    assert row[6] == _ci(np.subtract(hutch["sam"], hutch["adamw"]), 1.0)
    assert row[-2] == row[-1] == _ci(np.subtract(top["sam"], top["adamw"]), 1.0)
    # a seed without the table's estimator drops out of the trace's pairs instead of lending another one
    runs[0].results = [e for e in runs[0].results if e.get("method") != "fisher"]
    runs[1].results = [e for e in runs[1].results if e["kind"] != "flatness"]
    runs[1].results.append({"kind": "flatness", "step": 50, "method": "fisher", "trace": 4.0})
    md = report_paired.arms_vs_control(runs)
    (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in md if line.startswith("| sam")]
    assert row[6] == _ci(np.subtract(hutch["sam"][::2], hutch["adamw"][::2]), 1.0)


def test_paired_table_takes_the_experiments_own_trace(tmp_path):
    """Runs of an experiment (`<workdir>/runs/<name>`, experiment.json's flatness spec) are compared on the
    experiment's own measurement (`flatlm.results.measured_by`), not on a trace of the same estimator measured
    afterwards on other batches."""
    from flatlm import report_paired
    from flatlm.report import RunData

    (tmp_path / "experiment.json").write_text(json.dumps({"flatness": {"method": "fisher", "num_batches": 4}}))
    own = {"adamw": [10.0, 11.0], "sam": [8.0, 8.5]}
    runs = []
    for arm in ("adamw", "sam"):
        for s in range(2):
            r = _run_data(f"{arm}-seed{s}", 1.0, 0.5, 0.5)
            r.path = tmp_path / "runs" / r.name
            r.results.append({"kind": "flatness", "step": 50, "method": "fisher", "trace": own[arm][s],
                              "settings": {"num_batches": 4}})
            r.results.append({"kind": "flatness", "step": 50, "method": "fisher", "trace": 100.0 * (s + 1),
                              "settings": {"num_batches": 1}})  # `flatlm flatness --num-batches 1`, later
            runs.append(r)
    assert isinstance(runs[0], RunData)
    for _ in range(2):  # either order in results.json (a resumed experiment's re-measurement goes to the end)
        (row,) = [[c.strip() for c in line.strip("|").split("|")] for line in report_paired.arms_vs_control(runs)
                  if line.startswith("| sam")]
        assert row[6] == _ci(np.subtract(own["sam"], own["adamw"]), 1.0)
        for r in runs:
            r.results[-2:] = r.results[-2:][::-1]


def test_a_nan_stderr_is_read_back_as_a_number_and_reported(tmp_path):
    """results.json has no NaN: `results.append` writes a one-probe trace's NaN stderr as "nan"; `load` gives the
    float back (an audit found `flatlm report` failing on the string), and a rewrite keeps it."""
    import math

    wd = tmp_path / "r"
    wd.mkdir()
    (wd / "config.json").write_text("{}")
    entry = {"kind": "flatness", "step": 10, "method": "fisher", "trace": 2.5, "trace_stderr": float("nan"),
             "detail": {"stderr": float("inf")}}
    results.append(str(wd), [entry, {"kind": "probe", "step": 10, "task": "A", "accuracy": 0.5,
                                    "accuracy_std": 0.0}])
    assert '"nan"' in (wd / "results.json").read_text()
    results.append(str(wd), [{"kind": "probe", "step": 20, "task": "A", "accuracy": 0.6,
                              "accuracy_std": 0.0}])  # rewrites the file
    (back,) = [e for e in results.load(str(wd)) if e["kind"] == "flatness"]
    assert math.isnan(back["trace_stderr"]) and back["detail"]["stderr"] == math.inf and back["method"] == "fisher"
    json.loads((wd / "results.json").read_text(), parse_constant=pytest.fail)  # still strict JSON: no NaN
    md = report.make_report([str(wd)], str(tmp_path / "out")).read_text()
    assert "2.5 ± nan" in md
