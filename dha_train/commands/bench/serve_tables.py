"""`bench serve`'s tables and plots, made from its results (what the serving page quotes and the figures test checks
whole)."""

from __future__ import annotations

from pathlib import Path

from dha_train.plots import plot_curves

TARGET_DECODE_RATIO, TARGET_CONTEXT, TARGET_SEQUENCES, TARGET_CAPACITY_RATIO = 1.5, 8192, 8, 3.0


def _counts(report: dict) -> list[int]:
    return sorted({row['sequences'] for row in report['rows']})


def _ratio(value: float | None) -> str:
    return '-' if value is None else f'{value:.2f}x'


def decode_table(report: dict) -> str:
    """Per model, weights, cache type and context: one sequence's K+V MiB and prompt tokens/s, and the aggregate
    decode tokens/s at each count of sequences, each against the source's."""
    counts = _counts(report)
    lines = ['| model | weights | cache | context | K+V MiB a sequence | x source | prompt tok/s | x source | '
             + ' | '.join(f'decode tok/s, {count} seq. (x source)' for count in counts) + ' |',
             '| --- | --- | --- | --- | --- | --- | --- | --- |' + ' --- |' * len(counts)]
    by_key = {(row['model'], row['outtype'], row['cache_type'], row['context'], row['sequences']): row
              for row in report['rows']}
    for model, outtype, cache_type, context in dict.fromkeys(
            (row['model'], row['outtype'], row['cache_type'], row['context']) for row in sorted(
                report['rows'], key=lambda row: (row['outtype'], row['cache_type'], row['context']))):
        first = by_key[model, outtype, cache_type, context, counts[0]]
        source = by_key.get(('source', outtype, cache_type, context, counts[0]))
        kv_ratio = first['kv_mib_per_sequence'] / source['kv_mib_per_sequence'] if source else None
        cells = [f"{by_key[model, outtype, cache_type, context, count]['decode_tps']:.1f} "
                 f"({_ratio(by_key[model, outtype, cache_type, context, count]['decode_tps_ratio'])})"
                 for count in counts]
        lines.append(f"| {model} | {outtype} | {cache_type} | {context} | {first['kv_mib_per_sequence']:.2f} | "
                     f"{_ratio(kv_ratio)} | {first['prompt_tps']:.0f} | {_ratio(first['prompt_tps_ratio'])} | "
                     + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def capacity_table(report: dict) -> str:
    context = max((entry['context'] for entry in report['capacity']), default=0)
    budget = report['settings']['cache_budget_mib']
    lines = [f'| model | weights | cache | K+V MiB a {context}-token sequence | sequences in {budget:g} MiB | x source |',
             '| --- | --- | --- | --- | --- | --- |']
    for entry in sorted(report['capacity'], key=lambda e: (e['outtype'], e['cache_type'])):
        lines.append(f"| {entry['model']} | {entry['outtype']} | {entry['cache_type']} | "
                     f"{entry['kv_mib_per_sequence']:.2f} | {entry['sequences_fit']} | {_ratio(entry['ratio'])} |")
    return '\n'.join(lines)


def _verdict(value: float | None, met: bool | None) -> str:
    return '-' if value is None else f"{value:.2f}x, **{'met' if met else 'not met'}**"


def targets_table(report: dict) -> str:
    lines = [f'| model | weights | cache | decode at {TARGET_SEQUENCES} x {TARGET_CONTEXT} vs source (target >= '
             f'{TARGET_DECODE_RATIO}x) | sequences in the budget vs source (target >= {TARGET_CAPACITY_RATIO:.0f}x) |',
             '| --- | --- | --- | --- | --- |']
    for verdict in report['targets']:
        if 'overtakes_at' in verdict:
            continue
        lines.append(f"| {verdict['model']} | {verdict['outtype']} | {verdict['cache_type']} | "
                     f"{_verdict(verdict['decode_ratio'], verdict['decode_met'])} | "
                     f"{_verdict(verdict['capacity_ratio'], verdict['capacity_met'])} |")
    return '\n'.join(lines)


def loss_table(report: dict) -> str:
    columns = [key for key in next(iter(report['losses'].values()), {}) if key.startswith('llama_cpp_')]
    titles = [f"llama.cpp, {key.split('_')[2]} weights, {'_'.join(key.split('_')[3:])} cache" for key in columns]
    lines = ['| model | HF float32 | ' + ' | '.join(titles) + ' |', '| --- | --- |' + ' --- |' * len(columns)]
    for name, loss in report['losses'].items():
        lines.append(f"| {name} | {loss['hf_float32']:.4f} | "
                     + ' | '.join('refused' if loss[key] is None else f'{loss[key]:.4f}' for key in columns) + ' |')
    return '\n'.join(lines)


def plot_serve(report: dict, out: Path) -> list[str]:
    """Aggregate decode tokens/s against sequences, one plot per context, weights and cache type."""
    written = []
    for outtype, cache_type, context in sorted({(row['outtype'], row['cache_type'], row['context'])
                                                for row in report['rows']}):
        curves = {name: [(row['sequences'], row['decode_tps']) for row in report['rows'] if row['model'] == name
                         and row['outtype'] == outtype and row['cache_type'] == cache_type
                         and row['context'] == context] for name in report['models']}
        path = out / f'decode_{context}_{outtype}_{cache_type}.png'
        plot_curves({name: points for name, points in curves.items() if points}, path,
                    title=f'llama.cpp aggregate decode, {context}-token sequences, {outtype} weights, {cache_type} '
                    f'cache, {report["threads"]} threads', xlabel='sequences decoded together',
                    ylabel='decode tokens/s, all sequences')
        written.append(str(path))
    return written
