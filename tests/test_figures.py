"""The figures the README and the docs quote from the results files (docs/results/) equal them, to the decimals
printed: the README's headline table and the healing table are `dha-train bench real-tables`' output, compared whole
and both ways (a row missing, added, reordered or edited, a figure or an interval, fails); the README's prose figures
are made from the same files, and every decimal, percentage and ratio in that section must be one of them; the
llama.cpp tables of docs/serving.md, and the mla-zero and eval-speed tables, are checked against theirs."""

from __future__ import annotations

import json
import re

import pytest

from helpers import REPO

RESULTS = REPO / 'docs' / 'results'
TASKS = ('piqa', 'arc_easy', 'arc_challenge', 'hellaswag', 'winogrande', 'sciq')
NUMBER = re.compile(r'\d[\d,]*(?:\.\d+)?')



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


def table_problems(markdown: str, generated: str, where: str, after: str | None = None) -> list[str]:
    """The page's table headed as ``generated`` (the first one after the line ``after``, when given) is, line for
    line, ``generated``: every generated row on the page, every page row generated, in the same order."""
    header = generated.splitlines()[0]
    lines = markdown.splitlines()
    if after is not None and after not in lines:
        return [f'{where}: no line {after!r}']
    first = lines.index(after) if after is not None else 0
    if header not in lines[first:]:
        return [f'{where}: no table headed {header!r}']
    start = lines.index(header, first)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith('|')), len(lines))
    page, wanted = lines[start:end], generated.splitlines()
    problems = [f'{where}: lacks the row {line!r}' for line in wanted if line not in page]
    problems += [f'{where}: has a row the results do not give: {line!r}' for line in page if line not in wanted]
    if not problems and page != wanted:
        problems.append(f'{where}: the rows are in another order than the results give')
    return problems


def section_prose(markdown: str, heading: str) -> str:
    """The lines of the section that starts at ``heading`` (up to the next heading of its level), tables left out."""
    start = markdown.index(heading)
    end = markdown.find('\n' + heading.split(' ', 1)[0] + ' ', start + 1)
    section = markdown[start:end if end > 0 else len(markdown)]
    return '\n'.join(line for line in section.splitlines() if not line.startswith('|'))


def readme_prose_figures() -> dict[str, str]:
    """The README's headline prose figures, each a phrase made from the results file it quotes."""
    rerun = {row['label']: row for run in rerun_runs() for row in run['rows']}
    zero = json.loads((RESULTS / 'mla_zero.json').read_text())
    serve = json.loads((RESULTS / 'bench_serve.json').read_text())
    at_8x8k = {(row['model'], row['cache_type']): row for row in serve['rows'] if row['outtype'] == 'f16'
               and row['context'] == 8192 and row['sequences'] == 8}
    fits = {(entry['model'], entry['cache_type']): entry for entry in serve['capacity'] if entry['outtype'] == 'f16'}
    target = next(row for row in serve['targets'] if row['model'] == 'mean-pool 1/3' and row['outtype'] == 'f16'
                  and row.get('cache_type') == 'f16')

    def fresh_gap(budget: str) -> str:  # the DeepSeek layout against TransMLA's chosen setting, on the fresh text
        entry = next(entry for entry in zero['paired'] if entry['budget'] == budget and entry['text'] == 'heldout_fresh'
                     and entry['row'] == f'DeepSeek layout {budget}')
        low, high = entry['ci95']
        return f"{entry['difference']:+.3f} [{low:+.3f}, {high:+.3f}]"

    def text_spread(budget: str) -> str:  # the same difference, its range over every text scored
        differences = sorted(entry['difference'] for entry in zero['paired']
                             if entry['budget'] == budget and entry['row'] == f'DeepSeek layout {budget}')
        return f"{differences[0]:+.3f} to {differences[-1]:+.3f}"

    return {
        'deepseek_rerun': deepseek_rerun_phrase(rerun),
        'transmla': (f"over four texts of 64 documents each (three kinds TransMLA and the defaults were tuned on, one "
                     f"held out), DeepSeek layout minus TransMLA: {text_spread('kv1')} nats a token at a third, "
                     f"{text_spread('kv2')} at two thirds; on the held-out text (Perl's documentation and modules) "
                     f"{fresh_gap('kv1')} and {fresh_gap('kv2')}"),
        'serving': (f"at 8 sequences of 8,192 tokens each (f16 weights and cache), mean-pool at a third decodes at "
                    f"{at_8x8k['mean-pool 1/3', 'f16']['decode_tps_ratio']:.2f}x the source's aggregate tokens/s "
                    f"(target 1.5x: {'met' if target['decode_met'] else 'not met'}), and "
                    f"{fits['mean-pool 1/3', 'f16']['sequences_fit']} such sequences fit in 1 GiB of cache against the "
                    f"source's {fits['source', 'f16']['sequences_fit']} ({fits['mean-pool 1/3', 'f16']['ratio']:.1f}x); "
                    f"with a q8_0 cache {fits['mean-pool 1/3', 'q8_0']['sequences_fit']} against "
                    f"{fits['source', 'q8_0']['sequences_fit']}. The servable DHA at two thirds decodes at "
                    f"{at_8x8k['DHA-servable 2/3', 'f16']['decode_tps_ratio']:.2f}x; MLA in DeepSeek's format at "
                    f"{at_8x8k['MLA-DeepSeek 1/3', 'f16']['decode_tps_ratio']:.2f}x at a third and "
                    f"{at_8x8k['MLA-DeepSeek 2/3', 'f16']['decode_tps_ratio']:.2f}x at two thirds"),
        'healing_share': f"{rerun['mean-pool kv1 +KL']['mean_accuracy'] / rerun['teacher']['mean_accuracy']:.0%} of "
                         "the teacher's mean accuracy on the 400-document sample",
    }


ORDINAL = ('lowest', 'second lowest', 'third lowest', 'fourth lowest', 'fifth lowest', 'sixth lowest')


def deepseek_rerun_phrase(rerun: dict[str, dict]) -> str:
    """The README's sentence on healed MLA in DeepSeek's format: its place among the re-run's healed rows at each
    budget (by held-out loss, as the ranking orders them), its loss ± h and paired difference from healed mean-pool,
    and its gap to the teacher at two thirds."""
    from dha_train.commands.bench.real.report import ranking_groups

    def place(label: str) -> str:
        (labels,) = [[row['label'] for row in group] for group in ranking_groups(list(rerun.values())).values()
                     if label in [row['label'] for row in group]]
        return ORDINAL[labels.index(label)]

    def versus_mean_pool(row: dict) -> str:
        value, low, high = row['vs_mean_pool']['loss']
        return f"{value:+.3f} [{low:+.3f}, {high:+.3f}]" + (', not significant' if low <= 0 <= high else '')

    kv1, kv2 = rerun['MLA-DeepSeek kv1 +KL'], rerun['MLA-DeepSeek kv2 +KL']
    return (f"Healed, MLA in DeepSeek's format has the {place(kv1['label'])} held-out loss of the re-run's rows "
            f"at a third ({kv1['val_loss']:.3f} ± {kv1['val_loss_ci95']:.3f}; against healed mean-pool "
            f"{versus_mean_pool(kv1)}) and the {place(kv2['label'])} at two thirds ({kv2['val_loss']:.3f} ± "
            f"{kv2['val_loss_ci95']:.3f}; {versus_mean_pool(kv2)}), "
            f"{kv2['val_loss'] - rerun['teacher']['val_loss']:.2f} above the teacher's.")


FIGURE = re.compile(r'\d+(?:\.\d+)?(?:%|x\b)|\d+\.\d+')
STATED_FIGURES = ('90%', '1.5x', '95%')  # targets and the interval's level the prose names, not measurements


def prose_problems(readme: str) -> list[str]:
    """Every figure phrase of ``readme_prose_figures`` is in the headline section, and the section's prose (its table
    apart) holds no decimal, percentage or ratio that is not in one of them."""
    prose = section_prose(readme, '## Headline figures')
    phrases = readme_prose_figures()
    problems = [f'README: the headline section lacks {name}: {phrase!r}' for name, phrase in phrases.items()
                if phrase not in prose]
    for phrase in phrases.values():
        prose = prose.replace(phrase, ' ')
    problems += [f'README: the figure {figure!r} in the headline prose comes from no results file'
                 for figure in FIGURE.findall(prose) if figure not in STATED_FIGURES]
    return problems


SERVE_TABLES = ('decode_table', 'capacity_table', 'targets_table', 'loss_table')


def check_serving(serving: str, results: dict) -> list[str]:
    """Each of `bench serve`'s tables, made from its results file, against the serving page's, whole."""
    from dha_train.commands.bench import serve

    return [problem for name in SERVE_TABLES
            for problem in table_problems(serving, getattr(serve, name)(results), 'serving.md')]


def rerun_runs() -> list[dict]:
    from dha_train.commands.bench.real.tables import load_runs

    return load_runs(RESULTS / RERUN)


def test_the_readme_headline_table_is_the_bench_output():
    """The README's headline table is the re-run's: 400 sampled documents a task, intervals, paired differences."""
    from dha_train.commands.bench.real.tables import headline_table

    readme = (REPO / 'README.md').read_text()
    assert table_problems(readme, headline_table(rerun_runs()), 'README', after=README_HEADLINE) == []


def test_the_readme_prose_figures_are_the_results():
    assert prose_problems((REPO / 'README.md').read_text()) == []


@pytest.mark.parametrize('old, new', [('4.370 ± 0.066 / 0.401', '4.370 ± 0.067 / 0.401'),
                                      ('3.279 ± 0.076 / 0.467', '3.279 ± 0.076 / 0.468'),
                                      ('-0.388 [-0.434, -0.341]*', '-0.388 [-0.434, -0.341]'),
                                      ('+0.002 [-0.017, +0.021] |', '+0.002 [-0.017, +0.021] | 1.0 |')])
def test_an_edited_readme_table_fails(old, new):
    from dha_train.commands.bench.real.tables import headline_table

    readme = (REPO / 'README.md').read_text()
    assert old in readme
    assert table_problems(readme.replace(old, new, 1), headline_table(rerun_runs()), 'README',
                          after=README_HEADLINE) != []


def test_an_edited_readme_prose_figure_fails():
    readme = (REPO / 'README.md').read_text()
    share = readme_prose_figures()['healing_share']
    assert f'reaches {share}' in readme
    assert prose_problems(readme.replace(f'reaches {share}', 'reaches 88%' + share[3:], 1)) != []
    assert prose_problems(readme.replace(share, share.replace('%', '.5%'), 1)) != []
    assert prose_problems(readme.replace('(the target was 90%)', '(the target was 90%, 0.401 of 0.497)', 1)) != []


def test_an_edited_interval_or_difference_fails():
    """On a run whose rows carry intervals: changing a half-width or a difference's bound by one printed unit, or
    dropping a row, makes the page disagree with the results."""
    from dha_train.commands.bench.real.tables import headline_table, healing_table

    def row(label, method, budget, loss, accuracy, **extra):
        return {'label': label, 'method': method, 'budget': budget, 'tokens': 0 if method == 'teacher' else 64,
                'val_loss': loss, 'val_loss_ci95': 0.021, 'mean_accuracy': accuracy, 'accuracy_ci95': 0.018,
                'accuracy': dict.fromkeys(TASKS, accuracy), 'kv_bytes': 2 ** 20, 'documents_per_task': 400,
                'evaluation': 'ranking', **extra}

    run = {'settings': {'training_tokens_per_method': 64, 'limit': 400}, 'rows': [
        row('teacher', 'teacher', None, 3.0, 0.5),
        row('mean-pool kv1 +KL', 'mean_pool', 'kv1', 4.0, 0.43, stage='kl',
            vs_teacher={'loss': [1.0, 0.9, 1.1], 'accuracy': [-0.07, -0.09, -0.05]}),
        row('DHA kv1 +KL', 'dha', 'kv1', 3.9, 0.44, stage='kl',
            vs_mean_pool={'loss': [-0.1, -0.15, -0.05], 'accuracy': [0.01, -0.01, 0.03]})]}
    for table in (healing_table([run]), headline_table([run])):
        assert '± 0.021' in table and '*' in table
        page = f'# page\n\n{table}\n\nprose\n'
        assert table_problems(page, table, 'page') == []
        for old, new in (('± 0.021', '± 0.020'), ('[-0.150', '[-0.149'), ('+0.010 [', '+0.011 [')):
            if old in page:
                assert table_problems(page.replace(old, new, 1), table, 'page') != []
        dropped = '\n'.join(line for line in page.splitlines() if not line.startswith('| DHA'))
        assert table_problems(dropped, table, 'page') != []


def test_the_serving_tables_equal_their_results():
    results = json.loads((RESULTS / 'bench_serve.json').read_text())
    serving = (REPO / 'docs' / 'serving.md').read_text()
    assert check_serving(serving, results) == []


def test_an_edited_serving_figure_fails():
    from dha_train.commands.bench.serve import decode_table

    results = json.loads((RESULTS / 'bench_serve.json').read_text())
    serving = (REPO / 'docs' / 'serving.md').read_text()
    row = decode_table(results).splitlines()[-1]
    cells = row.split(' | ')
    cells[-2] = '999.9 (9.99x)'
    assert row in serving and check_serving(serving.replace(row, ' | '.join(cells)), results)


# bench -> (the page that prints its table, its results file, the module whose markdown_table makes the table)
BENCH_TABLES = {'mla-zero': ('docs/benchmarks/quality.md', 'mla_zero.json', 'dha_train.commands.bench.mla_zero'),
                'eval-speed': ('docs/benchmarks/cost.md', 'bench_eval_speed.json', 'dha_train.commands.bench.eval_speed'),
                'fusion': ('docs/methods/dha.md', 'bench_fusion.json', 'dha_train.commands.bench.fusion')}


def bench_table_problems(bench: str, markdown: str) -> list[str]:
    """``bench``'s table, made from its results file in docs/results/, against its page's, whole and both ways."""
    import importlib

    page, results_file, module = BENCH_TABLES[bench]
    results = json.loads((RESULTS / results_file).read_text())
    return table_problems(markdown, importlib.import_module(module).markdown_table(results), page)


@pytest.mark.parametrize('bench', list(BENCH_TABLES))
def test_each_bench_table_is_the_bench_output(bench):
    assert bench_table_problems(bench, (REPO / BENCH_TABLES[bench][0]).read_text()) == []


def mla_zero_problems(markdown: str) -> list[str]:
    return bench_table_problems('mla-zero', markdown)


def test_a_row_added_to_or_dropped_from_the_mla_zero_table_fails():
    markdown = (REPO / 'docs' / 'benchmarks' / 'quality.md').read_text()
    row = next(line for line in markdown.splitlines() if line.startswith('| TransMLA '))
    assert mla_zero_problems(markdown.replace(row + '\n', '', 1)) != []
    assert mla_zero_problems(markdown.replace(row, row + '\n' + row.replace('TransMLA', 'TransMLA 16-dim'), 1)) != []


@pytest.mark.parametrize('bench, row_start, cell, decimals', [('mla-zero', '| DeepSeek layout kv1 |', 2, 3),
                                                               ('fusion', '| 16 batches, omega lr 0.1, lambda lr 1000, margin 0 |', 2, 4)])
def test_an_edited_bench_table_figure_fails(bench, row_start, cell, decimals):
    markdown = (REPO / BENCH_TABLES[bench][0]).read_text()
    row = next(line for line in markdown.splitlines() if line.startswith(row_start))
    cells = row.split(' | ')
    figure, _, interval = cells[cell].partition(' ')  # a figure may carry its interval: '4.258 ± 0.050'
    cells[cell] = f'{float(figure) + 10 ** -decimals:.{decimals}f}' + (f' {interval}' if interval else '')
    assert bench_table_problems(bench, markdown.replace(row, ' | '.join(cells))) != []


@pytest.mark.parametrize('table, page', [('search_table', 'docs/benchmarks/quality.md'),
                                         ('paired_table', 'docs/benchmarks/quality.md'),
                                         ('candidates_table', 'docs/methods/mla.md'),
                                         ('versus_former_table', 'docs/methods/mla.md')])
def test_transmlas_search_the_deepseek_candidates_and_the_paired_differences_are_the_bench_output(table, page):
    from dha_train.commands.bench import mla_zero

    results = json.loads((RESULTS / 'mla_zero.json').read_text())
    markdown = (REPO / page).read_text()
    generated = getattr(mla_zero, table)(results)
    assert table_problems(markdown, generated, page) == []
    first = generated.splitlines()[2]
    assert table_problems(markdown.replace(first, first.replace('|', '| x', 1)), generated, page) != []


def eval_speed_problems(markdown: str) -> list[str]:
    return bench_table_problems('eval-speed', markdown)


def test_an_edited_eval_speed_figure_fails():
    markdown = (REPO / 'docs' / 'benchmarks' / 'cost.md').read_text()
    speedup = json.loads((RESULTS / 'bench_eval_speed.json').read_text())['tasks']['sciq']['speedup']
    assert f'| {speedup}x |' in markdown
    assert eval_speed_problems(markdown.replace(f'| {speedup}x |', f'| {speedup + 0.1:.2f}x |')) != []


# The prose of the sections that quote a results file: every decimal figure in it is a number of those files (to the
# decimals printed), or one of the figures named here with where it comes from instead. A figure with no results
# behind it fails; an edit that lands on another recorded number does not (the tables, compared whole, and the
# README's phrases, made from named rows, are the strict checks).
QUOTING_SECTIONS = {
    ('docs/benchmarks/healing.md', '# How fast each method heals'): {
        'files': ('bench_real.json',),
        'elsewhere': {'0.055': "a 6-task mean's half-width at 50 documents",
                      **dict.fromkeys(('3.017', '0.533', '0.547', '4.592', '5.817', '3.408', '0.480', '3.405', '3.372',
                                       '4.700', '3.708', '3.094', '3.922', '3.168', '4.073', '3.225'),
                                      'the 50-document rows (history: git show a737110:docs/results/bench_real.json)')}},
    ('docs/serving.md', '## Measured in llama.cpp'): {
        'files': ('bench_serve.json',),
        'elsewhere': {'82.5': 'the batch-1 run of 2026-11-26 (git show c6f27e9:docs/results/bench_serve.json)'}},
    ('docs/benchmarks/quality.md', '## MLA at 0 tokens against TransMLA'): {
        'files': ('mla_zero.json',),
        'elsewhere': dict.fromkeys(('0.159', '0.030'),
                                   'the run of 2026-11-29 (git show 3508001:docs/results/mla_zero.json)')},
    ('docs/benchmarks/quality.md', '## On SmolLM2-135M'): {
        'files': ('bench_real.json',),
        'elsewhere': {'0.630': 'dha-train eval, by hand', '0.485': 'dha-train eval, by hand', '0.660': 'dha-train eval, by hand',
                      '0.480': 'dha-train eval, by hand', '8.71': 'dha-train eval, by hand', '3.02': 'dha-train eval, by hand',
                      '8.54': 'the refit study',
                      '5.76': 'the refit study', '4.2931': 'bench conversion', '4.2944': 'bench conversion',
                      '0.472': "95% of the teacher's accuracy", '68.75': 'MHA2MLA (paper)', '96.8': 'MHA2MLA (paper)',
                      '0.25': 'MHA2MLA (paper)'}},
    ('docs/methods/dha.md', "## Fusion at a third of SmolLM2's cache"): {
        'files': ('bench_fusion.json', 'bench_fusion_budgets.json', 'bench_real.json', 'bench_real_dha.json'),
        'elsewhere': {'0.081': 'the run of 2026-11-28 (git show ac58914:docs/results/bench_fusion.json)',
                      '0.14': "mean-pool CT's move between two machines (git show 03e31c8:docs/results/bench_real_dha.json)",
                      '0.69': "the SmolLM2 token study's baked models, 5.383 - 4.693 (its section below)",
                      **dict.fromkeys(('0.312', '0.342', '0.281'),
                                      'the run of 2026-11-28 (git show 03e31c8:docs/results/bench_real_dha.json)')}},
    ('docs/benchmarks/quality.md', "## MLA on the quickstart teacher at the class's defaults"): {
        'files': ('bench_conversion_mla.json',),
        'elsewhere': {'4.2931': 'the 2026-11-25 run, the table above', '3.7700': 'the 2026-11-25 run, the table above',
                      '0.04': "a bound on the table's 0-token differences", '0.15': "the table's intervals, rounded"}},
    ('docs/methods/dha.md', "## DHA's tokens against GQA's"): {
        'files': ('bench_tokens.json', 'bench_tokens_smollm2.json'),
        'elsewhere': {'1.67': "bench conversion's single run (quality.md)",
                      '1.2': "GQA's tokens over DHA's mean Fusion tokens, by hand",
                      **{figure: 'the overturned run (git show 8f2b1f7:docs/results/bench_tokens.json)' for figure in
                         ('0.93', '0.90', '0.97', '0.42', '0.41', '0.49', '3.901', '3.966', '1.05', '0.94', '1.08')}}},
    ('docs/benchmarks/cost.md', '## `dha-train bench eval-speed`'): {
        'files': ('bench_eval_speed.json',), 'elsewhere': {'1.2': 'the profile, by hand'}},
}
DECIMAL = re.compile(r'\b\d+\.\d+\b')


def _numbers_in(value) -> list[float]:
    if isinstance(value, dict):
        return [number for item in value.values() for number in _numbers_in(item)]
    if isinstance(value, list):
        return [number for item in value for number in _numbers_in(item)]
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def quoted_prose_problems(page: str, heading: str, markdown: str) -> list[str]:
    spec = QUOTING_SECTIONS[(page, heading)]
    recorded = [n for name in spec['files'] for n in _numbers_in(json.loads((RESULTS / name).read_text()))]
    prose = section_prose(markdown, heading)
    problems = []
    for figure in DECIMAL.findall(prose):
        if figure in spec['elsewhere'] or any(agrees(figure, abs(number)) for number in recorded):  # sign apart
            continue
        problems.append(f'{page} ({heading}): {figure} is in no results file ({", ".join(spec["files"])})')
    return problems


@pytest.mark.parametrize('page, heading', list(QUOTING_SECTIONS))
def test_the_prose_figures_of_a_quoting_section_are_its_results(page, heading):
    assert quoted_prose_problems(page, heading, (REPO / page).read_text()) == []


def test_an_edited_prose_figure_of_the_healing_page_fails():
    page = (REPO / 'docs' / 'benchmarks' / 'healing.md').read_text()
    teacher = next(row for run in rerun_runs() for row in run['rows'] if row['label'] == 'teacher')
    quoted = f"**The teacher on the sample**: {teacher['val_loss']:.3f} ±"
    assert quoted in page
    edited = page.replace(quoted, f"**The teacher on the sample**: {teacher['val_loss'] + 0.01:.3f} ±", 1)
    assert quoted_prose_problems('docs/benchmarks/healing.md', '# How fast each method heals', edited) != []


RERUN = 'bench_real.json'  # one invocation of the bench with every method: 400 sampled documents a task
README_HEADLINE = '## Headline figures: every method on SmolLM2-135M'
RERUN_HEALING_LINE = '## The rows on record'


def test_the_rerun_healing_and_ranking_tables_are_the_bench_output():
    from dha_train.commands.bench.real.tables import healing_table, ranking_table

    page = (REPO / 'docs' / 'benchmarks' / 'healing.md').read_text()
    for table in (healing_table(rerun_runs()), ranking_table(rerun_runs())):
        assert table_problems(page, table, 'docs/benchmarks/healing.md', after=RERUN_HEALING_LINE) == []


def test_an_edited_place_or_mark_of_the_ranking_fails():
    from dha_train.commands.bench.real.tables import ranking_table

    page = (REPO / 'docs' / 'benchmarks' / 'healing.md').read_text()
    table = ranking_table(rerun_runs())
    second = next(line for line in table.splitlines() if line.split(' | ')[2] == '2')
    for edited in (second.replace(' | 2 | ', ' | 1 | ', 1), second.replace(']*', ']', 1)):
        assert edited != second and second in page
        assert table_problems(page.replace(second, edited, 1), table, 'docs/benchmarks/healing.md',
                              after=RERUN_HEALING_LINE) != []


def test_the_rerun_is_one_invocation_whose_ranking_rows_score_400_documents_with_intervals():
    (run,) = rerun_runs()
    assert run['command'].startswith('dha-train bench real ') and run['settings']['limit'] >= 400
    for row in run['rows']:
        if row.get('same_as'):
            continue
        assert row['val_loss_ci95'] > 0 and row['accuracy_ci95'] > 0, row['label']
        assert row['documents_per_task'] == (run['settings']['limit'] if row['evaluation'] == 'ranking'
                                             else run['settings']['intermediate_limit']), row['label']
        if row['method'] != 'teacher':
            assert len(row['vs_teacher']['accuracy']) == 3, row['label']


DHA_ROWS = 'bench_real_dha.json'  # bench real's DHA and mean-pool at a third, with the converging Fusion recipe
DHA_ROWS_LINE = "### DHA in `bench real` with the converging recipe"


def test_the_dha_page_rows_of_the_converging_recipe_are_the_bench_output():
    from dha_train.commands.bench.real.tables import headline_table, healing_table, load_runs

    page = (REPO / 'docs' / 'methods' / 'dha.md').read_text()
    runs = load_runs(RESULTS / DHA_ROWS)
    for table in (healing_table(runs), headline_table(runs)):
        assert table_problems(page, table, 'docs/methods/dha.md', after=DHA_ROWS_LINE) == []


# bench tokens: each teacher's table on the DHA page, under its own heading (the two tables share a header)
TOKEN_TABLES = {'bench_tokens.json': '### On the quickstart teacher, at a quarter of its cache',
                'bench_tokens_smollm2.json': '### On SmolLM2-135M, at two thirds of its cache'}


@pytest.mark.parametrize('results_file', list(TOKEN_TABLES))
def test_the_token_study_tables_are_the_bench_output(results_file):
    from dha_train.commands.bench.tokens import markdown_table

    page = (REPO / 'docs' / 'methods' / 'dha.md').read_text()
    results = json.loads((RESULTS / results_file).read_text())
    assert len(results['settings']['seeds']) >= 3 and all(len(runs) >= 3 for runs in results['runs'].values())
    assert table_problems(page, markdown_table(results), 'docs/methods/dha.md', after=TOKEN_TABLES[results_file]) == []


def test_an_edited_token_study_ratio_fails():
    from dha_train.commands.bench.tokens import markdown_table

    page = (REPO / 'docs' / 'methods' / 'dha.md').read_text()
    row = markdown_table(json.loads((RESULTS / 'bench_tokens.json').read_text())).splitlines()[-1]
    edited = page.replace(row, row.replace(' [', ' [9', 1), 1)
    assert edited != page
    assert table_problems(edited, row, 'docs/methods/dha.md', after=TOKEN_TABLES['bench_tokens.json']) != []


# bench conversion's MLA section (the quickstart teacher): its two tables on the quality page
CONVERSION_MLA = 'bench_conversion_mla.json'
CONVERSION_MLA_LINE = '## MLA on the quickstart teacher at the class\'s defaults (`dha-train bench conversion --sections mla`)'


@pytest.mark.parametrize('table', ['mla_table', 'mla_paired'])
def test_the_conversion_mla_tables_are_the_bench_output(table):
    from dha_train.commands.bench import conversion_mla

    page = (REPO / 'docs' / 'benchmarks' / 'quality.md').read_text()
    results = json.loads((RESULTS / CONVERSION_MLA).read_text())
    generated = (conversion_mla.mla_table(results) if table == 'mla_table'
                 else conversion_mla.mla_paired_table(results['mla_paired']))
    assert table_problems(page, generated, 'docs/benchmarks/quality.md', after=CONVERSION_MLA_LINE) == []


# --- held-out documents: the independent units of every loss interval ------------------------------------------
MIN_DOCUMENTS = 64  # dha_train.bench_runner.MIN_DOCUMENTS
# The results files whose rows carry a held-out loss interval or a paired loss difference.
LOSS_INTERVAL_FILES = ('bench_real.json', 'bench_real_dha.json', 'bench_fusion.json', 'bench_fusion_budgets.json',
                       'mla_zero.json')
# Written before the held-out texts were many capped documents: their loss intervals are over cuts of 2 documents
# (or an unrecorded count), which docs/status.md names; each leaves this list when its bench is re-run.
AWAITING_RERUN = ('bench_real.json',)


def recorded_documents(results) -> int | None:
    """The fewest documents any held-out split of a results file records: a split's ``units`` (what the benches
    write now), or a val manifest entry's ``documents`` (what they wrote before); None when it records none."""
    counts = []

    def walk(value):
        if isinstance(value, dict):
            units = value.get('units')
            if isinstance(units, dict) and isinstance(units.get('documents'), int):
                counts.append(units['documents'])
            elif {'samples', 'tokens', 'documents'} <= set(value) and isinstance(value['documents'], int):
                counts.append(value['documents'])
            for key, item in value.items():
                if key != 'units':
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
    walk(results.get('data', results))
    return min(counts) if counts else None


def document_problems(name: str, results: dict) -> list[str]:
    count = recorded_documents(results)
    if count is None or count < MIN_DOCUMENTS:
        return [f'{name}: its loss intervals are over {count or "an unrecorded number of"} held-out documents, '
                f'fewer than {MIN_DOCUMENTS}']
    return []


@pytest.mark.parametrize('name', LOSS_INTERVAL_FILES)
def test_every_loss_interval_is_over_64_documents_or_its_file_awaits_a_rerun(name):
    problems = document_problems(name, json.loads((RESULTS / name).read_text()))
    # a file on the list must still need its re-run, so the list cannot hide a file that has one
    assert bool(problems) == (name in AWAITING_RERUN), problems or f'{name} holds; take it off AWAITING_RERUN'


def test_a_results_file_with_63_documents_fails_and_64_holds():
    def results(documents):
        return {'data': {'heldout': {'units': {'sequences': 256, 'documents': documents}, 'manifest': {
            'val': {'samples': 256, 'tokens': 65536, 'documents': documents}}}}}
    assert document_problems('x', results(63)) and not document_problems('x', results(64))
    assert document_problems('x', {'data': {}})  # a file that records no count fails too


GEMMA_LINE = '## Gemma 3 270M, a second real teacher'


def test_the_gemma3_rows_on_the_families_page_are_the_bench_output():
    """docs/families.md's Gemma 3 270M table is `dha-train bench real-tables`' healing table of its results file,
    whose held-out split is over at least 64 documents."""
    from dha_train.commands.bench.real.tables import healing_table, load_runs

    results = RESULTS / 'bench_real_gemma3.json'
    page = (REPO / 'docs' / 'families.md').read_text()
    assert table_problems(page, healing_table(load_runs(results)), 'docs/families.md', after=GEMMA_LINE) == []
    assert document_problems(results.name, json.loads(results.read_text())) == []
