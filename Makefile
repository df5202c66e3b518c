# The single entry point. `make test` works on a fresh machine: it builds .venv itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
SPOOL_DIR ?= var/spool

.PHONY: install test test-fast test-crash lint typecheck fmt run bench bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check spool tests tools
	$(BIN)/ruff format --check spool tests tools
	$(BIN)/mypy

typecheck: $(STAMP)
	$(BIN)/mypy

fmt: $(STAMP)
	$(BIN)/ruff format spool tests tools
	$(BIN)/ruff check --fix spool tests tools

run: $(STAMP)
	$(BIN)/python -m spool.demo $(SPOOL_DIR)

bench-quick: $(STAMP)
	$(BIN)/python -m tools.bench --quick

bench: $(STAMP)
	$(BIN)/python -m tools.bench

clean:
	rm -rf $(VENV) var .pytest_cache .mypy_cache .ruff_cache
