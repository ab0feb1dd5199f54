"""The MLA section of `bench conversion` (``conversion``): MLA conversions at the GQA rows' cache bytes, right
after conversion and after CT with and without distillation, each scored per sequence and paired with the
reference rows; and its tables, which the docs quote whole."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dha_train.conversion.mla import MlaSettings, convert_to_mla
from dha_train.evaluation import folder_sequence_losses, loss_interval, paired_loss_difference
from dha_train.methods import kv_cache_bytes
from dha_train.model_folders import load_model_config
from dha_train.stages import SEQ_LEN, ct_curve, validation_loss


def mla_variants() -> list[tuple[str, dict]]:
    """(name, MlaSettings changes) of the MLA rows: the default conversion first, then one choice changed each."""
    return [('default', {}), ('weight SVD', {'factorisation': 'weight'}), ('uniform pairs', {'pair_criterion': 'uniform'}),
            ('uniform ranks', {'ranks': 'uniform'}), ('no balance', {'balance': 'none'}),
            ('feature-norm balance', {'balance': 'feature_norm'}),
            ('no FreqFold', {'freq_fold': 1})]


def sequence_scorer(data: Path, into: dict):
    """``score(label, folder)``: the model's loss on each validation sequence of ``data`` (per domain), kept in
    ``into[label]`` for paired comparisons, and returned as (mean of the domains' means, its 95% half-width)."""
    def score(label: str, folder: str | Path) -> tuple[float, float]:
        into[label] = folder_sequence_losses(folder, {label: data})[label]
        return loss_interval(into[label], data)
    return score


def mla_rows(teacher: Path, data: Path, work: Path, fraction: float, batches: int | None, seed: int,
             eval_every: int | None = None, variants: Sequence[str] | None = None, into: list | None = None,
             save=lambda: None, score=None) -> list[dict]:
    """MLA conversions of ``teacher`` at ``fraction`` of its K+V cache, calibrated on ``data``: every variant's loss
    right after conversion; the default's after CT of ``batches`` (None: none), with and without distillation from
    the teacher. ``variants`` picks by name (default: all). Rows are appended to ``into`` (and ``save`` called) as
    they come. ``score`` (``sequence_scorer``): every model is also scored per sequence, its row's losses get 95%
    intervals and name the scores they came from (``scored_as``)."""
    rows = [] if into is None else into

    def scored(row: dict, point: str, label: str, folder: str | Path | None) -> dict:
        if score is None:
            return row
        return {**row, f'{point}_ci95': score(label, folder)[1], 'scored_as': {**row.get('scored_as', {}), point: label}}

    for name, change in mla_variants():
        if variants is not None and name not in variants:
            continue
        print(f'[bench] MLA ({name}): convert at {fraction:.4g} of the K+V cache ...', flush=True)
        folder = work / f'bench-mla-{name.replace(" ", "-")}'
        settings = MlaSettings(**{'cache_fraction': fraction, 'data': str(data), 'rank_step': 1,
                                  'seed': seed, **change})
        report = convert_to_mla(teacher, folder, settings, overwrite=True)
        mla_config = load_model_config(folder, who='bench conversion')
        resolved = {'rope_pairs': report['rope_pairs'], 'freq_fold': report['freq_fold']}
        row = {'variant': name, 'settings': {**{k: v for k, v in vars(settings).items() if k != 'data'}, **resolved},
               'ranks': report['ranks'], 'fraction_of_source': report['fraction_of_source'],
               'kv_bytes_per_token': kv_cache_bytes(mla_config, seq_len=1), 'after_training': None, 'tokens': 0}
        row = scored(row, 'after_conversion', f'MLA {name} @0', folder)
        if name != 'default' or batches is None:
            rows.append({**row, 'after_conversion': validation_loss(data, folder)})
            save()
            continue
        every = eval_every or batches
        export = work / 'bench-mla-ct-hf' if score is not None else None
        plain = ct_curve(data, work, folder, 'bench-mla-ct', batches, every, SEQ_LEN, recipe='mla/tiny_ct.yaml',
                         export=export)
        trained = {**row, 'after_conversion': plain['curve'][0][1], 'after_training': plain['final'],
                   'tokens': plain['tokens'], 'curve': plain['curve']}
        rows.append(scored(trained, 'after_training', f'MLA {name} +CT', export))
        save()
        print(f'[bench] MLA ({name}): CT with distillation from the teacher ({batches} batches) ...', flush=True)
        export = work / 'bench-mla-distill-hf' if score is not None else None
        distilled = ct_curve(data, work, folder, 'bench-mla-distill', batches, every, SEQ_LEN,
                             recipe='mla/tiny_ct.yaml', overrides=[f'algorithms.distillation.teacher_path={teacher}',
                                                                   'algorithms.distillation.top_k=16'], export=export)
        trained = {**row, 'variant': 'default, distilled',
                   'after_conversion': plain['curve'][0][1], 'after_training': distilled['final'],
                   'tokens': distilled['tokens'], 'curve': distilled['curve']}
        rows.append(scored(trained, 'after_training', f'MLA {name}, distilled +CT', export))
        save()
    return rows


# Which reference each MLA row's point is compared with, on the same sequences: at 0 tokens mean-pool GQA's start;
# after training mean-pool GQA and DHA after the same tokens.
MLA_PAIRS = (('after_conversion', 'gqa_at_0'), ('after_training', 'gqa_after_ct'), ('after_training', 'dha_after_ct'))


def mla_paired(rows: list[dict], reference: dict, sequences: dict, data: Path, seed: int) -> list[dict]:
    """Each MLA row's loss minus a reference row's (``MLA_PAIRS``), with a 95% paired bootstrap interval over the
    validation sequences both were scored on."""
    paired, done = [], set()
    for row in rows:
        for point, against in MLA_PAIRS:
            label = row.get('scored_as', {}).get(point)
            if label is None or (label, against) in done:  # the distilled row shares the default's 0-token model
                continue
            done.add((label, against))
            difference, low, high = paired_loss_difference(sequences[reference[against]['label']],
                                                           sequences[label], data, seed=seed)
            paired.append({'row': label, 'against': reference[against]['label'], 'point': point,
                           'difference': difference, 'ci95': [low, high]})
    return paired


def _cell(loss: float | None, ci95: float | None) -> str:
    if loss is None:
        return ''
    return f'{loss:.4f}' + ('' if ci95 is None else f' ± {ci95:.4f}')


def mla_table(results: dict) -> str:
    """The MLA section as a Markdown table: the reference rows and every MLA row, loss at 0 tokens and after the
    equal budget, each with its 95% interval over validation sequences (the docs quote it whole)."""
    reference = results['reference']
    tokens = results['equal_budget_tokens']
    lines = [f'| row | KV bytes / token | val loss at 0 tokens | val loss after {tokens:,} training tokens |',
             '| --- | --- | --- | --- |',
             f'| MHA teacher | {results["teacher_kv_bytes_per_token"]} | '
             f'{_cell(reference["teacher"]["loss"], reference["teacher"]["ci95"])} | |']
    for start, trained, name in (('gqa_at_0', 'gqa_after_ct', 'GQA, mean-pool of neighbour heads, then CT'),
                                 ('dha_at_0', 'dha_after_ct', 'DHA: the Search\'s groups mean-pooled at 0 tokens; '
                                                              'Fusion, then CT')):
        lines.append(f'| {name} | {results["gqa_kv_bytes_per_token"]} | '
                     f'{_cell(reference[start]["loss"], reference[start]["ci95"])} | '
                     f'{_cell(reference[trained]["loss"], reference[trained]["ci95"])} |')
    for row in results['mla']:
        settings = row['settings']
        what = (f'MLA, {row["variant"]} ({settings["rope_pairs"]} RoPE pairs per K/V head, FreqFold '
                f'{settings["freq_fold"]}, ranks {row["ranks"]})')
        lines.append(f'| {what} | {row["kv_bytes_per_token"]} | '
                     f'{_cell(row["after_conversion"], row.get("after_conversion_ci95"))} | '
                     f'{_cell(row["after_training"], row.get("after_training_ci95"))} |')
    return '\n'.join(lines)


def mla_paired_table(paired: list[dict]) -> str:
    """The paired differences (``mla_paired``) as a Markdown table."""
    lines = ['| MLA row | minus | difference [95%] |', '| --- | --- | --- |']
    for entry in paired:
        low, high = entry['ci95']
        interval = '' if low is None else f' [{low:+.4f}, {high:+.4f}]'  # None: a text of one document
        lines.append(f'| {entry["row"]} | {entry["against"]} | {entry["difference"]:+.4f}{interval} |')
    return '\n'.join(lines)


def print_mla_paired(paired: list[dict]) -> None:
    print()
    print('  MLA rows minus a reference row, on the same validation sequences (95% paired bootstrap):')
    print(mla_paired_table(paired))
