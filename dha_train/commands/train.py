"""`dha-train train RECIPE [key=value ...]`: one training run from a YAML recipe, in this process."""

from __future__ import annotations

import argparse

from dha_train.train import main as train_main


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('recipe')
    parser.add_argument('overrides', nargs='*', help='key=value overrides (dotted keys)')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return train_main([args.recipe, *args.overrides])
