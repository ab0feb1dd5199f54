"""`dha-train quickstart`: the embedded default job, end to end in one run folder.

Stages (each reused on a second run once finished, unless --fresh):
  corpus     Python stdlib source (github) and docstrings (wikipedia) as RedPajama JSONL
  tokenizer  byte-level BPE trained on that corpus, saved as a HF tokenizer folder
  data       `dha-train data prep` -> MDS shards per domain, train and val
  pretrain   yamls/pretrain/tiny.yaml: a tiny MHA LLaMA (the teacher later issues convert)
  export     Hugging Face folder of the trained model
  report     per-domain validation loss at step 0 and at the end, loss-curve PNG, summary.json
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from dha_train.paths import recipe_path

QUICKSTART_RECIPE = 'pretrain/tiny.yaml'
VOCAB_SIZE = 4096
SEQ_LEN = 256
CORPUS_BYTES_PER_DOMAIN = 3_000_000
VAL_TOKENS = 4 * 16 * SEQ_LEN  # four eval batches per domain


class Stage:
    """A stage directory that counts as finished only once its DONE marker (with the stage's result) exists."""

    def __init__(self, run: Path, name: str):
        self.dir = run / name
        self.marker = self.dir / 'DONE.json'

    def done(self) -> dict | None:
        return json.loads(self.marker.read_text()) if self.marker.is_file() else None

    def finish(self, result: dict) -> dict:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(json.dumps(result, indent=2))
        return result


def _say(message: str) -> None:
    print(f'[quickstart] {message}', flush=True)


def _run_stage(run: Path, name: str, build) -> dict:
    stage = Stage(run, name)
    result = stage.done()
    if result is not None:
        _say(f'{name}: reusing finished stage in {stage.dir}')
        return result
    _say(f'{name}: running')
    started = time.perf_counter()
    result = build(stage.dir)
    result['seconds'] = round(time.perf_counter() - started, 1)
    _say(f'{name}: done in {result["seconds"]} s')
    return stage.finish(result)


def _corpus(out: Path, seed: int) -> dict:
    from dha_train.data.corpus import build_stdlib_corpus

    return build_stdlib_corpus(out, max_bytes_per_domain=CORPUS_BYTES_PER_DOMAIN, seed=seed)


def _tokenizer(out: Path, corpus: Path) -> dict:
    from dha_train.data.corpus import iter_corpus_texts
    from dha_train.data.tokenizer import train_byte_level_bpe

    tokenizer = train_byte_level_bpe(iter_corpus_texts(corpus), out, vocab_size=VOCAB_SIZE)
    return {'vocab_size': len(tokenizer)}


def _data(out: Path, corpus: Path, tokenizer: Path) -> dict:
    from dha_train.data.prep import prep_redpajama

    manifest = prep_redpajama([corpus], out, tokenizer, seq_len=SEQ_LEN, val_tokens=VAL_TOKENS, overwrite=True)
    return {'manifest': str(out / 'manifest.json'), 'domains': sorted(manifest['domains'])}


def _history_from(logger) -> dict:
    """Train loss per batch and per-domain eval loss per evaluation, from Composer's in-memory logger."""
    history: dict = {'train': [], 'eval': {}}
    for timestamp, value in logger.data.get('loss/train/total', []):
        history['train'].append([int(timestamp.batch), float(value)])
    for key, points in logger.data.items():
        if key.startswith('metrics/eval_') and key.endswith('/LanguageCrossEntropy'):
            domain = key[len('metrics/eval_'):-len('/LanguageCrossEntropy')]
            history['eval'][domain] = [[int(t.batch), float(v)] for t, v in points]
    return history


def _pretrain(out: Path, run: Path, seed: int, steps: int | None) -> dict:
    from composer.loggers import InMemoryLogger

    from dha_train.config import load_config
    from dha_train.train import train

    overrides = [f'variables.run_dir={run}', f'seed={seed}']
    if steps is not None:
        overrides.append(f'max_duration={steps}ba')
    config = load_config(recipe_path(QUICKSTART_RECIPE), overrides)
    memory = InMemoryLogger()
    trainer = train(config, extra_loggers=[memory])
    history = _history_from(memory)
    trainer.close()
    if not history['train']:
        raise RuntimeError(f'pretrain: nothing was trained; the checkpoints in {config.save_folder} are from a '
                           'finished run whose loss history was not saved. Run with --fresh.')
    out.mkdir(parents=True, exist_ok=True)
    (out / 'history.json').write_text(json.dumps(history))
    return {'checkpoint_folder': config.save_folder, 'history': str(out / 'history.json'),
            'batches': int(trainer.state.timestamp.batch)}


def _export(out: Path, checkpoint_folder: str) -> dict:
    from dha_train.export import export_hf

    export_hf(checkpoint_folder, out / 'hf', overwrite=True)
    return {'hf_folder': str(out / 'hf')}


def _report(run: Path, history: dict, timings: dict) -> dict:
    from dha_train.plots import plot_loss_curve

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
    print(f'  stage times: ' + ', '.join(f'{k} {v}s' for k, v in timings.items()))
    return summary


def run_quickstart(out: str | Path = 'quickstart_run', seed: int = 17, fresh: bool = False,
                   steps: int | None = None) -> dict:
    run = Path(out).resolve()
    if fresh and run.exists():
        if not (run / 'quickstart.json').is_file():
            raise FileExistsError(f'{run} exists but is not a quickstart run folder; refusing to delete it')
        shutil.rmtree(run)
    if run.exists() and any(run.iterdir()) and not (run / 'quickstart.json').is_file():
        raise FileExistsError(f'{run} exists and is not a quickstart run folder; choose another --out')
    run.mkdir(parents=True, exist_ok=True)
    (run / 'quickstart.json').write_text(json.dumps({'seed': seed, 'steps': steps}))

    corpus = _run_stage(run, 'corpus', lambda d: _corpus(d, seed))
    tokenizer = _run_stage(run, 'tokenizer', lambda d: _tokenizer(d, run / 'corpus'))
    data = _run_stage(run, 'data', lambda d: _data(d, run / 'corpus', run / 'tokenizer'))
    pretrain = _run_stage(run, 'pretrain', lambda d: _pretrain(d, run, seed, steps))
    export = _run_stage(run, 'export', lambda d: _export(d, pretrain['checkpoint_folder']))
    history = json.loads(Path(pretrain['history']).read_text())
    timings = {name: stage['seconds'] for name, stage in
               (('corpus', corpus), ('tokenizer', tokenizer), ('data', data), ('pretrain', pretrain),
                ('export', export))}
    return _report(run, history, timings)
