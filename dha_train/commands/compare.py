"""`dha-train compare`: evaluated runs side by side: final losses, task scores, KV-cache bytes and training tokens of
several `dha-train eval` results in one table and one plot (``dha_train.evaluation.compare``)."""

from __future__ import annotations

import argparse

from dha_train.evaluation import compare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('runs', nargs='+', help='folders evaluated by `dha-train eval` (or their eval_results.json)')
    parser.add_argument('--out', default=None, help='folder for compare.json and compare.png (default: compare)')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    compare(args.runs, out=args.out)
    return 0
