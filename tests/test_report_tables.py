"""`flatlm report`'s tables: fine-tuning at the last checkpoint, the rate chosen on validation, and the fine-tuned
initialisation (`eval.finetune.from_init`) in columns of its own, per run and over pre-training seeds."""

from __future__ import annotations

import numpy as np

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
