"""`flatlm theory dyck` on a tiny setting, in-process through argparse."""

from __future__ import annotations

import argparse
import json

import pytest

from flatlm.cli import theory as cli
from flatlm.errors import UserError


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flatlm")
    cli.add_parser(parser.add_subparsers(dest="verb", required=True))
    return parser.parse_args(list(argv))


def test_theory_dyck_writes_png_and_json(tmp_path, capsys):
    args = _parse("theory", "dyck", "--T", "4", "--m", "16", "--seeds", "0", "1", "--steps", "20",
                  "--probes", "0", "--draw", "mirrored", "--out", str(tmp_path), "--json")
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)  # stdout holds exactly one JSON object
    assert out == json.loads((tmp_path / cli.RESULTS_NAME).read_text())
    assert (tmp_path / cli.PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {(r["solution"], r["seed"]): r for r in out["solutions"]}
    assert set(rows) == {("transferable", 0), ("transferable", 1), ("random_features", 0),
                         ("random_features", 1), ("sgd", 0), ("sgd_trace_penalty", 0)}
    assert rows[("transferable", 0)]["pretrain_loss"] < 1e-10
    assert rows[("transferable", 0)]["trace"] < rows[("random_features", 0)]["trace"]
    assert len(out["training"]["sgd"]["history"]["step"]) == 21


def test_theory_dyck_table_and_user_errors(tmp_path, capsys):
    args = _parse("theory", "dyck", "--T", "4", "--m", "32", "--seeds", "0", "--steps", "0", "--probes", "2",
                  "--out", str(tmp_path))
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "Tr(H) Hutchinson" in table and "random_features" in table and "transferable" in table
    args = _parse("theory", "dyck", "--T", "6", "--m", "2", "--seeds", "0", "--steps", "0", "--probes", "0",
                  "--out", str(tmp_path))
    assert args.func(args) == 0  # Theorem 6.1's m >= 2; the random features are left out with a note
    table = capsys.readouterr().out
    assert "transferable" in table and "random_features" not in table and "m >= 132" in table
    with pytest.raises(UserError, match="even"):
        args = _parse("theory", "dyck", "--T", "5", "--out", str(tmp_path))
        args.func(args)
    assert capsys.readouterr().err == ""  # refused before the training bar starts: the error line stands alone
    with pytest.raises(UserError, match="--samples"):
        args = _parse("theory", "dyck", "--T", "16", "--out", str(tmp_path))
        args.func(args)


@pytest.mark.slow
def test_theory_dyck_search_and_label_noise(tmp_path, capsys):
    """--search and --label-noise write their parts of results.json, the search figure (png and pdf) and tables."""
    args = _parse("theory", "dyck", "--T", "4", "--m", "16", "--draw", "mirrored", "--seeds", "0", "--steps", "20",
                  "--penalty", "0", "--probes", "0", "--search", "1", "--search-rounds", "1", "--search-steps", "5",
                  "--search-n", "2", "8", "--label-noise", "1.0", "--out", str(tmp_path))
    assert args.func(args) == 0
    table = capsys.readouterr().out
    assert "closed-form minimum 4/(m sqrt T) = 0.125" in table and "Tr(H) label-noise SGD" in table
    out = json.loads((tmp_path / cli.RESULTS_NAME).read_text())
    assert len(out["search"]["rows"]) == 1 and set(out["search"]["rows"][0]["downstream"]) == {"2", "8"}
    assert out["search"]["reference"]["trace_gap"] == pytest.approx(0.0, abs=1e-9)
    assert (tmp_path / f"{cli.SEARCH_STEM}.pdf").read_bytes()[:4] == b"%PDF"
    noisy = out["label_noise"]["runs"]["label_noise_sgd"]
    assert noisy["step"][-1] == 20 and out["label_noise"]["runs"]["sgd"]["distance"][-1] < 1e-9
    with pytest.raises(UserError, match="--search"):
        args = _parse("theory", "dyck", "--T", "4", "--search", "-1", "--out", str(tmp_path))
        args.func(args)
