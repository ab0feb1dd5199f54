"""`dha-train bench tokens`: held-out loss against training tokens for DHA and mean-pool GQA, over seeds: the curve
seed 000's "GQA needs about 5x DHA's tokens" is about.

On the quickstart's MHA teacher at its 25% K+V budget (the run folder of ``--run``, made or reused), three arms, each
run once per seed of ``--seeds`` (the seed orders the batches and seeds every stage):

- ``dha``: Search (``yamls/dha/tiny/search.yaml``), Fusion (``fusion.yaml``, stops at its threshold), then CT
  (``ct.yaml``) for ``--ct-batches``;
- ``gqa``: the quickstart's mean-pool conversion, then CT (``yamls/gqa/tiny_ct.yaml``) for ``--gqa-batches``;
- ``healed_gqa``: the same conversion refitted (``dha-train refit``, calibration only: 0 training tokens), attention
  transfer (``yamls/healing/tiny_transfer.yaml``) and KL distillation (``tiny_kl.yaml``) of ``--heal-batches``
  each, then CT (``gqa/tiny_ct.yaml``) for ``--ct-batches``.

The token axis counts every token a stage trains on: DHA's Search and Fusion batches, the healing stages' batches,
the CT batches. Every CT runs at its recipe's learning rate held constant after warm-up (``scheduler.alpha_f=1``), and
is evaluated on the quickstart's validation split every ``--eval-every`` batches: a point mid-run is what a run of that
length gives before any decay, alike for every arm (a cosine schedule would tie each point to the run's length).

Per arm and point: the mean loss over seeds with its 95% interval (Student's t over seeds). At each DHA point: the
tokens each GQA arm needs to reach DHA's mean loss there (from its mean curve, linearly interpolated), over DHA's
tokens, with a bootstrap interval over both arms' seeds (``ops.token_curves``). Writes ``results.json`` and
``tokens.png`` in ``--out`` (default ``<run>/bench_tokens``) and, with ``--results``, a copy of the results.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from dha_train.bench_runner import command_line, run_stage, say
from dha_train.config import ConfigError
from dha_train.conversion.refit import RefitSettings, refit_folder
from dha_train.export import export_hf
from dha_train.ops.token_curves import seed_interval, tokens_to_reach
from dha_train.quickstart import run_quickstart
from dha_train.stages import DONE_MARKER, KV_BUDGET, SEQ_LEN, ct_curve, train_stage, train_tokens, validation_loss

ARMS = {'dha': 'DHA (Search, Fusion, CT)', 'gqa': 'mean-pool GQA, CT', 'healed_gqa': 'mean-pool GQA, healed, then CT'}
CONSTANT_LR = 'scheduler.alpha_f=1.0'  # the recipes' cosine decays to alpha_f x lr; 1 holds it after warm-up


@dataclass
class TokenBenchSettings:
    run: str = 'quickstart_run'
    out: str | None = None
    seeds: Sequence[int] = (1, 2, 3)
    ct_batches: int = 120  # DHA's and the healed model's CT (the quickstart's CT length)
    gqa_batches: int = 480  # mean-pool CT: long enough to reach DHA's losses, or to show it does not
    heal_batches: int = 40  # attention transfer, then KL distillation, each (the tiny healing recipes' length)
    eval_every: int = 20
    results: str | None = None
    # the quickstart run's own settings (a run folder made with others is refused by the quickstart)
    quickstart_steps: int | None = None
    conversion_steps: int | None = None  # also caps DHA's Search and Fusion here
    isolate_stages: bool = True


def run_token_bench(settings: TokenBenchSettings | None = None) -> dict:
    settings = settings or TokenBenchSettings()
    if len(set(settings.seeds)) < 2 or len(set(settings.seeds)) != len(settings.seeds):
        raise ConfigError(f'bench tokens: --seeds needs 2 or more distinct seeds (an interval over seeds), got '
                          f'{list(settings.seeds)}')
    for name in ('ct_batches', 'gqa_batches', 'heal_batches', 'eval_every'):
        if getattr(settings, name) < 1:
            raise ConfigError(f'bench tokens: --{name.replace("_", "-")} must be >= 1, got {getattr(settings, name)}')
    for name in ('ct_batches', 'gqa_batches'):
        if getattr(settings, name) % settings.eval_every:
            raise ConfigError(f'bench tokens: --{name.replace("_", "-")} ({getattr(settings, name)}) must be a '
                              f'multiple of --eval-every ({settings.eval_every}), so every curve ends on an evaluation')
    run = Path(settings.run).resolve()
    run_quickstart(run, steps=settings.quickstart_steps, conversion_steps=settings.conversion_steps)
    work = Path(settings.out).resolve() if settings.out else run / 'bench_tokens'
    work.mkdir(parents=True, exist_ok=True)
    teacher, data = run / 'export' / 'hf', run / 'data'
    pooled = json.loads((run / 'gqa_convert' / DONE_MARKER).read_text())['hf_folder']
    cap = settings.conversion_steps

    def stage(name: str, build) -> dict:
        return run_stage(work, name, build, settings.isolate_stages)

    def curve(name: str, model: str, batches: int, recipe: str, seed: int) -> dict:
        def build(out: Path) -> dict:
            named = ['variables.name=run'] if recipe.startswith('dha/') else []  # its save folder is by name
            result = ct_curve(data, out, model, 'ct', batches, settings.eval_every, SEQ_LEN, recipe=recipe,
                              overrides=[f'seed={seed}', CONSTANT_LR, 'autoresume=false', *named])
            if result['tokens'] % batches:
                raise RuntimeError(f'{name}: {result["tokens"]} tokens in {batches} batches')
            result['batch_tokens'] = result['tokens'] // batches
            shutil.rmtree(out / 'ct', ignore_errors=True)
            shutil.rmtree(out / 'run-ct', ignore_errors=True)
            return result
        return stage(name, build)

    def dha(seed: int) -> dict:
        prefix = f'seed{seed}-dha'

        def search(out: Path) -> dict:
            _, config, _ = train_stage('dha/tiny/search.yaml', [
                f'variables.data_root={data}', f'variables.save_root={out}', 'variables.name=dha',
                f'variables.model_path={teacher}', f'variables.kv_budget={KV_BUDGET}', f'seed={seed}',
                'autoresume=false', 'callbacks.head_search.overwrite=true'], cap)
            return {'head_map': str(out / 'dha-search' / 'search' / 'head_map.json'),
                    'tokens': train_tokens(config, SEQ_LEN)}
        searched = stage(f'{prefix}-search', search)

        def fusion(out: Path) -> dict:
            from dha_train.algorithms.head_fusion import HeadFusion

            trainer, config, _ = train_stage('dha/tiny/fusion.yaml', [
                f'variables.data_root={data}', f'variables.save_root={out}', 'variables.name=dha',
                f'variables.model_path={teacher}', f'variables.head_map={searched["head_map"]}', f'seed={seed}',
                'autoresume=false', 'eval_first=false'], cap)
            fusion = HeadFusion.of(trainer.state, 'bench tokens')
            hf = export_hf(config.save_folder, out / 'hf', overwrite=True)
            shutil.rmtree(config.save_folder, ignore_errors=True)
            return {'hf_folder': str(hf), 'batches': len(fusion.history), 'converged_at': fusion.converged_at,
                    'tokens': len(fusion.history) * config.global_train_batch_size * SEQ_LEN,
                    'final_fusion_loss': fusion.history[-1]['fusion_loss']}
        fused = stage(f'{prefix}-fusion', fusion)
        ct = curve(f'{prefix}-ct-{settings.ct_batches}', fused['hf_folder'], settings.ct_batches, 'dha/tiny/ct.yaml',
                   seed)
        start = searched['tokens'] + fused['tokens']
        return {'seed': seed, 'search_tokens': searched['tokens'], 'fusion_tokens': fused['tokens'],
                'fusion_batches': fused['batches'], 'fusion_converged_at': fused['converged_at'],
                'final_fusion_loss': fused['final_fusion_loss'],
                'points': [[start + batch * ct['batch_tokens'], loss] for batch, loss in ct['curve']]}

    def gqa(seed: int) -> dict:
        ct = curve(f'seed{seed}-gqa-ct-{settings.gqa_batches}', pooled, settings.gqa_batches, 'gqa/tiny_ct.yaml', seed)
        return {'seed': seed, 'points': [[batch * ct['batch_tokens'], loss] for batch, loss in ct['curve']]}

    def healed_gqa(seed: int) -> dict:
        prefix = f'seed{seed}-heal'

        def refit(out: Path) -> dict:
            report = refit_folder(teacher, pooled, out / 'hf', RefitSettings(data=str(data), seed=seed),
                                  overwrite=True)
            return {'hf_folder': str(out / 'hf'), 'loss': validation_loss(data, out / 'hf'),
                    'calibration_tokens': RefitSettings.tokens,
                    **{key: value for key, value in report.items() if key.startswith('mean_')}}
        refitted = stage(f'{prefix}-refit', refit)

        def healing(recipe: str, model: str):
            def build(out: Path) -> dict:
                _, config, _ = train_stage(recipe, [
                    f'variables.model_path={model}', f'variables.source_path={teacher}', f'variables.data_root={data}',
                    f'variables.save_root={out}', f'variables.steps={settings.heal_batches}ba', f'seed={seed}',
                    'autoresume=false', 'run_name=run'], None)
                hf = export_hf(out / 'run', out / 'hf', overwrite=True)
                shutil.rmtree(out / 'run', ignore_errors=True)
                return {'hf_folder': str(hf), 'loss': validation_loss(data, hf),
                        'tokens': train_tokens(config, SEQ_LEN)}
            return build
        transferred = stage(f'{prefix}-transfer-{settings.heal_batches}',
                            healing('healing/tiny_transfer.yaml', refitted['hf_folder']))
        distilled = stage(f'{prefix}-kl-{settings.heal_batches}',
                          healing('healing/tiny_kl.yaml', transferred['hf_folder']))
        ct = curve(f'{prefix}-ct-{settings.heal_batches}-{settings.ct_batches}', distilled['hf_folder'],
                   settings.ct_batches, 'gqa/tiny_ct.yaml', seed)
        healed = transferred['tokens'] + distilled['tokens']
        return {'seed': seed, 'refit_calibration_tokens': refitted['calibration_tokens'],
                'points': [[0, refitted['loss']], [transferred['tokens'], transferred['loss']]]
                + [[healed + batch * ct['batch_tokens'], loss] for batch, loss in ct['curve']]}

    runs = {'dha': [], 'gqa': [], 'healed_gqa': []}
    results = {'command': command_line(), 'settings': {**asdict(settings), 'seeds': list(settings.seeds)},
               'run': str(run), 'teacher': str(teacher), 'kv_budget': 0.25, 'arms': ARMS, 'runs': runs,
               'token_axis': 'every token a stage trains on: Search + Fusion + CT (DHA); transfer + KL + CT '
                             '(healed; the refit calibrates on tokens without training); CT (GQA)',
               'learning_rate': 'each recipe\'s, held after warm-up (scheduler.alpha_f=1)'}

    def save() -> None:
        (work / 'results.json').write_text(json.dumps(results, indent=2))

    for seed in settings.seeds:
        for arm, build in (('dha', dha), ('gqa', gqa), ('healed_gqa', healed_gqa)):
            say(f'bench tokens: {ARMS[arm]}, seed {seed}')
            runs[arm].append(build(seed))
            save()
    results.update(summarise(runs, seed=min(settings.seeds)))
    save()
    plot_tokens(results, work / 'tokens.png')
    if settings.results:
        Path(settings.results).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / 'results.json', settings.results)
    print(markdown_table(results))
    print(f'  results.json and tokens.png in {work}')
    return results


def summarise(runs: dict, *, seed: int = 0) -> dict:
    """Per arm, each point's mean over seeds with its interval; at each DHA point, each GQA arm's tokens to reach it."""
    curves = {}
    for arm, per_seed in runs.items():
        tokens = np.array([[x for x, _ in run['points']] for run in per_seed], dtype=np.float64)
        losses = np.array([[y for _, y in run['points']] for run in per_seed], dtype=np.float64)
        curves[arm] = {'tokens': tokens, 'losses': losses}
    summary = {'curves': {arm: [{'tokens': float(curve['tokens'][:, i].mean()),
                                 'tokens_range': [float(curve['tokens'][:, i].min()),
                                                  float(curve['tokens'][:, i].max())],
                                 **dict(zip(('loss', 'ci95'), seed_interval(curve['losses'][:, i])))}
                                for i in range(curve['losses'].shape[1])] for arm, curve in curves.items()}}
    reach = {}
    for arm in ('gqa', 'healed_gqa'):
        shared = curves[arm]['tokens']
        if not np.all(shared == shared[0]):
            raise ValueError(f'{arm}: the seeds were evaluated at different tokens')
        reach[arm] = tokens_to_reach(curves['dha']['tokens'], curves['dha']['losses'], shared[0],
                                     curves[arm]['losses'], seed=seed)
    summary['tokens_to_reach_dha'] = reach
    return summary


def markdown_table(results: dict) -> str:
    """At each DHA point: its tokens and loss, and each GQA arm's tokens to reach that loss, as a multiple of DHA's."""
    reach = results['tokens_to_reach_dha']
    dha = results['curves']['dha']
    lines = ['| DHA tokens | DHA loss | mean-pool CT: tokens to reach it | x DHA [95%] | healed then CT: tokens to '
             'reach it | x DHA [95%] |', '|' + ' --- |' * 6]

    def cells(row: dict) -> list[str]:
        if row['other_tokens_needed'] is None:
            return ['not reached', '-' if row['ratio_ci95'][0] is None else f"> [{row['ratio_ci95'][0]:.2f}, open]"]
        low, high = row['ratio_ci95']
        return [f"{row['other_tokens_needed']:,.0f}",
                f"{row['ratio']:.2f} [{low:.2f}, " + ('open' if high is None else f'{high:.2f}') + ']']

    for index, point in enumerate(dha):
        lines.append('| ' + ' | '.join([f"{point['tokens']:,.0f}", f"{point['loss']:.3f} ± {point['ci95']:.3f}",
                                        *cells(reach['gqa'][index]), *cells(reach['healed_gqa'][index])]) + ' |')
    return '\n'.join(lines)


def plot_tokens(results: dict, out: Path) -> Path:
    from dha_train.plots import plot_panels

    panel = {ARMS[arm]: {'points': [(p['tokens'], p['loss'], p['ci95']) for p in points], 'colour_key': arm,
                         'dashed': arm == 'healed_gqa'} for arm, points in results['curves'].items()}
    seeds = len(results['runs']['dha'])
    return plot_panels({f'quickstart teacher, 25% of its K+V cache ({seeds} seeds)': panel}, out,
                       title='held-out loss against training tokens (95% intervals over seeds)',
                       xlabel='training tokens', ylabel='validation loss')
