"""The quickstart: the embedded default job, end to end in one run folder (`dha-train quickstart` runs it; the benches
build their teacher with it).

Stages (each reused on a second run once finished, unless --fresh):
  corpus     Python stdlib source (github) and docstrings (wikipedia) as RedPajama JSONL
  tokenizer  byte-level BPE trained on that corpus, saved as a HF tokenizer folder
  data       `dha-train data prep` -> MDS shards per domain, train and val
  pretrain   yamls/pretrain/tiny.yaml: a tiny MHA LLaMA (the teacher later issues convert)
  export     Hugging Face folder of the trained model
then the conversions at a 25% KV budget (yamls/dha/tiny/*.yaml and yamls/gqa/tiny_ct.yaml, in this process):
  dha_search     DHA Search: warm-up fusion run, head distances, grouping and per-layer K/V budget -> head_map.json
  dha_fusion     DHA Fusion until L_fusion < 1e-3, then baked into the DHA model (export)
  dha_ct         continued pre-training of the DHA model
  gqa_convert    the mean-pool GQA baseline (2 K/V heads per layer: the same 25%)
  gqa_ct         its continued pre-training, with as many CT tokens as DHA's
  report     per-domain validation loss, the conversion table (losses and KV-cache bytes), plots, summary.json
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.config import ConfigError, load_config
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.data.corpus import build_stdlib_corpus, iter_corpus_texts
from dha_train.data.prep import prep_redpajama
from dha_train.data.tokenizer import train_byte_level_bpe
from dha_train.errors import OutputExistsError
from dha_train.export import export_hf
from dha_train.harness import build_local_task
from dha_train.methods import kv_cache_bytes
from dha_train.model_folders import load_model_config
from dha_train.models.head_map import HeadMap
from dha_train.models.llama_layout import head_dim
from dha_train.paths import recipe_path
from dha_train.plots import plot_curves, plot_loss_curve
from dha_train.stages import (
    DHA_NAME,
    KV_BUDGET,
    SEQ_LEN,
    Stage,
    gqa_kv_heads,
    mean_eval,
    mean_eval_curve,
    train_recipe,
    train_stage,
    train_tokens,
)

QUICKSTART_RECIPE = 'pretrain/tiny.yaml'
VOCAB_SIZE = 4096
CORPUS_BYTES_PER_DOMAIN = 3_000_000
VAL_TOKENS = 4 * 16 * SEQ_LEN  # four eval batches per domain


def _say(message: str) -> None:
    print(f'[quickstart] {message}', flush=True)


def _run_stage(run: Path, name: str, build) -> dict:
    return Stage(run, name).run(build, _say)


def _corpus(out: Path, seed: int) -> dict:
    return build_stdlib_corpus(out, max_bytes_per_domain=CORPUS_BYTES_PER_DOMAIN, seed=seed)


def _eval_task(out: Path, corpus: Path, seed: int) -> dict:
    # The offline lm-eval task: `dha-train eval <model> --suite local --include <run>/eval_task`.
    return {'folder': str(build_local_task(corpus, out, seed=seed))}


def _tokenizer(out: Path, corpus: Path) -> dict:
    tokenizer = train_byte_level_bpe(iter_corpus_texts(corpus), out, vocab_size=VOCAB_SIZE)
    return {'vocab_size': len(tokenizer)}


def _data(out: Path, corpus: Path, tokenizer: Path) -> dict:
    manifest = prep_redpajama([corpus], out, tokenizer, seq_len=SEQ_LEN, val_tokens=VAL_TOKENS, overwrite=True)
    return {'manifest': str(out / 'manifest.json'), 'domains': sorted(manifest['domains'])}


def _pretrain(out: Path, run: Path, seed: int, steps: int | None, teacher: Sequence[str]) -> dict:
    overrides = [f'variables.run_dir={run}', f'seed={seed}', *teacher]
    if steps is not None:
        overrides.append(f'max_duration={steps}ba')
    config = load_config(recipe_path(QUICKSTART_RECIPE), overrides)
    trainer, history = train_recipe(config)
    if not history['train']:
        raise RuntimeError(f'pretrain: nothing was trained; the checkpoints in {config.save_folder} are from a '
                           'finished run whose loss history was not saved. Run with --fresh.')
    out.mkdir(parents=True, exist_ok=True)
    (out / 'history.json').write_text(json.dumps(history))
    return {'checkpoint_folder': config.save_folder, 'history': str(out / 'history.json'),
            'batches': int(trainer.state.timestamp.batch)}


def _export(out: Path, checkpoint_folder: str) -> dict:
    export_hf(checkpoint_folder, out / 'hf', overwrite=True)
    return {'hf_folder': str(out / 'hf')}


def _dha_overrides(run: Path, *more: str) -> list[str]:
    return [f'variables.data_root={run / "data"}', f'variables.save_root={run / "conversions"}',
            f'variables.name={DHA_NAME}', *more]


def _dha_search(run: Path, max_batches: int | None) -> dict:
    teacher = run / 'export' / 'hf'
    _, config, _ = train_stage('dha/tiny/search.yaml', _dha_overrides(
        run, f'variables.model_path={teacher}', f'variables.kv_budget={KV_BUDGET}',
        'callbacks.head_search.overwrite=true'), max_batches)
    head_map_file = run / 'conversions' / f'{DHA_NAME}-search' / 'search' / 'head_map.json'
    head_map = HeadMap.load(head_map_file)
    return {'head_map': str(head_map_file), 'kv_heads': head_map.kv_heads(),
            'kv_budget_fraction': head_map.kv_budget_fraction()}


def _dha_fusion(out: Path, run: Path, max_batches: int | None) -> dict:
    teacher = run / 'export' / 'hf'
    trainer, config, history = train_stage('dha/tiny/fusion.yaml',
                                            _dha_overrides(run, f'variables.model_path={teacher}'), max_batches)
    fusion = next(a for a in trainer.state.algorithms if isinstance(a, HeadFusion))
    hf = export_hf(config.save_folder, Path(config.save_folder) / 'hf', overwrite=True, start=teacher)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'history.json').write_text(json.dumps({'fusion': fusion.history, 'train': history['train']}))
    return {'hf_folder': str(hf), 'batches': len(fusion.history), 'converged_at': fusion.converged_at,
            'tokens': len(fusion.history) * config.global_train_batch_size * SEQ_LEN,
            'final_fusion_loss': fusion.history[-1]['fusion_loss'] if fusion.history else None,
            'history': str(out / 'history.json')}


def _continued_pretraining(out: Path, recipe: str, overrides: list[str], max_batches: int | None) -> dict:
    _, config, history = train_stage(recipe, overrides, max_batches)
    save_folder = config.save_folder.format(run_name=config.run_name)
    if not history['eval']:
        raise RuntimeError(f'{recipe}: no evaluation was logged; the checkpoints in {save_folder} are from '
                           'a finished run whose history was not saved. Run with --fresh.')
    hf = export_hf(save_folder, Path(save_folder) / 'hf', overwrite=True)
    exported = load_model_config(hf, who='quickstart')
    head_map = HeadMap.from_hf_config(exported)
    out.mkdir(parents=True, exist_ok=True)
    (out / 'history.json').write_text(json.dumps(history))
    return {'hf_folder': str(hf), 'history': str(out / 'history.json'), 'initial': mean_eval(history, 0),
            'final': mean_eval(history, -1), 'tokens': train_tokens(config, SEQ_LEN),
            'kv_cache_bytes': kv_cache_bytes(exported, SEQ_LEN, bytes_per_value=2),
            'kv_heads': head_map.kv_heads()}


def _gqa_convert(out: Path, run: Path) -> dict:
    teacher = run / 'export' / 'hf'
    config = load_model_config(teacher, who='quickstart')
    head_map = HeadMap.gqa(config.num_hidden_layers, config.num_attention_heads,
                           gqa_kv_heads(config.num_attention_heads), head_dim(config))
    convert_checkpoint(teacher, out / 'hf', head_map, overwrite=True)
    return {'hf_folder': str(out / 'hf')}


def _report(run: Path, history: dict, timings: dict) -> dict:
    per_domain = {}
    for domain, points in sorted(history['eval'].items()):
        first, last = points[0], points[-1]
        per_domain[domain] = {'first_batch': first[0], 'first_loss': first[1], 'final_batch': last[0],
                              'final_loss': last[1], 'reduction': 1.0 - last[1] / first[1]}
    plot = plot_loss_curve(history, run / 'loss_curve.png', title='quickstart: tiny MHA LLaMA')
    summary = {'per_domain_val_loss': per_domain, 'loss_curve': str(plot), 'stage_seconds': timings}
    (run / 'summary.json').write_text(json.dumps(summary, indent=2))
    print()
    print('quickstart summary')
    print(f'  {"domain":<12} {"first val loss":>15} {"final val loss":>15} {"reduction":>10}')
    for domain, row in per_domain.items():
        first = f'{row["first_loss"]:.4f} @{row["first_batch"]}'
        last = f'{row["final_loss"]:.4f} @{row["final_batch"]}'
        print(f'  {domain:<12} {first:>15} {last:>15} {row["reduction"]:>9.1%}')
    if any(row['first_batch'] > 0 for row in per_domain.values()):
        print('  (this pretrain resumed from a checkpoint, so its first evaluation is not at batch 0)')
    print(f'  loss curve:  {plot}')
    print(f'  HF export:   {run / "export" / "hf"}')
    print('  stage times: ' + ', '.join(f'{k} {v}s' for k, v in timings.items()))
    return summary


def _conversion_report(run: Path, mha_loss: dict, mha_kv_bytes: int, search: dict, fusion: dict, dha_ct: dict,
                       gqa_ct: dict) -> dict:
    """The conversion table: losses (mean over the validation domains) and KV-cache bytes, plus the plots."""
    rows = [
        ('MHA teacher', mha_loss['mean'], mha_kv_bytes, 0),
        ('GQA at init (mean-pool)', gqa_ct['initial']['mean'], gqa_ct['kv_cache_bytes'], 0),
        ('GQA after CT', gqa_ct['final']['mean'], gqa_ct['kv_cache_bytes'], gqa_ct['tokens']),
        ('DHA after fusion (baked)', dha_ct['initial']['mean'], dha_ct['kv_cache_bytes'], fusion['tokens']),
        ('DHA after CT', dha_ct['final']['mean'], dha_ct['kv_cache_bytes'], fusion['tokens'] + dha_ct['tokens']),
    ]
    gqa_history = json.loads(Path(gqa_ct['history']).read_text())
    dha_history = json.loads(Path(dha_ct['history']).read_text())

    curves = plot_curves({'GQA CT (val)': mean_eval_curve(gqa_history), 'DHA CT (val)': mean_eval_curve(dha_history)},
                         run / 'conversion_loss.png', title='25% KV budget: continued pre-training',
                         xlabel='CT batch', ylabel='val cross-entropy (mean of domains)',
                         references={'MHA teacher': mha_loss['mean']})
    fusion_history = json.loads(Path(fusion['history']).read_text())['fusion']
    fusion_plot = plot_curves(
        {'L_fusion': [(i + 1, r['fusion_loss']) for i, r in enumerate(fusion_history)],
         'margin t(s)': [(i + 1, max(r['margin'], 1e-6)) for i, r in enumerate(fusion_history)],
         'lambda': [(i + 1, max(r['lambda'], 1e-6)) for i, r in enumerate(fusion_history)]},
        run / 'fusion_curve.png', title='DHA fusion', ylabel='value (log scale)', log_y=True)
    print()
    print(f'conversions at a {KV_BUDGET:.0%} KV budget (DHA K/V heads per layer: {search["kv_heads"]})')
    print(f'  {"model":<28} {"val loss":>9} {"KV bytes/seq":>13} {"train tokens":>13}')
    for name, loss, kv_bytes, tokens in rows:
        print(f'  {name:<28} {loss:>9.4f} {kv_bytes:>13,} {tokens:>13,}')
    converged = fusion['converged_at']
    print(f'  fusion: L_fusion {fusion["final_fusion_loss"]:.2e} after {fusion["batches"]} batches'
          + (f' (converged at batch {converged})' if converged else ' (did NOT reach the threshold)'))
    print(f'  KV bytes per sequence of {SEQ_LEN} tokens in bf16. Plots: {curves}, {fusion_plot}')
    return {'rows': [{'model': n, 'val_loss': loss, 'kv_cache_bytes': b, 'train_tokens': t} for n, loss, b, t in rows],
            'dha_kv_heads': search['kv_heads'], 'fusion': {k: fusion[k] for k in ('batches', 'converged_at',
                                                                                    'final_fusion_loss')},
            'plots': [str(curves), str(fusion_plot)]}


def run_quickstart(out: str | Path = 'quickstart_run', seed: int = 17, fresh: bool = False,
                   steps: int | None = None, conversion_steps: int | None = None, teacher: Sequence[str] = ()) -> dict:
    """The quickstart in ``out``, reusing its finished stages. ``teacher``: overrides of the teacher's pretraining
    recipe (e.g. ``model.config.hidden_size=1024``, for a larger model on a GPU); every conversion loads the
    teacher, so they follow it."""
    run = Path(out).resolve()
    settings = {'seed': seed, 'steps': steps, 'conversion_steps': conversion_steps, 'teacher': list(teacher)}
    if fresh and run.exists():
        if not (run / 'quickstart.json').is_file():
            raise OutputExistsError(f'{run} exists but is not a quickstart run folder; refusing to delete it')
        shutil.rmtree(run)
    if run.exists() and any(run.iterdir()) and not (run / 'quickstart.json').is_file():
        raise OutputExistsError(f'{run} exists and is not a quickstart run folder; choose another --out')
    if (run / 'quickstart.json').is_file():
        earlier = {'teacher': [], **json.loads((run / 'quickstart.json').read_text())}
        if earlier != settings:
            raise ConfigError(f'{run} was made with other settings ({earlier}, now {settings}): its finished stages '
                             'would be reused; pass --fresh to redo them, or choose another --out')
    teacher_config = load_config(recipe_path(QUICKSTART_RECIPE), [f'variables.run_dir={run}', *teacher]).model.config
    gqa_kv_heads(int(teacher_config['num_attention_heads']))  # a teacher the 25% budget cannot split fails now
    run.mkdir(parents=True, exist_ok=True)
    (run / 'quickstart.json').write_text(json.dumps(settings))

    corpus = _run_stage(run, 'corpus', lambda d: _corpus(d, seed))
    eval_task = _run_stage(run, 'eval_task', lambda d: _eval_task(d, run / 'corpus', seed))
    tokenizer = _run_stage(run, 'tokenizer', lambda d: _tokenizer(d, run / 'corpus'))
    data = _run_stage(run, 'data', lambda d: _data(d, run / 'corpus', run / 'tokenizer'))
    pretrain = _run_stage(run, 'pretrain', lambda d: _pretrain(d, run, seed, steps, teacher))
    export = _run_stage(run, 'export', lambda d: _export(d, pretrain['checkpoint_folder']))
    cap = conversion_steps
    search = _run_stage(run, 'dha_search', lambda d: _dha_search(run, cap))
    fusion = _run_stage(run, 'dha_fusion', lambda d: _dha_fusion(d, run, cap))
    dha_ct = _run_stage(run, 'dha_ct', lambda d: _continued_pretraining(d, 'dha/tiny/ct.yaml', _dha_overrides(
        run, f'variables.model_path={fusion["hf_folder"]}'), cap))
    gqa = _run_stage(run, 'gqa_convert', lambda d: _gqa_convert(d, run))
    gqa_ct = _run_stage(run, 'gqa_ct', lambda d: _continued_pretraining(d, 'gqa/tiny_ct.yaml', [
        f'variables.model_path={gqa["hf_folder"]}', f'variables.data_root={run / "data"}',
        f'variables.save_root={run / "conversions"}', f'max_duration={dha_ct["tokens"] // (16 * SEQ_LEN)}ba'], None))
    history = json.loads(Path(pretrain['history']).read_text())
    stages = (('corpus', corpus), ('eval_task', eval_task), ('tokenizer', tokenizer), ('data', data), ('pretrain', pretrain), ('export', export),
              ('dha_search', search), ('dha_fusion', fusion), ('dha_ct', dha_ct), ('gqa_convert', gqa),
              ('gqa_ct', gqa_ct))
    timings = {name: stage['seconds'] for name, stage in stages}
    summary = _report(run, history, timings)
    teacher = HeadMap.load(Path(search['head_map']))
    mha_kv_bytes = HeadMap.mha(len(teacher.layers), teacher.layers[0].num_query_heads, teacher.head_dim).kv_cache_bytes(
        1, SEQ_LEN, bytes_per_element=2)
    mha_loss = mean_eval(history, -1)
    summary['conversions'] = _conversion_report(run, mha_loss, mha_kv_bytes, search, fusion, dha_ct, gqa_ct)
    summary['stage_seconds'] = timings
    summary['total_seconds'] = round(sum(timings.values()), 1)
    (run / 'summary.json').write_text(json.dumps(summary, indent=2))
    print(f'  total: {summary["total_seconds"]} s of stage time')
    return summary
