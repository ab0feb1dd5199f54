"""The model card (``README.md`` with the Hub's metadata header) in every folder the project writes.

A card says what the folder holds and how it was made, read off the folder itself and its source:

- the Hub header: ``base_model`` (the source's own ``base_model`` when its card names one, else the source folder's
  name), ``library_name: transformers``, ``tags``, ``pipeline_tag: text-generation``, ``license`` carried from the
  source's card where it has one; and a ``dha_train`` block that ``read_model_card`` parses back: the method, the
  model type, the KV bytes per 4096 tokens in bf16 (``methods.kv_cache_bytes``) against the source's and MHA's,
  the head map or latent ranks in short, and the stages (what each did, its tokens and recipe);
- the same in prose, and how to load it (``trust_remote_code`` for the project's own classes, the transformers
  versions it was tested with);
- ``model-index`` once ``dha-train eval`` has scored the folder (``add_scores``).

Stages chain: a folder made from another folder of the project starts from that folder's stages, so a card lists
every step from the original checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from dha_train import families
from dha_train.errors import InputNotFoundError
from dha_train.methods import kv_cache_bytes
from dha_train.model_folders import load_model_config
from dha_train.models.head_map import HeadMap
from dha_train.models.llama_layout import mha_kv_values
from dha_train.paths import write_file_atomically
from dha_train.untrusted import config_from_dict

CARD_FILE = 'README.md'
# Written by `dha-train train` in its save folder (the folder the run started from, its recipe): what an export's card
# needs and a checkpoint does not hold (a new key in it would stop older sharded checkpoints from resuming).
RUN_RECORD = 'dha_train_run.json'
KV_TOKENS = 4096  # the KV bytes a card states: one sequence of this many tokens in bf16
TESTED_TRANSFORMERS = {  # the versions the project's tests load each model type with
    'llama': '4.53.3 and 5.23', 'mistral': '4.53.3', 'qwen2': '4.53.3', 'qwen3': '4.53.3', 'gemma3_text': '4.53.3', 'dha_llama': '4.53.3 and 5.23', 'moh_llama': '4.53.3 and 5.23',
    'mla_llama': '4.53.3 and 5.23', 'deepseek_v3': '4.53.3'}
OWN_CLASSES = ('dha_llama', 'moh_llama', 'mla_llama')  # loaded with trust_remote_code (the modeling file is copied)


def read_model_card(folder: str | Path) -> tuple[dict, str]:
    """(the metadata header as a dict, the body) of a folder's card; ({}, '') when it has none."""
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return {}, ''
    text = path.read_text()
    if not text.startswith('---\n'):
        return {}, text
    header, _, body = text[4:].partition('\n---\n')
    return yaml.safe_load(header) or {}, body


def read_run_record(checkpoint: Path, resolved: Path, start: str | Path | None = None) -> tuple[dict, Path | None]:
    """(the run record ``dha-train train`` wrote in the save folder of ``checkpoint``, the folder whose card an export
    of it continues). The record (``RUN_RECORD``: the run's recipe and start folder) is looked for beside the
    checkpoint as given and as ``resolved``; {} for a run without one (older runs, remote folders).

    ``start``, named by the caller (``dha-train export --start``), is the start. The record's own ``start`` is data
    that came with the checkpoint, so it is followed only inside the folder holding the save folder, where the
    pipelines lay a stage's start beside its run (``<save_root>/<name>-init``, ``<save_root>/<name>-fusion/hf``); any
    other folder it names is ignored with a one-line warning, and its card, base model and licence are not read."""
    # train writes a plain file there; a link is not the run's record and is not followed
    found = next((folder / RUN_RECORD for folder in (checkpoint, resolved.parent, resolved)
                  if (folder / RUN_RECORD).is_file() and not (folder / RUN_RECORD).is_symlink()), None)
    record: dict = {}
    if found is not None:
        try:
            record = json.loads(found.read_text())
        except (OSError, ValueError):
            record = {}
        if not isinstance(record, dict):
            record = {}
        record = {key: value for key, value in record.items() if isinstance(value, str)}
    if start is not None:
        if not Path(start).is_dir():
            raise InputNotFoundError(f'--start {start}: not a folder (give the model folder the run started from)')
        return record, Path(start)
    named = record.get('start')
    if found is None or not named or '://' in named:
        return record, None
    target = found.parent / named  # train records an absolute path; a relative one is taken from the save folder
    if not target.is_dir():
        return record, None
    own_parent = found.parent.resolve().parent
    if not target.resolve().is_relative_to(own_parent):
        print(f"dha-train: warning: {found} names {named} as the run's start, outside {own_parent} (the folder "
              "holding its save folder), so that folder's card is not carried into this one; pass --start "
              f'{named} if the run did start there', file=sys.stderr)
        return record, None
    return record, target


def _mha_kv_bytes(config) -> int:
    return config.num_hidden_layers * mha_kv_values(config) * KV_TOKENS * 2


def attention_summary(config) -> str:
    """The attention layout in short: K/V heads per layer, latent ranks, or MoH's active heads."""
    model_type = config.model_type
    if model_type == 'mla_llama':
        ranks = config.mla_ranks
        pairs = len(config.mla_rope_pairs[0][0])
        return (f'MLA: latent ranks {min(ranks)}-{max(ranks)} over {len(ranks)} layers, {pairs} RoPE pairs kept per '
                f'K/V head ({config.num_key_value_heads} K/V heads)')
    if model_type == 'deepseek_v3':
        return (f"MLA in DeepSeek's format: kv_lora_rank {config.kv_lora_rank}, a {config.qk_rope_head_dim}-dim RoPE "
                f'key shared by the {config.num_attention_heads} query heads')
    head_map = HeadMap.from_hf_config(config)
    counts = head_map.kv_heads()
    keys = sorted({k for k, _ in counts})
    values = sorted({v for _, v in counts})
    span = lambda xs: str(xs[0]) if len(xs) == 1 else f'{xs[0]}-{xs[-1]}'  # noqa: E731
    text = (f'{head_map.num_query_heads} query heads; K heads per layer {span(keys)}, V heads per layer '
            f'{span(values)}')
    if model_type == 'moh_llama':
        text += f'; MoH: {config.moh_shared_heads} shared + top-{config.moh_top_k} routed heads per token'
    return text


def _family_label(config) -> str:
    """The source family the model is built on, for people ('Qwen2'); DeepSeek's format is its own."""
    source_type = families.source_model_type(config)
    return families.FAMILIES[source_type].label if source_type in families.FAMILIES else 'DeepSeek-V3 (MLA)'


def _base_model(source: Path | None, source_card: dict) -> str | None:
    if source is None:
        return None
    return source_card.get('base_model') or source.name


def write_model_card(folder: str | Path, *, method: str | None, source: str | Path | None, stage: dict,
                     start: str | Path | None = None, base_model: str | None = None,
                     license_: str | None = None, name: str | None = None) -> dict:
    """Write ``folder``/README.md for the model saved in ``folder`` (its config.json must be there).

    ``method``: the registry name (None: a plain checkpoint, e.g. an import); ``source``: the checkpoint it was
    converted from (its KV bytes are the budget's reference; None when there is none, e.g. an import);
    ``stage``: this step (``{'step': ..., 'tokens': ..., 'recipe': ...}``); ``start``: the folder this step started
    from, whose card's stages come first (default ``source``); ``base_model`` names the base where there is no
    source folder (an import), ``license_`` its licence where the source folder has no card to carry it from;
    ``name`` the folder's final name (``folder`` may be a staging folder). Returns the header."""
    folder = Path(folder)
    config = config_from_dict(json.loads((folder / 'config.json').read_text()), where=f'model card: {folder}')
    source = Path(source) if source is not None else None
    start = Path(start) if start is not None else source
    source_card = read_model_card(source)[0] if source is not None else {}
    start_card = read_model_card(start)[0] if start is not None else {}
    earlier = list((start_card.get('dha_train') or {}).get('stages', []))
    stages = earlier + [{key: value for key, value in stage.items() if value is not None}]
    kv = kv_cache_bytes(config, KV_TOKENS, 2)
    # the budget's reference: the source's KV bytes, carried along the chain of stages from the first conversion
    source_kv = (start_card.get('dha_train') or {}).get('source_kv_bytes_per_4096_tokens_bf16')
    reference = source if source is not None else (start if start is not None and 'dha_train' not in start_card
                                                   else None)  # a run that started from the source itself
    if reference is not None and (reference / 'config.json').is_file():
        source_kv = kv_cache_bytes(load_model_config(reference, who='model card (source)'), KV_TOKENS, 2)
    method = method or (start_card.get('dha_train') or {}).get('method')
    block: dict[str, Any] = {
        'method': method, 'model_type': config.model_type, 'family': _family_label(config),
        'attention': attention_summary(config),
        'kv_bytes_per_4096_tokens_bf16': kv, 'fraction_of_mha_kv': round(kv / _mha_kv_bytes(config), 6),
        'stages': stages}
    if source_kv:
        block['source_kv_bytes_per_4096_tokens_bf16'] = source_kv
        block['fraction_of_source_kv'] = round(kv / source_kv, 6)
    header: dict[str, Any] = {'library_name': 'transformers', 'pipeline_tag': 'text-generation',
                              'tags': ['dha-train', config.model_type] + ([method] if method else [])
                              + [tag for tag in [families.source_model_type(config)] if tag != config.model_type
                                 and tag in families.FAMILIES]}
    base = base_model or start_card.get('base_model') or _base_model(source, source_card)
    if base:
        header['base_model'] = base
    license_ = license_ or source_card.get('license') or start_card.get('license')
    if license_:
        header['license'] = license_
    header['dha_train'] = block
    _write(folder, header, _body(name or folder.name, header, config))
    return header


def add_scores(folder: str | Path, scores: dict[str, dict[str, float]], name: str | None = None) -> dict:
    """Put ``scores`` ({task: {metric: value}}) into the card's ``model-index`` (a card is written first when the
    folder has none); other tasks' earlier scores stay. Returns the header."""
    folder = Path(folder)
    header, body = read_model_card(folder)
    if not header:
        header = write_model_card(folder, method=None, source=None, stage={'step': 'scored by dha-train eval'})
        body = read_model_card(folder)[1]
    results = {entry['dataset']['name']: entry
               for index in header.get('model-index', []) for entry in index.get('results', [])}
    for task, metrics in scores.items():
        results[task] = {'task': {'type': 'text-generation'}, 'dataset': {'name': task, 'type': task},
                         'metrics': [{'type': metric, 'value': float(value)} for metric, value in sorted(metrics.items())
                                     if isinstance(value, (int, float))]}
    header['model-index'] = [{'name': name or folder.name, 'results': [results[task] for task in sorted(results)]}]
    _write(folder, header, body)
    return header


def _write(folder: Path, header: dict, body: str) -> None:
    text = '---\n' + yaml.safe_dump(header, sort_keys=False, default_flow_style=False) + '---\n' + body
    write_file_atomically(folder / CARD_FILE, text)  # eval adds scores to a folder it was given: never through a link


def _body(name: str, header: dict, config) -> str:
    block = header['dha_train']
    method = block['method'] or 'none (a plain checkpoint)'
    lines = [f'\n# {name}\n', f'Written by dha_train (method: `{method}`, model type '
             f"`{block['model_type']}`, {block['family']} family)" + (f", from `{header['base_model']}`." if 'base_model' in header else '.'),
             '', f"- **Attention**: {block['attention']}.",
             f"- **KV cache**: {block['kv_bytes_per_4096_tokens_bf16']:,} bytes per {KV_TOKENS}-token sequence in bf16, "
             f"{block['fraction_of_mha_kv']:.1%} of MHA's"
             + (f", {block['fraction_of_source_kv']:.1%} of the source's." if 'fraction_of_source_kv' in block
                else '.')]
    if block['model_type'] == 'deepseek_v3':
        lines.append("  That is what an engine that caches the latent holds; transformers' own class caches every "
                     'head\'s expanded key and value.')
    lines += ['', '## Stages', '', '| step | training tokens | recipe |', '| --- | --- | --- |']
    for stage in block['stages']:
        lines.append(f"| {stage.get('step', '')} | {stage.get('tokens', 0):,} | {stage.get('recipe', '')} |")
    remote = block['model_type'] in OWN_CLASSES
    lines += ['', '## Loading', '', '```python', 'from transformers import AutoModelForCausalLM, AutoTokenizer',
              f"model = AutoModelForCausalLM.from_pretrained('{name}'"
              + (', trust_remote_code=True)' if remote else ')'),
              f"tokenizer = AutoTokenizer.from_pretrained('{name}')", '```', '',
              ('The modeling file travels in the folder (`trust_remote_code=True`); with dha_train installed, '
               '`import dha_train.models` registers the class instead.' if remote else
               "transformers' own class; no code in the folder."),
              f"Tested with transformers {TESTED_TRANSFORMERS.get(block['model_type'], '4.53.3')}.", '']
    return '\n'.join(lines)


def card_stage(step: str, tokens: int = 0, recipe: str | None = None, **extra) -> dict:
    """One stage entry, JSON-safe."""
    return json.loads(json.dumps({'step': step, 'tokens': int(tokens), 'recipe': recipe, **extra}, default=str))
