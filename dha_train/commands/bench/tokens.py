"""`dha-train bench tokens`: held-out loss against training tokens for DHA and mean-pool GQA, over seeds: the curve
seed 000's "GQA needs about 5x DHA's tokens" is about.

Two teachers (``--teacher``), three arms each, each arm run once per seed of ``--seeds`` (the seed orders the
batches and seeds every stage; each training stage after an arm's first adds its own offset to it, so it reads a
fresh order of the data rather than replaying the batches the stage before it trained on):

- ``quickstart``: the quickstart's MHA teacher at its 25% K+V budget (the run folder of ``--run``, made or reused),
  with the tiny recipes, evaluated on the quickstart's validation split:

  - ``dha``: Search (``yamls/dha/tiny/search.yaml``), Fusion (``fusion.yaml``, stops at its threshold), then CT
    (``ct.yaml``) for ``--ct-batches``;
  - ``gqa``: the quickstart's mean-pool conversion, then CT (``yamls/gqa/tiny_ct.yaml``) for ``--gqa-batches``;
  - ``healed_gqa``: the same conversion refitted (``dha-train refit``, calibration only: 0 training tokens),
    attention transfer (``yamls/healing/tiny_transfer.yaml``) and KL distillation (``tiny_kl.yaml``) of
    ``--heal-batches`` each, then CT (``gqa/tiny_ct.yaml``) for ``--ct-batches``;

- ``smollm2``: SmolLM2-135M (a GQA source, 3 K/V heads) at ``--budget`` (default ``kv2``, two thirds of its K+V
  cache, where DHA's Search chooses the heads per layer), with `bench real`'s stages, recipes (``yamls/real/``),
  training data and folder (``--run``, default ``bench_real``), evaluated on a held-out text no stage trains or is
  chosen on (``--text``, default the Rust book's chapters; ``--text-tokens`` of it, each document's first 4,096
  characters):

  - ``dha``: Search (``real/dha_search.yaml``), Fusion (``real/fusion.yaml``, stops at its threshold or after
    ``--fusion-batches``, default `bench real`'s budget), then CT (``real/ct.yaml``) for ``--ct-batches``;
  - ``gqa``: `bench real`'s mean-pool conversion at the budget, then CT for ``--gqa-batches``;
  - ``healed_gqa``: that conversion refitted, attention transfer (``real/transfer.yaml``) and KL
    (``real/kl.yaml``) of ``--heal-batches`` each, then CT for ``--ct-batches``. Its curve starts at the healed
    model (the refit and transfer models are not evaluated on the text).

The token axis counts every token a stage trains on: DHA's Search and Fusion batches, the healing stages' batches,
the CT batches. Every CT runs at its recipe's learning rate held constant after the same warm-up for every arm
(``scheduler.alpha_f=1``), and is evaluated every ``--eval-every`` batches: a point mid-run is what a run of that
length gives before any decay, alike for every arm (a cosine schedule would tie each point to the run's length).

Per arm and point: the mean loss over seeds with its 95% interval (Student's t over seeds). At each DHA point: the
tokens each GQA arm needs to reach DHA's mean loss there (from its mean curve, linearly interpolated), over DHA's
tokens, with an interval from Welch's t test over both arms' seeds (``ops.token_curves``: a percentile bootstrap over
3 seeds would cover about 75%). Writes ``results.json`` and
``tokens.png`` in ``--out`` (default ``<run>/bench_tokens``, or ``<run>/bench_tokens_<budget>`` for SmolLM2) and,
with ``--results``, a copy of the results.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from dha_train.bench_runner import command_line, prepare_data, run_stage, source_folder, text_folder
from dha_train.bench_settings import RealSettings, resolve_settings
from dha_train.bench_support import bench_say, write_results
from dha_train.config import ConfigError
from dha_train.conversion.refit import RefitSettings, refit_folder
from dha_train.export import export_hf
from dha_train.heldout_texts import BOOK_GLOB, text_files
from dha_train.model_folders import folder_digest
from dha_train.ops.token_curves import seed_interval, tokens_to_reach
from dha_train.quickstart import run_quickstart
from dha_train.stages import DONE_MARKER, KV_BUDGET, SEQ_LEN, ct_curve, train_stage, train_tokens, validation_loss

ARMS = {'dha': 'DHA (Search, Fusion, CT)', 'gqa': 'mean-pool GQA, CT', 'healed_gqa': 'mean-pool GQA, healed, then CT'}
TEACHERS = ('quickstart', 'smollm2')
CONSTANT_LR = 'scheduler.alpha_f=1.0'  # the recipes' cosine decays to alpha_f x lr; 1 holds it after warm-up
# Per teacher: the run folder, and the CT, healing and evaluation lengths in batches. The quickstart's: its CT length,
# four times it for mean-pool (long enough to reach DHA's losses, or to show it does not), the tiny healing recipes'
# length. SmolLM2's fit 2 cores (8 x 256 tokens a batch at about 10 s): CT as long as bench real's after its Fusion,
# mean-pool's as long as bench real's budget, the held-out text's 32 sequences scored at every evaluation.
DEFAULTS = {'quickstart': dict(run='quickstart_run', ct_batches=120, gqa_batches=480, heal_batches=40, eval_every=20),
            'smollm2': dict(run='bench_real', ct_batches=8, gqa_batches=16, heal_batches=4, eval_every=4,
                            budget='kv2', text_tokens=8192)}
SMOLLM2_ONLY = ('budget', 'fusion_batches', 'text', 'text_tokens', 'real')
QUICKSTART_ONLY = ('quickstart_steps', 'conversion_steps')
REAL_WARMUP = '1ba'  # every SmolLM2 CT's warm-up, whatever its length (bench real's is 10% of the run)
MAX_DOCUMENT_CHARS = 4096  # as `bench mla-zero`: the text's sequences come from many documents, not the longest few
# Each training stage after the first reads the loader with the run's seed plus its own offset, so it draws a fresh
# order of the data, not the batches the stage before it trained on (both teachers; DHA's Search keeps the seed).
FUSION_SEED, CT_AFTER_FUSION_SEED, TRANSFER_SEED, KL_SEED, CT_AFTER_HEALING_SEED = 104, 100, 101, 102, 103


def say(message: str) -> None:
    bench_say('tokens', message)


@dataclass
class TokenBenchSettings:
    teacher: str = 'quickstart'
    run: str | None = None  # the quickstart run folder, or bench real's folder (SmolLM2); default per teacher
    out: str | None = None
    seeds: Sequence[int] = (1, 2, 3)
    ct_batches: int | None = None  # DHA's and the healed model's CT (default per teacher)
    gqa_batches: int | None = None  # mean-pool CT
    heal_batches: int | None = None  # attention transfer, then KL distillation, each
    eval_every: int | None = None
    results: str | None = None
    # the quickstart run's own settings (a run folder made with others is refused by the quickstart)
    quickstart_steps: int | None = None
    conversion_steps: int | None = None  # also caps DHA's Search and Fusion here
    # SmolLM2 only
    budget: str | None = None  # kv1 or kv2
    fusion_batches: int | None = None  # Fusion's cap (default: bench real's training budget in batches)
    text: str | None = None  # the held-out text, a folder or a glob (default: the Rust book's chapters)
    text_tokens: int | None = None
    device: str = 'auto'
    # bench real's settings (its source, training data, batch, held-out text; None: its defaults); --run, --device
    # and isolate_stages replace its out, device and isolate_stages
    real: RealSettings | None = None
    isolate_stages: bool = True


def resolve(settings: TokenBenchSettings) -> TokenBenchSettings:
    """The teacher's defaults filled in, and every setting checked before anything runs."""
    if settings.teacher not in TEACHERS:
        raise ConfigError(f"bench tokens: --teacher must be one of {', '.join(TEACHERS)}, got '{settings.teacher}'")
    ignored = [name for name in (SMOLLM2_ONLY if settings.teacher == 'quickstart' else QUICKSTART_ONLY)
               if getattr(settings, name) is not None]
    if ignored:
        raise ConfigError(f'bench tokens: {", ".join("--" + name.replace("_", "-") for name in ignored)} do not apply to '
                          f'--teacher {settings.teacher}')
    filled = replace(settings, **{key: value for key, value in DEFAULTS[settings.teacher].items()
                                  if getattr(settings, key) is None})
    if len(set(filled.seeds)) < 2 or len(set(filled.seeds)) != len(filled.seeds):
        raise ConfigError(f'bench tokens: --seeds needs 2 or more distinct seeds (an interval over seeds), got '
                          f'{list(filled.seeds)}')
    for name in ('ct_batches', 'gqa_batches', 'heal_batches', 'eval_every', 'text_tokens'):
        if getattr(filled, name) is not None and getattr(filled, name) < 1:
            raise ConfigError(f'bench tokens: --{name.replace("_", "-")} must be >= 1, got {getattr(filled, name)}')
    for name in ('ct_batches', 'gqa_batches'):
        if getattr(filled, name) % filled.eval_every:
            raise ConfigError(f'bench tokens: --{name.replace("_", "-")} ({getattr(filled, name)}) must be a '
                              f'multiple of --eval-every ({filled.eval_every}), so every curve ends on an evaluation')
    if filled.teacher == 'smollm2':
        if filled.budget not in ('kv1', 'kv2'):
            raise ConfigError(f"bench tokens: --budget must be kv1 or kv2, got '{filled.budget}'")
        if filled.fusion_batches is not None and filled.fusion_batches < 1:
            raise ConfigError(f'bench tokens: --fusion-batches must be >= 1, got {filled.fusion_batches}')
    return filled


def run_token_bench(settings: TokenBenchSettings | None = None) -> dict:
    settings = resolve(settings or TokenBenchSettings())
    arms, work, about = (quickstart_arms if settings.teacher == 'quickstart' else smollm2_arms)(settings)
    runs = {arm: [] for arm in ARMS}
    results = {'command': command_line(), 'settings': {**asdict(settings), 'seeds': list(settings.seeds)},
               **about, 'arms': ARMS, 'runs': runs,
               'learning_rate': 'each recipe\'s, held after the same warm-up for every arm (scheduler.alpha_f=1)'}

    def save() -> None:
        write_results(results, work)

    for seed in settings.seeds:
        for arm in ARMS:
            say(f'{ARMS[arm]}, seed {seed}')
            runs[arm].append(arms[arm](seed))
            save()
    results.update(summarise(runs))
    write_results(results, work, settings.results)
    plot_tokens(results, work / 'tokens.png')
    print(markdown_table(results))
    print(f'  results.json and tokens.png in {work}')
    return results


Arms = dict[str, Callable[[int], dict]]


def quickstart_arms(settings: TokenBenchSettings) -> tuple[Arms, Path, dict]:
    """The three arms on the quickstart's teacher at its 25% budget (tiny recipes, its validation split)."""
    run = Path(settings.run).resolve()
    run_quickstart(run, steps=settings.quickstart_steps, conversion_steps=settings.conversion_steps)
    work = Path(settings.out).resolve() if settings.out else run / 'bench_tokens'
    work.mkdir(parents=True, exist_ok=True)
    teacher, data = run / 'export' / 'hf', run / 'data'
    pooled = json.loads((run / 'gqa_convert' / DONE_MARKER).read_text())['hf_folder']
    cap = settings.conversion_steps

    def stage(name: str, build) -> dict:
        return run_stage(work, name, build, settings.isolate_stages, say=say)

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
                f'variables.model_path={teacher}', f'variables.head_map={searched["head_map"]}',
                f'seed={seed + FUSION_SEED}', 'autoresume=false', 'eval_first=false'], cap)
            fusion = HeadFusion.of(trainer.state, 'bench tokens')
            hf = export_hf(config.save_folder, out / 'hf', overwrite=True)
            shutil.rmtree(config.save_folder, ignore_errors=True)
            return {'hf_folder': str(hf), 'batches': len(fusion.history), 'converged_at': fusion.converged_at,
                    'tokens': len(fusion.history) * config.global_train_batch_size * SEQ_LEN,
                    'final_fusion_loss': fusion.history[-1]['fusion_loss']}
        fused = stage(f'{prefix}-fusion', fusion)
        ct = curve(f'{prefix}-ct-{settings.ct_batches}', fused['hf_folder'], settings.ct_batches, 'dha/tiny/ct.yaml',
                   seed + CT_AFTER_FUSION_SEED)
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

        def healing(recipe: str, model: str, offset: int):
            def build(out: Path) -> dict:
                _, config, _ = train_stage(recipe, [
                    f'variables.model_path={model}', f'variables.source_path={teacher}', f'variables.data_root={data}',
                    f'variables.save_root={out}', f'variables.steps={settings.heal_batches}ba',
                    f'seed={seed + offset}', 'autoresume=false', 'run_name=run'], None)
                hf = export_hf(out / 'run', out / 'hf', overwrite=True)
                shutil.rmtree(out / 'run', ignore_errors=True)
                return {'hf_folder': str(hf), 'loss': validation_loss(data, hf),
                        'tokens': train_tokens(config, SEQ_LEN)}
            return build
        transferred = stage(f'{prefix}-transfer-{settings.heal_batches}',
                            healing('healing/tiny_transfer.yaml', refitted['hf_folder'], TRANSFER_SEED))
        distilled = stage(f'{prefix}-kl-{settings.heal_batches}',
                          healing('healing/tiny_kl.yaml', transferred['hf_folder'], KL_SEED))
        ct = curve(f'{prefix}-ct-{settings.heal_batches}-{settings.ct_batches}', distilled['hf_folder'],
                   settings.ct_batches, 'gqa/tiny_ct.yaml', seed + CT_AFTER_HEALING_SEED)
        healed = transferred['tokens'] + distilled['tokens']
        return {'seed': seed, 'refit_calibration_tokens': refitted['calibration_tokens'],
                'points': [[0, refitted['loss']], [transferred['tokens'], transferred['loss']]]
                + [[healed + batch * ct['batch_tokens'], loss] for batch, loss in ct['curve']]}

    about = {'teacher': 'quickstart', 'run': str(run), 'teacher_folder': str(teacher), 'kv_budget': KV_BUDGET,
             'evaluated_on': f'the quickstart\'s validation split ({data})',
             'token_axis': 'every token a stage trains on: Search + Fusion + CT (DHA); transfer + KL + CT '
                           '(healed; the refit calibrates on tokens without training); CT (GQA)'}
    return {'dha': dha, 'gqa': gqa, 'healed_gqa': healed_gqa}, work, about


def smollm2_arms(settings: TokenBenchSettings) -> tuple[Arms, Path, dict]:
    """The three arms on SmolLM2-135M at ``settings.budget``, as `bench real` runs its stages (same source, data,
    recipes and stage folders), each CT evaluated on the held-out text along the run."""
    from dha_train.commands.bench.real.methods import RealBench

    real = resolve_settings(replace(settings.real or RealSettings(), out=settings.run, device=settings.device,
                                    isolate_stages=settings.isolate_stages))
    root = Path(real.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    where = settings.text or BOOK_GLOB
    files = text_files(where)
    if not files:
        raise ConfigError(f'bench tokens: no held-out text at {where} (give one with --text: a folder or a glob of '
                          '.html, .txt, .md, .rst or .pod files)')
    source = source_folder(root, real.source)
    digest = folder_digest(source)
    train_data, heldout, data = prepare_data(root, source, real, digest)
    bench = RealBench(real, root, source, digest, train_data, heldout)
    text = text_folder(bench, 'tokens-heldout', where, files, seed=real.seed, tokens=settings.text_tokens,
                       seq_len=real.seq_len, max_document_chars=MAX_DOCUMENT_CHARS)
    work = Path(settings.out).resolve() if settings.out else root / f'bench_tokens_{settings.budget}'
    work.mkdir(parents=True, exist_ok=True)
    budget = settings.budget
    fusion_cap = settings.fusion_batches or bench.batches

    def curve(name: str, model: str, batches: int, seed: int) -> tuple[list, int]:
        """CT of ``model`` for ``batches``, evaluated on the text every ``eval_every`` batches from its start: the
        (batch, loss) curve and the tokens of a batch."""
        trained = bench.train(name, 'real/ct.yaml', batches, seed, keep_model=False, model_path=model,
                              warmup=REAL_WARMUP, extra=[f'eval_loader.root={text}', 'eval_first=true',
                                                         f'eval_interval={settings.eval_every}ba', CONSTANT_LR])
        return trained['eval_curve'], trained['tokens'] // batches

    def dha(seed: int) -> dict:
        name = f'tokens-seed{seed}-dha-{budget}'
        found = bench.dha_search(name, budget, seed=seed)
        fused = bench.dha_fusion(name, found['head_map'], fusion_cap, seed)
        # CT on its own seed: restarting the stream with Fusion's would replay Fusion's batches
        points, batch_tokens = curve(f'{name}-ct', fused['hf_folder'], settings.ct_batches, seed + CT_AFTER_FUSION_SEED)
        start = found['search_tokens'] + fused['fusion_tokens']
        return {'seed': seed, 'search_tokens': found['search_tokens'], 'fusion_tokens': fused['fusion_tokens'],
                'fusion_batches': fused['batches'], 'fusion_converged_at': fused['converged_at'],
                'final_fusion_loss': fused['final_fusion_loss'], 'kv_heads_per_layer': found['kv_heads'],
                'points': [[start + batch * batch_tokens, loss] for batch, loss in points]}

    def gqa(seed: int) -> dict:
        pooled = bench.mean_pool_convert(budget)
        points, batch_tokens = curve(f'tokens-seed{seed}-gqa-{budget}-ct', pooled['hf_folder'],
                                     settings.gqa_batches, seed)
        return {'seed': seed, 'points': [[batch * batch_tokens, loss] for batch, loss in points]}

    def healed_gqa(seed: int) -> dict:
        name = f'tokens-seed{seed}-heal-{budget}'
        refitted = bench.refit(name, bench.mean_pool_convert(budget)['hf_folder'], seed)
        transferred = bench.transfer(name, refitted['hf_folder'], settings.heal_batches, seed + TRANSFER_SEED)
        distilled = bench.distil(name, transferred['hf_folder'], settings.heal_batches, seed + KL_SEED)
        points, batch_tokens = curve(f'{name}-ct', distilled['hf_folder'], settings.ct_batches,
                                     seed + CT_AFTER_HEALING_SEED)
        healed = transferred['tokens'] + distilled['tokens']
        return {'seed': seed, 'refit_calibration_tokens': refitted['calibration_tokens'],
                'points': [[healed + batch * batch_tokens, loss] for batch, loss in points]}

    num_source = bench.source_map.layers[0].num_key_heads
    about = {'teacher': 'smollm2', 'run': str(root), 'teacher_folder': str(source), 'budget': budget,
             'kv_budget': int(budget[2:]) / num_source, 'fusion_cap_batches': fusion_cap,
             'evaluated_on': {'text': where, 'root': str(text), 'tokens': settings.text_tokens,
                              'max_document_chars': MAX_DOCUMENT_CHARS},
             'train_data': data['train'].get('source'), 'bench_real_settings': asdict(real),
             'token_axis': 'every token a stage trains on: Search + Fusion + CT (DHA); transfer + KL + CT '
                           '(healed; the refit calibrates on tokens without training, and the curve starts at the '
                           'healed model); CT (GQA)'}
    return {'dha': dha, 'gqa': gqa, 'healed_gqa': healed_gqa}, work, about


def summarise(runs: dict) -> dict:
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
                                     curves[arm]['losses'])
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
    teacher = 'quickstart teacher' if results['teacher'] == 'quickstart' else Path(results['teacher_folder']).name
    return plot_panels({f'{teacher}, {results["kv_budget"]:.0%} of its K+V cache ({seeds} seeds)': panel}, out,
                       title='held-out loss against training tokens (95% intervals over seeds)',
                       xlabel='training tokens', ylabel='validation loss')
