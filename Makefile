# Everything runs inside a project-local virtual environment, created on first use.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: install quickstart test

$(BIN)/dha-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install: $(BIN)/dha-train

quickstart: install
	$(BIN)/dha-train quickstart

test: install
	$(BIN)/python -m pytest tests
