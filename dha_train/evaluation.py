"""`dha-train eval` and `dha-train compare`: lm-evaluation-harness on any model the project exports, and converted
models side by side.

- ``run_eval``: loads an HF folder (plain LLaMA, standard GQA, or a DHA / MoH folder with its modeling file, via
  ``trust_remote_code``) or a Composer checkpoint (exported to a temporary HF folder first), wraps it in lm-eval's
  ``HFLM`` and runs ``simple_evaluate`` once per few-shot count of the chosen tasks. It prints a table, writes
  ``eval_results.json`` (scores, the model's KV-cache bytes per sequence, and the training tokens when the run
  folder says), and logs ``eval/<task>/<metric>`` to W&B when a project is given (offline works).
- ``SUITES``: each seed's task list with its shot counts; ``local``: the project's own multiple-choice task
  (``stdlib_mc``, built by ``build_local_task`` from the quickstart corpus, an lm-eval task over local JSON), the
  one task that needs no download.
- ``compare``: final losses, task scores, KV-cache bytes and training tokens of several evaluated runs in one table
  and one plot.
"""

from __future__ import annotations

import functools
import json
import math
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path

RESULTS_FILE = 'eval_results.json'
LOCAL_TASK = 'stdlib_mc'

# task -> few-shot count, as each paper reports them.
SUITES: dict[str, dict[str, int]] = {
    # DHA (seed 000, Table 1): commonsense and reading comprehension, then continued QA and text understanding.
    'dha': {'sciq': 0, 'piqa': 0, 'winogrande': 0, 'arc_easy': 0, 'arc_challenge': 25, 'hellaswag': 0,
            'logiqa': 0, 'boolq': 32, 'lambada_openai': 0},
    # Aligned GQA (seed 001): its eight datasets. The paper fine-tunes on them and scores with its own templates;
    # this preset runs lm-eval's standard zero-shot versions.
    'aligned_gqa': {'boolq': 0, 'piqa': 0, 'hellaswag': 0, 'winogrande': 0, 'arc_easy': 0, 'arc_challenge': 0,
                    'social_iqa': 0, 'openbookqa': 0},
    # MoH-LLM-S/B from scratch (seed 002 section 4.3): six simple zero-shot benchmarks.
    'moh': {'sciq': 0, 'piqa': 0, 'winogrande': 0, 'openbookqa': 0, 'logiqa': 0, 'truthfulqa_mc2': 0},
    # MoH-LLaMA3-8B (seed 002 appendix C).
    'moh_llama3': {'mmlu': 5, 'cmmlu': 5, 'ceval-valid': 5, 'gsm8k': 8, 'truthfulqa_mc2': 0, 'nq_open': 32,
                   'boolq': 32, 'arc_easy': 0, 'arc_challenge': 25, 'lambada_openai': 0, 'piqa': 0, 'sciq': 0,
                   'winogrande': 0, 'hellaswag': 10, 'logiqa': 0, 'openbookqa': 0},
    # The project's own task (offline, tests and the quickstart).
    'local': {LOCAL_TASK: 0},
}


class EvalError(ValueError):
    """Bad arguments to `dha-train eval` / `compare`: named before anything heavy runs."""


# --- the local task ----------------------------------------------------------------------------------------------
def _prose_passages(corpus: Path, min_words: int, max_words: int) -> list[list[str]]:
    """Paragraphs of the prose domain's JSONL documents, as word lists of a usable length."""
    from dha_train.data.corpus import PROSE_DOMAIN

    files = sorted((corpus / PROSE_DOMAIN).glob('*.jsonl'))
    if not files:
        raise EvalError(f'{corpus}: no {PROSE_DOMAIN}/*.jsonl (give the quickstart corpus folder)')
    passages = []
    for path in files:
        for line in path.read_text(encoding='utf-8').splitlines():
            for paragraph in json.loads(line)['text'].split('\n\n'):
                words = paragraph.split()
                if min_words <= len(words) <= max_words:
                    passages.append(words)
    return passages


def build_local_task(corpus: str | Path, out: str | Path, examples: int = 200, fewshot_examples: int = 16,
                     num_choices: int = 4, seed: int = 0, min_words: int = 8, max_words: int = 24) -> Path:
    """Write ``stdlib_mc``: for a docstring paragraph of the corpus, pick its true second half among
    ``num_choices`` (the others are second halves of other paragraphs). Files: ``test.jsonl``, ``fewshot.jsonl``
    and ``stdlib_mc.yaml`` (an lm-eval task over them, by absolute path), in ``out``. The paragraphs are the
    teacher's training prose, so the task checks the pipeline and relative quality, not generalisation."""
    corpus, out = Path(corpus), Path(out)
    passages = _prose_passages(corpus, min_words, max_words)
    needed = examples + fewshot_examples
    if len(passages) < needed + num_choices:
        raise EvalError(f'{corpus}: {len(passages)} usable paragraphs, {needed + num_choices} needed')
    rng = random.Random(seed)
    rng.shuffle(passages)
    splits = {'test': passages[:examples], 'fewshot': passages[examples:needed]}
    pool = passages[needed:]
    out.mkdir(parents=True, exist_ok=True)
    for split, chosen in splits.items():
        with (out / f'{split}.jsonl').open('w') as handle:
            for words in chosen:
                cut = len(words) // 2
                true_end = ' '.join(words[cut:])
                choices = [true_end]
                while len(choices) < num_choices:
                    other = rng.choice(pool)
                    candidate = ' '.join(other[len(other) // 2:])
                    if candidate not in choices:
                        choices.append(candidate)
                rng.shuffle(choices)
                handle.write(json.dumps({'context': ' '.join(words[:cut]), 'choices': choices,
                                         'label': choices.index(true_end)}) + '\n')
    (out / f'{LOCAL_TASK}.yaml').write_text(f"""# dha_train's offline multiple-choice task, built by `dha-train local-task`.
task: {LOCAL_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {(out / 'test.jsonl').resolve()}
    fewshot: {(out / 'fewshot.jsonl').resolve()}
test_split: test
fewshot_split: fewshot
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return out


# --- evaluation --------------------------------------------------------------------------------------------------
def resolve_tasks(suite: str | None, tasks: Sequence[str] | None, num_fewshot: int | None) -> dict[str, int]:
    """task -> few-shot count from a suite or a task list; ``num_fewshot`` overrides every count."""
    if (suite is None) == (not tasks):
        raise EvalError('give exactly one of a suite (--suite) and a task list (--tasks)')
    if suite is not None:
        if suite not in SUITES:
            raise EvalError(f"unknown suite '{suite}' (suites: {', '.join(SUITES)})")
        chosen = dict(SUITES[suite])
    else:
        chosen = {task: 0 for task in tasks}
    if num_fewshot is not None:
        if num_fewshot < 0:
            raise EvalError(f'--num-fewshot must be >= 0, got {num_fewshot}')
        chosen = {task: num_fewshot for task in chosen}
    return chosen


def load_model(path: str | Path, device: str = 'cpu', dtype: str = 'float32'):
    """(model, tokenizer) from an HF folder or a Composer checkpoint / save folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import dha_train.models  # noqa: F401  (DHA and MoH classes resolve without remote code too)

    path = Path(path)
    if not path.exists():
        raise EvalError(f'model not found: {path}')
    with tempfile.TemporaryDirectory(prefix='dha-eval-') as scratch:
        if not (path / 'config.json').is_file():  # a Composer checkpoint: export it first (removed after loading)
            from dha_train.export import export_hf

            path = export_hf(path, Path(scratch) / 'hf')
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, local_files_only=True,
                                                     torch_dtype=getattr(torch, dtype)).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def kv_cache_bytes(config, seq_len: int = 4096, bytes_per_value: int = 2) -> int:
    """K+V bytes per sequence of ``seq_len`` tokens (bf16 by default) of a LLaMA, GQA, DHA or MoH config."""
    from dha_train.models.head_map import HeadMap

    if getattr(config, 'head_map', None) is not None:
        head_map = HeadMap.from_dict(config.head_map)
    else:
        head_dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads
        head_map = HeadMap.gqa(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                               head_dim)
    return head_map.kv_cache_bytes(1, seq_len, bytes_per_value)


def _training_tokens(folder: Path) -> int | None:
    """Tokens the model was trained on, when its folder records them (a dha_train stage's DONE.json)."""
    for candidate in (folder / 'DONE.json', folder.parent / 'DONE.json'):
        if candidate.is_file():
            tokens = json.loads(candidate.read_text()).get('tokens')
            if tokens is not None:
                return int(tokens)
    return None


@functools.lru_cache(maxsize=8)
def task_manager(include: tuple[str, ...], tasks: tuple[str, ...]):
    """lm-eval's task index: only the ``include`` folders when they hold every task asked for (indexing lm-eval's
    own ~15k task configs takes seconds), else those plus lm-eval's."""
    from lm_eval.tasks import TaskManager

    if include:
        local = TaskManager(include_path=list(include), include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    return TaskManager(include_path=list(include) or None)


def check_tasks(chosen: dict[str, int], include: Sequence[str | Path] = ()) -> None:
    """Every task must be known to lm-eval (or to an ``include`` folder)."""
    for folder in include:
        if not Path(folder).is_dir():
            raise EvalError(f'--include {folder}: not a folder of lm-eval task YAMLs')
    manager = task_manager(tuple(str(Path(folder).resolve()) for folder in include), tuple(chosen))
    missing = [task for task in chosen if task not in manager.all_tasks]
    if missing:
        hint = (f" ({LOCAL_TASK} is built with `dha-train local-task <corpus> <folder>` and found with "
                '--include <folder>)' if LOCAL_TASK in missing else '')
        raise EvalError(f"unknown lm-eval task(s): {', '.join(missing)}{hint}")


def score_model(model, tokenizer, chosen: dict[str, int], limit: float | None = None,
                include: Sequence[str | Path] = (), batch_size: int = 8, device: str = 'cpu',
                seed: int = 1234) -> dict[str, dict[str, float]]:
    """lm-eval scores {task: {metric: value, 'num_fewshot': n}} of a loaded HF model, one ``simple_evaluate``
    per few-shot count."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    manager = task_manager(tuple(str(Path(folder).resolve()) for folder in include), tuple(chosen))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
              max_length=model.config.max_position_embeddings)
    scores: dict[str, dict[str, float]] = {}
    by_shots: dict[int, list[str]] = {}
    for task, shots in chosen.items():
        by_shots.setdefault(shots, []).append(task)
    for shots, group in sorted(by_shots.items()):
        output = simple_evaluate(model=lm, tasks=group, num_fewshot=shots, limit=limit, task_manager=manager,
                                 log_samples=False, random_seed=seed, numpy_random_seed=seed,
                                 torch_random_seed=seed, fewshot_random_seed=seed)
        for task, metrics in output['results'].items():
            scores[task] = {key.split(',')[0]: float(value) for key, value in metrics.items()
                            if isinstance(value, (int, float)) and not key.startswith('alias')
                            and 'stderr' not in key}
            scores[task]['num_fewshot'] = shots
    return scores


def validation_loss(model, tokenizer, data_root: str | Path, batch_size: int = 8,
                    device: str = 'cpu') -> dict[str, float]:
    """Per-domain validation cross-entropy of a loaded HF model on a `dha-train data prep` folder (its val split),
    through the same Composer evaluators as training, plus their mean."""
    from composer import Trainer

    from dha_train.config import EvalLoaderConfig
    from dha_train.data.loaders import build_evaluators, check_data_matches_model
    from dha_train.models.llama import wrap_composer
    from dha_train.train import close_trainer

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


def run_eval(model_path: str | Path, suite: str | None = None, tasks: Sequence[str] | None = None,
             num_fewshot: int | None = None, limit: float | None = None, include: Sequence[str | Path] = (),
             out: str | Path | None = None, batch_size: int = 8, device: str = 'cpu', name: str | None = None,
             wandb_project: str | None = None, wandb_mode: str = 'offline', wandb_dir: str | None = None,
             data: str | Path | None = None, train_tokens: int | None = None, seed: int = 1234) -> dict:
    """lm-eval scores of one model (and its validation loss on ``data``, a `dha-train data prep` folder), printed,
    written to ``out``/eval_results.json and, with ``wandb_project``, logged to W&B."""
    chosen = resolve_tasks(suite, tasks, num_fewshot)
    if limit is not None and limit <= 0:
        raise EvalError(f'--limit must be > 0, got {limit}')
    if data is not None and not Path(data).is_dir():
        raise EvalError(f'--data {data}: not a folder (give a `dha-train data prep` output with a val split)')
    check_tasks(chosen, include)
    model, tokenizer = load_model(model_path, device)
    losses = validation_loss(model, tokenizer, data, batch_size, device) if data is not None else None
    scores = score_model(model, tokenizer, chosen, limit=limit, include=include, batch_size=batch_size,
                         device=device, seed=seed)
    source = Path(model_path)
    result = {'model': str(source.resolve()), 'name': name or source.name, 'suite': suite, 'limit': limit,
              'scores': scores, 'kv_cache_bytes_per_4096_tokens': kv_cache_bytes(model.config),
              'model_type': model.config.model_type,
              'train_tokens': train_tokens if train_tokens is not None else _training_tokens(source),
              'val_loss': losses['mean'] if losses else None, 'val_loss_per_domain': losses}
    out = Path(out) if out is not None else (source if source.is_dir() else source.parent) / 'eval'
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(result, indent=2))
    print_scores(result)
    if losses:
        print(f"validation loss {losses['mean']:.4f} (" + ', '.join(f'{d} {v:.4f}' for d, v in losses.items()
                                                             if d != 'mean') + ')')
    if wandb_project:
        log_to_wandb(result, wandb_project, wandb_mode, wandb_dir)
    print(f'results: {out / RESULTS_FILE}')
    return result


def headline(metrics: dict[str, float]) -> tuple[str, float] | None:
    """The score a paper reports for a task: acc_norm where lm-eval gives it, else acc, else exact match."""
    for key in ('acc_norm', 'acc', 'exact_match', 'em', 'mc2'):
        if key in metrics:
            return key, metrics[key]
    return None


def print_scores(result: dict) -> None:
    print(f"\n{result['name']} ({result['model_type']}; KV cache {result['kv_cache_bytes_per_4096_tokens']:,} bytes "
          'per 4096 tokens in bf16)')
    print(f'{"task":<22} {"shots":>5} {"metric":>12} {"score":>8}')
    for task, metrics in sorted(result['scores'].items()):
        pick = headline(metrics)
        if pick is not None:
            print(f'{task:<22} {int(metrics["num_fewshot"]):>5} {pick[0]:>12} {pick[1]:>8.4f}')


def log_to_wandb(result: dict, project: str, mode: str = 'offline', folder: str | None = None) -> None:
    """One W&B run holding ``eval/<task>/<metric>`` (and the KV bytes), for the project's dashboards."""
    import wandb

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


# --- compare -----------------------------------------------------------------------------------------------------
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
    from dha_train.plots import plot_comparison

    plot = plot_comparison(rows, tasks, out / 'compare.png')
    summary = {'runs': rows, 'tasks': tasks, 'plot': str(plot)}
    (out / 'compare.json').write_text(json.dumps(summary, indent=2))
    print(f'table: {out / "compare.json"}  plot: {plot}')
    return summary
