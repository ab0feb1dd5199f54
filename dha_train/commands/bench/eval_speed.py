"""`dha-train bench eval-speed`: evaluation throughput, lm-eval's ``HFLM`` against ``ContextCachedLM`` (what
`dha-train eval` and the benches use), on one model, task by task, in the same run.

Per task and scorer: the documents and log-likelihood requests scored, the tokens in them (context + continuation,
what HFLM runs), the seconds spent in the log-likelihood stage (task building, the same for both, left out), documents
and tokens per second, and the ratio. The two scorers alternate task by task, so a slower or busier machine moves
both. Each document's scores must agree (log-likelihoods within 1e-4, the same choices): the run fails otherwise.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dha_train.bench_support import bench_say, write_results

TASKS = ('piqa', 'arc_easy', 'arc_challenge', 'hellaswag', 'winogrande', 'sciq')


@dataclass
class EvalSpeedSettings:
    model: str = 'smollm2-135m'  # an HF folder, or a GGUF import-gguf takes (imported into ``out``)
    tasks: tuple[str, ...] = TASKS
    limit: int = 100
    batch_size: int = 16
    out: str = 'bench_eval_speed'
    results: str | None = None  # also write the results here (the docs' record: docs/results/...)


def _score(lm_class, model, tokenizer, task: str, settings: EvalSpeedSettings) -> tuple[float, int, int, list]:
    """(seconds in the log-likelihood stage, requests, tokens, per-document samples) of one task."""
    from lm_eval import simple_evaluate

    from dha_train.harness import hub_offline, quiet_local_data, task_manager

    spent = {'seconds': 0.0, 'requests': 0, 'tokens': 0}
    plain = lm_class._loglikelihood_tokens

    def timed(self, requests, *args, **kwargs):
        started = time.perf_counter()
        answers = plain(self, requests, *args, **kwargs)
        spent['seconds'] += time.perf_counter() - started
        spent['requests'] += len(requests)
        spent['tokens'] += sum(len(context) + len(continuation) for _, context, continuation in requests)
        return answers

    lm_class._loglikelihood_tokens = timed
    try:
        with hub_offline(), quiet_local_data():
            lm = lm_class(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size, device='cpu',
                          max_length=model.config.max_position_embeddings)
            output = simple_evaluate(model=lm, tasks=[task], num_fewshot=0, limit=settings.limit, log_samples=True,
                                     task_manager=task_manager((), (task,)), random_seed=1234,
                                     numpy_random_seed=1234, torch_random_seed=1234, fewshot_random_seed=1234)
    finally:
        lm_class._loglikelihood_tokens = plain
    return spent['seconds'], spent['requests'], spent['tokens'], output['samples'][task]


def _agree(plain: list[dict], cached: list[dict], task: str) -> float:
    """The largest per-choice log-likelihood difference; raises if a document's choice differs or any is > 1e-4."""
    worst = 0.0
    for a, b in zip(plain, cached, strict=True):
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip([r[0] for r in a['resps']], [r[0] for r in b['resps']]):
            worst = max(worst, abs(ll_a - ll_b))
            if greedy_a != greedy_b:
                raise RuntimeError(f'{task}: document {a["doc_id"]} greedy flags differ')
        if a['acc'] != b['acc'] or a.get('acc_norm') != b.get('acc_norm'):
            raise RuntimeError(f'{task}: document {a["doc_id"]} scored differently')
    if worst > 1e-4:
        raise RuntimeError(f'{task}: a log-likelihood differs by {worst:.2e} (> 1e-4)')
    return worst


def run_eval_speed_bench(settings: EvalSpeedSettings | None = None) -> dict:
    from lm_eval.models.huggingface import HFLM

    from dha_train.bench_support import bench_source
    from dha_train.context_cache_lm import ContextCachedLM
    from dha_train.evaluation import load_model

    settings = settings or EvalSpeedSettings()
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = bench_source(out, settings.model, say=lambda message: bench_say('eval-speed', message))
    model, tokenizer = load_model(folder)
    rows = {}
    for task in settings.tasks:
        bench_say('eval-speed', f'{task}: HFLM, then ContextCachedLM, {settings.limit} documents ...')
        seconds_plain, requests, tokens, plain = _score(HFLM, model, tokenizer, task, settings)
        seconds_cached, _, _, cached = _score(ContextCachedLM, model, tokenizer, task, settings)
        docs = len(plain)
        rows[task] = {'documents': docs, 'requests': requests, 'tokens': tokens,
                      'hflm_s': round(seconds_plain, 2), 'cached_s': round(seconds_cached, 2),
                      'hflm_docs_per_s': round(docs / seconds_plain, 2),
                      'cached_docs_per_s': round(docs / seconds_cached, 2),
                      'hflm_tokens_per_s': round(tokens / seconds_plain), 'cached_tokens_per_s': round(tokens / seconds_cached),
                      'speedup': round(seconds_plain / seconds_cached, 2),
                      'max_loglikelihood_difference': _agree(plain, cached, task)}
        bench_say('eval-speed', f'{task}: {rows[task]}')
    total_plain = sum(row['hflm_s'] for row in rows.values())
    total_cached = sum(row['cached_s'] for row in rows.values())
    results = {'settings': {k: v for k, v in asdict(settings).items() if k != 'results'}, 'model': str(folder),
               'tasks': rows, 'total': {'hflm_s': round(total_plain, 2), 'cached_s': round(total_cached, 2),
                                        'speedup': round(total_plain / total_cached, 2)}}
    write_results(results, out, settings.results)
    print(markdown_table(results))
    return results


def markdown_table(results: dict) -> str:
    lines = ['| task | documents | tokens | HFLM docs/s | cached docs/s | HFLM tokens/s | cached tokens/s | speedup | '
             'max dLL |', '| --- | --- | --- | --- | --- | --- | --- | --- | --- |']
    for task, row in results['tasks'].items():
        lines.append(f"| {task} | {row['documents']} | {row['tokens']:,} | {row['hflm_docs_per_s']} | "
                     f"{row['cached_docs_per_s']} | {row['hflm_tokens_per_s']} | {row['cached_tokens_per_s']} | "
                     f"{row['speedup']}x | {row['max_loglikelihood_difference']:.1e} |")
    total = results['total']
    lines.append(f"| all (log-likelihood stage) | | | | | | | {total['speedup']}x ({total['hflm_s']} s -> "
                 f"{total['cached_s']} s) | |")
    return '\n'.join(lines)
