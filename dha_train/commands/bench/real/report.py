"""`bench real`'s report: the table it prints, its plots, and the merging of an earlier results.json."""

from __future__ import annotations

import json
from pathlib import Path

from dha_train.bench_runner import say
from dha_train.bench_settings import BUDGETS, METHODS, RealSettings


def print_table(results: dict) -> None:
    tasks = results['settings']['tasks']
    short = {'piqa': 'piqa', 'arc_easy': 'arcE', 'arc_challenge': 'arcC', 'hellaswag': 'hswag', 'winogrande': 'wino',
             'sciq': 'sciq'}
    print()
    print(f'{results["source"]["name"]}: every method at two K+V budgets of the source cache; '
          f'accuracy on the first {results["settings"]["limit"]} docs per task (0-shot), val loss on held-out text')
    header = (f'  {"row":<28} {"KV MiB":>7} {"%src":>5} {"tokens":>9} {"val loss":>8} '
              + ' '.join(f'{short.get(t, t)[:6]:>6}' for t in tasks) + f' {"mean":>6} {"wall s":>7} {"eval s":>6}')
    print(header)
    for row in results['rows']:
        accuracy = ' '.join(f'{row["accuracy"][t]:>6.3f}' if row['accuracy'].get(t) is not None else f'{"-":>6}'
                            for t in tasks)
        mean = f'{row["mean_accuracy"]:>6.3f}' if row['mean_accuracy'] is not None else f'{"-":>6}'
        print(f'  {row["label"]:<28} {row["kv_bytes"] / 2 ** 20:>7.1f} {row["kv_fraction_of_source"]:>5.0%} '
              f'{row["tokens"]:>9,} {row["val_loss"]:>8.4f} {accuracy} {mean} {row["wall_s"]:>7.0f} '
              f'{row["eval_s"]:>6.0f}' + ('  (= ' + row['same_as'] + ')' if row.get('same_as') else ''))
    for skipped in results['skipped']:
        print(f'  skipped: {skipped["method"]} {skipped["budget"]}: {skipped["reason"]}')
    print('  KV MiB: K+V cache of one 4096-token sequence in bf16; wall s: the method\'s conversion + training '
          'seconds up to the row (reused stages count their recorded time); eval s: that row\'s evaluation')


def plot_rows(results: dict, work: Path) -> list[str]:
    from dha_train.plots import plot_curves

    curves: dict[str, list] = {}
    for row in results['rows']:
        if row['method'] == 'teacher':
            continue
        key = row['method'] + (f' {row["budget"]}' if row['budget'] else '')
        if row.get('stage'):  # healing: its own curve, from the same 0-token point as the CT curve
            curves.setdefault(f'{key} healed', []).append(row)
            continue
        curves.setdefault(key, []).append(row)
        if row['tokens'] == 0:
            curves.setdefault(f'{key} healed', []).append(row)
    curves = {key: rows for key, rows in curves.items() if not key.endswith(' healed') or len(rows) > 1}
    teacher = results['rows'][0]
    files = []
    for metric, name, label in (('mean_accuracy', 'accuracy.png', 'mean accuracy (6 tasks)'),
                                ('val_loss', 'loss.png', 'held-out validation loss')):
        points = {key: sorted((r['tokens'], r[metric]) for r in rows if r[metric] is not None)
                  for key, rows in curves.items()}
        if teacher[metric] is None:
            continue
        files.append(str(plot_curves(points, work / name, title=f'{results["source"]["name"]}: {label}',
                                     xlabel='training tokens', ylabel=label,
                                     references={'teacher': teacher[metric]})))
    return files


_SETTINGS_OF_A_SELECTION = ('methods', 'budgets', 'out', 'isolate_stages')


def _ran_here(row: dict, settings: RealSettings) -> bool:
    """Whether this invocation produces ``row``'s (method, budget): the teacher always, MoH when named (it has one
    setting), any other method at the budgets named."""
    if row['method'] == 'teacher':
        return True
    return row['method'] in settings.methods and (row['method'] == 'moh' or row['budget'] in settings.budgets)


def earlier_results(path: Path, results: dict, settings: RealSettings) -> tuple[list, list]:
    """The rows and skip notes of an earlier ``results.json`` in the same folder that this invocation does not
    produce again, so a run of some methods or budgets adds to the table instead of replacing it. Only when the
    earlier run used the same source and settings (apart from which methods and budgets ran); otherwise it is
    kept as ``results.replaced-N.json``, never silently overwritten."""
    if not path.is_file():
        return [], []
    earlier = json.loads(path.read_text())

    def comparable(entry: dict) -> dict:  # as JSON holds it: tuples as lists, paths as strings
        return json.loads(json.dumps({'source': entry.get('source'), **{
            key: value for key, value in entry.get('settings', {}).items() if key not in _SETTINGS_OF_A_SELECTION}},
            default=str))

    if comparable(earlier) != comparable(results):
        number = 1
        while (path.parent / f'results.replaced-{number}.json').exists():
            number += 1
        kept = path.rename(path.parent / f'results.replaced-{number}.json')
        say(f'results.json of other settings or another source kept as {kept.name}')
        return [], []
    rows = [row for row in earlier.get('rows', []) if not _ran_here(row, settings)]
    skipped = [entry for entry in earlier.get('skipped', []) if not _ran_here(entry, settings)]
    if rows:
        say(f'keeping {len(rows)} rows of earlier runs in results.json (methods or budgets not run now)')
    return rows, skipped


def in_bench_order(rows: list[dict]) -> list[dict]:
    """The teacher, then by budget (``BUDGETS`` order), by method (``METHODS`` order), then MoH; each method's rows
    in the order they were made."""
    def place(names, name) -> int:  # a name this version does not know goes last
        return names.index(name) if name in names else len(names)

    def key(indexed):
        index, row = indexed
        if row['method'] == 'teacher':
            return (0, 0, 0, index)
        if row['budget'] is None:
            return (2, 0, place(METHODS, row['method']), index)
        return (1, place(BUDGETS, row['budget']), place(METHODS, row['method']), index)
    return [row for _, row in sorted(enumerate(rows), key=key)]
