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
   converge and the loss after fusion;
6. aligned GQA (seed 001), one row per criterion (cos, dist) and grouping (by key, by value): the loss of the
   aligned model mean-pooled to its groups (right after conversion), and of the standard GQA export after a
   pruning run (L0 gates + KL/BiLD distillation from the teacher, ``yamls/aligned_gqa/tiny/prune.yaml``) of DHA's
   fusion + CT tokens;
7. AsymGQA (seed 004): the asymmetric search (unequal groups) mean-pooled, and after CT (``yamls/gqa/tiny_ct.yaml``)
   of the same tokens; the symmetric search (equal groups) right after conversion.

8. MLA (``convert --method mla``) at the GQA rows' cache bytes: the default conversion (2-norm RoPE pairs, an eighth
   of each head's pairs kept; activation-aware joint K/V latent; ranks from the spectra), right after conversion,
   after CT (``yamls/mla/tiny_ct.yaml``) and after the same CT with KL + BiLD distillation from the teacher, both of
   the same tokens; then one conversion per changed choice (plain weight SVD, uniform pairs, uniform ranks, no K/V
   balance, twice the RoPE pairs), right after conversion only.

``sections`` picks which of these run: 'dha' (1-5), 'aligned' (6), 'asym' (7), 'mla' (8). Every method gets the same
teacher, the same 25% K+V budget (in cache bytes per token) and the same number of training tokens; DHA's 0-token
point is its Search's groups mean-pooled (what Fusion starts from). Prints a table and writes results.json in
``out`` (default <run>/bench_conversion).
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Sequence
from pathlib import Path

from dha_train.algorithms.head_fusion import HeadFusion
from dha_train.algorithms.kv_head_transfer import KVHeadTransfer
from dha_train.callbacks.throughput_probe import ThroughputProbe
from dha_train.commands.bench.conversion_mla import mla_paired, mla_rows, print_mla_paired, sequence_scorer
from dha_train.config import ConfigError
from dha_train.conversion.align import TARGET_MAP_FILE, AlignSettings, run_align
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.conversion.search import SearchSettings, run_search
from dha_train.export import export_hf
from dha_train.methods import kv_cache_bytes
from dha_train.model_folders import load_model_config
from dha_train.models.head_map import HeadMap
from dha_train.quickstart import run_quickstart
from dha_train.stages import (
    DHA_NAME,
    DONE_MARKER,
    SEQ_LEN,
    ct_curve,
    gqa_kv_heads,
    mean_eval,
    train_stage,
    train_tokens,
    validation_loss,
)

BATCH = 16  # the tiny recipes' global batch
SECTIONS = ('dha', 'aligned', 'asym', 'mla')
ALIGNED_VARIANTS = (('cos', 'key'), ('cos', 'value'), ('dist', 'key'), ('dist', 'value'))


def _tokens_per_second(recipe: str, overrides: list[str], batches: int, result: Path) -> float:
    # The recipes' own callbacks (fusion_monitor, speed_monitor, ...) are left out: every model is timed alike.
    train_stage(recipe, overrides + ['eval_first=false', 'eval_interval=100000ba', 'save_folder=null',
                                     'autoresume=false', 'console_log_interval=100000ba'],
                batches + 3, extra_callbacks=[ThroughputProbe(str(result), warmup_batches=3)], recipe_callbacks=False)
    return json.loads(result.read_text())['tokens_per_sec']


def _progressive_fusion(run: Path, work: Path, head_map: str, sizes: Sequence[int]) -> dict:
    """The tiny Fusion again with ``progressive: sizes``, baked, and its validation loss."""
    name = 'bench-progressive'
    shutil.rmtree(work / f'{name}-fusion', ignore_errors=True)
    common = [f'variables.data_root={run / "data"}', f'variables.save_root={work}', f'variables.name={name}']
    trainer, config, _ = train_stage('dha/tiny/fusion.yaml', common + [
        f'variables.model_path={run / "export" / "hf"}', f'variables.head_map={head_map}', 'eval_first=false',
        f'algorithms.head_fusion.progressive=[{",".join(str(size) for size in sizes)}]'], None)
    fusion = HeadFusion.of(trainer.state, 'bench conversion')
    history = fusion.history
    hf = export_hf(config.save_folder, Path(config.save_folder) / 'hf', overwrite=True)
    return {'sizes': list(sizes), 'batches': len(history), 'tokens': len(history) * BATCH * SEQ_LEN,
            'converged': fusion.converged_at is not None,
            'stage_starts': [i for i in range(1, len(history)) if history[i]['stage'] != history[i - 1]['stage']],
            'final_fusion_loss': history[-1]['fusion_loss'], 'loss_after_fusion': validation_loss(run / 'data', hf)}


def _aligned_gqa(run: Path, work: Path, num_groups: int, batches: int, criterion: str, group_by: str,
                 seed: int) -> dict:
    """Aligned GQA on the teacher: align (calibrate, aligned similarity, grouping, Procrustes folded in), the
    mean-pooled aligned model, then a pruning run of ``batches`` and its standard-GQA export."""
    name = f'bench-agqa-{criterion}-{group_by}'
    teacher = run / 'export' / 'hf'
    aligned = work / f'{name}-aligned'
    report = run_align(teacher, aligned, AlignSettings(num_groups=num_groups, criterion=criterion, group_by=group_by,
                                                       data=str(run / 'data'), seed=seed), overwrite=True)
    pooled = convert_checkpoint(aligned, work / f'{name}-pooled', HeadMap.load(aligned / TARGET_MAP_FILE),
                                overwrite=True)
    shutil.rmtree(work / f'{name}-prune', ignore_errors=True)
    trainer, config, history = train_stage('aligned_gqa/tiny/prune.yaml', [
        f'variables.model_path={aligned}', f'variables.teacher_path={teacher}', f'variables.data_root={run / "data"}',
        f'variables.save_root={work}', f'variables.name={name}', f'variables.num_groups={num_groups}',
        f'variables.steps={batches}', f'save_interval={batches}ba', f'eval_interval={batches}ba'], None)
    transfer = next(a for a in trainer.state.algorithms if isinstance(a, KVHeadTransfer))
    gqa = export_hf(config.save_folder, Path(config.save_folder) / 'hf', overwrite=True)
    return {'criterion': criterion, 'group_by': group_by, 'groups': [entry['groups'] for entry in report['layers']],
            'mean_cosine': report['mean_cosine'], 'align_seconds': report['timings']['total_s'],
            'after_conversion': validation_loss(run / 'data', pooled), 'after_training': validation_loss(run / 'data', gqa),
            'pruning_run_last_eval': mean_eval(history, -1)['mean'], 'gates_frozen_at': transfer.frozen_at,
            'gates_forced_closed': transfer.forced_closed, 'tokens': train_tokens(config, SEQ_LEN), 'export': str(gqa)}


def _asym_gqa(run: Path, work: Path, kv_heads: int, batches: int | None, symmetric: bool, seed: int) -> dict:
    """AsymGQA's grouping search on the teacher (LM-loss fitness), mean-pooled to it, then CT of ``batches``
    (None: conversion only)."""
    name = f'bench-{"sym" if symmetric else "asym"}gqa'
    result = run_search(run / 'export' / 'hf', work / f'{name}-search',
                        SearchSettings(method='asym', kv_heads=kv_heads, symmetric=symmetric, data=str(run / 'data'),
                                       fitness='loss', seed=seed), overwrite=True)
    hf = convert_checkpoint(run / 'export' / 'hf', work / f'{name}-convert', result.head_map, overwrite=True)
    row = {'symmetric': symmetric, 'group_sizes': [[len(group) for group in layer.key_groups()] for layer in
                                                   result.head_map.layers],
           'search_seconds': result.report['timings']['total_s']}
    if batches is None:
        return {**row, 'after_conversion': validation_loss(run / 'data', hf), 'after_training': None, 'tokens': 0}
    ct = ct_curve(run / 'data', work, str(hf), f'{name}-ct', batches, batches, SEQ_LEN)
    return {**row, 'after_conversion': ct['curve'][0][1], 'after_training': ct['final'], 'tokens': ct['tokens']}


def run_conversion_bench(run: str | Path = 'quickstart_run', out: str | Path | None = None, gqa_multiple: float = 5.0,
                         eval_every: int = 10, timing_batches: int = 20, repeats: int = 3, seed: int = 17,
                         teacher: Sequence[str] = (), progressive_sizes: Sequence[int] = (2,),
                         sections: Sequence[str] = SECTIONS) -> dict:
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        raise ConfigError(f'bench conversion: sections must be among {", ".join(SECTIONS)}, got {list(sections)}')
    run = Path(run).resolve()
    summary = run_quickstart(run, seed=seed, teacher=teacher)
    work = Path(out).resolve() if out else run / 'bench_conversion'
    work.mkdir(parents=True, exist_ok=True)
    stages = {name: json.loads((run / name / DONE_MARKER).read_text())
              for name in ('dha_search', 'dha_fusion', 'dha_ct', 'gqa_convert', 'gqa_ct')}
    fusion, dha_ct = stages['dha_fusion'], stages['dha_ct']
    # Every method trains on DHA's total budget (fusion + CT tokens).
    budget_batches = (fusion['tokens'] + dha_ct['tokens']) // (BATCH * SEQ_LEN)
    results = {'teacher_overrides': list(teacher), 'kv_budget': 0.25, 'sections': list(sections),
               'mha_loss': summary['conversions']['rows'][0]['val_loss'],
               'equal_budget_tokens': budget_batches * BATCH * SEQ_LEN}
    model = ' '.join(teacher) or 'the tiny quickstart teacher'
    print()
    print(f'Conversions at a 25% KV budget ({model}; MHA val loss {results["mha_loss"]:.4f})')

    sequences: dict = {}  # every scored model's loss per validation sequence, by label (sequence_losses.json)
    score = sequence_scorer(run / 'data', sequences)

    def save() -> None:  # after every section, so that a later failure keeps what was measured
        (work / 'results.json').write_text(json.dumps(results, indent=2))
        (work / 'sequence_losses.json').write_text(json.dumps(sequences))

    print(f'[bench] GQA continued pre-training with DHA\'s total (fusion + CT) tokens ({budget_batches} batches) ...',
          flush=True)
    equal = ct_curve(run / 'data', work, stages['gqa_convert']['hf_folder'], 'bench-gqa-equal', budget_batches,
                     budget_batches, SEQ_LEN, export=work / 'bench-gqa-equal-hf')
    results['equal_budget'] = {'tokens': equal['tokens'], 'dha_after_ct': dha_ct['final']['mean'],
                               'gqa_after_ct': equal['final']}
    # DHA's 0-token point: Fusion starts with every query head reading its own head, which bakes to the mean of each
    # Search group, i.e. the Search's head map mean-pooled.
    dha_start = convert_checkpoint(run / 'export' / 'hf', work / 'bench-dha-at-0',
                                   HeadMap.load(Path(stages['dha_search']['head_map'])), overwrite=True)
    results['dha_at_zero_tokens'] = validation_loss(run / 'data', dha_start)
    # the rows every method is ranked against, scored per sequence: their losses with intervals, and the sequences
    # the paired comparisons below use
    results['reference'] = {}
    for key, label, folder in (
            ('teacher', 'MHA teacher', run / 'export' / 'hf'),
            ('gqa_at_0', 'GQA mean-pool @0', stages['gqa_convert']['hf_folder']),
            ('gqa_after_ct', 'GQA mean-pool +CT', equal['hf_folder']),
            ('dha_at_0', 'DHA @0 (Search groups mean-pooled)', dha_start),
            ('dha_after_fusion', 'DHA after Fusion', fusion['hf_folder']),
            ('dha_after_ct', 'DHA after Fusion +CT', dha_ct['hf_folder'])):
        loss, ci95 = score(label, folder)
        results['reference'][key] = {'label': label, 'loss': loss, 'ci95': ci95}
    save()
    if 'dha' in sections:
        _dha_section(run, work, stages, results, save, equal, gqa_multiple, eval_every, timing_batches, repeats,
                     progressive_sizes)
    num_groups = gqa_kv_heads(HeadMap.load(Path(stages['dha_search']['head_map'])).layers[0].num_query_heads)
    if 'aligned' in sections:
        results['aligned_gqa'] = []
        for criterion, group_by in ALIGNED_VARIANTS:
            print(f'[bench] aligned GQA ({criterion}, grouped by {group_by}): align, prune with distillation '
                  f'({budget_batches} batches), export ...', flush=True)
            results['aligned_gqa'].append(_aligned_gqa(run, work, num_groups, budget_batches, criterion, group_by,
                                                       seed))
            save()
    if 'asym' in sections:
        results['asym_gqa'] = []
        for symmetric, batches in ((False, budget_batches), (True, None)):
            print(f'[bench] AsymGQA ({"symmetric" if symmetric else "asymmetric"} search)'
                  + ('' if batches is None else f', CT ({batches} batches)') + ' ...', flush=True)
            results['asym_gqa'].append(_asym_gqa(run, work, num_groups, batches, symmetric, seed))
            save()
    if 'mla' in sections:
        gqa_config = load_model_config(stages['gqa_convert']['hf_folder'], who='bench conversion')
        teacher_config = load_model_config(run / 'export' / 'hf', who='bench conversion')
        results['gqa_kv_bytes_per_token'] = kv_cache_bytes(gqa_config, seq_len=1)
        results['teacher_kv_bytes_per_token'] = kv_cache_bytes(teacher_config, seq_len=1)
        results['mla'] = []  # filled row by row, so that save() keeps what was measured
        mla_rows(run / 'export' / 'hf', run / 'data', work, num_groups / teacher_config.num_key_value_heads,
                 budget_batches, seed, into=results['mla'], save=save, score=score)
        results['mla_paired'] = mla_paired(results['mla'], results['reference'], sequences, run / 'data', seed)
        save()
        print_mla_paired(results['mla_paired'])
    _print_method_table(results, stages)
    save()
    print(f'  results.json in {work}')
    return results


def _print_method_table(results: dict, stages: dict) -> None:
    """Every method at the same budget: loss right after conversion and after the same training tokens."""
    tokens = results['equal_budget_tokens']
    rows = [('GQA mean-pool (neighbour groups)', stages['gqa_ct']['initial']['mean'],
             results['equal_budget']['gqa_after_ct']),
            ('DHA at 0 tokens (Search groups mean-pooled)', results['dha_at_zero_tokens'], None),
            ('DHA (fusion, then CT)', stages['dha_ct']['initial']['mean'], stages['dha_ct']['final']['mean'])]
    for row in results.get('aligned_gqa', []):
        rows.append((f'aligned GQA {row["criterion"]}, by {row["group_by"]}', row['after_conversion'],
                     row['after_training']))
    for row in results.get('asym_gqa', []):
        sizes = sorted({size for layer in row['group_sizes'] for size in layer})
        rows.append((f'{"Sym" if row["symmetric"] else "Asym"}GQA (group sizes {sizes})', row['after_conversion'],
                     row['after_training']))
    for row in results.get('mla', []):
        rows.append((f'MLA, {row["variant"]} ({row["kv_bytes_per_token"]} B/token)', row['after_conversion'],
                     row['after_training']))
    print()
    print(f'  every method at 25% K+V; "after training": {tokens:,} tokens (DHA\'s fusion + CT)')
    print(f'  {"method":<44} {"after conversion":>17} {"after training":>15}')
    for name, converted, trained in rows:
        print(f'  {name:<44} {converted:>17.4f} ' + (f'{trained:>15.4f}' if trained is not None else f'{"-":>15}'))
    print('  (after conversion: DHA after fusion; aligned GQA: the aligned model mean-pooled to its groups)')
    if 'gqa_kv_bytes_per_token' in results:
        print(f'  KV cache of the GQA-shaped rows: {results["gqa_kv_bytes_per_token"]} B/token in bf16, as every MLA row')


def _dha_section(run: Path, work: Path, stages: dict, results: dict, save, equal: dict, gqa_multiple: float,
                 eval_every: int, timing_batches: int, repeats: int, progressive_sizes: Sequence[int]) -> None:
    """DHA against mean-pool GQA: tokens to match, equal budgets, step-time ratios, progressive fusion."""
    fusion, dha_ct, gqa = stages['dha_fusion'], stages['dha_ct'], stages['gqa_convert']
    fusion_tokens, ct_tokens = fusion['tokens'], dha_ct['tokens']
    dha_after_fusion, dha_after_ct = dha_ct['initial']['mean'], dha_ct['final']['mean']
    gqa_at_init = stages['gqa_ct']['initial']['mean']

    print('[bench] GQA continued pre-training until it reaches DHA\'s post-fusion loss ...', flush=True)
    long_batches = max(int(round(gqa_multiple * fusion_tokens / (BATCH * SEQ_LEN))), eval_every)
    long = ct_curve(run / 'data', work, gqa['hf_folder'], 'bench-gqa-reach', long_batches, eval_every, SEQ_LEN)
    reached = next(((batch, loss) for batch, loss in long['curve'] if loss <= dha_after_fusion), None)

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

    results.update({
        'dha_kv_heads': stages['dha_search']['kv_heads'],
        'loss_after_conversion': {'gqa_mean_pool': gqa_at_init, 'dha_after_fusion': dha_after_fusion},
        'dha_fusion': {'tokens': fusion_tokens, 'batches': fusion['batches'], 'converged_at': fusion['converged_at'],
                       'final_fusion_loss': fusion['final_fusion_loss']},
        'gqa_tokens_to_reach_dha_fusion_loss': reached[0] * BATCH * SEQ_LEN if reached else None,
        'gqa_reach_run': {'tokens': long['tokens'], 'curve': long['curve']},
        'step_time_ratio': {'fusion_over_mha': statistics.median(fusion_ratios),
                            'dha_ct_over_mha': statistics.median(dha_ratios),
                            'per_round_fusion_over_mha': fusion_ratios, 'per_round_dha_ct_over_mha': dha_ratios},
        'tokens_per_second': timing, 'timing_batches': timing_batches,
    })
    save()
    speedup = (f'{results["gqa_tokens_to_reach_dha_fusion_loss"] / fusion_tokens:.2f}x DHA\'s fusion tokens'
               if reached else f'not reached within {long["tokens"]:,} tokens '
                               f'(> {long["tokens"] / fusion_tokens:.1f}x DHA\'s fusion tokens)')
    print()
    print('DHA vs GQA')
    print(f'  loss right after conversion:   GQA (mean-pool) {gqa_at_init:.4f}   DHA after fusion {dha_after_fusion:.4f}'
          f'   (fusion: {fusion_tokens:,} tokens, L_fusion {fusion["final_fusion_loss"]:.1e})')
    print('  GQA tokens to reach DHA\'s post-fusion loss: '
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
    save()
    print(f'  progressive fusion {progressive["sizes"]} then whole groups: {progressive["tokens"]:,} tokens '
          f'({progressive["batches"]} batches, next stage at batch {progressive["stage_starts"]}, '
          f'{"converged" if progressive["converged"] else "NOT converged"}, L_fusion '
          f'{progressive["final_fusion_loss"]:.1e}), loss after fusion {progressive["loss_after_fusion"]:.4f} '
          f'against one stage: {fusion_tokens:,} tokens, {dha_after_fusion:.4f}')
