"""The Colab quickstart runs headless, top to bottom, and its own assertions hold: in this checkout's venv (its
install cell finds flatlm and skips), and (slow) in a fresh venv with nothing installed but a Jupyter kernel, where
its install cell installs flatlm from a wheel and the next cell imports it (issue 16, item 4: the cell used to
look for setup.cfg, StopIteration outside the repository, and its `pip install -e` was not importable until a
restart)."""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest
from conftest import REPO
from nbclient import NotebookClient

NOTEBOOK = REPO / "colabs" / "quickstart.ipynb"


def _execute(nb, kernel: str, cwd) -> str:
    NotebookClient(nb, timeout=1200, kernel_name=kernel, resources={"metadata": {"path": str(cwd)}}).execute()
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {})
               for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_quickstart_notebook_executes():
    outputs = _execute(nbformat.read(NOTEBOOK, as_version=4), "python3", REPO / "colabs")
    assert "final exact loss" in outputs


def test_notebook_config_is_the_tiny_preset():
    """The notebook writes configs/hmm_mlm.py:tiny out (configs/ is not installed): same fields, except that it
    evaluates and logs every 15 steps."""
    from flatlm.config import apply_overrides, load_config

    cell = nbformat.read(NOTEBOOK, as_version=4).cells[2].source
    scope: dict = {}
    exec(cell.split("workdir =")[0], scope)  # the config lines only: no training
    tiny = apply_overrides(load_config(str(REPO / "configs" / "hmm_mlm.py") + ":tiny"),
                           ["--config.train.eval_every=15", "--config.train.log_every=15"])
    got = scope["config"]
    for section in ("language", "data", "model", "train", "checkpoint"):
        assert got[section].to_dict() == tiny[section].to_dict(), section
    assert tuple(got.eval.tasks) == tuple(tiny.eval.tasks)


@pytest.mark.slow  # minutes: pip downloads flatlm's dependencies into a fresh venv
def test_quickstart_in_a_fresh_venv(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                    str(wheels), str(REPO)], check=True)
    (wheel,) = wheels.glob("flatlm-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "ipykernel"], check=True)  # the kernel, nothing of flatlm
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert subprocess.run([py, "-c", "import flatlm"], capture_output=True, cwd=tmp_path, env=env).returncode != 0
    subprocess.run([py, "-m", "ipykernel", "install", "--prefix", str(tmp_path / "kernel"), "--name",
                    "flatlm-fresh"], check=True, capture_output=True)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "kernel" / "share" / "jupyter"))
    monkeypatch.setenv("FLATLM_SOURCE", str(wheel))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    outputs = _execute(nbformat.read(NOTEBOOK, as_version=4), "flatlm-fresh", tmp_path)  # outside the repository
    assert f"from {venv}" in outputs and "final exact loss" in outputs
