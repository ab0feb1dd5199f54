"""The Markdown tables the docs quote from `bench real`'s results files (`dha-train bench real-tables`): the healing
table (every row) and the README's headline table (each method's rows at the common training budget). Every figure
that ranks carries its 95% interval where the row kept its documents, and each paired difference is marked ``*`` when
its interval excludes 0. ``tests/test_figures.py`` compares the pages' tables with these, whole and both ways."""

from __future__ import annotations

import json
from pathlib import Path

from dha_train.bench_settings import METHODS
from dha_train.commands.bench.real.report import marked_difference, ranking_groups, with_interval
from dha_train.config import ConfigError

TASK_COLUMNS = (('piqa', 'piqa'), ('arc_easy', 'arc-e'), ('arc_challenge', 'arc-c'), ('hellaswag', 'hswag'),
                ('winogrande', 'wino'), ('sciq', 'sciq'))
HEADLINE_COLUMNS = (('kv1', 'a third of the cache'), ('kv2', 'two thirds of the cache'),
                    (None, 'the full cache'))
METHOD_NAMES = {'teacher': 'teacher (SmolLM2-135M)', 'mean_pool': 'mean-pool GQA', 'aligned_gqa': 'aligned GQA',
                'asym_gqa': 'AsymGQA', 'dha': 'DHA', 'dha_servable': 'servable DHA', 'mla': 'MLA class',
                'mla_deepseek': "MLA in DeepSeek's format", 'moh': 'MoH'}


def load_runs(path: str | Path) -> list[dict]:
    """The runs of a results file: one invocation's ``results.json`` (``bench real --results``), or the older form
    that kept several runs under ``runs``."""
    if not Path(path).is_file():
        raise ConfigError(f'{path}: no such results file')
    try:
        data = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f'{path}: not a JSON results file ({exc})') from None
    if not isinstance(data, dict):
        raise ConfigError(f'{path}: not a bench real results file (not a JSON object)')
    runs = data['runs'] if 'runs' in data else [data]
    for run in runs:
        if not isinstance(run.get('rows'), list) or not isinstance(run.get('settings'), dict):
            raise ConfigError(f'{path}: not a bench real results file (a run without rows or settings)')
    return runs


def result_rows(runs: list[dict]) -> list[dict]:
    """Every row of the runs, once: a label in two runs must have the same figures (the teacher, reused)."""
    rows: dict[str, dict] = {}
    for run in runs:
        for row in run['rows']:
            earlier = rows.get(row['label'])
            if earlier is not None and (earlier['val_loss'], earlier['accuracy']) != (row['val_loss'], row['accuracy']):
                raise ConfigError(f'two runs have different figures for the row "{row["label"]}"')
            rows.setdefault(row['label'], row)
    return list(rows.values())


def _difference(row: dict, versus: str, metric: str) -> str:
    return marked_difference((row.get(versus) or {}).get(metric))


def _documents(row: dict, runs: list[dict]) -> str:
    if row.get('documents_per_task'):
        return str(row['documents_per_task'])
    return f'first {runs[0]["settings"]["limit"]}'  # the runs before seeded samples scored each split's first N


def healing_table(runs: list[dict]) -> str:
    """Every row: tokens, documents a task, held-out loss ± its interval, the six accuracies, mean accuracy ± its
    interval, and the paired differences from the teacher and from mean-pool (same budget, tokens and kind)."""
    lines = ['| row | train tokens | docs a task | held-out loss | '
             + ' | '.join(name for _, name in TASK_COLUMNS)
             + ' | mean accuracy | loss - teacher | accuracy - teacher | loss - mean-pool | accuracy - mean-pool '
             '| KV MiB |',
             '| --- ' * (10 + len(TASK_COLUMNS)) + '|']
    for row in result_rows(runs):
        accuracies = [f'{row["accuracy"][task]:.3f}' if row['accuracy'].get(task) is not None else '-'
                      for task, _ in TASK_COLUMNS]
        cells = [row['label'], f'{row["tokens"]:,}', _documents(row, runs),
                 with_interval(row['val_loss'], row.get('val_loss_ci95')), *accuracies,
                 with_interval(row['mean_accuracy'], row.get('accuracy_ci95')),
                 _difference(row, 'vs_teacher', 'loss'), _difference(row, 'vs_teacher', 'accuracy'),
                 _difference(row, 'vs_mean_pool', 'loss'), _difference(row, 'vs_mean_pool', 'accuracy'),
                 f'{row["kv_bytes"] / 2 ** 20:.1f}']
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


STAGE_NAMES = {'+KL': 'healed (refit, transfer, KL)', '+CT': 'CT', '+prune': 'L0 pruning + distillation',
               'post-fusion': 'Fusion', 'teacher': ''}


def _headline_stage(row: dict) -> str:
    """What the row's model went through, by the end of its label: 'healed (refit, transfer, KL)', 'CT', ..."""
    end = row['label'].rsplit(' ', 1)[-1] if row['label'] != 'teacher' else 'teacher'
    name = STAGE_NAMES.get(end, end)
    if row['method'] in ('dha', 'dha_servable') and end == '+CT':
        return 'Fusion + CT'
    if row['method'] == 'moh':
        if end == '+KL':  # MoH pools no K/V head: its healing has no refit
            name = 'healed (transfer, KL)'
        return f'{name}, {row["label"].split()[1]} heads active'  # 'MoH 7/9 +CT': its own setting
    return name


def headline_rows(runs: list[dict]) -> list[dict]:
    """The rows that rank the methods at the common budget: the teacher, and each method's rows trained on the
    training tokens every method gets (healed, and its own training)."""
    tokens = max(run['settings'].get('training_tokens_per_method', 0) for run in runs)
    return [row for row in result_rows(runs) if row['method'] == 'teacher'
            or (row['tokens'] == tokens and row.get('evaluation', 'ranking') == 'ranking')]


def headline_table(runs: list[dict]) -> str:
    """| method | row | a third | two thirds | the full cache |: each cell ``loss ± h / accuracy ± h``, then the paired
    differences from mean-pool's row of the same kind at that budget (loss, accuracy; ``*``: the interval excludes 0).
    A method with no row at a budget has an empty cell."""
    cells: dict[tuple[str, str], dict[str | None, dict]] = {}
    for row in headline_rows(runs):
        cells.setdefault((row['method'], _headline_stage(row)), {})[row['budget']] = row
    order = ['teacher', *METHODS]
    lines = ['| method | row | ' + ' | '.join(name for _, name in HEADLINE_COLUMNS) + ' |',
             '| --- ' * (2 + len(HEADLINE_COLUMNS)) + '|']
    for (method, stage), by_budget in sorted(cells.items(), key=lambda item: (order.index(item[0][0]),
                                                                             not item[0][1].startswith('healed'))):
        figures = []
        for budget, _ in HEADLINE_COLUMNS:
            row = by_budget.get(budget)
            if row is None:
                figures.append('')
                continue
            text = (f'{with_interval(row["val_loss"], row.get("val_loss_ci95"))} / '
                    f'{with_interval(row["mean_accuracy"], row.get("accuracy_ci95"))}')
            if row.get('vs_mean_pool'):
                text += (f'; vs mean-pool {_difference(row, "vs_mean_pool", "loss")} / '
                         f'{_difference(row, "vs_mean_pool", "accuracy")}')
            figures.append(text)
        lines.append(f'| {METHOD_NAMES.get(method, method)} | {stage} | ' + ' | '.join(figures) + ' |')
    return '\n'.join(lines)


RANKING_KINDS = {'converted': '0 tokens', 'kl': 'healed', 'trained': 'own training'}
CACHE_NAMES = {'kv1': 'a third', 'kv2': 'two thirds', 'half': 'a half', 'third': 'a third', None: 'the whole'}


def ranking_table(runs: list[dict]) -> str:
    """The ranking rows that compete (``ranking_groups``: same cache, kind of row and tokens), each group in order of
    held-out loss, each row with its paired differences from the row just ahead of it (``*``: the interval excludes
    0, so the two places are told apart at 95%)."""
    lines = ['| cache | rows | place | row | held-out loss | mean accuracy | loss - the row above '
             '| accuracy - the row above |', '| --- ' * 8 + '|']
    def place(key: tuple) -> tuple[int, int]:  # by cache, then 0 tokens, healed, own training
        budget, kind, _ = key
        kinds = list(RANKING_KINDS)
        return list(CACHE_NAMES).index(budget), kinds.index(kind) if kind in kinds else len(kinds)

    groups = ranking_groups(result_rows(runs))
    for (budget, kind, _), group in sorted(groups.items(), key=lambda item: place(item[0])):
        for place, row in enumerate(group, 1):
            above = row.get('vs_next_better') or {}
            lines.append(f'| {CACHE_NAMES.get(budget, budget)} | {RANKING_KINDS.get(kind, kind)} | {place} | '
                         f'{row["label"]} | {with_interval(row["val_loss"], row.get("val_loss_ci95"))} | '
                         f'{with_interval(row["mean_accuracy"], row.get("accuracy_ci95"))} | '
                         f'{marked_difference(above.get("loss"))} | {marked_difference(above.get("accuracy"))} |')
    return '\n'.join(lines)


def print_tables(paths: list[str | Path]) -> None:
    runs = [run for path in paths for run in load_runs(path)]
    print('Headline (README):\n')
    print(headline_table(runs))
    print('\nEvery row (docs/benchmarks/healing.md):\n')
    print(healing_table(runs))
    print('\nThe ranking, with the difference from the row just ahead (docs/benchmarks/healing.md):\n')
    print(ranking_table(runs))
