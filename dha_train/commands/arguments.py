"""Arguments that several sub-commands share (a helper of the commands wing, not a command)."""

from __future__ import annotations

import argparse


def add_teacher_argument(parser: argparse.ArgumentParser) -> None:
    """``--teacher KEY=VALUE ...``: overrides of the teacher's pretraining recipe (also taken by the benches)."""
    parser.add_argument('--teacher', nargs='+', default=[], metavar='KEY=VALUE',
                        help='overrides of the teacher\'s pretraining recipe, e.g. model.config.hidden_size=1024 '
                             'model.config.num_hidden_layers=8 for a larger model on a GPU (default: the tiny one)')
