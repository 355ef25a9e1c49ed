"""`flatlm reproduce --report-only` judges the workdir it is given and nothing else: a workdir that does not exist,
was made with another preset or seeds, or lacks a claim asked for by name is a one-line error (exit 2) that writes
nothing; claims not run are named on stderr. A rerun without --preset keeps the workdir's preset."""

from __future__ import annotations

import json

import pytest
from test_reproduce import SEEDS, _dir, _run

from flatlm import reproduce_run
from flatlm.cli.main import main


def _table1_hmm_workdir(wd, preset="cpu", seeds=None):
    """A suite workdir of `preset` holding table1_hmm's runs (C3 and C5 at the cpu preset) and nothing else."""
    wd.mkdir()
    exp = _dir(wd, "table1_hmm", preset=preset)
    (wd / "suite.json").write_text(json.dumps({"preset": preset, "seeds": seeds}))
    for s in SEEDS:
        _run(exp, f"adamw-seed{s}", {2000: (2.000, 0.010, 0.40, 5.0)})
        _run(exp, f"adversarial-lam2-seed{s}", {2000: (2.002, 0.012, 0.30, 6.0 + 0.1 * s)})
    return wd


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_report_only_on_a_workdir_that_does_not_exist_writes_nothing(tmp_path, capsys):
    err = _one_line_error(capsys, ["reproduce", "--report-only", "--workdir", str(tmp_path / "w")])
    assert "does not exist: run `flatlm reproduce --workdir" in err and "(without --report-only)" in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny"], "holds the suite of --preset cpu, not tiny; rerun with --preset cpu"),
    (["--seeds", "3,4"], "was made with the preset's seeds, not --seeds 3,4; use a new --workdir"),
    (["--claims", "C1"], "C1 has not run in {wd} (no fig1_after_convergence-hmm): run `flatlm reproduce --workdir "
                         "{wd} --claims C1` first"),
])
def test_report_only_refuses_another_preset_other_seeds_or_a_claim_not_run(tmp_path, capsys, argv, message):
    wd = _table1_hmm_workdir(tmp_path / "w")
    err = _one_line_error(capsys, ["reproduce", "--report-only", "--workdir", str(wd), *argv])
    assert message.format(wd=wd) in err
    assert not (wd / "report").exists()


def test_report_only_judges_the_claims_run_and_names_the_others(tmp_path, capsys):
    wd = _table1_hmm_workdir(tmp_path / "w", seeds=[0, 1, 2])
    assert main(["reproduce", "--report-only", "--workdir", str(wd), "--seeds", "0,1,2", "--json"]) == 0
    out, err = capsys.readouterr()
    assert [c["claim"] for c in json.loads(out)["claims"]] == ["C3", "C5"]
    assert err.splitlines() == [f"{cid}: not run in {wd} (no {names}): `flatlm reproduce --workdir {wd} --claims "
                                f"{cid}` runs it" for cid, names in (
                                    ("C1", "fig1_after_convergence-hmm"),
                                    ("C2", "fig2_model_sizes-hmm, fig5_grown_sizes-hmm"), ("C4", "fig3_sgd-hmm"))]
    text = (wd / "report" / "reproduction.md").read_text()
    assert f"`flatlm reproduce --preset cpu --workdir {wd} --seeds 0,1,2`" in text


def test_a_workdir_of_other_files_is_not_a_suite(tmp_path, capsys):
    (tmp_path / "w").mkdir()
    err = _one_line_error(capsys, ["reproduce", "--report-only", "--workdir", str(tmp_path / "w")])
    assert "holds no claim's experiments: run `flatlm reproduce --workdir" in err
    assert list((tmp_path / "w").iterdir()) == []


def test_without_preset_a_workdir_keeps_its_own(tmp_path):
    wd = tmp_path / "w"
    assert reproduce_run.check_suite(str(wd), None, ()) == ("cpu", ())  # a new workdir: cpu, the preset's seeds
    assert reproduce_run.check_suite(str(wd), "tiny", (5,)) == ("tiny", (5,))
    wd.mkdir()
    (wd / "suite.json").write_text(json.dumps({"preset": "tiny", "seeds": [5]}))
    assert reproduce_run.check_suite(str(wd), None, ()) == ("tiny", (5,))
    assert reproduce_run.check_suite(str(wd), "tiny", (5,)) == ("tiny", (5,))


def test_a_workdir_without_suite_json_is_judged_under_the_preset_given(tmp_path, capsys):
    """A workdir made before suite.json (or by hand, as configs/experiments/adversarial_strength.py suggests): cpu
    by default; under --preset paper, C3 also needs the PCFG tables, which it lacks."""
    wd = _table1_hmm_workdir(tmp_path / "w")
    (wd / "suite.json").unlink()
    assert main(["reproduce", "--report-only", "--workdir", str(wd), "--claims", "C3", "--json"]) == 0
    assert [c["claim"] for c in json.loads(capsys.readouterr().out)["claims"]] == ["C3"]
    err = _one_line_error(capsys, ["reproduce", "--report-only", "--workdir", str(wd), "--claims", "C3",
                                   "--preset", "paper"])
    assert "C3 has not run in" in err and "(no table1-pcfg, table2-pcfg)" in err
