"""`dha-train align`: the aligned-GQA transform (``dha_train.conversion.align`` does the work)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from dha_train.conversion.align import CRITERIA, GROUP_BY, AlignSettings, run_align


def add_arguments(align: argparse.ArgumentParser) -> None:
    defaults = AlignSettings(num_groups=1)
    align.add_argument('model_dir', help='local HF LLaMA folder (MHA or GQA)')
    align.add_argument('out_dir', help='folder for the aligned model, target_head_map.json and alignment.json')
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
    align.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = AlignSettings(**{f.name: getattr(args, f.name) for f in fields(AlignSettings)})
    report = run_align(args.model_dir, args.out_dir, settings, overwrite=args.overwrite)
    cosine = report['mean_cosine']
    print(f'dha-train align: wrote {args.out_dir} (GQA-{settings.num_groups} groups by {settings.group_by} '
          f'{settings.criterion}; within-group cache cosine K {cosine["key_before"]:.3f} -> {cosine["key_after"]:.3f}, '
          f'V {cosine["value_before"]:.3f} -> {cosine["value_after"]:.3f}; '
          f'{report["timings"]["total_s"]:.1f} s)')
    return 0
