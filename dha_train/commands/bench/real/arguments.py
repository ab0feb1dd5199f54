"""The ``real`` and ``real-tables`` subcommands of ``dha-train bench``: their arguments and front-ends."""
from __future__ import annotations

import argparse

from dha_train.bench_runner import command_line
from dha_train.commands.bench.real import BUDGETS, METHODS, TASKS, RealSettings, run_real_bench
from dha_train.commands.bench.real.tables import print_tables


def add_real(bench) -> None:
    """``dha-train bench real``."""
    real = bench.add_parser('real', help='every method on SmolLM2-135M (GQA, imported from the bundled GGUF) at 1/3 '
                            'and 2/3 of its K+V cache: held-out loss, 6-task accuracy, KV bytes, tokens, wall time')
    real.add_argument('--out', default='bench_real', help='folder for the imported model, data, stages (reused '
                      'when run again), results.json and the plots (default: bench_real)')
    real.add_argument('--device', default='auto', choices=['auto', 'cpu', 'cuda'],
                      help='auto: cuda when there is one; the defaults below depend on it')
    real.add_argument('--tokens', type=int, default=None,
                      help='training tokens of every method (default: 32,768 on CPU, 6,553,600 on cuda)')
    real.add_argument('--limit', type=int, default=None,
                      help='a seeded random sample of N documents of each task, the same for every ranking row '
                      '(default: 400 on CPU, 500 on cuda)')
    real.add_argument('--intermediate-limit', dest='intermediate_limit', type=int, default=None,
                      help='documents a task for the intermediate rows (refit, attention transfer, DHA after Fusion): '
                      'the first of the same sample (default: 100 on CPU, the limit on cuda)')
    real.add_argument('--results', default=None,
                      help='also write the results file here (docs/results/bench_real*.json: written by the run, '
                      'one file per invocation, never edited by hand)')
    real.add_argument('--seq-len', dest='seq_len', type=int, default=None, help='default 256 on CPU, 512 on cuda')
    real.add_argument('--batch', type=int, default=None, help='global batch in sequences (default 8 CPU, 32 cuda)')
    real.add_argument('--microbatch', type=int, default=None, help='device microbatch (default: the batch)')
    real.add_argument('--val-tokens', dest='val_tokens', type=int, default=None,
                      help='held-out validation tokens (default 65,536 on CPU, 262,144 on cuda)')
    real.add_argument('--calib-tokens', dest='calib_tokens', type=int, default=None,
                      help='calibration tokens of align and the AsymGQA search (default 2,048 CPU, 16,384 cuda)')
    real.add_argument('--search-batches', dest='search_batches', type=int, default=None,
                      help='DHA Search batches (default 2 CPU, 40 cuda; not counted as training tokens)')
    real.add_argument('--asym-iterations', dest='asym_iterations', type=int, default=None,
                      help='AsymGQA fitness-search iterations per layer, each a forward pass (default 3 CPU, 50 cuda)')
    real.add_argument('--eval-batch-size', dest='eval_batch_size', type=int, default=None)
    real.add_argument('--methods', nargs='+', default=list(METHODS), choices=METHODS)
    real.add_argument('--budgets', nargs='+', default=['kv1', 'kv2'], choices=BUDGETS,
                      help='kv1 / kv2: one / two K and V heads per layer (a third / two thirds of SmolLM2\'s cache); '
                           'half / third / eighth: that fraction of any source\'s cache (where it is no whole number '
                           'of K/V heads, as an eighth or a one-K/V-head source such as gemma3-270m: latent (MLA) rows '
                           'only) (default: kv1 kv2)')
    real.add_argument('--tasks', nargs='+', default=list(TASKS), help='lm-eval tasks (default: %(default)s)')
    real.add_argument('--include', nargs='*', default=[], help='extra lm-eval task folders')
    real.add_argument('--source', default='smollm2-135m',
                      help='a GGUF (path or bundled name: smollm2-135m, gemma3-270m) to import, or an HF folder of a '
                           'supported family (default: smollm2-135m)')
    real.add_argument('--train-data', dest='train_data', default=None,
                      help='an existing `dha-train data prep` folder (github + wikipedia train splits, the source\'s '
                           'tokenizer) instead of the stdlib corpus')
    real.add_argument('--seed', type=int, default=17)
    real.add_argument('--no-heal', dest='heal', action='store_false',
                      help='leave out the healing rows (refit, attention transfer, KL after each 0-token conversion)')
    real.add_argument('--no-ct', dest='ct', action='store_false',
                      help='leave out each method\'s own-training rows (CT, aligned GQA\'s pruning, MoH\'s '
                           'continue-tuning; DHA\'s Fusion + CT stay, they are its method)')
    real.add_argument('--refit-tokens', dest='refit_tokens', type=int, default=None,
                      help='calibration tokens of the healing refit (default 16384 CPU, 65536 cuda)')
    real.add_argument('--transfer-lr', dest='transfer_lr', type=float, default=3.0e-4,
                      help='attention transfer\'s peak lr (default 3e-4)')
    real.add_argument('--kl-lr', dest='kl_lr', type=float, default=1.0e-4, help='the KL stage\'s peak lr (default 1e-4)')
    real.add_argument('--transfer-fraction', dest='transfer_fraction', type=float, default=0.5,
                      help='share of the training tokens spent on attention transfer; KL gets the rest (default 0.5)')
    real.add_argument('--heal-points', dest='heal_points', type=int, nargs='+', default=[],
                      help='the recovery curve: healing tokens (attention transfer + KL) at which each healing chain '
                           'is scored, KL from each point to the next its own resumable stage (e.g. 32768 131072 '
                           '524288 1048576); default: one KL stage to the method\'s --tokens')
    real.set_defaults(func=run_real)


def add_real_tables(bench) -> None:
    """``dha-train bench real-tables``."""
    tables = bench.add_parser('real-tables', help="the README's headline table, the healing page's table and the ranking "
                              "(each competing row against the one just ahead) from bench real's results files, with "
                              "95%% intervals and marked paired differences")
    tables.add_argument('results', nargs='+', help='bench real results files (docs/results/bench_real.json)')
    tables.set_defaults(func=run_real_tables)


def run_real_tables(args: argparse.Namespace) -> int:
    print_tables(args.results)
    return 0


def run_real(args: argparse.Namespace) -> int:
    run_real_bench(RealSettings(
        out=args.out, device=args.device, tokens=args.tokens, limit=args.limit,
        intermediate_limit=args.intermediate_limit, seq_len=args.seq_len,
        batch=args.batch, microbatch=args.microbatch, val_tokens=args.val_tokens, calib_tokens=args.calib_tokens,
        search_batches=args.search_batches, refit_tokens=args.refit_tokens, heal=args.heal, ct=args.ct,
        transfer_fraction=args.transfer_fraction, transfer_lr=args.transfer_lr, kl_lr=args.kl_lr,
        asym_iterations=args.asym_iterations, eval_batch_size=args.eval_batch_size, methods=args.methods,
        budgets=args.budgets, tasks=args.tasks, include=args.include, source=args.source, train_data=args.train_data,
        seed=args.seed, heal_points=args.heal_points), command=command_line(), results_copy=args.results)
    return 0
