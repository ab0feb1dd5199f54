"""`dha-train export-gguf IN OUT.gguf`: an HF folder the project wrote (or any plain folder of a supported family:
LLaMA, Mistral, Qwen2, Qwen3, Gemma 3) as one GGUF file of the family's own llama.cpp architecture, which llama.cpp
serves (llama-server, ollama, LM Studio); ``dha_train.gguf_export`` does the work."""

from __future__ import annotations

import argparse

from dha_train.gguf_export import OUTTYPES, export_gguf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('folder', help='an HF folder: a plain or GQA model of a supported family (LLaMA, Mistral, '
                        'Qwen2, Qwen3, Gemma 3), a servable DHA or AsymGQA (dha_llama), or MLA in DeepSeek\'s format '
                        '(deepseek_v3)')
    parser.add_argument('out', help='the .gguf file to write')
    parser.add_argument('--outtype', choices=OUTTYPES, default='f16',
                        help='weight type: f32, f16 (default), bf16 or q8_0 (norms stay f32)')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing OUT')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = export_gguf(args.folder, args.out, outtype=args.outtype, overwrite=args.overwrite)
    if report.architecture == 'deepseek2':
        layout = 'MLA: the latent plus the shared RoPE key cached per layer'
    else:
        counts = sorted(set(report.kv_heads))
        layout = (f'{counts[0]} K/V heads per layer' if len(counts) == 1 else
                  f'K/V heads per layer {", ".join(map(str, report.kv_heads))}')
    share = (f', {report.kv_bytes_per_token_f16 / report.source_kv_bytes_per_token_f16:.1%} of the source\'s'
             if report.source_kv_bytes_per_token_f16 else '')
    print(f'dha-train export-gguf: wrote {report.path} ({report.architecture}, {report.outtype}, {report.tensors} '
          f'tensors; a {report.family} model; {layout}; K/V cache {report.kv_bytes_per_token_f16:,} bytes per token '
          f'in f16{share})')
    if report.cache_unquantizable:
        advice = (' (convert with --quantizable-cache for one it can)' if report.architecture == 'deepseek2' else '')
        print(f'dha-train export-gguf: llama.cpp cannot quantize this file\'s K/V cache (-ctk/-ctv q8_0): '
              f'{report.cache_unquantizable}{advice}; it runs with an f16 cache')
    return 0
