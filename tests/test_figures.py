"""The figures the README and the docs quote from `bench real` and `bench serve` equal the results files they came
from (docs/results/), to the decimals printed: the README's headline table, the healing table
(docs/benchmarks/healing.md), and the llama.cpp tables of docs/serving.md. Every number in those tables must
come from a row; a number edited by hand, or a row copied from a run whose results were not kept, fails here."""

from __future__ import annotations

import json
import re

import pytest

from helpers import REPO

RESULTS = REPO / 'docs' / 'results'
TASKS = ('piqa', 'arc_easy', 'arc_challenge', 'hellaswag', 'winogrande', 'sciq')
NUMBER = re.compile(r'\d[\d,]*(?:\.\d+)?')

# The README's headline table: its row -> the bench real label of each cell's row ({budget} is kv1 or kv2).
HEADLINE_ROWS = {
    'mean-pool GQA, healed (refit, transfer, KL)': 'mean-pool {budget} +KL',
    'AsymGQA, healed': 'AsymGQA {budget} +KL',
    'DHA, healed': 'DHA {budget} +KL',
    'servable DHA, healed': 'DHA-servable {budget} +KL',
    'MLA in DeepSeek\'s format, after transfer': 'MLA-DeepSeek {budget} +transfer',
    'MLA in DeepSeek\'s format, healed': 'MLA-DeepSeek {budget} +KL',
    'MLA class (FreqFold per K/V head), healed': 'MLA {budget} +KL',
}
HEADLINE_COLUMNS = ('kv1', 'kv2')  # a third, two thirds of the cache


def bench_real_rows() -> dict[str, dict]:
    rows = {}
    for run in json.loads((RESULTS / 'bench_real.json').read_text())['runs']:
        for row in run['rows']:
            assert row['label'] not in rows, f'{row["label"]} is in two runs of docs/results/bench_real.json'
            rows[row['label']] = row
    return rows


def tables(markdown: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every pipe table in ``markdown`` as (header cells, body rows of cells)."""
    found, block = [], []
    for line in [*markdown.splitlines(), '']:
        if line.startswith('|'):
            block.append([cell.strip() for cell in line.strip().strip('|').split('|')])
        else:
            if len(block) >= 2 and set(''.join(block[1])) <= set('-: '):
                found.append((block[0], block[2:]))
            block = []
    return found


def table_with_header(markdown: str, first_cells: list[str], where: str) -> list[list[str]]:
    """The body of the one table whose header cells start with ``first_cells``."""
    hits = [rows for header, rows in tables(markdown) if len(header) >= len(first_cells)
            and all(cell.startswith(first) for cell, first in zip(header, first_cells))]
    assert len(hits) == 1, f'{where}: expected one table headed {first_cells}, found {len(hits)}'
    return hits[0]


def numbers(cell: str) -> list[str]:
    return NUMBER.findall(cell.replace('*', ''))


def agrees(printed: str, value: float) -> bool:
    """``printed`` is ``value`` to the decimals printed (thousands separators allowed)."""
    digits = printed.replace(',', '')
    decimals = len(digits.split('.')[1]) if '.' in digits else 0
    return f'{value:.{decimals}f}' == digits


def check_bench_real_table(rows: list[list[str]], results: dict[str, dict], where: str) -> list[str]:
    """Rows of `| row | train tokens | held-out loss | piqa | ... | sciq | mean | KV MiB | wall s | eval s |`: every
    cell against its row."""
    wrong = []
    for cells in rows:
        label = cells[0].replace('*', '')
        if label not in results:
            wrong.append(f'{where}: "{label}" is not a row of docs/results/bench_real.json')
            continue
        row = results[label]
        expected = [row['tokens'], row['val_loss'], *(row['accuracy'][task] for task in TASKS), row['mean_accuracy'],
                    row['kv_bytes'] / 2**20, row['wall_s'], row['eval_s']]
        if len(cells) != 1 + len(expected):
            wrong.append(f'{where}: "{label}" has {len(cells) - 1} figures, its row {len(expected)}')
            continue
        for cell, value in zip(cells[1:], expected, strict=True):
            printed = numbers(cell)
            if len(printed) != 1 or not agrees(printed[0], value):
                wrong.append(f'{where}: "{label}" prints {cell!r} where its row has {value}')
    return wrong


def check_readme_headline(readme: str, results: dict[str, dict]) -> list[str]:
    rows = table_with_header(readme, ['method', 'a third of the cache', 'two thirds of the cache'], 'README')
    wrong = []
    for cells in rows:
        name, budget_cells = cells[0], cells[1:]
        for budget, cell in zip(HEADLINE_COLUMNS, budget_cells, strict=True):
            printed = numbers(cell)
            if not printed:
                continue  # a cell that says why there is no figure
            if name not in HEADLINE_ROWS:
                wrong.append(f'README: row "{name}" has figures but no results row to check them against')
                continue
            label = HEADLINE_ROWS[name].format(budget=budget)
            row = results.get(label)
            if row is None:
                wrong.append(f'README: "{name}" at {budget}: "{label}" is not in docs/results/bench_real.json')
            elif len(printed) != 2 or not (agrees(printed[0], row['val_loss'])
                                           and agrees(printed[1], row['mean_accuracy'])):
                wrong.append(f'README: "{name}" at {budget} prints {cell!r}; "{label}" has '
                             f'{row["val_loss"]} / {row["mean_accuracy"]}')
    return wrong


def check_serving(serving: str, results: dict) -> list[str]:
    wrong = []
    by_key = {(row['model'], row['outtype'], str(row['context'])): row for row in results['rows']}
    measured = table_with_header(serving, ['model', 'weights', 'context', 'KV MiB'], 'serving.md')
    fields = ('kv_mib', 'kv_ratio', 'prompt_tps', 'prompt_ratio', 'decode_tps', 'decode_ratio')
    for cells in measured:
        row = by_key.get((cells[0], cells[1], cells[2]))
        if row is None:
            wrong.append(f'serving.md: no result for {cells[:3]}')
            continue
        for cell, field in zip(cells[3:], fields, strict=True):
            if not agrees(numbers(cell)[0], row[field]):
                wrong.append(f'serving.md: {cells[:3]} {field} prints {cell!r}, the result is {row[field]}')
    losses = table_with_header(serving, ['model', 'HF float32'], 'serving.md')
    for cells in losses:
        recorded = results['losses'].get(cells[0])
        if recorded is None:
            wrong.append(f'serving.md: no held-out losses for {cells[0]}')
            continue
        for cell, key in zip(cells[1:], ('hf_float32', 'llama_cpp_f16', 'llama_cpp_q8_0'), strict=True):
            if not agrees(numbers(cell)[0], recorded[key]):
                wrong.append(f'serving.md: {cells[0]} {key} prints {cell!r}, the result is {recorded[key]}')
    targets = table_with_header(serving, ['model', 'weights', 'K+V MiB vs source'], 'serving.md')
    by_target = {(row['model'], row['outtype']): row for row in results['targets']}
    for cells in targets:
        row = by_target.get((cells[0], cells[1]))
        if row is None:
            wrong.append(f'serving.md: no target result for {cells[:2]}')
            continue
        for cell, ratio, met in ((cells[2], row['kv_ratio'], row['kv_met']),
                                 (cells[3], row['decode_ratio'], row['decode_met'])):
            if not agrees(numbers(cell)[0], ratio) or (('not met' not in cell) != met):
                wrong.append(f'serving.md: target {cells[:2]} prints {cell!r}, the result is {ratio:.3f} met={met}')
    return wrong


def _healing_table() -> list[list[str]]:
    page = (REPO / 'docs' / 'benchmarks' / 'healing.md').read_text()
    return table_with_header(page, ['row', 'train tokens', 'held-out loss', 'piqa'], 'docs/benchmarks/healing.md')


def test_the_readme_headline_table_equals_its_results():
    assert check_readme_headline((REPO / 'README.md').read_text(), bench_real_rows()) == []


def test_the_healing_table_equals_its_results_and_quotes_every_row_once():
    rows, results = _healing_table(), bench_real_rows()
    assert check_bench_real_table(rows, results, 'docs/benchmarks/healing.md') == []
    quoted = [cells[0].replace('*', '') for cells in rows]
    assert sorted(quoted) == sorted(results), 'every kept row is quoted, once'


def test_an_edited_healing_figure_fails():
    rows, results = _healing_table(), bench_real_rows()
    edited = [[*cells[:2], '9.999', *cells[3:]] if cells[0] == 'mean-pool kv2 +KL' else cells for cells in rows]
    assert check_bench_real_table(edited, results, 'healing') != []


def test_the_serving_tables_equal_their_results():
    results = json.loads((RESULTS / 'bench_serve.json').read_text())
    serving = (REPO / 'docs' / 'serving.md').read_text()
    assert check_serving(serving, results) == []
    assert len(table_with_header(serving, ['model', 'weights', 'context', 'KV MiB'], 'serving.md')) == len(
        results['rows'])


@pytest.mark.parametrize('old, new', [('4.416', '4.414'), ('0.547', '0.548'), ('3.153', '3.154')])
def test_an_edited_readme_figure_fails(old, new):
    readme = (REPO / 'README.md').read_text()
    assert old in readme
    edited = readme.replace(old, new, 1)
    assert check_readme_headline(edited, bench_real_rows())


def test_an_edited_serving_figure_fails():
    results = json.loads((RESULTS / 'bench_serve.json').read_text())
    serving = (REPO / 'docs' / 'serving.md').read_text()
    assert '| mean-pool 1/3 | f16 | 8192 | 60.00 | 0.333 |' in serving
    edited = serving.replace('| mean-pool 1/3 | f16 | 8192 | 60.00 | 0.333 |', '| mean-pool 1/3 | f16 | 8192 | 59.00 | 0.333 |')
    assert check_serving(edited, results)


def mla_zero_problems(markdown: str) -> list[str]:
    """The rows of `bench mla-zero`'s table (docs/results/mla_zero.json) that the docs do not quote as printed."""
    from dha_train.commands.bench.mla_zero import markdown_table

    results = json.loads((RESULTS / 'mla_zero.json').read_text())
    lines = markdown_table(results).splitlines()
    return [f'docs/benchmarks/quality.md lacks the mla-zero row {line!r}' for line in lines if line not in markdown]


def test_the_mla_zero_table_is_the_bench_output():
    assert mla_zero_problems((REPO / 'docs' / 'benchmarks' / 'quality.md').read_text()) == []


def test_an_edited_mla_zero_figure_fails():
    markdown = (REPO / 'docs' / 'benchmarks' / 'quality.md').read_text()
    row = next(line for line in markdown.splitlines() if line.startswith('| TransMLA kv1 |'))
    cells = row.split(' | ')
    cells[2] = f'{float(cells[2]) + 0.001:.3f}'
    assert mla_zero_problems(markdown.replace(row, ' | '.join(cells))) != []


def eval_speed_problems(markdown: str) -> list[str]:
    """The rows of `bench eval-speed`'s table (docs/results/bench_eval_speed.json) the cost page does not quote as
    printed."""
    from dha_train.commands.bench.eval_speed import markdown_table

    results = json.loads((RESULTS / 'bench_eval_speed.json').read_text())
    return [line for line in markdown_table(results).splitlines() if line not in markdown.splitlines()]


def test_the_eval_speed_table_is_the_bench_output():
    assert eval_speed_problems((REPO / 'docs' / 'benchmarks' / 'cost.md').read_text()) == []


def test_an_edited_eval_speed_figure_fails():
    markdown = (REPO / 'docs' / 'benchmarks' / 'cost.md').read_text()
    speedup = json.loads((RESULTS / 'bench_eval_speed.json').read_text())['tasks']['sciq']['speedup']
    assert f'| {speedup}x |' in markdown
    assert eval_speed_problems(markdown.replace(f'| {speedup}x |', f'| {speedup + 0.1:.2f}x |')) != []
