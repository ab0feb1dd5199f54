"""`dha-train bench healing-speed`: where a healing stage's time goes on this machine, and the healing chain's
training tokens/s under each way of running it, from one run (issue 62).

The chain is bench real's: attention transfer, then KL distillation (``yamls/real/transfer.yaml``, ``kl.yaml``), of
the source mean-pooled to one K/V head, on bench real's training data and batch. Every arm trains the same batches
(the same seeds) from the same start, one after another (never two at once):

- ``fsdp-1p``: FSDP2 over one rank, one process with the machine's threads: how bench real ran its healing stages
  before this bench (``launch/heal.sh``'s code path; the stream carries every layer's gradient path, and every
  position's logits are computed and their loss cancelled);
- ``fsdp-2p``: FSDP2 over two processes (gloo), the threads split between them (``launch/heal.sh ... 2``), each
  taking half the global batch (so at most half of it a micro-batch);
- ``plain-1p``: one process without FSDP2 (bench real's healing now): attention transfer back-propagates each
  layer's MSE within the layer and its LM head computes one position;
- ``plain-1p-mb<k>``: the same at another micro-batch.

A stage's wall time is split into launch (process start, imports, the model and the source loaded, up to Composer's
fit start), data (waiting for batches), compute (forward, backward, optimizer step) and end (checkpoint, export and
exit). Each arm's per-batch losses are compared with the first arm's: in one process at the same micro-batch the
curve is the same to float rounding; two processes, or another micro-batch, group each batch's sequences into other
micro-batches, and the per-micro-batch normalised MSE and KL then differ by a little (the same objective). Timings on a shared machine are noisy: the ratios are measured in one run, arm after arm.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from dha_train.bench_runner import StageRunner, command_line, prepare_data, source_folder
from dha_train.bench_settings import RealSettings, resolve_settings
from dha_train.bench_support import bench_say, launch_bench_recipe, write_results
from dha_train.model_folders import folder_digest

STAGES = (('transfer', 'real/transfer.yaml'), ('kl', 'real/kl.yaml'))
BASE_ARM = 'fsdp-1p'
TRANSFER_SEED, KL_SEED = 101, 102  # offsets from the bench seed, as bench real's healing stages


@dataclass(frozen=True)
class Arm:
    name: str
    processes: int
    fsdp: bool
    microbatch: int | None = None  # None: the bench's


@dataclass
class HealingSpeedSettings:
    out: str = 'bench_healing_speed'
    source: str = RealSettings.source
    batches: int = 4  # per stage
    microbatches: Sequence[int] = (4,)  # the plain arm again at each of these micro-batches
    two_processes: bool = True
    results: str | None = None  # a second copy of the results file (docs/results/...)
    # bench real's settings, None for its CPU defaults (the tests' tiny runs set them)
    train_data: str | None = None
    seq_len: int | None = None
    batch: int | None = None
    microbatch: int | None = None
    val_tokens: int | None = None


def arms(settings: HealingSpeedSettings, batch: int, microbatch: int) -> list[Arm]:
    chosen = [Arm(BASE_ARM, 1, True)]
    if settings.two_processes:  # each process takes half the global batch, so at most half of it a micro-batch
        chosen.append(Arm('fsdp-2p', 2, True, None if microbatch <= batch // 2 else batch // 2))
    chosen.append(Arm('plain-1p', 1, False))
    chosen += [Arm(f'plain-1p-mb{size}', 1, False, size) for size in settings.microbatches if size != microbatch]
    return chosen


def _timeline(path: Path, started: float, finished: float) -> dict:
    """The stage's seconds split into launch, data, compute and end, from the ``batch_timeline`` callback's file."""
    marks = json.loads(path.read_text())
    data = sum(batch['data_s'] for batch in marks['batches'])
    compute = sum(batch['compute_s'] for batch in marks['batches'])
    fit = marks['fit_end'] - marks['fit_start']
    return {'seconds': finished - started, 'launch_s': marks['fit_start'] - started, 'data_s': data,
            'compute_s': compute, 'fit_other_s': max(fit - data - compute, 0.0), 'end_s': finished - marks['fit_end'],
            'tokens': marks['batches'][-1]['tokens'], 'losses': [batch['loss'] for batch in marks['batches']],
            'compute_s_per_batch': [batch['compute_s'] for batch in marks['batches']]}


def _run_stage(runner: StageRunner, arm: Arm, stage: str, recipe: str, model: str, steps: int, seed: int,
               timeline: Path) -> tuple[dict, str]:
    """One healing stage of ``arm``, timed from its launch to its exported folder: (timings, export folder)."""
    from dha_train.export import export_hf

    s = runner.settings
    name = f'{arm.name}-{stage}'
    lr = s.transfer_lr if stage == 'transfer' else s.kl_lr
    extra = [f'callbacks.batch_timeline.out={timeline}']
    if arm.microbatch is not None:
        extra.append(f'device_train_microbatch_size={arm.microbatch}')
    started = time.time()
    if arm.processes == 1:
        result = runner.train(name, recipe, steps, seed, fsdp=arm.fsdp, extra=extra, model_path=model,
                              source_path=runner.source, lr=lr)
        hf = result['hf_folder']
    else:
        overrides = runner.overrides(name, steps, seed, model_path=model, source_path=runner.source, lr=lr) + extra
        log = timeline.with_suffix('.log')
        code = launch_bench_recipe(arm.processes, recipe, overrides, log)
        if code != 0 or not timeline.is_file():
            raise RuntimeError(f'bench healing-speed: {name} failed (exit {code}); see {log}')
        save = runner.runs / 'checkpoints' / name
        hf = str(export_hf(save, timeline.parent / f'{name}-hf', overwrite=True))
        shutil.rmtree(save, ignore_errors=True)
    return _timeline(timeline, started, time.time()), hf


def _curve_difference(losses: list[float], base: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, base)) if len(losses) == len(base) else float('nan')


def run_healing_speed_bench(settings: HealingSpeedSettings, command: str | None = None) -> dict:
    work = Path(settings.out).resolve()
    work.mkdir(parents=True, exist_ok=True)
    # no row is scored here (limit 1 is never read); the held-out split is made as bench real makes it
    real = resolve_settings(RealSettings(out=str(work), source=settings.source, device='cpu', limit=1,
                                         intermediate_limit=1, train_data=settings.train_data,
                                         seq_len=settings.seq_len, batch=settings.batch,
                                         microbatch=settings.microbatch, val_tokens=settings.val_tokens))
    source = source_folder(work, settings.source)
    digest = folder_digest(source)
    train_data, heldout, data = prepare_data(work, source, real, digest)
    runner = StageRunner(real, work, source, digest, train_data, heldout)
    runner.runs = work / 'speed-runs'
    shutil.rmtree(runner.runs, ignore_errors=True)  # every arm trains now: a reused stage would time nothing
    runner.runs.mkdir(parents=True)
    start = _mean_pooled(runner, source)
    results = {'command': command, 'date': time.strftime('%Y-%m-%d'), 'source': str(source),
               'batch': real.batch, 'microbatch': real.microbatch, 'seq_len': real.seq_len,
               'batches_per_stage': settings.batches, 'train_data': data['train'], 'arms': {}}
    for arm in arms(settings, real.batch, real.microbatch):
        bench_say('healing-speed', f'{arm.name}: {arm.processes} process(es), FSDP2 {"on" if arm.fsdp else "off"}, '
                                   f'micro-batch {arm.microbatch or real.microbatch}')
        model, stages = start, {}
        for stage, recipe in STAGES:
            seed = real.seed + (TRANSFER_SEED if stage == 'transfer' else KL_SEED)
            stages[stage], model = _run_stage(runner, arm, stage, recipe, model, settings.batches, seed,
                                              runner.runs / f'{arm.name}-{stage}-timeline.json')
        results['arms'][arm.name] = {'processes': arm.processes, 'fsdp': arm.fsdp,
                                     'microbatch': arm.microbatch or real.microbatch, 'stages': stages}
    _summarise(results)
    write_results(results, work, settings.results)
    print_summary(results)
    return results


def _mean_pooled(runner: StageRunner, source: Path) -> str:
    """The chain's start: the source mean-pooled to one K/V head (the speed does not depend on the weights)."""
    from dha_train.conversion.mean_pool import convert_checkpoint
    from dha_train.models.head_map import HeadMap

    def convert(out: Path) -> dict:
        return {'hf_folder': str(convert_checkpoint(source, out / 'hf', HeadMap.pooled(runner.source_map, 1),
                                                    overwrite=True))}

    return runner.stage(runner.runs, 'meanpool-kv1', convert)['hf_folder']


def _summarise(results: dict) -> None:
    for arm in results['arms'].values():
        tokens = sum(stage['tokens'] for stage in arm['stages'].values())
        seconds = sum(stage['seconds'] for stage in arm['stages'].values())
        trained = sum(stage['data_s'] + stage['compute_s'] for stage in arm['stages'].values())
        arm['chain'] = {'tokens': tokens, 'seconds': seconds, 'tokens_per_s': tokens / seconds,
                        'training_tokens_per_s': tokens / trained}
    base = results['arms'][BASE_ARM]
    for arm in results['arms'].values():
        arm['chain']['speedup'] = arm['chain']['tokens_per_s'] / base['chain']['tokens_per_s']
        arm['loss_curve_max_relative_difference'] = {
            name: _curve_difference(stage['losses'], base['stages'][name]['losses'])
            for name, stage in arm['stages'].items()}


def print_summary(results: dict) -> None:
    print()
    print(f'healing chain (attention transfer then KL, {results["batches_per_stage"]} batches each of '
          f'{results["batch"]} x {results["seq_len"]} tokens) on {Path(results["source"]).name}')
    print(f'  {"arm":<14} {"stage":<9} {"launch s":>9} {"data s":>7} {"compute s":>10} {"end s":>6} {"total s":>8} '
          f'{"tokens/s":>9} {"loss vs " + BASE_ARM:>16}')
    for name, arm in results['arms'].items():
        for stage_name, stage in arm['stages'].items():
            difference = arm['loss_curve_max_relative_difference'][stage_name]
            print(f'  {name:<14} {stage_name:<9} {stage["launch_s"]:>9.1f} {stage["data_s"]:>7.1f} '
                  f'{stage["compute_s"]:>10.1f} {stage["end_s"]:>6.1f} {stage["seconds"]:>8.1f} '
                  f'{stage["tokens"] / stage["seconds"]:>9.1f} {difference:>16.2e}')
        chain = arm['chain']
        print(f'  {name:<14} {"chain":<9} {"":>9} {"":>7} {"":>10} {"":>6} {chain["seconds"]:>8.1f} '
              f'{chain["tokens_per_s"]:>9.1f} {chain["speedup"]:>15.2f}x')


def add_parser(bench) -> None:
    """The ``healing-speed`` subcommand of ``dha-train bench``."""
    defaults = HealingSpeedSettings()
    parser = bench.add_parser('healing-speed', help="the healing chain's tokens/s: FSDP2 on 1 and 2 processes against "
                              'one plain process, with where each stage spends its time')
    parser.add_argument('--out', default=defaults.out, help='a folder (a `bench real` one reuses its source and data)')
    parser.add_argument('--source', default=defaults.source, help='a GGUF name or path (import-gguf) or an HF folder')
    parser.add_argument('--batches', type=int, default=defaults.batches, help='training batches per stage')
    parser.add_argument('--microbatches', type=int, nargs='*', default=list(defaults.microbatches),
                        help='the plain arm again at each of these micro-batches')
    parser.add_argument('--no-two-processes', dest='two_processes', action='store_false',
                        help='leave out FSDP2 over two processes')
    parser.add_argument('--results', default=None, help='also write the results file here (docs/results/...)')
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from dha_train.config import ConfigError

    if args.batches < 2:
        raise ConfigError(f'bench healing-speed: --batches must be at least 2, got {args.batches}')
    settings = HealingSpeedSettings(out=args.out, source=args.source, batches=args.batches,
                                    microbatches=tuple(args.microbatches), two_processes=args.two_processes,
                                    results=args.results)
    run_healing_speed_bench(settings, command=command_line())
    return 0
