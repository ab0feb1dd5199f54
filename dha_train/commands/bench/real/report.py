"""`bench real`'s report: the intervals and paired differences of its rows, the tables it prints, its plots, and
where an earlier results.json goes."""

from __future__ import annotations

import json
from pathlib import Path

from dha_train.bench_runner import say
from dha_train.bench_settings import BUDGETS, METHODS


def _paired_items(row: dict) -> tuple[dict, dict, dict] | None:
    """A row's per-document accuracies (its headline metric; per task, by document index), per-sequence held-out
    losses (per domain) and each sequence's document (per domain; the units a loss difference resamples), from its
    evaluation's documents file; None for a row evaluated without one (older runs)."""
    path = row.get('documents_file')
    if not path or not Path(path).is_file():
        return None
    saved = json.loads(Path(path).read_text())
    accuracy = {task: {doc['doc_id']: doc[row['metric'][task]] for doc in docs}
                for task, docs in saved['tasks'].items() if row['metric'].get(task)}
    return accuracy, saved.get('heldout_sequences') or {}, saved.get('heldout_sequence_documents') or {}


def _shared(a: dict, b: dict) -> tuple[dict, dict]:
    """Two rows' per-document accuracies on the documents both were scored on (an intermediate row's sample is the
    first part of a ranking row's), as aligned lists per task."""
    tasks = sorted(set(a) & set(b))
    ids = {task: sorted(set(a[task]) & set(b[task])) for task in tasks}
    return ({task: [a[task][i] for i in ids[task]] for task in tasks},
            {task: [b[task][i] for i in ids[task]] for task in tasks})


def comparison_kind(row: dict) -> str:
    """What a row is, for choosing its mean-pool peer: a healing stage ('refit', 'transfer', 'kl'), the 0-token
    conversion, or the method's own training (CT, L0 pruning, Fusion + CT), which pairs with mean-pool's CT."""
    return row.get('stage') or ('converted' if row['tokens'] == 0 else 'trained')


def add_intervals(results: dict, seed: int = 0) -> None:
    """Each row's 95% intervals (held-out loss and mean accuracy, both over documents) and its paired
    differences, with seeded bootstrap intervals, from the teacher and from mean-pool at the same budget, tokens and
    kind of row (``comparison_kind``), over the documents and sequences the two share (``vs_teacher``,
    ``vs_mean_pool``: {'loss'|'accuracy': [difference, low, high]}), for rows that kept their documents; and each
    ranking row's difference from the row just ahead of it (``add_ranking``)."""
    from dha_train.ops.intervals import mean_of_means_interval

    items = {row['label']: _paired_items(row) for row in results['rows']}
    teacher = next((row['label'] for row in results['rows'] if row['method'] == 'teacher'), None)
    for row in results['rows']:
        mine = items[row['label']]
        if mine is None:
            continue
        row['accuracy_ci95'] = mean_of_means_interval({task: list(values.values())
                                                       for task, values in mine[0].items()})[1]
        peer = next((other['label'] for other in results['rows'] if other['method'] == 'mean_pool'
                     and row['budget'] is not None and other['budget'] == row['budget']
                     and comparison_kind(other) == comparison_kind(row) and other['tokens'] == row['tokens']), None)
        for key, reference in (('vs_teacher', teacher), ('vs_mean_pool', peer)):
            theirs = items.get(reference) if reference not in (None, row['label']) else None
            if theirs is None:
                continue
            row[key] = _paired(theirs, mine, seed)
    add_ranking(results, items, seed)


def _paired(theirs: tuple[dict, dict], mine: tuple[dict, dict], seed: int) -> dict:
    """{'accuracy'[, 'loss']: [mine - theirs, low, high]} over the documents and sequences the two rows share."""
    from dha_train.ops.intervals import paired_difference

    paired = {'accuracy': list(paired_difference(*_shared(theirs[0], mine[0]), seed=seed))}
    # both scored the same held-out split, so the same documents label its sequences; a split of one document has
    # nothing to resample, so no loss interval
    if mine[1] and theirs[1] and all(len(set(labels or range(2))) > 1 for labels in mine[2].values()):
        paired['loss'] = list(paired_difference(theirs[1], mine[1], seed=seed, documents=mine[2]))
    return paired


def ranking_groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The ranking rows that compete (same budget, kind of row and training tokens; the teacher, rows that repeat
    another row's model (``same_as``) and rows without an interval left out), each group in order of held-out loss."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if (row['method'] != 'teacher' and not row.get('same_as') and row.get('accuracy_ci95') is not None
                and row.get('evaluation', 'ranking') == 'ranking'):
            groups.setdefault((row['budget'], comparison_kind(row), row['tokens']), []).append(row)
    return {key: sorted(group, key=lambda row: row['val_loss']) for key, group in groups.items() if len(group) > 1}


def add_ranking(results: dict, items: dict, seed: int = 0) -> None:
    """Each competing row after the first of its ``ranking_groups`` gets ``vs_next_better``: its paired differences
    from the row just ahead of it in held-out loss, so a claim that one method ranks above the next carries an
    interval."""
    for group in ranking_groups(results['rows']).values():
        for ahead, row in zip(group, group[1:]):
            row['vs_next_better'] = {'label': ahead['label'], **_paired(items[ahead['label']], items[row['label']],
                                                                         seed)}


def with_interval(value: float | None, half: float | None, digits: int = 3) -> str:
    """``value ± half`` as the tables print a figure (the value alone where no interval was measured)."""
    if value is None:
        return '-'
    return f'{value:.{digits}f}' + (f' ± {half:.{digits}f}' if half is not None else '')


def marked_difference(difference: list[float] | None, digits: int = 3) -> str:
    """A paired difference and its interval, ``*`` where the interval excludes 0 (significant at 95%) as printed:
    an end that prints as 0.000 does not, so the star never sits beside "[+0.000, +0.039]"."""
    from dha_train.ops.intervals import excludes_zero

    if not difference:
        return '-'
    value, low, high = difference
    marked = excludes_zero(round(low, digits), round(high, digits))
    return f'{value:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]' + ('*' if marked else '')


def print_intervals(results: dict) -> None:
    """The rows that kept their documents: loss and mean accuracy with 95% intervals, and the paired differences
    from the teacher and from mean-pool at the same budget and stage (* : the interval excludes 0)."""
    rows = [row for row in results['rows'] if row.get('accuracy_ci95') is not None]
    if not rows:
        return
    print(f'\n  {"row":<28} {"val loss":>16} {"mean acc":>15}  {"loss - teacher":>26} {"acc - teacher":>26} '
          f'{"acc - mean-pool":>26}')
    for row in rows:
        versus_teacher = row.get('vs_teacher') or {}
        print(f'  {row["label"]:<28} {with_interval(row["val_loss"], row.get("val_loss_ci95")):>16} '
              f'{with_interval(row["mean_accuracy"], row["accuracy_ci95"]):>15}  '
              f'{marked_difference(versus_teacher.get("loss")):>26} {marked_difference(versus_teacher.get("accuracy")):>26} '
              f'{marked_difference((row.get("vs_mean_pool") or {}).get("accuracy")):>26}')
    print('  ± : 95% interval over documents (held-out loss: the documents its sequences come from; accuracy: each task\'s); [ ] : paired bootstrap 95% '
          'interval of the difference on the same documents and sequences; * : it excludes 0')


def print_table(results: dict) -> None:
    tasks = results['settings']['tasks']
    short = {'piqa': 'piqa', 'arc_easy': 'arcE', 'arc_challenge': 'arcC', 'hellaswag': 'hswag', 'winogrande': 'wino',
             'sciq': 'sciq'}
    print()
    print(f'{results["source"]["name"]}: every method at two K+V budgets of the source cache; '
          f'accuracy on {results["settings"]["limit"]} sampled docs per task (0-shot), val loss on held-out text')
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


# kv1 / kv2 are named as on SmolLM2 (3 K/V heads); half / third are the fractions of any source's
BUDGET_PANELS = {'kv1': 'a third of the cache', 'kv2': 'two thirds of the cache', 'half': 'half the cache',
                 'third': 'one third of the cache', 'eighth': 'an eighth of the cache', None: 'the full cache'}


def panel_curves(results: dict, metric: str, half_width: str) -> dict[str, dict]:
    """{panel: {curve: {'points': [(tokens, value, half-width)], 'colour_key', 'dashed'}}}, one panel per cache budget:
    each method's healing (solid) and own training (dashed) from its shared 0-token point. A curve whose rows are all
    another method's models (``same_as``) is left out: it would only draw over that curve."""
    panels: dict[str, dict] = {}
    for row in results['rows']:
        if row['method'] == 'teacher':
            continue
        curves = panels.setdefault(BUDGET_PANELS[row['budget']], {})
        own = curves.setdefault(row['method'], {'rows': [], 'dashed': True})
        healed = curves.setdefault(f'{row["method"]} healed', {'rows': [], 'dashed': False})
        (healed if row.get('stage') else own)['rows'].append(row)
        if not row.get('stage') and row['tokens'] == 0:
            healed['rows'].append(row)
    return {title: {name: {'points': [(r['tokens'], r[metric], r.get(half_width)) for r in curve['rows']
                                      if r[metric] is not None],
                           'colour_key': curve['rows'][0]['method'], 'dashed': curve['dashed']}
                    for name, curve in panels[title].items()
                    if len(curve['rows']) > 1 and not all(r.get('same_as') for r in curve['rows'])}
            for title in BUDGET_PANELS.values() if title in panels}


def plot_rows(results: dict, work: Path) -> list[str]:
    """accuracy.png and loss.png (``panel_curves``), every point with its 95% interval, the teacher as a line."""
    from dha_train.plots import plot_panels

    teacher = results['rows'][0]
    files = []
    for metric, half, name, label in (('mean_accuracy', 'accuracy_ci95', 'accuracy.png', 'mean accuracy (6 tasks)'),
                                      ('val_loss', 'val_loss_ci95', 'loss.png', 'held-out validation loss')):
        if teacher[metric] is not None:
            files.append(str(plot_panels(panel_curves(results, metric, half), work / name,
                                         title=f'{results["source"]["name"]}: {label} (95% intervals)',
                                         xlabel='training tokens', ylabel=label,
                                         reference=('teacher', teacher[metric]))))
    return files


def set_aside_earlier(path: Path) -> Path | None:
    """An earlier ``results.json`` in the run folder, renamed ``results.replaced-N.json`` (never overwritten, never
    merged: each results file holds one invocation's rows under that invocation's settings and command; the stages
    the earlier run made are reused, so running the methods again costs only what is new)."""
    if not path.is_file():
        return None
    number = 1
    while (path.parent / f'results.replaced-{number}.json').exists():
        number += 1
    kept = path.rename(path.parent / f'results.replaced-{number}.json')
    say(f'the earlier results.json is kept as {kept.name}')
    return kept


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
