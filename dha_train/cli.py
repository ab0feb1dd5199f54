"""`dha-train`: quickstart, data prep, train, search, convert, export, bench."""

from __future__ import annotations

import argparse
import sys


def _quickstart(args) -> int:
    from dha_train.quickstart import run_quickstart

    run_quickstart(out=args.out, seed=args.seed, fresh=args.fresh, steps=args.steps,
                   conversion_steps=args.conversion_steps, teacher=args.teacher)
    return 0


def _teacher_argument(parser) -> None:
    parser.add_argument('--teacher', nargs='+', default=[], metavar='KEY=VALUE',
                        help='overrides of the teacher\'s pretraining recipe, e.g. model.config.hidden_size=1024 '
                             'model.config.num_hidden_layers=8 for a larger model on a GPU (default: the tiny one)')


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


def _search(args) -> int:
    from dataclasses import fields

    from dha_train.search import SearchSettings, run_search

    settings = SearchSettings(**{f.name: getattr(args, f.name) for f in fields(SearchSettings)})
    result = run_search(args.model_dir, args.out_dir, settings, overwrite=args.overwrite)
    counts = result.head_map.kv_heads()
    print(f'dha-train search: wrote {args.out_dir} ({settings.method}: '
          f'{result.report["kv_heads_total"]} K+V heads, {result.head_map.kv_budget_fraction():.0%} of MHA; '
          f'K per layer {[k for k, _ in counts]}, V per layer {[v for _, v in counts]})')
    return 0


def _align(args) -> int:
    from dataclasses import fields

    from dha_train.aligned_gqa import AlignSettings, run_align

    settings = AlignSettings(**{f.name: getattr(args, f.name) for f in fields(AlignSettings)})
    report = run_align(args.model_dir, args.out_dir, settings, overwrite=args.overwrite)
    cosine = report['mean_cosine']
    print(f'dha-train align: wrote {args.out_dir} (GQA-{settings.num_groups} groups by {settings.group_by} '
          f'{settings.criterion}; within-group cache cosine K {cosine["key_before"]:.3f} -> {cosine["key_after"]:.3f}, '
          f'V {cosine["value_before"]:.3f} -> {cosine["value_after"]:.3f}; '
          f'{report["timings"]["total_s"]:.1f} s)')
    return 0


def add_align_arguments(align: argparse.ArgumentParser) -> None:
    from dha_train.aligned_gqa import CRITERIA, GROUP_BY, AlignSettings

    defaults = AlignSettings(num_groups=1)
    align.add_argument('model_dir', help='local HF LLaMA folder (MHA)')
    align.add_argument('out_dir', help='folder for the aligned MHA model, target_head_map.json and alignment.json')
    align.add_argument('--num-groups', dest='num_groups', type=int, required=True,
                       help='K/V heads per layer of the GQA model to be (GQA-<n>)')
    align.add_argument('--criterion', choices=CRITERIA, default=defaults.criterion,
                       help='cos: mean row cosine of unit-norm caches; dist: minus the mean squared distance')
    align.add_argument('--group-by', dest='group_by', choices=GROUP_BY, default=defaults.group_by,
                       help='group the heads by their key or by their value similarity after alignment')
    align.add_argument('--data', required=True, help='calibration data: a `dha-train data prep` output root')
    align.add_argument('--split', default=defaults.split)
    align.add_argument('--tokens', type=int, default=defaults.tokens, help='calibration tokens')
    align.add_argument('--batch-size', dest='batch_size', type=int, default=defaults.batch_size)
    align.add_argument('--restarts', type=int, default=defaults.restarts, help='annealing restarts')
    align.add_argument('--steps', type=int, default=defaults.steps, help='annealing proposals per restart')
    align.add_argument('--seed', type=int, default=defaults.seed)
    align.add_argument('--device', default=defaults.device, help='cpu, cuda, cuda:1, ...')
    align.add_argument('--overwrite', action='store_true')
    align.set_defaults(func=_align)


def add_search_arguments(search: argparse.ArgumentParser) -> None:
    from dha_train.search import ALLOCATIONS, FITNESS, MEASURES, METHODS, SearchSettings

    defaults = SearchSettings()
    search.add_argument('model_dir', help='local HF LLaMA folder (MHA)')
    search.add_argument('out_dir', help='folder for head_map.json, search.json, similarity.pt and the plots')
    search.add_argument('--method', choices=METHODS, default=defaults.method)
    budget = search.add_mutually_exclusive_group(required=True)
    budget.add_argument('--kv-heads', dest='kv_heads', type=int, help='K and V heads per layer')
    budget.add_argument('--kv-budget', dest='kv_budget', type=float,
                        help='fraction of the MHA K+V heads (0.25 keeps a quarter of the KV cache)')
    search.add_argument('--allocation', choices=ALLOCATIONS, default=defaults.allocation,
                        help='similarity method: uniform counts, or per-layer K/V counts by dynamic programming')
    search.add_argument('--measure', choices=MEASURES, default=defaults.measure,
                        help='similarity method: centred CKA over all tokens, or AsymGQA Eq. 1 on the subsample')
    search.add_argument('--shared-kv', dest='shared_kv', action='store_true',
                        help='similarity method: one grouping for K and V (exports as plain HF GQA)')
    search.add_argument('--data', default=None, help='calibration data: a `dha-train data prep` output root')
    search.add_argument('--split', default=defaults.split)
    search.add_argument('--tokens', type=int, default=defaults.tokens, help='calibration tokens')
    search.add_argument('--batch-size', dest='batch_size', type=int, default=defaults.batch_size)
    search.add_argument('--sample-tokens', dest='sample_tokens', type=int, default=defaults.sample_tokens,
                        help='uniform token subsample for Eq. 1, which is quadratic in tokens')
    search.add_argument('--restarts', type=int, default=defaults.restarts, help='annealing restarts')
    search.add_argument('--steps', type=int, default=defaults.steps, help='annealing proposals per restart')
    search.add_argument('--iterations', type=int, default=defaults.iterations, help='asym: fitness calls per layer')
    search.add_argument('--symmetric', action='store_true', help='asym: equal-size groups (Alg. 1)')
    search.add_argument('--p-preserve', dest='p_preserve', type=float, default=defaults.p_preserve)
    search.add_argument('--p-acc', dest='p_acc', type=float, default=defaults.p_acc)
    search.add_argument('--p-reset', dest='p_reset', type=float, default=defaults.p_reset)
    search.add_argument('--top-k', dest='top_k', type=int, default=defaults.top_k)
    search.add_argument('--fitness-batches', dest='fitness_batches', type=int, default=defaults.fitness_batches,
                        help='asym: held-out batches the fitness is measured on')
    search.add_argument('--fitness', choices=FITNESS, default=defaults.fitness,
                        help='asym: minus the LM loss of the grouped model, or minus its KL from the MHA model')
    search.add_argument('--seed', type=int, default=defaults.seed)
    search.add_argument('--device', default=defaults.device, help='cpu, cuda, cuda:1, ...')
    search.add_argument('--dtype', default=defaults.dtype, choices=['float32', 'bfloat16', 'float16'])
    search.add_argument('--save-calibration', dest='save_calibration', action='store_true',
                        help='also write calibration.pt (per-layer Grams: (H*d)^2 float64 values per layer and kind)')
    search.add_argument('--overwrite', action='store_true')
    search.set_defaults(func=_search)


def _eval(args) -> int:
    from dha_train.evaluation import run_eval

    tasks = [t for t in args.tasks.split(',') if t] if args.tasks else None
    run_eval(args.model, suite=args.suite, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
             include=args.include, out=args.out, batch_size=args.batch_size, device=args.device, name=args.name,
             wandb_project=args.wandb_project, wandb_mode=args.wandb_mode, wandb_dir=args.wandb_dir, data=args.data,
             train_tokens=args.train_tokens)
    return 0


def _local_task(args) -> int:
    from dha_train.evaluation import build_local_task

    out = build_local_task(args.corpus, args.out, examples=args.examples, seed=args.seed)
    print(f'dha-train local-task: wrote {out} (use it with: dha-train eval <model> --suite local --include {out})')
    return 0


def _compare(args) -> int:
    from dha_train.evaluation import compare

    compare(args.runs, out=args.out)
    return 0


def _bench_throughput(args) -> int:
    from dha_train.bench.throughput import run_throughput_bench

    run_throughput_bench(models=args.models, processes=args.processes, steps=args.steps, out=args.out)
    return 0


def _bench_conversion(args) -> int:
    from dha_train.bench.conversion import run_conversion_bench

    run_conversion_bench(run=args.run, out=args.out, gqa_multiple=args.gqa_multiple, eval_every=args.eval_every,
                         timing_batches=args.timing_batches, repeats=args.repeats, teacher=args.teacher,
                         progressive_sizes=args.progressive, sections=args.sections)
    return 0


def _bench_moh(args) -> int:
    from dha_train.bench.moh import run_moh_bench

    run_moh_bench(sections=args.sections, seq_lens=args.seq_lens, heads=args.heads, head_dim=args.head_dim,
                  layers=args.layers, calls=args.calls, decode_tokens=args.decode_tokens, repeats=args.repeats,
                  run=args.run, steps=args.steps, out=args.out, teacher=args.teacher)
    return 0


def _bench_search(args) -> int:
    from dha_train.bench.search import run_search_bench

    run_search_bench(layers=args.layers, heads=args.heads, head_dim=args.head_dim, tokens=args.tokens,
                     sample_tokens=args.sample_tokens, groups=args.groups, restarts=args.restarts, steps=args.steps,
                     reference_matrices=args.reference_matrices, seed=args.seed, out=args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog='dha-train', description=__doc__)
    commands = parser.add_subparsers(dest='command', required=True)

    quick = commands.add_parser('quickstart', help='build a corpus from the Python stdlib, train a tokenizer, '
                                'pretrain a tiny MHA LLaMA, evaluate per domain and export it')
    quick.add_argument('--out', default='quickstart_run', help='run folder (default: ./quickstart_run)')
    quick.add_argument('--seed', type=int, default=17)
    quick.add_argument('--fresh', action='store_true', help='redo every stage instead of reusing finished ones')
    quick.add_argument('--steps', type=int, default=None, help='pretraining batches (default: the recipe value)')
    quick.add_argument('--conversion-steps', dest='conversion_steps', type=int, default=None,
                       help='cap on the batches of each conversion stage (default: the recipe values)')
    _teacher_argument(quick)
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

    from dha_train.evaluation import SUITES

    evaluate = commands.add_parser('eval', help='lm-evaluation-harness on an HF folder or a checkpoint (any model '
                                   'the project exports)')
    evaluate.add_argument('model', help='HF folder, Composer checkpoint, or save_folder (its latest checkpoint)')
    evaluate.add_argument('--suite', default=None, choices=sorted(SUITES),
                          help='a preset task list with each paper\'s shot counts')
    evaluate.add_argument('--tasks', default=None, help='comma-separated lm-eval task names (instead of --suite)')
    evaluate.add_argument('--num-fewshot', dest='num_fewshot', type=int, default=None,
                          help='one shot count for every task (default: the suite\'s, or 0)')
    evaluate.add_argument('--limit', type=float, default=None, help='examples per task (a fraction if < 1)')
    evaluate.add_argument('--include', nargs='+', default=[], metavar='DIR',
                          help='folders of extra lm-eval task YAMLs (the local task; standard tasks pointed at '
                               'local data copies)')
    evaluate.add_argument('--data', default=None, help='also the validation loss per domain on this `dha-train data '
                          'prep` folder (its val split)')
    evaluate.add_argument('--train-tokens', dest='train_tokens', type=int, default=None,
                          help='training tokens to record for `compare` (default: from the stage folder if known)')
    evaluate.add_argument('--out', default=None, help='results folder (default: <model>/eval)')
    evaluate.add_argument('--name', default=None, help='run name in tables and W&B (default: the folder name)')
    evaluate.add_argument('--batch-size', dest='batch_size', type=int, default=8)
    evaluate.add_argument('--device', default='cpu', help='cpu, cuda, cuda:1, ...')
    evaluate.add_argument('--wandb-project', dest='wandb_project', default=None, help='log the scores to W&B')
    evaluate.add_argument('--wandb-mode', dest='wandb_mode', default='offline', choices=['online', 'offline'])
    evaluate.add_argument('--wandb-dir', dest='wandb_dir', default=None)
    evaluate.set_defaults(func=_eval)

    local = commands.add_parser('local-task', help='build the offline multiple-choice lm-eval task from a corpus '
                                'folder (the quickstart\'s corpus/)')
    local.add_argument('corpus', help='folder with wikipedia/*.jsonl (e.g. quickstart_run/corpus)')
    local.add_argument('out', help='folder for the task YAML and its JSONL files')
    local.add_argument('--examples', type=int, default=200)
    local.add_argument('--seed', type=int, default=0)
    local.set_defaults(func=_local_task)

    comparison = commands.add_parser('compare', help='evaluated runs side by side: a table and one plot')
    comparison.add_argument('runs', nargs='+', help='folders evaluated by `dha-train eval` (or their '
                            'eval_results.json)')
    comparison.add_argument('--out', default=None, help='folder for compare.json and compare.png (default: compare)')
    comparison.set_defaults(func=_compare)

    search = commands.add_parser('search', help='a head map (neighbour, similarity or AsymGQA search) and analysis '
                                 'plots from an MHA folder plus calibration data')
    add_search_arguments(search)

    align = commands.add_parser('align', help='aligned GQA transform: Procrustes similarity, grouping by key or value, '
                                'alignment folded into the weights, heads permuted into contiguous groups')
    add_align_arguments(align)

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
    conversion = bench.add_parser('conversion', help='DHA vs mean-pool GQA at a 25%% KV budget on the quickstart '
                                  'teacher: losses, GQA tokens to match DHA fusion, equal budgets, step-time ratios')
    conversion.add_argument('--run', default='quickstart_run', help='quickstart run folder (finished stages reused)')
    conversion.add_argument('--out', default=None, help='results folder (default: <run>/bench_conversion)')
    conversion.add_argument('--gqa-multiple', dest='gqa_multiple', type=float, default=5.0,
                            help='GQA CT length for the tokens-to-match measure, in multiples of the fusion tokens')
    conversion.add_argument('--eval-every', dest='eval_every', type=int, default=10)
    conversion.add_argument('--timing-batches', dest='timing_batches', type=int, default=20)
    conversion.add_argument('--repeats', type=int, default=3, help='interleaved timing rounds (median reported)')
    conversion.add_argument('--progressive', nargs='+', type=int, default=[2], metavar='SIZE',
                            help='sub-group sizes of the progressive fusion compared with one-stage fusion (default 2)')
    from dha_train.bench.conversion import SECTIONS

    conversion.add_argument('--sections', nargs='+', default=list(SECTIONS), choices=SECTIONS,
                            help='dha: DHA vs GQA (tokens to match, equal budgets, step times, progressive fusion); '
                                 'aligned: aligned GQA cos/dist x key/value; asym: AsymGQA (default: all)')
    _teacher_argument(conversion)
    conversion.set_defaults(func=_bench_conversion)
    from dha_train.bench.moh import SECTIONS as MOH_SECTIONS

    moh = bench.add_parser('moh', help='MoH: decode attention time and decode tokens/s at 90/75/50%% active heads '
                           'against MHA; continue-tuning the quickstart teacher to 75%% active')
    moh.add_argument('--sections', nargs='+', default=list(MOH_SECTIONS), choices=MOH_SECTIONS,
                     help='attention: one decode step\'s attention; decode: greedy decode tokens/s; continue: '
                          'yamls/moh/tiny/continue.yaml on the quickstart teacher (default: all)')
    moh.add_argument('--seq-lens', dest='seq_lens', nargs='+', type=int, default=[256, 512, 2048])
    moh.add_argument('--heads', type=int, default=32)
    moh.add_argument('--head-dim', dest='head_dim', type=int, default=64)
    moh.add_argument('--layers', type=int, default=2, help='layers of the decode model')
    moh.add_argument('--calls', type=int, default=200, help='attention calls per timing round')
    moh.add_argument('--decode-tokens', dest='decode_tokens', type=int, default=16, help='tokens per decode round')
    moh.add_argument('--repeats', type=int, default=7, help='interleaved timing rounds (median reported)')
    moh.add_argument('--run', default='quickstart_run', help='quickstart run folder (finished stages reused)')
    moh.add_argument('--steps', type=int, default=None, help='continue-tuning batches (default: the recipe\'s 120)')
    moh.add_argument('--out', default=None, help='results folder (default: <run>/bench_moh with continue, else '
                     'bench_moh)')
    _teacher_argument(moh)
    moh.set_defaults(func=_bench_moh)
    search_bench = bench.add_parser('search', help='activation similarity + grouping at LLaMA-2-7B geometry '
                                    '(synthetic activations), with the anchors\' full-rescore annealing as reference')
    search_bench.add_argument('--layers', type=int, default=32)
    search_bench.add_argument('--heads', type=int, default=32)
    search_bench.add_argument('--head-dim', dest='head_dim', type=int, default=128)
    search_bench.add_argument('--tokens', type=int, default=16384, help='calibration tokens per layer')
    search_bench.add_argument('--sample-tokens', dest='sample_tokens', type=int, default=256,
                              help='token subsample for Eq. 1')
    search_bench.add_argument('--groups', type=int, default=8, help='K (and V) heads per layer after grouping')
    search_bench.add_argument('--restarts', type=int, default=8)
    search_bench.add_argument('--steps', type=int, default=None, help='proposals per restart (default 100 x heads)')
    search_bench.add_argument('--reference-matrices', dest='reference_matrices', type=int, default=None,
                              help='matrices the reference anneals (default all: an equal number of proposals)')
    search_bench.add_argument('--seed', type=int, default=0)
    search_bench.add_argument('--out', default=None, help='folder for results.json')
    search_bench.set_defaults(func=_bench_search)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from dha_train.config import ConfigError
    from dha_train.data.prep import DataPrepError
    from dha_train.export import CheckpointError
    from dha_train.calibration import CalibrationError
    from dha_train.models.head_map import HeadMapError
    from dha_train.evaluation import EvalError

    try:
        return args.func(args)
    except (ConfigError, CheckpointError, DataPrepError, HeadMapError, CalibrationError, EvalError, FileExistsError,
            FileNotFoundError) as exc:
        print(f'dha-train: error: {exc}', file=sys.stderr)
        return 2


if __name__ == '__main__':
    sys.exit(main())
