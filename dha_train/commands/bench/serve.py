"""`dha-train bench serve`: the converted SmolLM2 models served by llama.cpp on this CPU, many sequences at once,
against their source.

It takes the models ``dha-train bench real`` made (each ``--real`` is a bench real folder or a results file; their
rows are pooled): the source, mean-pool and aligned GQA at a third of the cache, mean-pool at two thirds, the
servable DHA at two thirds and MLA in DeepSeek's format at both budgets. Each method's row with the lowest held-out
loss is the model served (after healing, for every method that heals). Each is exported with ``export-gguf`` at every
``--outtypes`` weight type; a model no engine serves is recorded as skipped, with the exporter's reason.

Then, in one run, for every context of ``--contexts`` and every K/V cache type of ``--cache-types`` (llama.cpp's
``-ctk``/``-ctv``; q8_0 halves the f16 cache), each model is loaded once with room for the most sequences of
``--sequences``, each sequence in its own K/V stream, as llama-server holds ``-np N`` slots
(``llama_cpp_engine.LlamaCppSequences``):

- the prompt (held-out text filling the context but for the decoded tokens) is processed once from an empty cache
  (prompt tokens/s of one sequence: prefill runs in 512-token batches, so a token's work is the same when other
  sequences share the batch) and copied into every sequence's stream (a copy of the memory, so N sequences read N
  caches);
- for each N of ``--sequences``: ``--decode-tokens`` greedy steps of N sequences together, one token of each per
  step, each sequence with its own first token (aggregate decode tokens/s, the best of ``--repeats`` rounds; models
  interleaved within a round so that drift reaches all alike, and every round reads the same caches);
- the K+V MiB of one sequence's stream, from llama.cpp's own report of the cache it allocated; a cache type llama.cpp
  refuses for a model (a quantized cache whose head sizes are not whole 32-value blocks) is recorded with its reason;
- each as a ratio to the source at the same context, weights, cache type and sequences;
- how many sequences of the longest context fit in ``--cache-budget-mib`` of cache;
- held-out loss from llama.cpp's own logits (each of the first ``--loss-sequences`` held-out sequences from an empty
  cache), at every weight and cache type, beside the HF folder's float32 loss on the same sequences.

The results go to ``<out>/results.json`` at the end; after each context and cache type the timings so far are
written to ``<out>/results.partial.json``, so that a run stopped part-way keeps what it timed.

Flash attention is on (llama-server's ``--flash-attn auto`` turns it on for the CPU, and a quantized V cache needs it).

Targets (reported, never tested): at 8 sequences of 8,192 tokens a third of the cache decodes at least 1.5x the
source's aggregate tokens/s; 3x as many 8,192-token sequences fit in the same cache budget; where on the curve
(sequences, context) MLA in DeepSeek's format overtakes the source, if anywhere. Time it on an otherwise idle machine:
llama.cpp's OpenMP threads spin while they wait, so its decode collapses when the cores are shared.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from dha_train.commands.bench.serve_tables import (  # noqa: F401  (the tables are read from here too)
    TARGET_CAPACITY_RATIO,
    TARGET_CONTEXT,
    TARGET_DECODE_RATIO,
    TARGET_SEQUENCES,
    capacity_table,
    decode_table,
    loss_table,
    plot_serve,
    targets_table,
)
from dha_train.config import ConfigError
from dha_train.data.loaders import split_sequences
from dha_train.engine_process import EngineCrashedError, EngineProcess
from dha_train.gguf_export import GgufExportError, export_gguf
from dha_train.llama_cpp_engine import CACHE_TYPES, LlamaCppError, LlamaCppModel, LlamaCppSequences

# (name in the table, bench real method, budget); the source's row has method 'teacher' there
MODELS = (
    ('source', 'teacher', None),
    ('mean-pool 1/3', 'mean_pool', 'kv1'),
    ('aligned GQA 1/3', 'aligned_gqa', 'kv1'),
    ('mean-pool 2/3', 'mean_pool', 'kv2'),
    ('DHA-servable 2/3', 'dha_servable', 'kv2'),
    ('MLA-DeepSeek 1/3', 'mla_deepseek', 'kv1'),
    ('MLA-DeepSeek 2/3', 'mla_deepseek', 'kv2'),
)
HELDOUT_DOMAIN = 'book'


@dataclass
class ServeSettings:
    real: list[str] = field(default_factory=lambda: ['bench_real'])  # bench real folders or results files
    out: str = 'bench_serve'
    contexts: list[int] = field(default_factory=lambda: [2048, 8192])
    sequences: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    outtypes: list[str] = field(default_factory=lambda: ['f16'])
    cache_types: list[str] = field(default_factory=lambda: ['f16', 'q8_0'])
    decode_tokens: int = 16
    repeats: int = 3
    threads: int | None = None  # default: every core
    cache_budget_mib: float = 1024.0
    loss: bool = True  # held-out loss in llama.cpp and transformers
    loss_sequences: int = 32  # the first held-out sequences the losses are taken on


def chosen_rows(results: dict) -> tuple[dict[str, dict], list[str]]:
    """{table name: the bench real row served} and notes on the models the results do not hold."""
    rows, missing = {}, []
    for name, method, budget in MODELS:
        candidates = [row for row in results['rows'] if row['method'] == method and row.get('budget') == budget
                      and row.get('val_loss') is not None and Path(row.get('hf_folder', '')).is_dir()]
        if not candidates:
            missing.append(f'{name}: no {method} row at {budget} with its folder in the bench real results (run '
                           f'`dha-train bench real --methods {method} --budgets {budget}`)')
            continue
        rows[name] = min(candidates, key=lambda row: row['val_loss'])
    return rows, missing


def pooled_results(reals: list[str]) -> dict:
    """The rows of every bench real results file given (a folder stands for its results.json), with the held-out
    data they were all scored on; files scored on different held-out text are refused."""
    pooled: dict = {'rows': [], 'files': []}
    for real in reals:
        path = Path(real)
        path = path / 'results.json' if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f'bench serve: {path} not found; run `dha-train bench real --out {real}` first (it makes '
                              'the models this bench serves)')
        results = json.loads(path.read_text())
        heldout = (results.get('data') or {}).get('heldout', {})
        if 'heldout' in pooled and heldout.get('root') != pooled['heldout'].get('root'):
            raise ConfigError(f'bench serve: {path} scored its rows on {heldout.get("root")}, '
                              f'{pooled["files"][0]} on {pooled["heldout"].get("root")}; give results of one bench '
                              'real folder')
        pooled['heldout'] = heldout
        pooled['rows'] += results['rows']
        pooled['files'].append(str(path))
    return pooled


def _heldout(pooled: dict) -> list[np.ndarray]:
    """The held-out validation sequences bench real scored every row on (its results name the folder)."""
    root = pooled['heldout'].get('root')
    if root is None or not Path(root).is_dir():
        raise ConfigError(f'bench serve: the held-out data of {pooled["files"][0]} ({root}) is not there')
    return split_sequences(root, pooled['heldout'].get('domain_label', HELDOUT_DOMAIN), 'val')


def _hf_loss(folder: str, sequences: list[np.ndarray]) -> float:
    from dha_train.model_folders import load_causal_lm

    model = load_causal_lm(folder, who='bench serve', torch_dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for sequence in sequences:
            ids = torch.from_numpy(sequence.astype(np.int64))[None]
            logits = model(ids).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction='sum'))
            count += ids.shape[1] - 1
    return total / count


def _engine_loss(path: Path, sequences: list[np.ndarray], threads: int, cache_type: str) -> float:
    total, count = 0.0, 0
    with EngineProcess(LlamaCppModel, path, n_ctx=len(sequences[0]), all_logits=True, threads=threads,
                       cache_type=cache_type) as engine:
        for sequence in sequences:
            tokens = [int(t) for t in sequence]
            logits = torch.from_numpy(engine.logits(tokens)[:-1])
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:]), reduction='sum'))
            count += len(tokens) - 1
    return total / count


def check_settings(settings: ServeSettings) -> None:
    if settings.decode_tokens < 1 or settings.repeats < 1:
        raise ConfigError('bench serve: --decode-tokens and --repeats must be >= 1')
    if any(context <= settings.decode_tokens + 1 for context in settings.contexts):
        raise ConfigError(f'bench serve: every context must be longer than --decode-tokens + 1 '
                          f'({settings.decode_tokens + 1}), got {settings.contexts}')
    if not settings.sequences or min(settings.sequences) < 1:
        raise ConfigError(f'bench serve: --sequences must be counts >= 1, got {settings.sequences}')
    unknown = sorted(set(settings.cache_types) - set(CACHE_TYPES))
    if unknown or not settings.cache_types:
        raise ConfigError(f'bench serve: --cache-types must be among {", ".join(CACHE_TYPES)}, got {unknown or "none"}')
    if settings.loss_sequences < 1:
        raise ConfigError(f'bench serve: --loss-sequences must be >= 1, got {settings.loss_sequences}')
    if settings.cache_budget_mib <= 0:
        raise ConfigError(f'bench serve: --cache-budget-mib must be positive, got {settings.cache_budget_mib}')


def run_serve_bench(settings: ServeSettings) -> dict:
    check_settings(settings)
    out = Path(settings.out)
    pooled = pooled_results(list(settings.real))
    rows, missing = chosen_rows(pooled)
    if 'source' not in rows:
        raise ConfigError(f'bench serve: {", ".join(pooled["files"])} has no teacher row with its folder')
    for note in missing:
        print(f'[bench serve] skipped {note}', flush=True)
    sequences = _heldout(pooled)
    prompt_text = [int(t) for t in np.concatenate(sequences)]
    most = max(settings.sequences)
    if len(prompt_text) < max(settings.contexts) + most:
        raise ConfigError(f'bench serve: the held-out text holds {len(prompt_text)} tokens, fewer than the '
                          f'{max(settings.contexts)}-token context and a first token for each of {most} sequences')
    threads = settings.threads or os.cpu_count() or 1
    (out / 'gguf').mkdir(parents=True, exist_ok=True)

    files: dict[tuple[str, str], Path] = {}
    cache_notes: dict[str, str] = {}
    for name, row in list(rows.items()):
        paths = {(name, outtype): out / 'gguf' / f"{name.replace(' ', '_').replace('/', '-')}.{outtype}.gguf"
                 for outtype in settings.outtypes}
        try:
            for (_, outtype), path in paths.items():
                report = export_gguf(row['hf_folder'], path, outtype=outtype, overwrite=True)
        except GgufExportError as exc:  # a model no engine serves is a finding of the bench, not a reason to stop
            if name == 'source':
                raise
            del rows[name]
            missing.append(f"{name}: {row['label']} does not serve in llama.cpp: {exc}")
            print(f'[bench serve] skipped {missing[-1]}', flush=True)
            continue
        if report.cache_unquantizable:
            cache_notes[name] = report.cache_unquantizable
        files.update(paths)
    print(f'[bench serve] exported {len(files)} GGUF files to {out / "gguf"}', flush=True)

    timings: dict[tuple, dict] = {}
    refused: list[dict] = []
    crashed: list[dict] = []  # an engine whose process died: recorded with the signal, and the bench goes on

    def crash(name: str, outtype: str, cache_type: str, context: int | None, exc: EngineCrashedError) -> None:
        crashed.append({'model': name, 'outtype': outtype, 'cache_type': cache_type, 'context': context,
                        'reason': str(exc)})
        print(f'[bench serve] {name}: {exc}', flush=True)

    partial = out / 'results.partial.json'
    run = {'settings': asdict(settings), 'results_files': pooled['files'], 'threads': threads, 'machine': _machine(),
           'date': time.strftime('%Y-%m-%d')}  # heads both the partial and the final results
    for context in settings.contexts:
        prompt = prompt_text[:context - settings.decode_tokens - 1]
        first_tokens = prompt_text[len(prompt):len(prompt) + most]  # each sequence's own next token of the text
        for outtype in settings.outtypes:
            for cache_type in settings.cache_types:
                engines = {}
                try:
                    for name in rows:
                        engine = None
                        try:
                            engine = EngineProcess(LlamaCppSequences, files[name, outtype], sequences=most,
                                                   context=context, threads=threads, cache_type=cache_type)
                            prompt_tps = engine.fill(prompt)  # once per model: compute-bound and steady
                        except (LlamaCppError, EngineCrashedError) as exc:
                            if engine is not None:
                                engine.close()
                            if isinstance(exc, EngineCrashedError):
                                crash(name, outtype, cache_type, context, exc)
                                continue
                            if context == settings.contexts[0]:
                                refused.append({'model': name, 'outtype': outtype, 'cache_type': cache_type,
                                                'reason': str(exc)})
                                print(f'[bench serve] {name}: {exc}', flush=True)
                            continue
                        engines[name] = engine
                        for count in settings.sequences:
                            timings[name, outtype, cache_type, context, count] = {
                                'prompt_tps': prompt_tps, 'decode_tps': 0.0,
                                'kv_mib_per_sequence': engine.kv_mib_per_sequence,
                                'kv_mib': count * engine.kv_mib_per_sequence}
                    for _ in range(settings.repeats):  # decode rounds, models interleaved: drift reaches all alike
                        for count in settings.sequences:
                            for name, engine in list(engines.items()):
                                try:
                                    decode_tps, _ = engine.decode(count, settings.decode_tokens, first_tokens[:count])
                                except EngineCrashedError as exc:  # its rows of this context and cache go
                                    crash(name, outtype, cache_type, context, exc)
                                    engines.pop(name).close()
                                    for key in [key for key in timings if key[:4] == (name, outtype, cache_type,
                                                                                      context)]:
                                        del timings[key]
                                    continue
                                best = timings[name, outtype, cache_type, context, count]
                                best['decode_tps'] = max(best['decode_tps'], decode_tps)
                finally:
                    for engine in engines.values():
                        engine.close()
                print(f'[bench serve] timed context {context} ({outtype} weights, {cache_type} cache)', flush=True)
                # what is timed so far, so that a long run stopped part-way keeps it (replaced by results.json)
                partial.write_text(json.dumps({**run, 'complete': False, 'refused': refused, 'crashed': crashed,
                                               'rows': _timing_rows(timings, rows)}, indent=2) + '\n')

    table = _timing_rows(timings, rows)
    losses = {}
    scored = sequences[:settings.loss_sequences]
    if settings.loss:
        for name, row in rows.items():
            losses[name] = {'hf_float32': _hf_loss(row['hf_folder'], scored), 'bench_real': row['val_loss']}
            for outtype in settings.outtypes:
                for cache_type in settings.cache_types:
                    try:
                        loss = _engine_loss(files[name, outtype], scored, threads, cache_type)
                    except LlamaCppError:
                        loss = None  # the refusal is in 'refused'
                    except EngineCrashedError as exc:
                        crash(name, outtype, cache_type, None, exc)
                        loss = None
                    losses[name][f'llama_cpp_{outtype}_{cache_type}'] = loss
        print('[bench serve] held-out losses done', flush=True)
    report = {**run,
              'models': {name: row['hf_folder'] for name, row in rows.items()},
              'labels': {name: row['label'] for name, row in rows.items()},
              'skipped': missing, 'cache_unquantizable': cache_notes, 'refused': refused, 'crashed': crashed,
              'loss_tokens': int(sum(len(s) for s in scored)), 'rows': table,
              'capacity': capacity(table, settings.cache_budget_mib), 'losses': losses}
    report['targets'] = target_verdicts(report)
    (out / 'results.json').write_text(json.dumps(report, indent=2) + '\n')  # kept should plotting fail
    report['plots'] = plot_serve(report, out)
    (out / 'results.json').write_text(json.dumps(report, indent=2) + '\n')
    partial.unlink(missing_ok=True)
    for table_text in (decode_table(report), capacity_table(report), targets_table(report), loss_table(report)):
        print('\n' + table_text)
    return report


def _timing_rows(timings: dict[tuple, dict], rows: dict[str, dict]) -> list[dict]:
    """One row of the results per (model, weights, cache type, context, sequences) timed, with its ratios to the
    source's row of the same key (None where the source has none)."""
    table = []
    for (name, outtype, cache_type, context, count), timing in timings.items():
        source = timings.get(('source', outtype, cache_type, context, count))
        table.append({'model': name, 'method': rows[name]['method'], 'budget': rows[name].get('budget'),
                      'label': rows[name]['label'], 'outtype': outtype, 'cache_type': cache_type, 'context': context,
                      'sequences': count, **timing,
                      **{f'{key}_ratio': timing[key] / source[key] if source else None
                         for key in ('kv_mib', 'prompt_tps', 'decode_tps')}})
    return table


def capacity(table: list[dict], budget_mib: float) -> list[dict]:
    """Per model, weights and cache type: how many sequences of the longest context fit in ``budget_mib`` of cache,
    from llama.cpp's reported MiB per sequence, and that count against the source's."""
    longest, fewest = max(row['context'] for row in table), min(row['sequences'] for row in table)
    per_sequence = {(row['model'], row['outtype'], row['cache_type']): row for row in table
                    if row['context'] == longest and row['sequences'] == fewest}
    entries = []
    for (name, outtype, cache_type), row in per_sequence.items():
        fits = int(budget_mib // row['kv_mib_per_sequence'])
        source = per_sequence.get(('source', outtype, cache_type))
        source_fits = int(budget_mib // source['kv_mib_per_sequence']) if source else None
        entries.append({'model': name, 'budget': row['budget'], 'method': row['method'], 'outtype': outtype,
                        'cache_type': cache_type, 'context': longest, 'budget_mib': budget_mib,
                        'kv_mib_per_sequence': row['kv_mib_per_sequence'], 'sequences_fit': fits,
                        'ratio': fits / source_fits if source_fits else None})
    return entries


def target_verdicts(report: dict) -> list[dict]:
    """Each model at a third of the cache, per weights and cache type: aggregate decode at TARGET_SEQUENCES sequences
    of TARGET_CONTEXT against the source's, and the sequences that fit the cache budget against the source's. Each
    MLA-DeepSeek model: the (sequences, context) points where it decodes at least as fast as the source."""
    verdicts = []
    rows = report['rows']
    for entry in report['capacity']:
        if entry['budget'] != 'kv1':
            continue
        at_target = next((row for row in rows if row['model'] == entry['model'] and row['outtype'] == entry['outtype']
                          and row['cache_type'] == entry['cache_type'] and row['context'] == TARGET_CONTEXT
                          and row['sequences'] == TARGET_SEQUENCES), None)
        decode = at_target['decode_tps_ratio'] if at_target else None
        verdicts.append({'model': entry['model'], 'outtype': entry['outtype'], 'cache_type': entry['cache_type'],
                         'decode_ratio': decode, 'decode_met': None if decode is None else decode >= TARGET_DECODE_RATIO,
                         'capacity_ratio': entry['ratio'],
                         'capacity_met': None if entry['ratio'] is None else entry['ratio'] >= TARGET_CAPACITY_RATIO})
    for name in sorted({row['model'] for row in rows if row['method'] == 'mla_deepseek'}):
        for outtype, cache_type in sorted({(row['outtype'], row['cache_type']) for row in rows if row['model'] == name}):
            points = sorted((row['context'], row['sequences']) for row in rows if row['model'] == name
                            and row['outtype'] == outtype and row['cache_type'] == cache_type
                            and row['decode_tps_ratio'] is not None and row['decode_tps_ratio'] >= 1.0)
            verdicts.append({'model': name, 'outtype': outtype, 'cache_type': cache_type,
                             'overtakes_at': [{'context': context, 'sequences': count} for context, count in points]})
    return verdicts


def _machine() -> str:
    return f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores'
