"""The rows, texts and pairings of `bench mla-zero` (``mla_zero``): what is compared, and the paired differences
and the fixed default read from the scored rows."""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from dha_train.bench_runner import text_folder
from dha_train.config import ConfigError
from dha_train.conversion.deepseek_choice import Candidate
from dha_train.evaluation import paired_loss_difference
from dha_train.heldout_texts import BOOK_GLOB, HEADERS_GLOB, MARKDOWN_GLOB, VALIDATION_GLOB, text_files

ROWS = ('deepseek', 'deepseek_candidates', 'mla', 'mean_pool_refit', 'transmla')
LABELS = {'deepseek': 'DeepSeek layout', 'mla': 'MLA class', 'mean_pool_refit': 'mean-pool + refit',
          'transmla': 'TransMLA'}
# The DeepSeek layout's split and balance before issue 47 (the unrounded split, the energy balance): the reference
# every candidate is set beside, text by text.
FORMER_DEFAULT = Candidate(quantizable_cache=False, balance='energy')
FRACTIONS = {'kv1': 1 / 3, 'kv2': 2 / 3}
# Named on 2026-11-28, before any row was scored on it: Perl's documentation, prose about a language no conversion
# calibrates on (the calibration text is Python), in a markup (POD) none of the other texts uses.
# Its 54 .pod files are too few documents for an interval (64 at least), so the modules' own POD and code (.pm) join
# them (2026-12-03): a text of that name before then was the .pod files alone.
DEFAULT_FRESH_GLOB = '/usr/share/perl/5.*/**/*.p*'  # text_documents reads the .pod and .pm
TEXTS = ('validation', 'validation_headers', 'validation_markdown', 'heldout_doc', 'heldout_book', 'heldout_fresh')
VALIDATION_TEXTS = ('validation', 'validation_headers', 'validation_markdown')  # what fixed defaults are chosen on


def paired_rows(rows: Sequence[dict], reference: dict, texts: dict[str, Path], *, seed: int) -> list[dict]:
    """Each row of ``reference``'s budget against ``reference`` on every text both were scored on: the difference
    of the mean loss per sequence (row minus reference; below 0, the row is better) and its 95% bootstrap interval,
    the same sequences drawn for both."""
    paired = []
    for row in rows:
        if row['budget'] != reference['budget'] or row is reference:
            continue
        for text, sequences in row['sequence_losses'].items():
            if text in reference['sequence_losses']:
                difference, low, high = paired_loss_difference(reference['sequence_losses'][text], sequences,
                                                               texts[text], seed=seed)
                paired.append({'budget': row['budget'], 'row': row['label'], 'against': reference['label'],
                               'text': text, 'difference': difference, 'ci95': [low, high]})
    return paired


def fixed_default(entries: Sequence[dict], texts: dict[str, Path], *, seed: int) -> dict:
    """Of one budget's candidates, the one of the lowest mean loss over the validation texts scored, and each
    candidate's difference from the former default on every text, paired by sequence with its interval over
    documents: the spread a default chosen on several texts carries."""
    validation = [name for name in VALIDATION_TEXTS if all(name in entry['loss'] for entry in entries)]
    if not validation:
        raise ConfigError('bench mla-zero: the fixed defaults are chosen on the validation texts; --texts names none')
    means = {entry['label']: sum(entry['loss'][name] for name in validation) / len(validation) for entry in entries}
    chosen = min(means, key=means.get)
    former = next((entry for entry in entries if entry['former_default']), None)
    versus = []
    for entry in entries if former is not None else ():
        for text, values in entry['sequence_losses'].items():
            if entry is former or text not in former['sequence_losses']:
                continue
            difference, low, high = paired_loss_difference(former['sequence_losses'][text], values, texts[text],
                                                           seed=seed)
            versus.append({'label': entry['label'], 'text': text, 'difference': difference, 'ci95': [low, high]})
    return {'budget': entries[0]['budget'], 'chosen_on': validation, 'mean_validation_loss': means,
            'chosen': chosen, 'against_former_default': versus}


def search_label(budget: str, rope_dim: int, freq_fold: int) -> str:
    """The stage name of a TransMLA setting's scores (its search entry and its row share them)."""
    return f'TransMLA {budget} r{rope_dim} f{freq_fold}'


def slug(label: str) -> str:
    """A stage name from a row's label."""
    return re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')


def gather_texts(settings, runner, heldout: Path, data: dict) -> tuple[dict[str, Path], dict[str, str]]:
    """The texts of ``settings.texts`` as split folders (each document cut to ``max_document_chars``, so documents
    are the intervals' units), and a note per text of what it is, or why it was left out."""
    texts = {'heldout_doc': heldout} if 'heldout_doc' in settings.texts else {}
    notes = {'heldout_doc': data['heldout']['source'], 'calibration': data['train']['source']}
    for name, given, default, what in (
            ('validation', settings.validation, VALIDATION_GLOB,
             'the text the DeepSeek defaults and TransMLA\'s setting were chosen on'),
            ('validation_headers', settings.headers, HEADERS_GLOB,
             'a validation text of code: the fixed defaults are chosen on it'),
            ('validation_markdown', settings.markdown, MARKDOWN_GLOB,
             'a validation text of Markdown documentation: the fixed defaults are chosen on it'),
            ('heldout_book', settings.book, BOOK_GLOB,
             'a book, held out from training and choosing; read during the latent-norm redesign'),
            ('heldout_fresh', settings.fresh, DEFAULT_FRESH_GLOB,
             'held out, and nothing in the project was designed, tuned or chosen on it')):
        if name not in settings.texts:
            notes[name] = 'not scored in this run (--texts)'
            continue
        files = text_files(given or default)
        if not files:
            if given:
                raise ConfigError(f'bench mla-zero: --{name.split("_")[-1]} {given}: no such folder or files')
            notes[name] = f'left out: nothing at {default} ({what}; give it with --{name.split("_")[-1]})'
            continue
        texts[name] = text_folder(runner, name.replace('_', '-'), given or default, files, seed=settings.seed,
                                  tokens=settings.text_tokens, seq_len=settings.text_seq_len,
                                  max_document_chars=settings.max_document_chars)
        notes[name] = f'{given or default} ({what})'
    return texts, notes
