# Two jobs: `make demo` (the embedded default) and `make test` (the suite CI runs).
# Each installs what it needs into .venv on first use: the CPU build of torch, unless
# the system Python already has a CUDA torch, which the venv then inherits.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "using the system's CUDA torch"; \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install -q --upgrade pip; \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[server,test]"
	touch $(STAMP)

demo: install
	$(VENV)/bin/kvstrata demo

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: install lint
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
