"""`dha-train export CHECKPOINT OUT_DIR`: a Composer checkpoint as a Hugging Face folder (``dha_train.export``)."""

from __future__ import annotations

import argparse

from dha_train.export import export_hf


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('checkpoint', help='checkpoint file, sharded checkpoint folder, or save_folder (latest)')
    parser.add_argument('out_dir')
    parser.add_argument('--tokenizer', default=None, help='tokenizer folder to ship instead of the checkpoint one')
    parser.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    parser.add_argument('--overwrite', action='store_true')
    parser.add_argument('--start', default=None, help="the model folder the run started from, whose card (stages, "
                        "base model, licence) the export's card continues; default: the one the run recorded, when "
                        'it lies beside the save folder')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = export_hf(args.checkpoint, args.out_dir, tokenizer=args.tokenizer, dtype=args.dtype,
                    overwrite=args.overwrite, start=args.start)
    print(f'dha-train export: wrote {out}')
    return 0
