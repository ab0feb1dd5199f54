"""`dha-train bench conversion`: DHA against mean-pool GQA on one pretrained MHA model at a 25% KV budget.

It runs the quickstart (reusing every finished stage of the run folder): the tiny MHA teacher, DHA Search ->
Fusion -> CT and the GQA conversion. Then, in the same process:

1. loss right after conversion: GQA at init (mean-pool) against DHA after fusion (the baked model);
2. tokens GQA continued pre-training needs to reach DHA's post-fusion loss (a GQA run of ``gqa_multiple`` x the
   fusion tokens, evaluated every ``eval_every`` batches), against DHA's fusion tokens (the paper claims 5x);
3. loss after equal total budgets: a GQA CT run with DHA's fusion + CT tokens, against DHA after CT;
4. step time of the fusion phase and of the DHA model's CT, each over the MHA model's step time, from interleaved
   timing runs of ``timing_batches`` batches (after 3 warm-up batches), the median over ``repeats`` rounds;
5. progressive fusion (``progressive_sizes``, then the whole groups) against the one-stage fusion: tokens to
   converge and the loss after fusion.

Prints a table and writes results.json in ``out`` (default <run>/bench_conversion).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from dha_train.quickstart import (DHA_NAME, SEQ_LEN, mean_eval, mean_eval_curve, run_quickstart, train_stage,
                                  train_tokens)

BATCH = 16  # the tiny recipes' global batch


def _gqa_ct(run: Path, work: Path, gqa_model: str, name: str, batches: int, eval_every: int) -> dict:
    _, config, history = train_stage('gqa/tiny_ct.yaml', [
        f'variables.model_path={gqa_model}', f'variables.data_root={run / "data"}', f'variables.save_root={work}',
        f'run_name={name}', f'max_duration={batches}ba', f'eval_interval={eval_every}ba', 'save_interval=100000ba'],
        None)
    if not history['eval']:
        raise RuntimeError(f'bench {name}: no evaluation logged; delete {work / name} and run again')
    return {'curve': mean_eval_curve(history), 'final': mean_eval(history, -1)['mean'], 'tokens': train_tokens(config)}


def _tokens_per_second(recipe: str, overrides: list[str], batches: int, result: Path) -> float:
    from dha_train.callbacks.throughput_probe import ThroughputProbe

    # The recipes' own callbacks (fusion_monitor, speed_monitor, ...) are left out: every model is timed alike.
    train_stage(recipe, overrides + ['eval_first=false', 'eval_interval=100000ba', 'save_folder=null',
                                     'autoresume=false', 'console_log_interval=100000ba'],
                batches + 3, extra_callbacks=[ThroughputProbe(str(result), warmup_batches=3)], recipe_callbacks=False)
    return json.loads(result.read_text())['tokens_per_sec']


def _progressive_fusion(run: Path, work: Path, head_map: str, sizes: Sequence[int]) -> dict:
    """The tiny Fusion again with ``progressive: sizes``, baked, and its validation loss."""
    import shutil

    from dha_train.algorithms.head_fusion import HeadFusion
    from dha_train.export import export_hf

    name = 'bench-progressive'
    shutil.rmtree(work / f'{name}-fusion', ignore_errors=True)
    common = [f'variables.data_root={run / "data"}', f'variables.save_root={work}', f'variables.name={name}']
    trainer, config, _ = train_stage('dha/tiny/fusion.yaml', common + [
        f'variables.model_path={run / "export" / "hf"}', f'variables.head_map={head_map}', 'eval_first=false',
        f'algorithms.head_fusion.progressive=[{",".join(str(size) for size in sizes)}]'], None)
    fusion = HeadFusion.of(trainer.state, 'bench conversion')
    history = fusion.history
    hf = export_hf(config.save_folder, Path(config.save_folder) / 'hf', overwrite=True)
    _, _, evaluation = train_stage('dha/tiny/ct.yaml', common + [f'variables.model_path={hf}', 'save_folder=null',
                                                                 'autoresume=false'], 1)
    return {'sizes': list(sizes), 'batches': len(history), 'tokens': len(history) * BATCH * SEQ_LEN,
            'converged': fusion.converged_at is not None,
            'stage_starts': [i for i in range(1, len(history)) if history[i]['stage'] != history[i - 1]['stage']],
            'final_fusion_loss': history[-1]['fusion_loss'], 'loss_after_fusion': mean_eval(evaluation, 0)['mean']}


def run_conversion_bench(run: str | Path = 'quickstart_run', out: str | Path | None = None, gqa_multiple: float = 5.0,
                         eval_every: int = 10, timing_batches: int = 20, repeats: int = 3, seed: int = 17,
                         teacher: Sequence[str] = (), progressive_sizes: Sequence[int] = (2,)) -> dict:
    run = Path(run).resolve()
    summary = run_quickstart(run, seed=seed, teacher=teacher)
    work = Path(out).resolve() if out else run / 'bench_conversion'
    work.mkdir(parents=True, exist_ok=True)
    stages = {name: json.loads((run / name / 'DONE.json').read_text())
              for name in ('dha_search', 'dha_fusion', 'dha_ct', 'gqa_convert', 'gqa_ct')}
    fusion, dha_ct, gqa = stages['dha_fusion'], stages['dha_ct'], stages['gqa_convert']
    fusion_tokens, ct_tokens = fusion['tokens'], dha_ct['tokens']
    dha_after_fusion, dha_after_ct = dha_ct['initial']['mean'], dha_ct['final']['mean']
    gqa_at_init = stages['gqa_ct']['initial']['mean']

    print('[bench] GQA continued pre-training until it reaches DHA\'s post-fusion loss ...', flush=True)
    long_batches = max(int(round(gqa_multiple * fusion_tokens / (BATCH * SEQ_LEN))), eval_every)
    long = _gqa_ct(run, work, gqa['hf_folder'], 'bench-gqa-reach', long_batches, eval_every)
    reached = next(((batch, loss) for batch, loss in long['curve'] if loss <= dha_after_fusion), None)
    print('[bench] GQA continued pre-training with DHA\'s total (fusion + CT) tokens ...', flush=True)
    equal = _gqa_ct(run, work, gqa['hf_folder'], 'bench-gqa-equal', (fusion_tokens + ct_tokens) // (BATCH * SEQ_LEN),
                    max(1, (fusion_tokens + ct_tokens) // (BATCH * SEQ_LEN)))

    print('[bench] step times: MHA, fusion phase, DHA model (interleaved rounds) ...', flush=True)
    teacher_hf = run / 'export' / 'hf'
    common = [f'variables.data_root={run / "data"}', f'variables.save_root={work}']
    timing = {'mha': [], 'fusion': [], 'dha_ct': []}
    for round_index in range(repeats):
        timing['mha'].append(_tokens_per_second('gqa/tiny_ct.yaml', common + [
            f'variables.model_path={teacher_hf}', 'run_name=bench-time-mha'], timing_batches, work / 'mha.json'))
        timing['fusion'].append(_tokens_per_second('dha/tiny/fusion.yaml', common + [
            f'variables.model_path={teacher_hf}', f'variables.name={DHA_NAME}', 'run_name=bench-time-fusion',
            f'variables.head_map={stages["dha_search"]["head_map"]}',
            'algorithms.head_fusion.stop_at_threshold=false'], timing_batches, work / 'fusion.json'))
        timing['dha_ct'].append(_tokens_per_second('dha/tiny/ct.yaml', common + [
            f'variables.model_path={fusion["hf_folder"]}', 'run_name=bench-time-dha'], timing_batches,
            work / 'dha.json'))
    fusion_ratios = [m / f for m, f in zip(timing['mha'], timing['fusion'])]
    dha_ratios = [m / d for m, d in zip(timing['mha'], timing['dha_ct'])]

    results = {
        'teacher_overrides': list(teacher), 'kv_budget': 0.25, 'dha_kv_heads': stages['dha_search']['kv_heads'],
        'mha_loss': summary['conversions']['rows'][0]['val_loss'],
        'loss_after_conversion': {'gqa_mean_pool': gqa_at_init, 'dha_after_fusion': dha_after_fusion},
        'dha_fusion': {'tokens': fusion_tokens, 'batches': fusion['batches'], 'converged_at': fusion['converged_at'],
                       'final_fusion_loss': fusion['final_fusion_loss']},
        'gqa_tokens_to_reach_dha_fusion_loss': reached[0] * BATCH * SEQ_LEN if reached else None,
        'gqa_reach_run': {'tokens': long['tokens'], 'curve': long['curve']},
        'equal_budget': {'tokens': fusion_tokens + ct_tokens, 'dha_after_ct': dha_after_ct,
                         'gqa_after_ct': equal['final']},
        'step_time_ratio': {'fusion_over_mha': statistics.median(fusion_ratios),
                            'dha_ct_over_mha': statistics.median(dha_ratios),
                            'per_round_fusion_over_mha': fusion_ratios, 'per_round_dha_ct_over_mha': dha_ratios},
        'tokens_per_second': timing, 'timing_batches': timing_batches,
    }
    (work / 'results.json').write_text(json.dumps(results, indent=2))
    speedup = (f'{results["gqa_tokens_to_reach_dha_fusion_loss"] / fusion_tokens:.2f}x DHA\'s fusion tokens'
               if reached else f'not reached within {long["tokens"]:,} tokens '
                               f'(> {long["tokens"] / fusion_tokens:.1f}x DHA\'s fusion tokens)')
    print()
    model = ' '.join(teacher) or 'the tiny quickstart teacher'
    print(f'DHA vs GQA at a 25% KV budget ({model}; MHA val loss {results["mha_loss"]:.4f})')
    print(f'  loss right after conversion:   GQA (mean-pool) {gqa_at_init:.4f}   DHA after fusion {dha_after_fusion:.4f}'
          f'   (fusion: {fusion_tokens:,} tokens, L_fusion {fusion["final_fusion_loss"]:.1e})')
    print(f'  GQA tokens to reach DHA\'s post-fusion loss: '
          + (f'{results["gqa_tokens_to_reach_dha_fusion_loss"]:,} = {speedup}' if reached else speedup))
    print(f'  equal total budget ({fusion_tokens + ct_tokens:,} tokens): GQA after CT {equal["final"]:.4f}   '
          f'DHA after fusion + CT {dha_after_ct:.4f}')
    print(f'  step time / MHA step time (median of {repeats}): fusion phase '
          f'{results["step_time_ratio"]["fusion_over_mha"]:.3f}x, DHA model CT '
          f'{results["step_time_ratio"]["dha_ct_over_mha"]:.3f}x')

    # Last, so that a failure here keeps everything above: progressive fusion (appendix B.2) against one stage.
    print('[bench] progressive fusion (pairs first, then the whole groups) ...', flush=True)
    progressive = _progressive_fusion(run, work, stages['dha_search']['head_map'], progressive_sizes)
    results['progressive_fusion'] = progressive
    (work / 'results.json').write_text(json.dumps(results, indent=2))
    print(f'  progressive fusion {progressive["sizes"]} then whole groups: {progressive["tokens"]:,} tokens '
          f'({progressive["batches"]} batches, next stage at batch {progressive["stage_starts"]}, '
          f'{"converged" if progressive["converged"] else "NOT converged"}, L_fusion '
          f'{progressive["final_fusion_loss"]:.1e}), loss after fusion {progressive["loss_after_fusion"]:.4f} '
          f'against one stage: {fusion_tokens:,} tokens, {dha_after_fusion:.4f}')
    print(f'  results.json in {work}')
    return results
