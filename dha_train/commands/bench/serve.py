"""`dha-train bench serve`: the converted SmolLM2 models served by llama.cpp on this CPU, against their source.

It takes the models ``dha-train bench real`` made (its ``results.json`` names each row's HF folder): the source,
mean-pool at a third and two thirds of the cache, the servable DHA at two thirds and MLA in DeepSeek's format at both
budgets. Each method's row with the lowest held-out loss is the model served (after healing, for every method that
heals). Each is exported with ``export-gguf`` at every ``--outtypes`` weight type, then in one run:

- at every context in ``--contexts``, batch 1: the prompt (held-out text filling the context but for the decoded
  tokens) processed once from an empty cache (prompt tokens/s: compute-bound and steady), then ``--decode-tokens``
  greedy single-token steps over the cache it filled, restored for each of ``--repeats`` rounds (decode tokens/s,
  the best round; models interleaved within a round so that drift reaches all alike);
  the K+V MiB llama.cpp allocates for the context (its loader's report), flash attention on as llama-server's
  default (``--flash-attn auto``) turns it on for the CPU, the cache in f16 (its default);
- each as a ratio to the source at the same context and weight type;
- held-out loss from llama.cpp's own logits (each 256-token held-out sequence from an empty cache) beside the HF
  folder's float32 loss on the same sequences.

Targets (reported, never tested): at 8192 tokens of context a third of the cache decodes at least 1.5x as fast as
the source; the engine's K+V MiB for it is at most 0.34x the source's. Time it on an otherwise idle machine: llama.cpp's
OpenMP threads spin while they wait, so its decode collapses when the cores are shared.
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

from dha_train.config import ConfigError
from dha_train.data.loaders import split_sequences
from dha_train.gguf_io import GgufExportError, export_gguf
from dha_train.llama_cpp_engine import LlamaCppModel
from dha_train.plots import plot_curves

# (name in the table, bench real method, budget); the source's row has method 'teacher' there
MODELS = (
    ('source', 'teacher', None),
    ('mean-pool 1/3', 'mean_pool', 'kv1'),
    ('mean-pool 2/3', 'mean_pool', 'kv2'),
    ('DHA-servable 2/3', 'dha_servable', 'kv2'),
    ('MLA-DeepSeek 1/3', 'mla_deepseek', 'kv1'),
    ('MLA-DeepSeek 2/3', 'mla_deepseek', 'kv2'),
)
HELDOUT_DOMAIN = 'book'
TARGET_DECODE_RATIO, TARGET_KV_RATIO, TARGET_CONTEXT = 1.5, 0.34, 8192


@dataclass
class ServeSettings:
    real: str = 'bench_real'  # a `dha-train bench real` folder
    out: str = 'bench_serve'
    contexts: list[int] = field(default_factory=lambda: [512, 2048, 8192])
    outtypes: list[str] = field(default_factory=lambda: ['f16', 'q8_0'])
    decode_tokens: int = 32
    repeats: int = 3
    threads: int | None = None  # default: every core
    loss: bool = True  # held-out loss in llama.cpp and transformers


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


def _heldout(real: Path, results: dict) -> list[np.ndarray]:
    """The held-out validation sequences bench real scored every row on (its results name the folder)."""
    heldout = (results.get('data') or {}).get('heldout', {})
    root = heldout.get('root')
    if root is None or not Path(root).is_dir():
        raise ConfigError(f'bench serve: the held-out data of {real / "results.json"} ({root}) is not there')
    return split_sequences(root, heldout.get('domain_label', HELDOUT_DOMAIN), 'val')


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


def _engine_loss(path: Path, sequences: list[np.ndarray], threads: int) -> float:
    total, count = 0.0, 0
    with LlamaCppModel(path, n_ctx=len(sequences[0]), all_logits=True, threads=threads) as engine:
        for sequence in sequences:
            tokens = [int(t) for t in sequence]
            logits = torch.from_numpy(engine.logits(tokens)[:-1])
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:]), reduction='sum'))
            count += len(tokens) - 1
    return total / count


def run_serve_bench(settings: ServeSettings) -> dict:
    real, out = Path(settings.real), Path(settings.out)
    results_file = real / 'results.json'
    if not results_file.is_file():
        raise ConfigError(f'bench serve: {results_file} not found; run `dha-train bench real --out {real}` first '
                          '(it makes the models this bench serves)')
    if settings.decode_tokens < 1 or settings.repeats < 1 or any(c <= settings.decode_tokens for c in settings.contexts):
        raise ConfigError('bench serve: --decode-tokens and --repeats must be >= 1, and every context longer than '
                          'the decoded tokens')
    results = json.loads(results_file.read_text())
    rows, missing = chosen_rows(results)
    if 'source' not in rows:
        raise ConfigError(f'bench serve: {results_file} has no teacher row with its folder')
    for note in missing:
        print(f'[bench serve] skipped {note}', flush=True)
    sequences = _heldout(real, results)
    prompt_text = [int(t) for t in np.concatenate(sequences)]
    if len(prompt_text) < max(settings.contexts):
        raise ConfigError(f'bench serve: the held-out text holds {len(prompt_text)} tokens, fewer than the '
                          f'{max(settings.contexts)}-token context')
    threads = settings.threads or os.cpu_count() or 1
    (out / 'gguf').mkdir(parents=True, exist_ok=True)

    files: dict[tuple[str, str], Path] = {}
    for name, row in list(rows.items()):
        paths = {(name, outtype): out / 'gguf' / f"{name.replace(' ', '_').replace('/', '-')}.{outtype}.gguf"
                 for outtype in settings.outtypes}
        try:
            for (_, outtype), path in paths.items():
                export_gguf(row['hf_folder'], path, outtype=outtype, overwrite=True)
        except GgufExportError as exc:  # a model no engine serves is a finding of the bench, not a reason to stop
            if name == 'source':
                raise
            del rows[name]
            missing.append(f"{name}: {row['label']} does not serve in llama.cpp: {exc}")
            print(f'[bench serve] skipped {missing[-1]}', flush=True)
            continue
        files.update(paths)
    print(f'[bench serve] exported {len(files)} GGUF files to {out / "gguf"}', flush=True)

    timings: dict[tuple[str, str, int], dict] = {}
    for context in settings.contexts:
        prompt = prompt_text[:context - settings.decode_tokens]
        for outtype in settings.outtypes:
            engines, states = {}, {}
            try:
                for name in rows:  # the prompt once per model: it is compute-bound and steady
                    engines[name] = LlamaCppModel(files[name, outtype], n_ctx=context, threads=threads)
                    prompt_tps, state, token = engines[name].timed_prompt(prompt)
                    states[name] = (state, token)
                    cache = engines[name].kv_cache
                    timings[name, outtype, context] = {'prompt_tps': prompt_tps, 'decode_tps': 0.0,
                                                       'kv_mib': cache.k_mib + cache.v_mib}
                for _ in range(settings.repeats):  # decode rounds, models interleaved: drift reaches all alike
                    for name, engine in engines.items():
                        decode_tps = engine.timed_decode(*states[name], settings.decode_tokens)
                        best = timings[name, outtype, context]
                        best['decode_tps'] = max(best['decode_tps'], decode_tps)
            finally:
                for engine in engines.values():
                    engine.close()
            print(f'[bench serve] timed context {context} ({outtype})', flush=True)

    table = []
    for (name, outtype, context), timing in timings.items():
        source = timings['source', outtype, context]
        table.append({'model': name, 'method': rows[name]['method'], 'budget': rows[name].get('budget'),
                      'label': rows[name]['label'], 'outtype': outtype, 'context': context, **timing,
                      'kv_ratio': timing['kv_mib'] / source['kv_mib'] if source['kv_mib'] else float('nan'),
                      'prompt_ratio': timing['prompt_tps'] / source['prompt_tps'],
                      'decode_ratio': timing['decode_tps'] / source['decode_tps']})
    losses = {}
    if settings.loss:
        for name, row in rows.items():
            losses[name] = {'hf_float32': _hf_loss(row['hf_folder'], sequences), 'bench_real': row['val_loss'],
                            **{f'llama_cpp_{outtype}': _engine_loss(files[name, outtype], sequences, threads)
                               for outtype in settings.outtypes}}
        print('[bench serve] held-out losses done', flush=True)
    report = {'settings': asdict(settings), 'threads': threads, 'machine': _machine(),
              'date': time.strftime('%Y-%m-%d'), 'models': {name: row['hf_folder'] for name, row in rows.items()},
              'skipped': missing, 'heldout_tokens': int(sum(len(s) for s in sequences)), 'rows': table,
              'losses': losses, 'targets': target_verdicts(table)}
    (out / 'results.json').write_text(json.dumps(report, indent=2) + '\n')
    for outtype in settings.outtypes:
        curves = {name: [(row['context'], row['decode_tps']) for row in table
                         if row['model'] == name and row['outtype'] == outtype] for name in rows}
        plot_curves(curves, out / f'decode_{outtype}.png', title=f'llama.cpp decode, {outtype} weights, batch 1, '
                    f'{threads} threads', xlabel='context (tokens)', ylabel='decode tokens/s')
    print_report(report)
    return report


def target_verdicts(table: list[dict]) -> list[dict]:
    """The targets at 8192 tokens, for each model at a third of the cache and each weight type."""
    verdicts = []
    for row in table:
        if row['budget'] != 'kv1' or row['context'] != TARGET_CONTEXT:
            continue
        verdicts.append({'model': row['model'], 'outtype': row['outtype'],
                         'decode_ratio': row['decode_ratio'], 'decode_met': row['decode_ratio'] >= TARGET_DECODE_RATIO,
                         'kv_ratio': row['kv_ratio'], 'kv_met': row['kv_ratio'] <= TARGET_KV_RATIO})
    return verdicts


def _machine() -> str:
    return f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores'


def print_report(report: dict) -> None:
    print('\n| model | weights | context | KV MiB | x source | prompt tok/s | x source | decode tok/s | x source |')
    print('| --- | --- | --- | --- | --- | --- | --- | --- | --- |')
    for row in sorted(report['rows'], key=lambda r: (r['outtype'], r['context'])):
        print(f"| {row['model']} | {row['outtype']} | {row['context']} | {row['kv_mib']:.2f} | {row['kv_ratio']:.3f} | "
              f"{row['prompt_tps']:.0f} | {row['prompt_ratio']:.2f} | {row['decode_tps']:.1f} | "
              f"{row['decode_ratio']:.2f} |")
    if report['losses']:
        outtypes = report['settings']['outtypes']
        print('\n| model | held-out loss, HF float32 | ' + ' | '.join(f'llama.cpp {t}' for t in outtypes) + ' |')
        print('| --- | --- |' + ' --- |' * len(outtypes))
        for name, loss in report['losses'].items():
            print(f"| {name} | {loss['hf_float32']:.4f} | "
                  + ' | '.join(f"{loss[f'llama_cpp_{t}']:.4f}" for t in outtypes) + ' |')
    for verdict in report['targets']:
        print(f"target at {TARGET_CONTEXT} ({verdict['model']}, {verdict['outtype']}): decode "
              f"{verdict['decode_ratio']:.2f}x (>= {TARGET_DECODE_RATIO}: {'met' if verdict['decode_met'] else 'not met'})"
              f", KV {verdict['kv_ratio']:.3f}x (<= {TARGET_KV_RATIO}: {'met' if verdict['kv_met'] else 'not met'})")
