"""`dha-train plan RECIPE [key=value ...]`: a recipe's per-rank peak memory, fit, FLOPs and wall time, measured on
this CPU with fake tensors under a fake process group of the run's world size (``dha_train.plan``)."""

from __future__ import annotations

import argparse
import json

from dha_train.config import ConfigError
from dha_train.plan import DEFAULT_MFU, GPUS, RESERVE_GIB, plan_recipe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('recipe')
    parser.add_argument('overrides', nargs='*', help='key=value overrides (dotted keys), as for `dha-train train`; '
                        'model.pretrained_path may name a folder holding only config.json')
    parser.add_argument('--world-size', dest='world_size', type=int, default=8,
                        help='ranks (GPUs) of the run (default 8)')
    parser.add_argument('--gpu', default='a100-80g', help=f'{", ".join(GPUS)} or a memory size in GiB '
                        '(default a100-80g)')
    parser.add_argument('--mfu', type=float, default=DEFAULT_MFU,
                        help=f'model FLOPs utilisation assumed for the time (default {DEFAULT_MFU})')
    parser.add_argument('--seq-len', dest='seq_len', type=int, default=None,
                        help="training sequence length (default: the seq_len in the recipe's data folder's "
                        'manifest.json when it is there, else the model\'s max_position_embeddings)')
    parser.add_argument('--exact', action='store_true', help='track every layer instead of extrapolating a deep '
                        'model from its first 3 and 4 layers (about 0.8 s a 7B layer per micro-batch tried)')
    parser.add_argument('--json', action='store_true', help='print the plan as JSON')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_recipe(args.recipe, args.overrides, world_size=args.world_size, gpu=args.gpu, mfu=args.mfu,
                       exact=args.exact, seq_len=args.seq_len)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(format_plan(plan))
    if not plan['fits']:
        raise ConfigError(
            f"plan: {args.recipe} does not fit on {plan['gpu']}: {plan['needed_gib']:.1f} GiB per rank needed "
            f"(peak {plan['peak_gib']:.1f} + 5% fragmentation) against {plan['usable_gib']:.1f} usable; "
            + (f"use device_train_microbatch_size={plan['largest_microbatch']}" if plan['largest_microbatch']
               else 'no micro-batch fits: use more ranks, activation checkpointing or a larger GPU'))
    return 0


def format_plan(plan: dict) -> str:
    gib = plan['by_category_gib']
    lines = [
        f"{plan['recipe']}: {plan['world_size']} x {plan['gpu']}, micro-batch {plan['microbatch']} x "
        f"{plan['seq_len']}, {plan['precision']}, activation checkpointing "
        f"{'on' if plan['activation_checkpointing'] else 'off'}, {plan['layers']} layers "
        + (f"(extrapolated from the first {' and '.join(map(str, plan['extrapolated_from']))})"
           if plan['extrapolated_from'] else '(every layer tracked)'),
        f"  peak per rank {plan['peak_gib']:.2f} GiB: parameters {gib['parameters']:.2f}, gradients "
        f"{gib['gradients']:.2f}, optimizer {gib['optimizer']:.2f}, activations {gib['activations']:.2f}, FSDP "
        f"buffers {gib['fsdp_buffers']:.2f}, teacher {gib['teacher']:.2f}, other {gib['other']:.2f}",
        f"  verdict: {'fits' if plan['fits'] else 'DOES NOT FIT'}: {plan['needed_gib']:.2f} GiB with 5% "
        f"fragmentation against {plan['usable_gib']:.2f} usable ({plan['gpu_memory_gib']:g} less {RESERVE_GIB:g} "
        f"for the CUDA context and NCCL), margin {plan['margin_gib']:+.2f} GiB",
        f"  largest micro-batch that fits: {plan['largest_microbatch'] or 'none'}",
        f"  {plan['flops_per_token'] / 1e9:.1f} GFLOP per token; at MFU {plan['mfu']:g}: "
        f"{plan['tokens_per_s']:,.0f} tokens/s, {plan['run_tokens']:,} tokens in {plan['wall_hours']:.1f} h",
        f"  one checkpoint on disk: {plan['checkpoint_gib']:.1f} GiB (fp32 weights and Adam state, every rank's "
        'shards)',
    ]
    return '\n'.join(lines)
