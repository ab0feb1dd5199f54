"""`dha-train bench mla-zero`: MLA conversions at 0 training tokens, at equal cached numbers, on texts kept apart.

The question it answers: which conversion of a GQA checkpoint to MLA loses least before any training, on text no
conversion calibrated on, and which defaults hold across texts of different kinds. The source, its calibration text
and the first held-out text are `bench real`'s (same ``--out`` folder, reused): SmolLM2-135M, the Python standard
library (calibration, 16,384 tokens for every row, the same sequences; its 8,192-token val split is what `convert`
chooses its split and balance on) and ``/usr/share/doc`` (held out). The other texts, each ``--text-tokens`` at
``text_seq_len`` a sequence from documents cut to their first ``max_document_chars`` (so every sequence starts in
another document and the documents are the intervals' units; the results record their count, ``text_splits``):

- validation (three kinds, what fixed defaults and TransMLA's setting are chosen on): vim's help files
  (``/usr/share/vim/vim*/doc``, ``--validation``), C headers (``/usr/include``, ``--headers``) and Markdown
  documentation (``/usr/lib/node_modules``, ``--markdown``);
- book: a book given by ``--book`` (default: The Rust Programming Language as rustup installs it, when present),
  held out; left out, and the results say so, where there is none;
- fresh: held out, a text nothing in the project was designed, tuned or chosen on (``--fresh``; default: Perl's
  bundled POD documentation and modules under ``/usr/share/perl/5.*``).

Rows per budget (``kv1``: a third of the source's K+V numbers per token, ``kv2``: two thirds):

- ``deepseek``: ``convert --method mla --format deepseek`` with its defaults (the layout engines serve; the split and
  balance chosen on the calibration data's val split, the choice in the row);
- ``deepseek_candidates``: every split and balance that choice is among, each asked for by name, scored on every
  text (``deepseek_candidates``); ``fixed_default`` is the one of the lowest mean loss over the validation texts, and
  every candidate's paired difference from the former default (the unrounded split, the energy balance) per text;
- ``mla``: ``convert --method mla`` (the project's MLA class) as `bench real` runs it;
- ``mean_pool_refit``: the source mean-pooled to the budget's K/V heads, then ``dha-train refit``;
- ``transmla``: TransMLA's own converter (``--transmla``: a checkout of github.com/fxmeng/TransMLA, run unchanged in
  a subprocess; only its data loading is replaced, by the same calibration sequences; ``transmla_runner``), its
  latent rank the budget less its RoPE key. It gets the tuning the project's defaults had: every RoPE key width of
  ``--transmla-rope-dims`` (16, 32, 64) with every FreqFold of ``--transmla-folds`` (2, 4, 8) that its converter
  accepts (the fold a multiple of head_dim / width) is converted and scored on vim's text (``transmla_search``);
  the setting with the lowest loss there is its row, with its defaults (a 64-dim key, fold 4, as its scripts run it)
  as a second row when they were not chosen. Left out when no checkout is given.

Columns: the loss on each text (the mean of its sequences' losses, with a 95% interval over documents), accuracy
(acc_norm) on the first ``--limit`` validation documents of piqa and arc_easy, zero-shot, and per layer the relative
error of the attention output when every layer reads the teacher's own input (``evaluation.attention_output_errors``):
where the loss goes. Writes ``mla_zero/results.json`` under ``--out`` and prints the tables (``mla_zero_tables``).
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dha_train.bench_runner import StageRunner, model_config, prepare_data, say, source_folder
from dha_train.bench_settings import RealSettings, resolve_settings
from dha_train.bench_support import write_results
from dha_train.commands.bench.mla_zero_rows import (
    FORMER_DEFAULT,
    FRACTIONS,
    LABELS,
    ROWS,
    TEXTS,
    fixed_default,
    gather_texts,
    paired_rows,
    search_label,
    slug,
)
from dha_train.commands.bench.mla_zero_tables import (
    candidates_table,
    markdown_table,
    paired_table,
    print_table,
    search_table,
    versus_former_table,
)
from dha_train.commands.bench.transmla_runner import (
    CALIBRATION_BATCH,
    TRANSMLA_DEFAULTS,
    adopt_transmla,
    calibration_sequences,
    check_transmla,
    choose_on_validation,
    run_transmla,
    set_latent_norm_aside,
    transmla_candidates,
)
from dha_train.config import ConfigError
from dha_train.conversion import deepseek_choice
from dha_train.conversion.deepseek import DeepseekSettings, convert_to_deepseek, quantizable_fits
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.conversion.mla import MlaSettings, convert_to_mla
from dha_train.conversion.refit import RefitSettings, refit_folder
from dha_train.evaluation import (
    attention_output_errors,
    domain_means,
    load_model,
    loss_interval,
    run_eval,
    sequence_losses,
)
from dha_train.harness import headline
from dha_train.heldout_texts import folder_units
from dha_train.model_folders import folder_digest

# the tables the docs quote, read from here by the figures test (BENCH_TABLES names this module)
__all__ = ['MlaZeroSettings', 'candidates_table', 'markdown_table', 'paired_table', 'run_mla_zero_bench',
           'search_table', 'versus_former_table']

@dataclass
class MlaZeroSettings:
    out: str = 'bench_real'
    budgets: Sequence[str] = ('kv1', 'kv2')
    rows: Sequence[str] = ROWS
    transmla: str | None = None  # a TransMLA checkout (the repository's root)
    transmla_python: str = sys.executable
    book: str | None = None  # a folder or a glob of HTML / text files (default: the Rust book's chapters, if present)
    validation: str | None = None  # a folder or a glob (default: vim's help files)
    fresh: str | None = None  # a folder or a glob (default: Perl's POD and modules)
    headers: str | None = None  # a folder or a glob: the validation text of code (default: /usr/include's C headers)
    markdown: str | None = None  # the validation text of Markdown (default: the Node.js modules' Markdown files)
    transmla_rope_dims: Sequence[int] = (16, 32, 64)  # TransMLA's RoPE key widths searched
    transmla_folds: Sequence[int] = (2, 4, 8)  # and its FreqFolds
    tokens: int = 16384  # calibration tokens of every row
    text_tokens: int = 16384  # tokens scored on each text but /usr/share/doc (bench real's): 64 sequences of 256
    texts: Sequence[str] = TEXTS  # the texts scored (TransMLA's search needs validation)
    # each document's first characters only (about 150 tokens, under a sequence), so each of a text's 64 sequences
    # starts in another document: a sequence counts as one of the document its first token is of, so the documents
    # are the sequences' independent units (None: whole documents, as the 2026-11-27 rows were made; 4,096 until
    # 2026-12-03, when the texts' 32 sequences of 512 came from 13 to 18 documents)
    max_document_chars: int | None = 512
    text_seq_len: int = 256
    limit: int = 200
    tasks: Sequence[str] = ('piqa', 'arc_easy')
    source: str = 'smollm2-135m'
    device: str = 'auto'
    seed: int = 17
    results: str | None = None  # also write the results file here (docs/results/mla_zero.json)
    # bench real's settings for the calibration and /usr/share/doc texts (None: its defaults for the device)
    train_data: str | None = None
    seq_len: int | None = None
    val_tokens: int | None = None
    include: Sequence[str] = ()  # extra lm-eval task folders (tests: a local task)
    isolate_stages: bool = True


# --- the bench ----------------------------------------------------------------------------------------------------
def run_mla_zero_bench(settings: MlaZeroSettings | None = None) -> dict:
    settings = settings or MlaZeroSettings()
    unknown = sorted(set(settings.rows) - set(ROWS)) + sorted(set(settings.budgets) - set(FRACTIONS))
    if unknown or not settings.rows or not settings.budgets:
        raise ConfigError(f'bench mla-zero: rows must be among {", ".join(ROWS)} and budgets among kv1, kv2; got '
                          f'{list(settings.rows)} and {list(settings.budgets)}')
    if settings.tokens < 1 or settings.limit < 1 or settings.text_tokens < settings.text_seq_len:
        raise ConfigError('bench mla-zero: --tokens and --limit must be >= 1, --text-tokens at least one sequence')
    if not set(settings.texts) <= set(TEXTS) or not settings.texts:
        raise ConfigError(f'bench mla-zero: --texts must be among {", ".join(TEXTS)}, got {list(settings.texts)}')
    if 'transmla' in settings.rows and settings.transmla and 'validation' not in settings.texts:
        raise ConfigError('bench mla-zero: TransMLA\'s setting is chosen on the validation text: --texts needs '
                          'validation')
    transmla = Path(settings.transmla).resolve() if settings.transmla else None
    if transmla is not None:
        check_transmla(transmla)
    real = resolve_settings(RealSettings(
        out=settings.out, device=settings.device, source=settings.source, seed=settings.seed,
        tasks=tuple(settings.tasks), limit=settings.limit, include=tuple(settings.include),
        train_data=settings.train_data, seq_len=settings.seq_len, val_tokens=settings.val_tokens,
        isolate_stages=settings.isolate_stages))
    work = Path(real.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    source = source_folder(work, real.source)
    digest = folder_digest(source)
    train_data, heldout, data = prepare_data(work, source, real, digest)
    runner = StageRunner(real, work, source, digest, train_data, heldout)
    runs = work / 'mla_zero'

    texts, notes = gather_texts(settings, runner, heldout, data)

    config = model_config(source)
    kv_heads, dim = config.num_key_value_heads, runner.source_map.head_dim
    numbers = 2 * kv_heads * dim  # the source's cached numbers per token per layer
    # every TransMLA setting to convert, per budget
    candidates = {budget: transmla_candidates(dim, settings.transmla_rope_dims, settings.transmla_folds,
                                              round(FRACTIONS[budget] * numbers)) for budget in settings.budgets}
    for budget, accepted in candidates.items():
        if transmla is not None and 'transmla' in settings.rows and not accepted:
            raise ConfigError(f'bench mla-zero: no TransMLA setting of --transmla-rope-dims '
                              f'{list(settings.transmla_rope_dims)} and --transmla-folds '
                              f'{list(settings.transmla_folds)} fits a head of {dim} at {budget}')
    calibration = {'data': str(train_data), 'tokens': settings.tokens, 'batch_size': CALIBRATION_BATCH,
                   'seed': settings.seed, 'device': real.device}

    def conversion(row: str, budget: str):
        fraction = FRACTIONS[budget]
        heads = round(fraction * kv_heads)
        if row == 'deepseek':
            convert_settings = DeepseekSettings(cache_fraction=fraction, data=str(train_data), tokens=settings.tokens,
                                                batch_size=CALIBRATION_BATCH, seed=settings.seed, device=real.device)

            def build(out: Path) -> dict:
                report = convert_to_deepseek(source, out / 'hf', convert_settings, overwrite=True)
                return {'hf_folder': str(out / 'hf'), 'setting': {key: report[key] for key in (
                    'kv_lora_rank', 'qk_rope_head_dim', 'freq_fold', 'latent_norm_fit', 'balance',
                    'quantizable_cache', 'choice')}}
            return build, asdict(convert_settings)
        if row == 'mla':
            convert_settings = MlaSettings(cache_fraction=fraction, data=str(train_data), tokens=settings.tokens,
                                           rank_step=1, seed=settings.seed, device=real.device)

            def build(out: Path) -> dict:
                report = convert_to_mla(source, out / 'hf', convert_settings, overwrite=True)
                return {'hf_folder': str(out / 'hf'), 'setting': {
                    'rope_pairs': report['rope_pairs'], 'freq_fold': report['freq_fold'],
                    'latent_ranks': [min(report['ranks']), max(report['ranks'])]}}
            return build, asdict(convert_settings)
        if row == 'mean_pool_refit':
            refit_settings = RefitSettings(data=str(train_data), tokens=settings.tokens, seed=settings.seed,
                                           device=real.device)

            def build(out: Path) -> dict:
                from dha_train.models.head_map import HeadMap

                pooled = convert_checkpoint(source, out / 'pooled', HeadMap.pooled(runner.source_map, heads),
                                            overwrite=True)
                refit_folder(source, pooled, out / 'hf', refit_settings, overwrite=True)
                return {'hf_folder': str(out / 'hf'), 'setting': {'kv_heads': heads}}
            return build, {'heads': heads, **asdict(refit_settings)}
        raise ValueError(f'no conversion named {row}')

    def transmla_conversion(budget: str, rope_dim: int, freq_fold: int):
        rank = round(FRACTIONS[budget] * numbers) - rope_dim

        def build(out: Path) -> dict:
            sequences = out / 'calibration.pt'
            rows = calibration_sequences(source, train_data, settings.tokens, CALIBRATION_BATCH, settings.seed)
            torch.save(rows, sequences)
            run_transmla(transmla, settings.transmla_python, source, sequences, out / 'hf', rank, rope_dim, freq_fold,
                         out / 'reference.pt')
            check = adopt_transmla(out / 'hf', out / 'adopted', source, out / 'reference.pt')
            return {'hf_folder': str(out / 'adopted'), 'setting': {
                'kv_lora_rank': rank, 'qk_rope_head_dim': rope_dim, 'freq_fold': freq_fold,
                'checkout': str(transmla), **check}}
        reads = {'checkout': str(transmla), 'rank': rank, 'rope_dim': rope_dim, 'freq_fold': freq_fold,
                 'adopted': 'deepseek_v3, latent norm set aside, checked against its own classes', **calibration}
        return runner.stage(runs, f'transmla-{budget}-r{rope_dim}-f{freq_fold}', build, **reads)

    def norm_read(latent_norm: bool) -> dict:  # only a set-aside norm is a read: other stages keep their names
        return {} if latent_norm else {'latent_norm': False}

    def load(folder: str, latent_norm: bool):
        model, tokenizer = load_model(folder, device=real.device)
        if not latent_norm:
            set_latent_norm_aside(model)
        return model, tokenizer

    def score_texts(label: str, folder: str, names: Sequence[str] = TEXTS, latent_norm: bool = True) -> dict:
        """The loss of every sequence of each text of ``names`` (one stage a text, so a model scored on some texts
        is scored on the rest without repeating them). ``latent_norm=False``: TransMLA's models."""
        sequences = {}
        for name in (name for name in names if name in texts):
            def build(out: Path, root=texts[name]) -> dict:
                model, tokenizer = load(folder, latent_norm)
                return {'sequence_losses': sequence_losses(model, tokenizer, root, batch_size=8, device=real.device)}
            sequences[name] = runner.stage(runs / 'texts', f'{slug(label)}-{name}', build, model=folder,
                                           text=str(texts[name]), **norm_read(latent_norm))['sequence_losses']
        return {'loss': {name: domain_means(values)['mean'] for name, values in sequences.items()},
                'loss_ci95': {name: loss_interval(values, texts[name])[1] for name, values in sequences.items()},
                'sequence_losses': sequences}

    def score(label: str, folder: str, latent_norm: bool = True) -> dict:
        """The texts, the tasks and the per-layer attention errors."""
        def build(out: Path) -> dict:
            scores = {} if not settings.tasks else run_eval(
                folder, tasks=list(settings.tasks), num_fewshot=0, limit=settings.limit, out=out,
                include=list(settings.include), batch_size=real.eval_batch_size, device=real.device, name=label,
                seed=settings.seed)['scores']
            model, _ = load(folder, latent_norm)
            teacher, _ = load_model(source, device=real.device)
            probe = _probe_batch(heldout)
            errors = attention_output_errors(teacher, model, probe.to(real.device))
            accuracy = {task: (headline(scores.get(task, {})) or (None, None))[1] for task in settings.tasks}
            return {'accuracy': accuracy, 'layer_errors': errors}
        tasks = runner.stage(runs / 'eval', slug(label), build, model=folder, tasks=list(settings.tasks),
                             include=list(map(str, settings.include)), limit=settings.limit,
                             **norm_read(latent_norm))
        return {**score_texts(label, folder, latent_norm=latent_norm), 'accuracy': tasks['accuracy'], 'layer_errors': tasks['layer_errors']}

    def transmla_rows(budget: str) -> list[dict]:
        """Every accepted (width, fold) converted and scored on the texts; the lowest on validation, and TransMLA's
        defaults, as full rows."""
        search = []
        for rope_dim, freq_fold in candidates[budget]:
            say(f'mla-zero: TransMLA at {budget}, a {rope_dim}-dim RoPE key, fold {freq_fold}')
            converted = transmla_conversion(budget, rope_dim, freq_fold)
            # the search reads validation alone (its row is scored on the other texts after)
            scored = score_texts(search_label(budget, rope_dim, freq_fold), converted['hf_folder'], ('validation',),
                                 latent_norm=False)
            search.append({'budget': budget, **converted['setting'], 'convert_s': converted['seconds'],
                           'hf_folder': converted['hf_folder'], 'loss': scored['loss'],
                           'loss_ci95': scored['loss_ci95']})
        best = choose_on_validation(search)
        for entry in search:
            entry['chosen'] = entry is best
        results.setdefault('transmla_search', []).extend(search)
        rows = []
        for entry in [best] + [e for e in search if (e['qk_rope_head_dim'], e['freq_fold']) == TRANSMLA_DEFAULTS
                               and e is not best]:
            what = [] if entry is not best else ['chosen on validation']
            if (entry['qk_rope_head_dim'], entry['freq_fold']) == TRANSMLA_DEFAULTS:
                what.insert(0, 'its defaults')
            label = (f"TransMLA {entry['qk_rope_head_dim']}-dim key, fold {entry['freq_fold']} "
                     f"({', '.join(what)}) {budget}")
            scored = score(search_label(budget, entry['qk_rope_head_dim'], entry['freq_fold']), entry['hf_folder'],
                           latent_norm=False)
            rows.append({'label': label, 'row': 'transmla', 'budget': budget,
                         'numbers': round(FRACTIONS[budget] * numbers),
                         **{key: entry[key] for key in ('kv_lora_rank', 'qk_rope_head_dim', 'freq_fold', 'checkout',
                                                         'convert_s', 'reference_max_abs_logit_difference')},
                         **({'chosen_on': 'validation'} if entry is best else {}), **scored})
        return rows

    def deepseek_candidate_rows(budget: str) -> list[dict]:
        """Every split and balance `convert` chooses among, each asked for by name (no choice), scored on every text:
        what the fixed defaults are chosen on (``fixed_default``)."""
        fraction = FRACTIONS[budget]
        probe = DeepseekSettings(cache_fraction=fraction)
        entries = []
        for option in deepseek_choice.candidates(None, None, quantizable_fits(config, probe)):
            say(f'mla-zero: DeepSeek layout at {budget}, {option.label}')
            convert_settings = DeepseekSettings(
                cache_fraction=fraction, quantizable_cache=option.quantizable_cache, balance=option.balance,
                choose_tokens=0, data=str(train_data), tokens=settings.tokens, batch_size=CALIBRATION_BATCH,
                seed=settings.seed, device=real.device)

            def build(out: Path, convert_settings=convert_settings) -> dict:
                report = convert_to_deepseek(source, out / 'hf', convert_settings, overwrite=True)
                return {'hf_folder': str(out / 'hf'), 'setting': {key: report[key] for key in (
                    'kv_lora_rank', 'qk_rope_head_dim', 'rope_stride', 'quantizable_cache', 'balance')}}
            converted = runner.stage(runs, f'deepseek-{budget}-{slug(option.label)}', build,
                                     **asdict(convert_settings))
            scored = score_texts(f'DeepSeek {budget} {option.label}', converted['hf_folder'])
            entries.append({'budget': budget, 'label': option.label, **converted['setting'],
                            'former_default': option == FORMER_DEFAULT, 'convert_s': converted['seconds'],
                            'loss': scored['loss'], 'loss_ci95': scored['loss_ci95'],
                            'sequence_losses': scored['sequence_losses']})
        return entries

    results = {'source': {'folder': str(source), 'sha256': digest, 'cached_numbers_per_token_per_layer': numbers},
               'texts': notes, 'text_splits': {name: {'root': str(root), 'units': folder_units(root)}
                                               for name, root in texts.items()},
               'settings': {**asdict(settings), 'budgets': list(settings.budgets),
                                            'texts': list(settings.texts),
                                            'rows': list(settings.rows), 'tasks': list(settings.tasks)},
               'rows': []}
    def save(copy_to: str | None = None) -> None:  # after every row, so a stopped run leaves what it measured
        write_results(results, runs, copy_to)

    teacher = score('teacher', str(source))
    results['rows'].append({'label': 'teacher', 'row': 'teacher', 'budget': None, 'numbers': numbers, **teacher})
    for budget in settings.budgets:
        for row in settings.rows:
            if row == 'transmla' and transmla is None:
                results.setdefault('skipped', []).append({'row': row, 'budget': budget,
                                                          'reason': 'no --transmla checkout given'})
                continue
            if row == 'transmla':
                results['rows'] += transmla_rows(budget)
                save()
                continue
            if row == 'deepseek_candidates':
                entries = deepseek_candidate_rows(budget)
                results.setdefault('deepseek_candidates', []).extend(
                    {key: value for key, value in entry.items() if key != 'sequence_losses'} for entry in entries)
                results.setdefault('fixed_default', []).append(fixed_default(entries, texts, seed=settings.seed))
                save()
                continue
            say(f'mla-zero: {LABELS[row]} at {budget}')
            started = time.perf_counter()
            build, reads = conversion(row, budget)
            converted = runner.stage(runs, f'{row}-{budget}', build, **reads)
            scored = score(f'{LABELS[row]} {budget}', converted['hf_folder'])
            results['rows'].append({'label': f'{LABELS[row]} {budget}', 'row': row, 'budget': budget,
                                    'numbers': round(FRACTIONS[budget] * numbers), **converted['setting'],
                                    'convert_s': converted['seconds'], **scored,
                                    'wall_s': round(time.perf_counter() - started, 1)})
            save()
        chosen = [r for r in results['rows'] if r['budget'] == budget and r.get('chosen_on') == 'validation']
        if chosen:
            results.setdefault('paired', []).extend(paired_rows(results['rows'], chosen[0], texts, seed=settings.seed))
    save(settings.results)
    print_table(results)
    print(f'  results.json in {runs}')
    return results


def _probe_batch(heldout: Path, rows: int = 4) -> torch.Tensor:
    """The first ``rows`` sequences of the held-out text's val split (for the per-layer errors)."""
    from dha_train.data.loaders import split_sequences

    manifest = json.loads((heldout / 'manifest.json').read_text())
    domain = sorted(manifest['domains'])[0]
    return torch.as_tensor(np.stack(split_sequences(heldout, domain, 'val')[:rows]), dtype=torch.long)
