"""`dha-train data prep`: RedPajama JSONL(.gz/.zst) -> tokenized MDS shards per domain (``data.prep``);
`dha-train data verify`: every shard file against the size and hash its index.json records (``data.integrity``);
`dha-train data corpus`: the stdlib corpus as RedPajama JSONL (``data.corpus``), data to try a pipeline on."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dha_train.config import ConfigError
from dha_train.data.corpus import build_stdlib_corpus
from dha_train.data.domains import DOMAINS
from dha_train.data.integrity import AUTO, verify_data
from dha_train.data.prep import SPLITS, default_workers, prep_redpajama
from dha_train.data.redpajama import MAX_LINE_BYTES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    data = parser.add_subparsers(dest='data_command', required=True)
    prep = data.add_parser('prep', help='RedPajama JSONL(.gz/.zst) -> tokenized MDS shards per domain')
    add_prep_arguments(prep)
    prep.set_defaults(func=run)
    verify = data.add_parser('verify', help='check every shard file under a data folder against the size and hash '
                             'its index.json records (what train_loader.validate_hash checks at the start of a run)')
    verify.add_argument('root', help='a folder written by `dha-train data prep` (or one MDS split folder)')
    verify.add_argument('--hash', default=AUTO, metavar='ALGORITHM',
                        help='hash to check: auto (the one recorded, xxh64 for data prep), or a name such as sha1 '
                             '(default: %(default)s)')
    verify.set_defaults(func=run_verify)
    corpus = data.add_parser('corpus', help='a RedPajama-style JSONL corpus from the local Python standard library '
                             '(its source as github, its docstrings as wikipedia): data to try a pipeline on with no '
                             'download; the input of `data prep`')
    corpus.add_argument('out', help='an empty or new folder: <out>/github/*.jsonl and <out>/wikipedia/*.jsonl')
    corpus.add_argument('--max-bytes', dest='max_bytes', type=int, default=3_000_000,
                        help='text bytes per domain (default: %(default)s, the quickstart\'s)')
    corpus.add_argument('--seed', type=int, default=0)
    corpus.set_defaults(func=run_corpus)


def run(args: argparse.Namespace) -> int:
    run_prep_from_args(args)
    return 0


def run_corpus(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f'data corpus: {out} is not empty; give a new folder')
    if args.max_bytes < 1:
        raise ConfigError(f'data corpus: --max-bytes must be >= 1, got {args.max_bytes}')
    stats = build_stdlib_corpus(out, max_bytes_per_domain=args.max_bytes, seed=args.seed)
    for domain, numbers in stats.items():
        print(f"  {domain:<10} {numbers['documents']:>6} documents {numbers['bytes']:>11,} bytes")
    print(f'data corpus: wrote {out} (next: dha-train data prep --input {out} --out DATA --tokenizer MODEL ...)')
    return 0


def run_verify(args: argparse.Namespace) -> int:
    for split, files, algorithms in verify_data(args.root, args.hash):
        checked = ', '.join(sorted(a for a in algorithms if a)) or 'sizes only: no hashes recorded'
        print(f'  {split:<24} {files:>6} shard files ok ({checked})')
    print(f'data verify: {args.root}: every shard file matches its index.json')
    return 0


def add_prep_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument('--input', nargs='+', required=True, metavar='PATH',
                        help='RedPajama folders (searched recursively) and/or .jsonl/.jsonl.gz/.jsonl.zst files')
    parser.add_argument('--out', required=True, help='output folder: <out>/<domain>/{train,val}/ + manifest.json')
    parser.add_argument('--tokenizer', required=True, help='local HF tokenizer folder')
    parser.add_argument('--seq-len', type=int, required=True, help='tokens per packed sample')
    parser.add_argument('--val-tokens', type=int, default=0,
                        help='val tokens per domain, taken from the start of its first file (default: 0, no val)')
    parser.add_argument('--workers', type=int, default=default_workers(),
                        help='processes, one input file each at a time (default: %(default)s)')
    parser.add_argument('--overwrite', action='store_true', help='replace a non-empty --out')
    parser.add_argument('--skip-bad-lines', action='store_true',
                        help='skip bad lines (malformed JSON, or longer than --max-line-bytes; counted in the '
                             'manifest) instead of stopping')
    parser.add_argument('--max-line-bytes', type=int, default=MAX_LINE_BYTES, metavar='BYTES',
                        help='longest input line (one document) read; a longer one is a bad line, and no more than '
                             'this is ever held in memory (default: %(default)s, 64 MiB)')
    parser.add_argument('--domain', choices=DOMAINS, help='force this domain for every input file')
    parser.add_argument('--compression', choices=('none', 'zstd'), default='none',
                        help='MDS shard compression (default: %(default)s)')
    return parser


def run_prep_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``prep_redpajama`` from parsed ``add_prep_arguments`` options and print a per-domain summary."""
    manifest = prep_redpajama(
        args.input, args.out, args.tokenizer, args.seq_len, val_tokens=args.val_tokens, workers=args.workers,
        overwrite=args.overwrite, skip_bad_lines=args.skip_bad_lines, domain=args.domain,
        compression=None if args.compression == 'none' else args.compression, max_line_bytes=args.max_line_bytes,
    )
    print(f'wrote {args.out} (seq_len {manifest["seq_len"]}, {manifest["token_dtype"]} tokens)')
    for name, entry in manifest['domains'].items():
        splits = ', '.join(f'{s} {entry[s]["samples"]:,} samples' for s in SPLITS if s in entry)
        print(f'  {name:<14} {entry["files"]:>5} files {entry["documents"]:>10,} docs  {splits}')
    return manifest
