# Everything runs inside a project-local virtual environment, created on first use.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install quickstart test lint

$(BIN)/dha-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(BIN)/dha-train

quickstart: install
	$(BIN)/dha-train quickstart

# The layer contracts (import-linter, pyproject.toml) and ruff, then the suite.
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check dha_train tests tools

test: lint
	$(BIN)/python -m pytest tests
