"""`dha-train bench mla-zero`: MLA conversions at 0 training tokens, at equal cached numbers, on texts kept apart.

The question it answers: which conversion of a GQA checkpoint to MLA loses least before any training, on text no
conversion calibrated on and no default was chosen on. The source, its calibration text and the first held-out text
are `bench real`'s (same ``--out`` folder, reused): SmolLM2-135M, the Python standard library (calibration, 16,384
tokens for every row, the same sequences) and ``/usr/share/doc`` (held-out). Two more texts:

- validation: vim's help files (``/usr/share/vim/vim*/doc``): the text the DeepSeek-layout defaults were chosen on
  (``docs/methods/mla.md``, "Ablation"); reported so a reader sees how far choice and test differ;
- book: a book given by ``--book`` (a folder of HTML or text files; default: The Rust Programming Language as rustup
  installs it, when present), held out like ``/usr/share/doc``; its row is left out, and the results say so, where
  there is no book. It was read while the DeepSeek layout's latent norm was redesigned, so it is no longer unseen;
- fresh: a text nothing in the project was designed, tuned or chosen on, named before any row was scored on it
  (``--fresh``; default: Perl's bundled POD documentation, ``/usr/share/perl/5.*/**/*.pod``). The comparison rests
  on it: each row's loss per sequence, and paired differences (``paired``) against TransMLA's chosen setting.

Rows per budget (``kv1``: a third of the source's K+V numbers per token, ``kv2``: two thirds):

- ``deepseek``: ``convert --method mla --format deepseek`` with its defaults (the layout engines serve);
- ``mla``: ``convert --method mla`` (the project's MLA class) as `bench real` runs it;
- ``mean_pool_refit``: the source mean-pooled to the budget's K/V heads, then ``dha-train refit``;
- ``transmla``: TransMLA's own converter (``--transmla``: a checkout of github.com/fxmeng/TransMLA, run unchanged in
  a subprocess; only its data loading is replaced, by the same calibration sequences), its latent rank the budget
  less its RoPE key. It gets the tuning the project's defaults had: every RoPE key width of
  ``--transmla-rope-dims`` (16, 32, 64) with every FreqFold of ``--transmla-folds`` (2, 4, 8) that its converter
  accepts (the fold a multiple of head_dim / width) is converted and scored on the validation text
  (``transmla_search``); the setting with the lowest validation loss is its row, with its defaults (a 64-dim key, fold 4, as its scripts run
  it) as a second row when they were not chosen. Left out when no checkout is given.

Columns: the loss on each text (the mean of its sequences' losses, with a 95% interval over sequences), accuracy (acc_norm) on the first ``--limit`` validation documents of piqa and
arc_easy, zero-shot, and per layer the relative error of the attention output when every layer reads the teacher's
own input (``evaluation.attention_output_errors``): where the loss goes. Writes ``mla_zero/results.json`` under
``--out`` and prints the table.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dha_train.bench_runner import StageRunner, model_config, prepare_data, say, source_folder, text_folder
from dha_train.bench_settings import RealSettings, resolve_settings
from dha_train.config import ConfigError
from dha_train.conversion import deepseek_choice
from dha_train.conversion.deepseek import DeepseekSettings, convert_to_deepseek, quantizable_fits
from dha_train.conversion.deepseek_choice import Candidate
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.conversion.mla import MlaSettings, convert_to_mla
from dha_train.conversion.refit import RefitSettings, refit_folder
from dha_train.evaluation import (
    attention_output_errors,
    domain_means,
    load_model,
    loss_interval,
    paired_loss_difference,
    run_eval,
    sequence_losses,
)
from dha_train.harness import headline
from dha_train.heldout_texts import BOOK_GLOB, HEADERS_GLOB, MARKDOWN_GLOB, VALIDATION_GLOB, folder_units, text_files
from dha_train.model_folders import folder_digest

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
TRANSMLA_DEFAULTS = (64, 4)  # (qk_mqa_dim, freqfold): its one 64-dim shared RoPE key, the fold its scripts pass
TEXTS = ('validation', 'validation_headers', 'validation_markdown', 'heldout_doc', 'heldout_book', 'heldout_fresh')
VALIDATION_TEXTS = ('validation', 'validation_headers', 'validation_markdown')  # what fixed defaults are chosen on
CALIBRATION_BATCH = 8  # rows per calibration batch, for every row (TransMLA's loader included)


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
    # bench real's settings for the calibration and /usr/share/doc texts (None: its defaults for the device)
    train_data: str | None = None
    seq_len: int | None = None
    val_tokens: int | None = None
    include: Sequence[str] = ()  # extra lm-eval task folders (tests: a local task)
    isolate_stages: bool = True


# --- TransMLA, run from its own checkout ----------------------------------------------------------------------------
def calibration_sequences(source: Path, data: Path, tokens: int, batch_size: int, seed: int) -> torch.Tensor:
    """The token rows the project's conversions calibrate on (``calibration.calibrate`` over
    ``calibration_batches`` with the same data, batch size and seed: whole rows until ``tokens``)."""
    from dha_train.calibration import calibration_batches

    rows, count = [], 0
    stream = calibration_batches(source, model_config(source), data=str(data), split='train', batch_size=batch_size,
                                 seed=seed, who='bench mla-zero')
    try:
        for batch in stream:
            ids = batch['input_ids']
            needed = -(-(tokens - count) // ids.shape[1])
            rows.append(ids[:needed])
            count += rows[-1].numel()
            if count >= tokens:
                break
    finally:
        stream.close()
    if count < tokens:
        raise ConfigError(f'bench mla-zero: the calibration data gave {count} tokens, fewer than {tokens}')
    return torch.cat(rows)


def check_transmla(checkout: Path) -> Path:
    """The folder TransMLA's converter runs from (``<checkout>/transmla``, holding ``transmla/converter.py``)."""
    for candidate in (checkout / 'transmla', checkout):
        if (candidate / 'transmla' / 'converter.py').is_file():
            return candidate
    raise ConfigError(f'bench mla-zero: --transmla {checkout} is not a TransMLA checkout (no transmla/converter.py '
                      'under it or its transmla/ folder)')


def run_transmla(checkout: Path, python: str, source: Path, sequences: Path, out: Path, rank: int,
                 rope_dim: int, freq_fold: int, reference: Path) -> None:
    """TransMLA's ``converter.main`` in a subprocess (its modules import each other by bare name, and it copies
    modeling files by paths relative to its folder), fed ``sequences`` as its calibration loader. Then, in the same
    subprocess, its converted model through its own classes, taken from the checkout (never from the folder it
    wrote): the logits of the first two calibration rows, saved to ``reference``, which ``adopt_transmla`` must
    reproduce."""
    folder = check_transmla(checkout)
    classes = folder / 'transmla' / 'transformers'
    program = f'''
import argparse, shutil, sys, torch
sys.path.insert(0, {str(folder / 'transmla')!r})
import converter
ids = torch.load({str(sequences)!r})
step = {CALIBRATION_BATCH}
batches = [{{'input_ids': ids[i:i + step], 'attention_mask': torch.ones_like(ids[i:i + step])}} for i in range(0, len(ids), step)]
converter.get_dataset_loader = lambda tokenizer, **kwargs: (batches, None)
converter.main(argparse.Namespace(
    model_path={str(source)!r}, save_path={str(out)!r}, dtype='fp32', device='cpu', cal_dataset='local',
    cal_nsamples=len(ids), cal_batch_size=step, cal_max_seqlen=ids.shape[1], seed=42, ppl_eval_batch_size=0,
    freqfold='{freq_fold}', collapse='auto', qk_mqa_dim={rope_dim}, q_lora_rank=None,
    kv_lora_rank={rank}, balance_kv_ratio=1.0, use_qkv_norm=False, deepseek_style=False))
# its classes as one package, copied from the checkout
import pathlib
package = pathlib.Path({str(reference.parent / 'transmla_classes')!r})
package.mkdir(exist_ok=True)
(package / '__init__.py').write_text('')
for name in ('llama/configuration_llamamla.py', 'llama/modeling_llamamla.py', 'mla.py'):
    shutil.copy(pathlib.Path({str(classes)!r}) / name, package)
sys.path.insert(0, str(package.parent))
from transmla_classes.configuration_llamamla import LlamaMLAConfig
from transmla_classes.modeling_llamamla import LlamaMLAForCausalLM
config = LlamaMLAConfig.from_pretrained({str(out)!r})
model = LlamaMLAForCausalLM.from_pretrained({str(out)!r}, config=config, torch_dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=ids[:2]).logits
torch.save({{'input_ids': ids[:2], 'logits': logits}}, {str(reference)!r})
shutil.rmtree(package)
'''
    done = subprocess.run([python, '-c', program], cwd=folder, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f'bench mla-zero: TransMLA\'s converter failed (exit {done.returncode}):\n'
                           f'{done.stderr[-3000:]}')


def transmla_deepseek_config(source_config, transmla: dict):
    """The ``DeepseekV3Config`` transformers' own class computes TransMLA's model with, once its latent norm is set
    aside (``set_latent_norm_aside``): the source's sizes, dense MLPs, TransMLA's latent and RoPE widths, its RoPE
    base, interleaved RoPE (its attention rotates interleaved pairs). Only numbers are read from its config."""
    from transformers import DeepseekV3Config

    numbers = {key: transmla[key] for key in ('kv_lora_rank', 'qk_rope_head_dim', 'qk_nope_head_dim', 'v_head_dim',
                                              'rope_theta', 'rms_norm_eps')}
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in numbers.values()) or (
            transmla.get('q_lora_rank') is not None or transmla.get('rope_scaling') is not None):
        raise RuntimeError(f'bench mla-zero: TransMLA wrote a config this bench does not read: {numbers}, '
                           f'q_lora_rank {transmla.get("q_lora_rank")!r}, rope_scaling {transmla.get("rope_scaling")!r}')
    c = source_config
    return DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_attention_heads, n_shared_experts=1,
        n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=c.num_hidden_layers, q_lora_rank=None, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rope_scaling=None, rope_interleave=True,
        attention_bias=False, attention_dropout=c.attention_dropout, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        initializer_range=c.initializer_range, torch_dtype='float32', **numbers)


def set_latent_norm_aside(model) -> None:
    """Each layer's latent norm replaced by the identity: TransMLA's latent has none (``use_qkv_norm`` off, as its
    scripts run it)."""
    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()


def adopt_transmla(written: Path, out: Path, source: Path, reference: Path, tolerance: float = 1e-3) -> dict:
    """TransMLA's folder as one this project loads without its code: our config (``transmla_deepseek_config``), its
    weights with a unit latent-norm weight per layer (set aside when scored), the source's tokenizer. The model is
    checked against TransMLA's own: the largest logit difference on the reference rows must be under ``tolerance``
    (float32), or the bench stops."""
    from safetensors.torch import load_file, save_file

    transmla = json.loads((written / 'config.json').read_text())
    config = transmla_deepseek_config(model_config(source), transmla)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    weights = load_file(str(written / 'model.safetensors'))
    for layer in range(config.num_hidden_layers):
        weights[f'model.layers.{layer}.self_attn.kv_a_layernorm.weight'] = torch.ones(config.kv_lora_rank)
    save_file(weights, str(out / 'model.safetensors'), metadata={'format': 'pt'})
    for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    model, _ = load_model(out)
    set_latent_norm_aside(model)
    expected = torch.load(reference)
    with torch.no_grad():
        logits = model(input_ids=expected['input_ids']).logits
    difference = float((logits - expected['logits']).abs().max())
    if not difference < tolerance:
        raise RuntimeError(f'bench mla-zero: {out} does not compute TransMLA\'s model: its logits differ from '
                           f'TransMLA\'s own by up to {difference:.3g} (tolerance {tolerance})')
    return {'reference_max_abs_logit_difference': difference}


def transmla_candidates(head_dim: int, rope_dims: Sequence[int], folds: Sequence[int],
                        numbers: int) -> list[tuple[int, int]]:
    """The (RoPE key width, FreqFold) settings TransMLA's converter accepts for a head of ``head_dim`` at a budget of
    ``numbers`` cached numbers: the width divides the head (its ``collapse`` is head_dim / width), the fold is a
    multiple of that collapse and divides the head's pairs, and a latent rank is left."""
    chosen = []
    for width in rope_dims:
        if width < 1 or head_dim % width or width >= numbers:
            continue
        collapse = head_dim // width
        chosen += [(width, fold) for fold in folds
                   if fold >= 1 and fold % collapse == 0 and (head_dim // 2) % fold == 0]
    return chosen


def choose_on_validation(search: Sequence[dict]) -> dict:
    """The search entry with the lowest validation loss (the first of equals)."""
    return min(search, key=lambda entry: entry['loss']['validation'])


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
    def save() -> None:  # after every row, so a stopped run leaves what it measured
        runs.mkdir(parents=True, exist_ok=True)
        (runs / 'results.json').write_text(json.dumps(results, indent=2, default=str))

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
    save()
    print_table(results)
    print(f'  results.json in {runs}')
    return results


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


def _probe_batch(heldout: Path, rows: int = 4) -> torch.Tensor:
    """The first ``rows`` sequences of the held-out text's val split (for the per-layer errors)."""
    from dha_train.data.loaders import split_sequences

    manifest = json.loads((heldout / 'manifest.json').read_text())
    domain = sorted(manifest['domains'])[0]
    return torch.as_tensor(np.stack(split_sequences(heldout, domain, 'val')[:rows]), dtype=torch.long)


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
