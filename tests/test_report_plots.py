"""The report's figures (issue 16, item 9): PNG and PDF, error bars from the stored stds, accuracy vs steps as
mean ± std over pre-training seeds (one line per method), the KL axis says ln, size tick labels do not overlap."""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from flatlm import report_plots as plots
from flatlm.report import RunData


def _run(name, accs, stds, params=None, evals=()):
    results = [{"kind": "probe", "step": s, "task": "A", "accuracy": a, "accuracy_std": sd}
               for s, a, sd in zip((10, 20), accs, stds)]
    return RunData(name=name, path=None, config={}, evals=list(evals), results=results, num_params=params)


def test_accuracy_vs_steps_is_mean_and_std_over_seeds():
    runs = [_run("adv-seed0", [0.5, 0.6], [0.01, 0.01]), _run("adv-seed1", [0.7, 0.9], [0.02, 0.02]),
            _run("adv-seed2", [0.6, 0.75], [0.03, 0.03]), _run("plain", [0.4, 0.45], [0.05, 0.06])]
    fig = plots.accuracy_vs_steps(runs, ["A"])
    (ax,) = fig.axes
    assert len(ax.containers) == 2  # one line per method, not one per seed
    adv, plain = ax.containers
    np.testing.assert_allclose(adv.lines[0].get_ydata(), 100 * np.mean([[0.5, 0.6], [0.7, 0.9], [0.6, 0.75]], 0))
    half_bar = [seg[1, 1] - seg[0, 1] for seg in adv.lines[2][0].get_segments()]
    np.testing.assert_allclose(half_bar, 2 * 100 * np.std([[0.5, 0.6], [0.7, 0.9], [0.6, 0.75]], 0, ddof=1))
    half_bar = [seg[1, 1] - seg[0, 1] for seg in plain.lines[2][0].get_segments()]  # one seed: its probe std
    np.testing.assert_allclose(half_bar, [2 * 5.0, 2 * 6.0])
    assert ax.get_legend_handles_labels()[1] == ["adv (3 seeds)", "plain"]


def test_loss_plot_has_error_bars_and_says_ln(tmp_path):
    evals = [{"step": s, "eval/loss": 2.0 / s, "eval/loss_std": 0.01 * s, "eval/kl": 0.1 / s, "eval/kl_std": 0.002,
              "eval/entropy": 1.0} for s in (1, 2)]
    fig = plots.loss_vs_steps([_run("r", [0.5, 0.5], [0, 0], evals=evals)])
    a, b = fig.axes
    half_bar = [seg[1, 1] - seg[0, 1] for seg in a.containers[0].lines[2][0].get_segments()]
    np.testing.assert_allclose(half_bar, [0.02, 0.04])
    assert b.get_ylabel().startswith("ln KL")
    plots.save(fig, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "loss.pdf").read_bytes()[:4] == b"%PDF"


def test_size_tick_labels_do_not_overlap():
    sizes = [56_468, 61_000, 70_000, 83_000, 99_000]  # within a decade: matplotlib labels its minor log ticks
    runs = [_run(f"s{n}", [0.5, 0.6], [0.01, 0.01], params=n) for n in sizes]
    fig = plots.accuracy_vs_size(runs, ["A"])
    assert not plots.tick_labels_overlap(fig)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["56.5k", "61k", "70k", "83k", "99k"]
    # the check itself can fail: default log ticks at these sizes, labelled as matplotlib does
    old = Figure(figsize=(5.5, 4))
    ax = old.subplots()
    ax.plot(sizes, range(5))
    ax.set(xscale="log")
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes], fontsize=14)
    assert plots.tick_labels_overlap(old)


def test_the_lookup_table_line_is_the_mean_over_runs():
    """Each run probes the exact conditionals with its own probe seeds: the line is their mean (it was the last
    run's), and the legend gives how many and their range."""
    runs = [_run(f"adamw-seed{k}", [0.5, 0.6], [0.01, 0.01]) for k in range(3)]
    for r, acc in zip(runs, (0.537, 0.534, 0.502)):
        r.results.append({"kind": "lookup_table", "task": "A", "accuracy": acc, "accuracy_std": 0.0})
    runs[0].results.append({"kind": "lookup_table", "task": "B", "accuracy": 0.9, "accuracy_std": 0.0})
    assert plots.lookup_accuracies(runs, "A") == [0.537, 0.534, 0.502]
    (ax,) = plots.accuracy_vs_steps(runs, ["A"]).axes
    (line,) = [x for x in ax.lines if x.get_linestyle() == ":"]
    np.testing.assert_allclose(line.get_ydata(), 100 * np.mean([0.537, 0.534, 0.502]))
    assert "lookup table (mean of 3: 50.2-53.7)" in ax.get_legend_handles_labels()[1]
    runs[1].results.append({"kind": "lookup_words", "task": "A", "accuracy": 0.58, "accuracy_std": 0.0})
    (ax,) = plots.accuracy_vs_steps(runs, ["A"]).axes  # the words-added table: a line of its own
    (words,) = [x for x in ax.lines if x.get_linestyle() == "-."]
    np.testing.assert_allclose(words.get_ydata(), 58.0)
    assert "lookup table + words" in ax.get_legend_handles_labels()[1]


def test_accuracy_vs_size_is_each_arms_mean_and_t_interval_over_seeds():
    """Seed-repeated runs: one point per arm at its mean final accuracy with a 95 % t-interval over seeds (by hand,
    scipy's t quantile), every seed as a faint dot, in order of size; a single run keeps its probe-seed std."""
    from scipy import stats

    finals = {"big": [0.55, 0.58, 0.52], "small": [0.50, 0.49, 0.53]}
    runs = [_run(f"{arm}-seed{k}", [0.3, acc], [0.01, 0.01], params=2000 if arm == "big" else 100)
            for arm, accs in finals.items() for k, acc in enumerate(accs)]
    runs.append(_run("mid", [0.3, 0.61], [0.01, 0.04], params=500))
    (ax,) = plots.accuracy_vs_size(runs, ["A"]).axes
    (line,) = ax.containers
    xs = np.asarray(line.lines[0].get_xdata(), float)
    np.testing.assert_allclose(xs, [100, 500, 2000])  # sorted by size, one point per arm
    np.testing.assert_allclose(np.asarray(line.lines[0].get_ydata(), float), [100 * np.mean(finals["small"]), 61.0,
                                                           100 * np.mean(finals["big"])])
    ci = lambda a: stats.t.ppf(0.975, 2) * 100 * np.std(a, ddof=1) / np.sqrt(3)  # noqa: E731
    half_bar = [(seg[1, 1] - seg[0, 1]) / 2 for seg in line.lines[2][0].get_segments()]
    np.testing.assert_allclose(half_bar, [ci(finals["small"]), 4.0, ci(finals["big"])])
    dots = [c for c in ax.collections if c not in line.lines[2]]
    assert sorted(len(c.get_offsets()) for c in dots) == [3, 3]  # every seed of an arm; no dot for the single run
    assert sorted(a.get_text().strip() for a in ax.texts if a.get_text().strip()) == ["big (3 seeds)",
                                                                                     "small (3 seeds)"]
