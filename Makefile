# flatlm: `make demo` and `make test` work on a fresh machine with only Python 3.11.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
WORKERS ?= 2

.PHONY: demo test test-all bench lint clean install reproduce

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=/path/to/python3.11 ...'"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/flatlm demo

# --dist loadfile: each file's tests on one worker, so what they compile (same tiny shapes, file after file) is
# compiled once per file, not once per worker: 1071 s of test time instead of 1230 s in two runs one after the other
# (2 cores); 9:09-10:24 of wall over six runs with it, 10:36-12:05 over two without, on a slow machine that drifts.
# FLATLM_TEST_XLA=O0: LLVM -O0 for a compile-bound selection (tests/conftest.py); test-all's training keeps -O1.
test: $(STAMP)
	FLATLM_TEST_XLA=$${FLATLM_TEST_XLA:-O0} $(PY) -m pytest -n $(WORKERS) --dist loadfile -m "not slow" --durations=15

test-all: $(STAMP)
	$(PY) -m pytest -n $(WORKERS) --dist loadfile --durations=25

reproduce: $(STAMP)  # the paper's claims at CPU scale (resumable; see docs/reproduction/)
	$(VENV)/bin/flatlm reproduce --preset cpu --workdir runs/reproduce-cpu

# The peers (`bench` extra). TORCH is installed first so that pip takes the CPU wheel, not gigabytes of CUDA
# packages; elsewhere pass e.g. TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
TORCH ?= torch==2.13.0
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)  # every benchmark, peers in the same process; tens of minutes on 2 cores
	@for b in benchmarks/[a-z]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
