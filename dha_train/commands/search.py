"""`dha-train search`: a head map and its analysis plots (``dha_train.conversion.search`` does the work)."""

from __future__ import annotations

import argparse
from dataclasses import fields

from dha_train.conversion.search import ALLOCATIONS, FITNESS, MEASURES, METHODS, SearchSettings, run_search
from dha_train.models.head_map import HeadMap


def add_arguments(search: argparse.ArgumentParser) -> None:
    defaults = SearchSettings()
    search.add_argument('model_dir', help='local HF LLaMA folder (MHA or GQA)')
    search.add_argument('out_dir', help='folder for head_map.json, search.json, similarity.pt and the plots')
    search.add_argument('--method', choices=METHODS, default=defaults.method)
    budget = search.add_mutually_exclusive_group(required=True)
    budget.add_argument('--kv-heads', dest='kv_heads', type=int, help='K and V heads per layer')
    budget.add_argument('--kv-budget', dest='kv_budget', type=float,
                        help='fraction of the source\'s K+V heads (0.25 keeps a quarter of its KV cache)')
    search.add_argument('--allocation', choices=ALLOCATIONS, default=defaults.allocation,
                        help='similarity method: uniform counts, or per-layer K/V counts by dynamic programming')
    search.add_argument('--measure', choices=MEASURES, default=defaults.measure,
                        help='similarity method: centred CKA over all tokens, or AsymGQA Eq. 1 on the subsample')
    search.add_argument('--shared-kv', dest='shared_kv', action='store_true',
                        help='similarity method: one grouping for K and V (exports as plain HF GQA); with '
                             '--allocation dp, one count per layer for K and V together')
    search.add_argument('--servable', action='store_true',
                        help='a map serving engines take (llama.cpp per-layer head_count_kv, vLLM): in every layer '
                             'K and V grouped together in groups of equal size; implies --shared-kv; with '
                             '--allocation dp, per-layer counts from the divisors of the source\'s K/V heads')
    search.add_argument('--data', default=None, help='calibration data: a `dha-train data prep` output root')
    search.add_argument('--split', default=defaults.split)
    search.add_argument('--tokens', type=int, default=defaults.tokens, help='calibration tokens')
    search.add_argument('--batch-size', dest='batch_size', type=int, default=defaults.batch_size)
    search.add_argument('--sample-tokens', dest='sample_tokens', type=int, default=defaults.sample_tokens,
                        help='uniform token subsample for Eq. 1, which is quadratic in tokens')
    search.add_argument('--restarts', type=int, default=defaults.restarts, help='annealing restarts')
    search.add_argument('--steps', type=int, default=defaults.steps, help='annealing proposals per restart')
    search.add_argument('--iterations', type=int, default=defaults.iterations, help='asym: fitness calls per layer')
    search.add_argument('--symmetric', action='store_true', help='asym: equal-size groups (Alg. 1)')
    search.add_argument('--p-preserve', dest='p_preserve', type=float, default=defaults.p_preserve)
    search.add_argument('--p-acc', dest='p_acc', type=float, default=defaults.p_acc)
    search.add_argument('--p-reset', dest='p_reset', type=float, default=defaults.p_reset)
    search.add_argument('--top-k', dest='top_k', type=int, default=defaults.top_k)
    search.add_argument('--fitness-batches', dest='fitness_batches', type=int, default=defaults.fitness_batches,
                        help='asym: held-out batches the fitness is measured on')
    search.add_argument('--fitness', choices=FITNESS, default=defaults.fitness,
                        help='asym: minus the LM loss of the grouped model, or minus its KL from the MHA model')
    search.add_argument('--seed', type=int, default=defaults.seed)
    search.add_argument('--device', default=defaults.device, help='cpu, cuda, cuda:1, ...')
    search.add_argument('--dtype', default=defaults.dtype, choices=['float32', 'bfloat16', 'float16'])
    search.add_argument('--save-calibration', dest='save_calibration', action='store_true',
                        help='also write calibration.pt (per-layer Grams: (H*d)^2 float64 values per layer and kind)')
    search.add_argument('--overwrite', action='store_true')
    search.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = SearchSettings(**{f.name: getattr(args, f.name) for f in fields(SearchSettings)})
    result = run_search(args.model_dir, args.out_dir, settings, overwrite=args.overwrite)
    counts = result.head_map.kv_heads()
    print(f'dha-train search: wrote {args.out_dir} ({settings.method}: '
          f'{result.report["kv_heads_total"]} K+V heads, '
          f'{result.head_map.budget_text(HeadMap.from_dict(result.report["source_head_map"]))}; '
          f'K per layer {[k for k, _ in counts]}, V per layer {[v for _, v in counts]})')
    return 0
