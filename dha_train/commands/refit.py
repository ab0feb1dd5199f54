"""`dha-train refit SOURCE CONVERTED OUT --data D`: fit a converted model's compressed attention back to its source
from calibration statistics, in closed form (``dha_train.conversion.refit``)."""

from __future__ import annotations

import argparse

from dha_train.conversion.refit import RefitSettings, refit_folder
from dha_train.model_folders import missing_tokenizer_note


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = RefitSettings(data='')
    parser.add_argument('source', help='the plain LLaMA (MHA or GQA) HF folder the model was converted from')
    parser.add_argument('converted', help='the converted HF folder: mean-pool / aligned GQA (plain LLaMA), AsymGQA or '
                        'DHA (the DHA class), or MLA; MoH is refused (it keeps every K/V head)')
    parser.add_argument('out_dir', help='where the refitted model goes (same class and KV cache as CONVERTED)')
    parser.add_argument('--data', required=True, help='`dha-train data prep` folder for calibration (train split)')
    parser.add_argument('--tokens', type=int, default=defaults.tokens,
                        help=f'calibration tokens (default {defaults.tokens}); memory does not grow with them')
    parser.add_argument('--batch-size', type=int, default=defaults.batch_size)
    parser.add_argument('--seed', type=int, default=defaults.seed)
    parser.add_argument('--device', default=defaults.device, choices=['cpu', 'cuda'])
    parser.add_argument('--overwrite', action='store_true')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = RefitSettings(data=args.data, tokens=args.tokens, batch_size=args.batch_size, seed=args.seed,
                             device=args.device)
    report = refit_folder(args.source, args.converted, args.out_dir, settings, overwrite=args.overwrite)
    summary = ', '.join(f'{kind} error {report[f"mean_{kind}_error_before"]:.3f} -> '
                        f'{report[f"mean_{kind}_error_after"]:.3f}'
                        for kind in ('key', 'value') if f'mean_{kind}_error_before' in report)
    print(f'dha-train refit: wrote {args.out_dir} ({report["kind"]}; mean relative {summary}; calibration '
          f'{report["calibration_seconds"]} s, fit {report["fit_seconds"]} s)')
    if note := missing_tokenizer_note(args.out_dir, args.converted):
        print(note)
    return 0
