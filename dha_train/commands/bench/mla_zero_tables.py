"""The Markdown tables of `bench mla-zero`'s results, as the docs quote them (``tests/test_figures.py`` checks the
docs' copies against the results file), and the printed report."""

from __future__ import annotations

from collections.abc import Sequence

TEXT_COLUMNS = {'validation': 'validation (vim)', 'validation_headers': 'validation (C headers)',
                'validation_markdown': 'validation (Markdown)', 'heldout_doc': 'held-out /usr/share/doc',
                'heldout_book': 'held-out book', 'heldout_fresh': 'fresh held-out (Perl)'}


def _loss_cell(row: dict, text: str) -> str:
    if text not in row['loss']:
        return '-'
    interval = row.get('loss_ci95', {}).get(text)
    return f"{row['loss'][text]:.3f}" + ('' if interval is None else f' ± {interval:.3f}')


def _texts(rows: Sequence[dict]) -> list[str]:
    return [name for name in TEXT_COLUMNS if any(name in row['loss'] for row in rows)]


def markdown_table(results: dict) -> str:
    """The results as the docs quote them (``tests/test_figures.py`` checks the docs' copy against the results)."""
    texts = _texts(results['rows'])
    tasks = list(results['settings']['tasks'])
    header = ['row', 'cached numbers / token / layer', *(TEXT_COLUMNS[t] for t in texts), *tasks,
              'mean layer error', 'worst layer']
    lines = ['| ' + ' | '.join(header) + ' |', '|' + ' --- |' * len(header)]
    for row in results['rows']:
        errors = row['layer_errors']
        worst = max(range(len(errors)), key=errors.__getitem__)
        cells = [row['label'], str(row['numbers'])]
        cells += [_loss_cell(row, t) for t in texts]
        cells += [f"{row['accuracy'][t]:.3f}" if row['accuracy'].get(t) is not None else '-' for t in tasks]
        cells += [f'{sum(errors) / len(errors):.3f}', f'{worst} ({errors[worst]:.3f})']
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def search_table(results: dict) -> str:
    """TransMLA's settings as searched: every width and fold, its loss on each text, the one chosen on validation."""
    search = results.get('transmla_search', [])
    texts = _texts(search)
    lines = ['| budget | RoPE key dims | fold | latent rank | ' + ' | '.join(TEXT_COLUMNS[t] for t in texts)
             + ' | chosen |', '|' + ' --- |' * (5 + len(texts))]
    for entry in search:
        cells = [entry['budget'], str(entry['qk_rope_head_dim']), str(entry['freq_fold']), str(entry['kv_lora_rank'])]
        cells += [_loss_cell(entry, t) for t in texts] + ['yes' if entry['chosen'] else '']
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def paired_table(results: dict) -> str:
    """Each row against TransMLA's chosen setting at its budget, per text: mean loss difference per sequence (the row
    minus TransMLA; below 0 the row is better) and its 95% interval."""
    paired = results.get('paired', [])
    lines = ['| budget | row | against | text | difference | 95% interval |', '|' + ' --- |' * 6]
    for entry in paired:
        low, high = entry['ci95']
        interval = '-' if low is None else f'[{low:+.3f}, {high:+.3f}]'  # None: a text of one document
        lines.append(f"| {entry['budget']} | {entry['row']} | {entry['against']} | {TEXT_COLUMNS[entry['text']]} | "
                     f"{entry['difference']:+.3f} | {interval} |")
    return '\n'.join(lines)


def candidates_table(results: dict) -> str:
    """The DeepSeek layout's candidate splits and balances on every text, the former default marked, and which one
    the validation texts chose as the fixed default."""
    entries = results.get('deepseek_candidates', [])
    texts = _texts(entries)
    chosen = {entry['budget']: entry['chosen'] for entry in results.get('fixed_default', [])}
    lines = ['| budget | split, balance | latent + RoPE key (stride) | ' + ' | '.join(TEXT_COLUMNS[t] for t in texts)
             + ' | |', '|' + ' --- |' * (4 + len(texts))]
    for entry in entries:
        marks = [mark for mark, holds in (('the former default', entry['former_default']),
                                          ('chosen on validation', chosen.get(entry['budget']) == entry['label']))
                 if holds]
        cells = [entry['budget'], entry['label'],
                 f"{entry['kv_lora_rank']} + {entry['qk_rope_head_dim']} ({entry['rope_stride']})"]
        cells += [_loss_cell(entry, t) for t in texts] + [', '.join(marks)]
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def versus_former_table(results: dict) -> str:
    """Each candidate minus the former default, per text: the mean loss difference per sequence (below 0 better)
    and its 95% interval over documents."""
    lines = ['| budget | split, balance | text | minus the former default | 95% interval |', '|' + ' --- |' * 5]
    for summary in results.get('fixed_default', []):
        for entry in summary['against_former_default']:
            low, high = entry['ci95']
            interval = '-' if low is None else f'[{low:+.3f}, {high:+.3f}]'
            lines.append(f"| {summary['budget']} | {entry['label']} | {TEXT_COLUMNS[entry['text']]} | "
                         f"{entry['difference']:+.3f} | {interval} |")
    return '\n'.join(lines)


def print_table(results: dict) -> None:
    print(markdown_table(results))
    if results.get('deepseek_candidates'):
        print('\n' + candidates_table(results) + '\n\n' + versus_former_table(results))
    if results.get('transmla_search'):
        print('\n' + search_table(results))
    if results.get('paired'):
        print('\n' + paired_table(results))
    for skipped in results.get('skipped', []):
        print(f"  skipped: {skipped['row']} at {skipped['budget']}: {skipped['reason']}")
