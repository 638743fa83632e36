# Two entry points: `make demo` (the main job) and `make test` (the whole suite).
# Both create or reuse .venv. On a machine whose python already has a CUDA torch,
# the venv sees it (--system-site-packages) and keeps it; otherwise it installs
# torch==2.13.0, which on a CPU-only machine is the local CPU build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.insum-installed

.PHONY: venv demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m insum demo

test: $(STAMP)
	$(PY) -m ruff check insum tests benchmarks
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider

# The benchmark suite (benchmarks/__main__.py): on a CUDA machine every study at full size,
# results and REPORT.md in benchmarks/results/<device>/; without CUDA the --smoke plumbing check.
BENCH_ARGS ?= $(shell $(PY) -c "import torch; print('' if torch.cuda.is_available() else '--smoke')" 2>/dev/null)
bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
