"""colabs/claims/C1..C5.ipynb read a finished suite workdir and draw each claim's verdict and figures; executed
headless by nbclient on a synthetic suite (the fixtures of test_reproduce), with the paper preset's layout."""

from __future__ import annotations

import nbformat
import pytest
from conftest import REPO
from nbclient import NotebookClient
from test_reproduce import (
    test_c1_compares_the_first_and_last_checkpoint_after_convergence as make_c1,
)
from test_reproduce import (
    test_c2_orders_models_by_parameter_count as make_c2,
)
from test_reproduce import (
    test_c3_adversarial_lower_accuracy_and_higher_trace_at_the_same_loss_is_reproduced as make_c3,
)
from test_reproduce import (
    test_c5_compares_adamws_probe_with_the_lookup_tables_on_each_seed as make_c5,
)
from test_reproduce import (
    test_without_the_convergence_watch_convergence_is_the_first_checkpoint_in_the_band as make_c4,
)


def test_committed_notebooks_are_what_the_generator_writes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_notebooks", REPO / "colabs" / "claims" / "make_notebooks.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for cid in ("C1", "C2", "C3", "C4", "C5"):
        committed = nbformat.read(REPO / "colabs" / "claims" / f"{cid}.ipynb", as_version=4)
        assert [c.source for c in committed.cells] == [c.source for c in gen.notebook(cid).cells], cid


@pytest.mark.slow
@pytest.mark.parametrize("cid, make", [("C1", lambda p: make_c1(p, 0.45, "reproduced")), ("C2", make_c2),
                                       ("C3", make_c3), ("C4", make_c4),
                                       ("C5", lambda p: make_c5(p, 0.015, "reproduced"))])
def test_claim_notebook_shows_verdict_and_figures(tmp_path, monkeypatch, cid, make):
    make(tmp_path)
    monkeypatch.setenv("FLATLM_REPRODUCE_WORKDIR", str(tmp_path))
    nb = nbformat.read(REPO / "colabs" / "claims" / f"{cid}.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"{cid} (" in text and "The paper:" in text and "Same-loss checks:" in text
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.mark.parametrize("cid, make", [("C1", lambda p: make_c1(p, 0.45, "reproduced")), ("C3", make_c3)])
def test_claim_notebook_code_runs_in_process(tmp_path, monkeypatch, capsys, cid, make):
    """The fast suite's guard on the notebooks' code (the kernel test above is slow): their cells, executed in this
    process on the same synthetic suite, find every name they use in flatlm (a name moved between modules stopped
    every notebook once, seen only by the slow test) and print the verdict and the paper's numbers."""
    make(tmp_path)
    monkeypatch.setenv("FLATLM_REPRODUCE_WORKDIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    nb = nbformat.read(REPO / "colabs" / "claims" / f"{cid}.ipynb", as_version=4)
    namespace: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "code":
            exec(compile(cell.source, f"{cid}.ipynb", "exec"), namespace)  # noqa: S102
    text = capsys.readouterr().out
    assert f"{cid} (" in text and "The paper:" in text and "Same-loss checks:" in text
    assert "<IPython.core.display.Image object>" in text  # a figure was drawn and displayed
