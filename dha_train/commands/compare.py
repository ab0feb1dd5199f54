"""`dha-train compare`: evaluated runs side by side: final losses, task scores, KV-cache bytes and training tokens of
several `dha-train eval` results in one table and one plot."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from dha_train.harness import RESULTS_FILE, EvalError, headline
from dha_train.plots import plot_comparison


def _load_result(path: Path) -> dict:
    for candidate in (path, path / RESULTS_FILE, path / 'eval' / RESULTS_FILE):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise EvalError(f'{path}: no {RESULTS_FILE} (run `dha-train eval` on it first, or give the JSON file)')


def compare(paths: Sequence[str | Path], out: str | Path | None = None) -> dict:
    """Side-by-side table and one plot of several `dha-train eval` results (run folders or their JSON)."""
    if len(paths) < 2:
        raise EvalError('compare needs at least two runs')
    results = [_load_result(Path(p)) for p in paths]
    tasks = sorted({task for r in results for task in r['scores']})
    rows = []
    for r in results:
        row = {'name': r['name'], 'model_type': r['model_type'], 'val_loss': r.get('val_loss'),
               'kv_cache_bytes_per_4096_tokens': r['kv_cache_bytes_per_4096_tokens'],
               'train_tokens': r.get('train_tokens'), 'scores': {}}
        for task in tasks:
            pick = headline(r['scores'].get(task, {}))
            row['scores'][task] = pick[1] if pick else None
        scored = [v for v in row['scores'].values() if v is not None]
        row['mean_score'] = sum(scored) / len(scored) if scored else None
        rows.append(row)

    def cell(value, fmt):
        return format(value, fmt) if value is not None and not (isinstance(value, float) and math.isnan(value)) \
            else '-'
    header = f'{"run":<24} {"val loss":>9} {"KV bytes/4k":>12} {"train tokens":>13}' + \
        ''.join(f' {t[:14]:>14}' for t in tasks) + f' {"mean":>7}'
    print(header)
    for row in rows:
        print(f'{row["name"][:24]:<24} {cell(row["val_loss"], ".4f"):>9} '
              f'{row["kv_cache_bytes_per_4096_tokens"]:>12,} {cell(row["train_tokens"], ","):>13}' +
              ''.join(f' {cell(row["scores"][t], ".4f"):>14}' for t in tasks) + f' {cell(row["mean_score"], ".4f"):>7}')
    out = Path(out) if out is not None else Path('compare')
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_comparison(rows, tasks, out / 'compare.png')
    summary = {'runs': rows, 'tasks': tasks, 'plot': str(plot)}
    (out / 'compare.json').write_text(json.dumps(summary, indent=2))
    print(f'table: {out / "compare.json"}  plot: {plot}')
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('runs', nargs='+', help='folders evaluated by `dha-train eval` (or their eval_results.json)')
    parser.add_argument('--out', default=None, help='folder for compare.json and compare.png (default: compare)')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    compare(args.runs, out=args.out)
    return 0
