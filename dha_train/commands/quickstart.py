"""`dha-train quickstart`: the embedded default job, end to end in one run folder (``dha_train.quickstart`` lists its
stages and runs them)."""

from __future__ import annotations

import argparse

from dha_train.commands.arguments import add_teacher_argument
from dha_train.quickstart import run_quickstart


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--out', default='quickstart_run', help='run folder (default: ./quickstart_run)')
    parser.add_argument('--seed', type=int, default=17)
    parser.add_argument('--fresh', action='store_true', help='redo every stage instead of reusing finished ones')
    parser.add_argument('--steps', type=int, default=None, help='pretraining batches (default: the recipe value)')
    parser.add_argument('--conversion-steps', dest='conversion_steps', type=int, default=None,
                        help='cap on the batches of each conversion stage (default: the recipe values)')
    add_teacher_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    run_quickstart(out=args.out, seed=args.seed, fresh=args.fresh, steps=args.steps,
                   conversion_steps=args.conversion_steps, teacher=args.teacher)
    return 0
