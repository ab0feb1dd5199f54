"""lm-evaluation-harness as a library: task suites, task checks, scoring a loaded model, the offline local task.

Used by `dha-train eval` (``commands.evaluate``) and by the ``lm_eval_at_end`` callback, so it imports neither.

- ``SUITES``: each seed's task list with its shot counts; ``local``: the project's own multiple-choice task
  (``stdlib_mc``, built by ``build_local_task`` from the quickstart corpus, an lm-eval task over local JSON), the
  one task that needs no download.
- ``score_model``: lm-eval's ``simple_evaluate`` on a loaded HF model, once per few-shot count.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Sequence
from pathlib import Path

from dha_train.data.corpus import PROSE_DOMAIN
from dha_train.errors import DhaTrainError

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


class EvalError(DhaTrainError, ValueError):
    """Bad arguments to `dha-train eval` / `compare`: named before anything heavy runs."""


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


def headline(metrics: dict[str, float]) -> tuple[str, float] | None:
    """The score a paper reports for a task: acc_norm where lm-eval gives it, else acc, else exact match."""
    for key in ('acc_norm', 'acc', 'exact_match', 'em', 'mc2'):
        if key in metrics:
            return key, metrics[key]
    return None
