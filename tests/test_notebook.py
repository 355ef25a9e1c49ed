"""The Colab quickstart runs headless, top to bottom, and its own assertions hold."""

from __future__ import annotations

import nbformat
from conftest import REPO
from nbclient import NotebookClient


def test_quickstart_notebook_executes():
    nb = nbformat.read(REPO / "colabs" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(REPO / "colabs")}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "final exact loss" in outputs
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
