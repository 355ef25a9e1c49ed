"""Start-up of the command line: only the verb being run is imported, and JAX's persistent compilation cache is on
(issue 17: `flatlm train` tiny to its first step; `benchmarks/startup_pipeline.py` measures it)."""

from __future__ import annotations

import subprocess
import sys

import jax

from flatlm.run import enable_compilation_cache


def test_the_train_verb_does_not_import_the_report_or_the_theory():
    code = ("import sys; from flatlm.cli.main import build_parser; p = build_parser(('train',)); "
            "print(sorted(m for m in ('flatlm.report', 'flatlm.theory', 'flatlm.experiment', 'matplotlib', "
            "'scipy') if m in sys.modules)); print(sorted(p._subparsers._group_actions[0].choices))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "['train']"


def test_compilation_cache_folder_follows_the_environment(tmp_path):
    before = jax.config.jax_compilation_cache_dir
    try:
        assert enable_compilation_cache({"FLATLM_COMPILATION_CACHE": "off"}) is None
        assert jax.config.jax_compilation_cache_dir == before
        assert enable_compilation_cache({"XDG_CACHE_HOME": str(tmp_path)}) == str(tmp_path / "flatlm" / "jax")
        assert enable_compilation_cache({"JAX_COMPILATION_CACHE_DIR": "/x", "FLATLM_COMPILATION_CACHE": "/y"}) == "/y"
        assert jax.config.jax_compilation_cache_dir == "/y"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
