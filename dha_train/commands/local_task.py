"""`dha-train local-task CORPUS OUT`: the offline multiple-choice lm-eval task from a corpus folder
(``harness.build_local_task``)."""

from __future__ import annotations

import argparse

from dha_train.harness import build_local_task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('corpus', help='folder with wikipedia/*.jsonl (e.g. quickstart_run/corpus)')
    parser.add_argument('out', help='folder for the task YAML and its JSONL files')
    parser.add_argument('--examples', type=int, default=200)
    parser.add_argument('--seed', type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = build_local_task(args.corpus, args.out, examples=args.examples, seed=args.seed)
    print(f'dha-train local-task: wrote {out} (use it with: dha-train eval <model> --suite local --include {out})')
    return 0
