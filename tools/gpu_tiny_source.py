"""A stand-in source for `tools/gpu_check.py --source` when a lent GPU has too little time for SmolLM2's GGUF (98 MB:
three carried calls).

Here: ``python tools/gpu_tiny_source.py .whl/tiny`` trains a byte-level BPE tokenizer on the stdlib corpus and writes
a LLaMA config of SmolLM2-135M's shape (30 layers, 576 wide, 9 query and 3 K/V heads) at its vocabulary, a few
hundred KB in all. On the device: ``python tools/gpu_tiny_source.py .whl/tiny --init`` adds random weights (about
111M parameters). Throughput and memory figures then match a 135M-class model; losses mean nothing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def write_tokenizer_and_config(folder: Path, vocab_size: int, corpus_bytes: int) -> None:
    from transformers import AutoTokenizer, LlamaConfig

    from dha_train.data.corpus import build_stdlib_corpus
    from dha_train.data.tokenizer import train_byte_level_bpe

    with tempfile.TemporaryDirectory() as corpus:
        build_stdlib_corpus(corpus, max_bytes_per_domain=corpus_bytes, seed=0)
        texts = [json.loads(line)['text'] for path in sorted(Path(corpus).rglob('*.jsonl')) for line in path.open()]
        train_byte_level_bpe(texts, folder, vocab_size=vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, torch_dtype='float32').save_pretrained(folder)


def add_random_weights(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(folder)).save_pretrained(folder)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('folder', type=Path)
    parser.add_argument('--init', action='store_true', help='add random weights to a folder this wrote earlier')
    parser.add_argument('--vocab-size', dest='vocab_size', type=int, default=8192)
    parser.add_argument('--corpus-bytes', dest='corpus_bytes', type=int, default=2_000_000,
                        help='stdlib corpus per domain for the tokenizer')
    args = parser.parse_args(argv)
    if args.init:
        if not (args.folder / 'config.json').is_file():
            raise SystemExit(f'{args.folder}: no config.json; run this without --init first')
        add_random_weights(args.folder)
    else:
        args.folder.mkdir(parents=True, exist_ok=True)
        write_tokenizer_and_config(args.folder, args.vocab_size, args.corpus_bytes)
    print(f'{args.folder}: {sorted(p.name for p in args.folder.iterdir())}')


if __name__ == '__main__':
    main()
