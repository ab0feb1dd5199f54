"""`dha-train`: quickstart, data prep, train, convert, export, bench."""

from __future__ import annotations

import argparse
import sys


def _quickstart(args) -> int:
    from dha_train.quickstart import run_quickstart

    run_quickstart(out=args.out, seed=args.seed, fresh=args.fresh, steps=args.steps)
    return 0


def _data_prep(args) -> int:
    from dha_train.data.prep import run_prep_from_args

    run_prep_from_args(args)
    return 0


def _train(args) -> int:
    from dha_train.train import main

    return main([args.recipe, *args.overrides])


def _export(args) -> int:
    from dha_train.export import export_hf

    out = export_hf(args.checkpoint, args.out_dir, tokenizer=args.tokenizer, dtype=args.dtype,
                    overwrite=args.overwrite)
    print(f'dha-train export: wrote {out}')
    return 0


def _convert(args) -> int:
    from dha_train.convert import convert_checkpoint
    from dha_train.models.head_map import HeadMap

    if args.head_map is not None:
        head_map = HeadMap.load(args.head_map)
    else:
        from transformers import LlamaConfig

        config = LlamaConfig.from_pretrained(args.model_dir, local_files_only=True)
        head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
        head_map = HeadMap.gqa(config.num_hidden_layers, config.num_attention_heads, args.kv_heads, head_dim)
    out = convert_checkpoint(args.model_dir, args.out_dir, head_map, overwrite=args.overwrite)
    print(f'dha-train convert: wrote {out} ({head_map.kv_budget_fraction():.0%} of the MHA KV heads)')
    return 0


def _bench_throughput(args) -> int:
    from dha_train.bench.throughput import run_throughput_bench

    run_throughput_bench(models=args.models, processes=args.processes, steps=args.steps, out=args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='dha-train', description=__doc__)
    commands = parser.add_subparsers(dest='command', required=True)

    quick = commands.add_parser('quickstart', help='build a corpus from the Python stdlib, train a tokenizer, '
                                'pretrain a tiny MHA LLaMA, evaluate per domain and export it')
    quick.add_argument('--out', default='quickstart_run', help='run folder (default: ./quickstart_run)')
    quick.add_argument('--seed', type=int, default=17)
    quick.add_argument('--fresh', action='store_true', help='redo every stage instead of reusing finished ones')
    quick.add_argument('--steps', type=int, default=None, help='training batches (default: the recipe value)')
    quick.set_defaults(func=_quickstart)

    data = commands.add_parser('data', help='data preparation').add_subparsers(dest='data_command', required=True)
    prep = data.add_parser('prep', help='RedPajama JSONL(.gz/.zst) -> tokenized MDS shards per domain')
    from dha_train.data.prep import add_prep_arguments

    add_prep_arguments(prep)
    prep.set_defaults(func=_data_prep)

    train = commands.add_parser('train', help='train from a YAML recipe in this process '
                                '(use `composer -n N -m dha_train.train` for several)')
    train.add_argument('recipe')
    train.add_argument('overrides', nargs='*', help='key=value overrides (dotted keys)')
    train.set_defaults(func=_train)

    export = commands.add_parser('export', help='Composer checkpoint -> Hugging Face folder')
    export.add_argument('checkpoint', help='checkpoint file, sharded checkpoint folder, or save_folder (latest)')
    export.add_argument('out_dir')
    export.add_argument('--tokenizer', default=None, help='tokenizer folder to ship instead of the checkpoint one')
    export.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    export.add_argument('--overwrite', action='store_true')
    export.set_defaults(func=_export)

    convert = commands.add_parser('convert', help='mean-pool the K/V heads of an MHA HF folder to a head map '
                                  '(the GQA baseline)')
    convert.add_argument('model_dir', help='local HF LLaMA folder (MHA)')
    convert.add_argument('out_dir')
    target = convert.add_mutually_exclusive_group(required=True)
    target.add_argument('--head-map', default=None, help='a head_map.json')
    target.add_argument('--kv-heads', type=int, default=None, help='contiguous GQA with this many K/V heads per layer')
    convert.add_argument('--overwrite', action='store_true')
    convert.set_defaults(func=_convert)

    bench = commands.add_parser('bench', help='benchmarks').add_subparsers(dest='bench_command', required=True)
    throughput = bench.add_parser('throughput', help='training tokens/s: 1 process vs 2 processes with FSDP2')
    throughput.add_argument('--models', nargs='+', default=['tiny', 'small'])
    throughput.add_argument('--processes', nargs='+', type=int, default=[1, 2])
    throughput.add_argument('--steps', type=int, default=12, help='timed batches per run (after warm-up)')
    throughput.add_argument('--out', default=None, help='folder for the run logs and results.json')
    throughput.set_defaults(func=_bench_throughput)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dha_train.config import ConfigError
    from dha_train.data.prep import DataPrepError
    from dha_train.export import CheckpointError
    from dha_train.models.head_map import HeadMapError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, DataPrepError, HeadMapError, FileExistsError, FileNotFoundError) as exc:
        print(f'dha-train: error: {exc}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
