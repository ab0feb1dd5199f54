"""`dha-train bench fusion`: DHA's Fusion on `bench real`'s source under several optimiser settings: does L_fusion
reach its threshold within the bench's Fusion budget, and at what cost on a validation text.

The question (issue 46): at a third of SmolLM2-135M's cache, `bench real`'s Fusion (the paper's fusion lr, 0.05)
ends its 16 batches at L_fusion 0.194, far from the 1e-3 at which Fusion stops. Each row here is one Fusion run from
the same map, `yamls/real/fusion.yaml` with `bench real`'s batch, sequence length, data and seed, for ``--batches``
batches (stopping early at the threshold, as in `bench real`), at one fusion lr (``--omega-lr``), one multiplier
ascent rate (``--lambda-lr``) and one margin warm-up (``--margin-steps``, Eq. 8's k). The source, training data and
held-out text are `bench real`'s (same ``--out``, reused). Settings are compared on a validation text only (vim's help files, as `bench mla-zero`): the loss of the
baked model, with its 95% interval over sequences and its paired difference from the first setting given. The
held-out text's loss is recorded beside it for the setting a recipe then takes, never used to choose.

Every combination of ``--batches`` x ``--omega-lr`` x ``--lambda-lr`` x ``--margin-steps`` is a run; several
``--batches`` give the budget curve (each budget its own run, since the cosine schedule spans the run), and a run
already made (same source, data, recipe and setting) is reused, so a curve can extend a grid's row.

A run that reaches the threshold early continues with CT for the rest of its budget, as `bench real` runs DHA, so
runs are compared (``vs_first``) at the same tokens. Rows: the setting, L_fusion after every batch, the batch at
which it fell below the threshold (or none), the baked model's losses and the losses at the budget. Writes
``results.json`` (and ``--results``), ``fusion.png`` and, over several budgets, ``fusion_budgets.png`` in the grid's
own folder, ``fusion/grid-<digest of its settings>`` under ``--out``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dha_train.bench_runner import StageRunner, command_line, prepare_data, source_folder, text_folder
from dha_train.bench_settings import RealSettings, resolve_settings
from dha_train.bench_support import bench_say, write_results
from dha_train.commands.bench.real.report import with_interval
from dha_train.config import ConfigError
from dha_train.evaluation import folder_sequence_losses, loss_interval, paired_loss_difference
from dha_train.heldout_texts import VALIDATION_GLOB, folder_units, text_files
from dha_train.model_folders import folder_digest
from dha_train.models.head_map import HeadMap
from dha_train.paths import recipe_path

RECIPE = 'real/fusion.yaml'


@dataclass
class FusionBenchSettings:
    out: str = 'bench_real'
    kv_heads: int = 1  # K/V heads per layer after Fusion: 1 is a third of SmolLM2's cache, the only map
    batches: Sequence[int] | None = None  # Fusion budgets; default: bench real's whole training budget in batches
    omega_lr: Sequence[float] = (0.05, 0.1, 0.2, 0.4)
    lambda_lr: Sequence[float] = (20.0,)
    margin_steps: Sequence[int] | None = None  # Eq. 8's margin warm-up k; default: the recipe's (bench real's)
    validation: str | None = None  # a folder or glob of text files (default: vim's help files)
    text_tokens: int = 16384  # 64 sequences of bench real's 256 tokens
    # each document's first characters (as `bench mla-zero`'s texts, whose validation split this one is): each
    # sequence then starts in another document (until 2026-12-03 whole files: three of vim's help files)
    max_document_chars: int | None = 512
    results: str | None = None
    source: str = 'smollm2-135m'
    device: str = 'auto'
    seed: int = 17
    train_data: str | None = None
    seq_len: int | None = None
    val_tokens: int | None = None
    isolate_stages: bool = True
    overrides: dict | None = None  # recipe variables for every run (tests: e.g. a threshold every run reaches)


def run_fusion_bench(settings: FusionBenchSettings | None = None) -> dict:
    settings = settings or FusionBenchSettings()
    if not settings.omega_lr or not settings.lambda_lr or min(settings.omega_lr) <= 0 or min(settings.lambda_lr) < 0:
        raise ConfigError('bench fusion: --omega-lr needs values > 0 and --lambda-lr values >= 0')
    if settings.batches is not None and (not settings.batches or min(settings.batches) < 1):
        raise ConfigError(f'bench fusion: --batches needs values >= 1, got {list(settings.batches)}')
    if settings.margin_steps is not None and (not settings.margin_steps or min(settings.margin_steps) < 0):
        raise ConfigError(f'bench fusion: --margin-steps needs values >= 0, got {list(settings.margin_steps)}')
    real = resolve_settings(RealSettings(out=settings.out, device=settings.device, source=settings.source,
                                         seed=settings.seed, train_data=settings.train_data, seq_len=settings.seq_len,
                                         val_tokens=settings.val_tokens, isolate_stages=settings.isolate_stages,
                                         overrides=dict(settings.overrides or {})))
    work = Path(real.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    source = source_folder(work, real.source)
    digest = folder_digest(source)
    train_data, heldout, data = prepare_data(work, source, real, digest)
    runner = StageRunner(real, work, source, digest, train_data, heldout)
    files = text_files(settings.validation or VALIDATION_GLOB)
    if not files:
        raise ConfigError(f'bench fusion: no validation text at {settings.validation or VALIDATION_GLOB}')
    validation = text_folder(runner, 'validation', settings.validation or VALIDATION_GLOB, files, seed=settings.seed,
                             tokens=settings.text_tokens, seq_len=real.seq_len,
                             max_document_chars=settings.max_document_chars)
    source_heads = runner.source_map.layers[0].num_key_heads
    if not 1 <= settings.kv_heads < source_heads or source_heads % settings.kv_heads:
        raise ConfigError(f'bench fusion: --kv-heads {settings.kv_heads} must divide the source\'s {source_heads} '
                          'K/V heads into equal groups of two or more (Fusion fuses equal groups)')
    runs = work / 'fusion'
    head_map = HeadMap.pooled(runner.source_map, settings.kv_heads)
    runs.mkdir(parents=True, exist_ok=True)
    head_map.save(runs / f'head_map_kv{settings.kv_heads}.json')
    budgets = list(settings.batches or [runner.batches])
    texts = {'validation': validation, 'heldout': heldout}
    results = {'command': command_line(), 'settings': {**asdict(settings), 'batches': budgets, 'batch': real.batch,
                                                       'seq_len': real.seq_len},
               'source': {'folder': str(source), 'sha256': digest}, 'data': data,
               'texts': {'validation': settings.validation or VALIDATION_GLOB, 'heldout': data['heldout']['source']},
               'text_splits': {name: {'root': str(root), 'units': folder_units(root)} for name, root in texts.items()},
               'rows': []}
    sequences = {}

    def fusion_record(trainer, out: Path) -> dict:
        from dha_train.algorithms.head_fusion import HeadFusion

        state = HeadFusion.of(trainer.state, 'bench fusion')
        return {'history': [entry['fusion_loss'] for entry in state.history], 'converged_at': state.converged_at}

    for batches, omega_lr, lambda_lr, margin in grid(settings, budgets):
        label = f'{batches} batches, {setting_label(omega_lr, lambda_lr, margin)}'
        name = re.sub(r'[^a-z0-9]+', '-', f'fusion kv{settings.kv_heads} {label}'.lower()).strip('-')
        fused = runner.train(name, RECIPE, batches, then=fusion_record, model_path=source,
                             head_map=runs / f'head_map_kv{settings.kv_heads}.json',
                             margin_steps=margin, omega_lr=omega_lr, lambda_lr=lambda_lr)

        remaining = batches - len(fused['history'])  # > 0 only when Fusion stopped at the threshold
        baked = score_stage(runner, runs, name, fused['hf_folder'], texts, real.device)
        at_budget, trained = baked, None
        if remaining > 0:  # CT takes the rest of the budget, as in `bench real`: every run compared at the same tokens
            trained = runner.ct_after_fusion(name, fused['hf_folder'], remaining)
            at_budget = score_stage(runner, runs, f'{name}-ct', trained['hf_folder'], texts, real.device)
        sequences[label] = at_budget
        row = {'label': label, 'batches': batches, 'omega_lr': omega_lr, 'lambda_lr': lambda_lr,
               'margin_steps': margin, 'batches_run': len(fused['history']),
               'converged_at': fused['converged_at'], 'fusion_loss': fused['history'],
               'final_fusion_loss': fused['history'][-1] if fused['history'] else None,
               'tokens': len(fused['history']) * real.batch * real.seq_len, 'seconds': fused['seconds'],
               'ct_batches': remaining, 'ct_seconds': trained['seconds'] if trained is not None else 0.0}
        for text in texts:
            row[f'{text}_loss'], row[f'{text}_ci95'] = loss_interval(baked[text], texts[text])
            row[f'budget_{text}_loss'], row[f'budget_{text}_ci95'] = loss_interval(at_budget[text], texts[text])
        first = next(iter(sequences))
        if label != first:
            row['vs_first'] = {text: list(paired_loss_difference(sequences[first][text], at_budget[text],
                                                                 texts[text], seed=settings.seed)) for text in texts}
        results['rows'].append(row)
        bench_say('fusion', f'{label}: L_fusion {row["final_fusion_loss"]:.4f} after {row["batches_run"]} '
            f'batches (converged at {row["converged_at"]}); validation {row["validation_loss"]:.3f} baked, '
            f'{row["budget_validation_loss"]:.3f} at the budget')
    # each grid its own folder of results and plots, so a second invocation (another grid) keeps the first's
    outputs = runs / f'grid-{grid_digest(results["settings"])}'
    results['plots'] = [str(plot_fusion(results, outputs / 'fusion.png'))]
    if len(budgets) > 1:
        results['plots'].append(str(plot_budgets(results, outputs / 'fusion_budgets.png')))
    write_results(results, outputs, settings.results)
    print(markdown_table(results))
    return results


def grid_digest(settings: dict) -> str:
    """Eight hex digits naming a grid by every setting but where its results are copied to."""
    chosen = {key: value for key, value in settings.items() if key != 'results'}
    return hashlib.sha256(json.dumps(chosen, sort_keys=True, default=str).encode()).hexdigest()[:8]


def score_stage(runner: StageRunner, runs: Path, name: str, folder: str, texts: dict[str, Path],
                device: str) -> dict[str, list[float]]:
    """The loss of every sequence of each text under the model in ``folder``, as a stage (reused when run again)."""
    def score(out: Path) -> dict:
        scored = folder_sequence_losses(folder, texts, device)
        (out / 'sequence_losses.json').write_text(json.dumps(scored))
        return {'file': str(out / 'sequence_losses.json')}

    done = runner.stage(runs / 'eval', name, score, model=folder, texts={k: str(v) for k, v in texts.items()})
    return json.loads(Path(done['file']).read_text())


def setting_label(omega_lr: float, lambda_lr: float, margin: int) -> str:
    """A run's optimiser setting, as its row label gives it after the budget."""
    return f'omega lr {omega_lr:g}, lambda lr {lambda_lr:g}, margin {margin}'


def grid(settings: FusionBenchSettings, budgets: Sequence[int]) -> list[tuple[int, float, float, int]]:
    """(batches, omega lr, lambda lr, margin steps) of every run, budgets outermost; the margin default is the
    recipe's, the one `bench real` runs."""
    from omegaconf import OmegaConf

    margins = settings.margin_steps
    if margins is None:
        margins = [int(OmegaConf.load(recipe_path(RECIPE)).variables.margin_steps)]
    return [(batches, omega_lr, lambda_lr, margin) for batches in budgets for omega_lr in settings.omega_lr
            for lambda_lr in settings.lambda_lr for margin in margins]


def plot_fusion(results: dict, out: Path) -> Path:
    from dha_train.plots import plot_curves

    curves = {row['label']: list(enumerate(row['fusion_loss'], start=1)) for row in results['rows']}
    threshold = 1e-3
    return plot_curves(curves, out, title='DHA Fusion: L_fusion per batch', xlabel='batch', ylabel='L_fusion',
                       references={'threshold': threshold}, log_y=True)


def plot_budgets(results: dict, out: Path) -> Path:
    """The validation and held-out loss (± 95%) at each budget (the baked model, after CT where Fusion stopped early)
    against the budget's tokens, one curve per setting over its budgets."""
    from dha_train.plots import plot_panels

    panels: dict = {'validation': {}, 'held-out': {}}
    for row in results['rows']:
        setting = setting_label(row['omega_lr'], row['lambda_lr'], row['margin_steps'])
        for panel, text in (('validation', 'validation'), ('held-out', 'heldout')):
            curve = panels[panel].setdefault(setting, {'points': [], 'colour_key': setting, 'dashed': False})
            curve['points'].append((row['batches'] * results['settings']['batch'] * results['settings']['seq_len'],
                                    row[f'budget_{text}_loss'], row[f'budget_{text}_ci95']))
    return plot_panels(panels, out, title='DHA Fusion: the baked model against the Fusion budget',
                       xlabel='tokens (Fusion + CT)', ylabel='loss (nats/token)')


def markdown_table(results: dict) -> str:
    """One line per run: where Fusion got to, the baked model's validation loss, and at the budget (after CT for the
    batches Fusion left, as `bench real` runs it) the validation and held-out loss (± 95%), with the paired
    difference from the first run on the validation text (`*`: its interval excludes 0)."""
    lines = ['| run | converged at batch | final L_fusion | validation, baked | CT batches | validation at the budget | '
             'vs first | held-out at the budget |', '| --- | --- | --- | --- | --- | --- | --- | --- |']
    for row in results['rows']:
        versus = '-'
        if row.get('vs_first'):
            value, low, high = row['vs_first']['validation']
            versus = f'{value:+.3f}' + ('' if low is None else f' [{low:+.3f}, {high:+.3f}]'
                                        + ('*' if low > 0 or high < 0 else ''))
        converged = row['converged_at'] if row['converged_at'] is not None else 'no'
        lines.append(f'| {row["label"]} | {converged} | {row["final_fusion_loss"]:.4f} | '
                     f'{with_interval(row["validation_loss"], row["validation_ci95"])} | {row["ct_batches"]} | '
                     f'{with_interval(row["budget_validation_loss"], row["budget_validation_ci95"])} | {versus} | '
                     f'{with_interval(row["budget_heldout_loss"], row["budget_heldout_ci95"])} |')
    return '\n'.join(lines)
