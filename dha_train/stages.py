"""Running recipes as stages inside one process, and reading what they logged.

The quickstart, the benches and the tests run conversion recipes back to back in one process; these are the helpers
they share: a stage folder that counts as finished only once its marker exists, one recipe run with an in-memory
history, and the readings of that history (validation loss per domain, its mean, tokens trained).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from composer import Callback, Logger, State
from composer.loggers import InMemoryLogger

from dha_train.config import ConfigError, TrainConfig, load_config
from dha_train.export import export_hf
from dha_train.ops.budget import whole_head_count
from dha_train.paths import recipe_path, write_file_atomically
from dha_train.plan import run_tokens
from dha_train.train import close_trainer, train

DONE_MARKER = 'DONE.json'

# The quickstart run folder's fixed settings: the benches and the tests read its stages.
SEQ_LEN = 256
KV_BUDGET = 0.25
DHA_NAME = 'tiny-dha25'


class Stage:
    """A stage directory that counts as finished only once its DONE marker (with the stage's result) exists."""

    def __init__(self, run: Path, name: str):
        self.dir = run / name
        self.marker = self.dir / DONE_MARKER

    def done(self) -> dict | None:
        return json.loads(self.marker.read_text()) if self.marker.is_file() else None

    def finish(self, result: dict) -> dict:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_file_atomically(self.marker, json.dumps(result, indent=2))
        return result

    def run(self, build, say, isolated: bool = False) -> dict:
        """``build(stage_dir)`` once: a finished stage's result is reused; a fresh one records its seconds. ``say``
        prints progress. Memory is released after the build (``release_freed_memory``), so a stage's trainer, models
        and optimizer state go before the next stage builds its own.

        ``isolated=True`` runs the build in a fresh Python process (the closure travels by cloudpickle), so a caller
        that builds stage after stage does not keep what each one leaves in its heap; the result comes back through
        the DONE marker. A fresh process and not a fork: a fork of a process whose torch thread pool has run hangs."""
        name = self.dir.name
        result = self.done()
        if result is not None:
            say(f'{name}: reusing finished stage in {self.dir}')
            return result
        if isolated:
            return self._run_in_child(build, say)
        say(f'{name}: running')
        started = time.perf_counter()
        result = build(self.dir)
        release_freed_memory()
        result['seconds'] = round(time.perf_counter() - started, 1)
        say(f'{name}: done in {result["seconds"]} s')
        return self.finish(result)

    def _run_in_child(self, build, say) -> dict:
        import cloudpickle

        self.dir.parent.mkdir(parents=True, exist_ok=True)
        # The closure goes to the child through its stdin, never through a file: nothing the child unpickles can be
        # planted or swapped in the run folder.
        payload = cloudpickle.dumps((build, say))
        # the child imports what the parent can (functions of importable modules travel by reference)
        environment = {**os.environ, 'PYTHONPATH': os.pathsep.join(path for path in sys.path if path)}
        code = subprocess.run([sys.executable, '-m', 'dha_train.stages', str(self.dir.parent), self.dir.name],
                              input=payload, env=environment).returncode
        result = self.done()
        if code or result is None:
            raise RuntimeError(f'stage {self.dir.name} failed in its own process (exit code {code}); its traceback '
                               'is printed above')
        return result


def _run_stage_process(run: str, name: str) -> int:
    """The child of ``Stage.run(isolated=True)``: unpickle the build its parent wrote to this process's stdin (the
    parent's own bytes, through a pipe) and run the stage here."""
    import pickle

    try:
        build, say = pickle.loads(sys.stdin.buffer.read())
        Stage(Path(run), name).run(build, say)
    except BaseException:  # noqa: BLE001 - any failure is reported to the parent through the exit code
        traceback.print_exc()
        return 1
    return 0


def release_freed_memory() -> None:
    """Collect garbage, then hand the heap's free pages back to the OS (glibc ``malloc_trim``). Without the trim a
    process that builds model after model (the benches: a 135M model per stage) keeps each stage's freed tensors as
    fragmented heap, and its resident memory grows stage by stage until the OOM killer ends it."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    name = ctypes.util.find_library('c')
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, 'malloc_trim') else None  # musl and macOS have no trim


_LIBC = _glibc()


def history_from(logger: InMemoryLogger) -> dict:
    """Train loss per batch and per-domain eval loss per evaluation, from Composer's in-memory logger."""
    history: dict = {'train': [], 'eval': {}}
    for timestamp, value in logger.data.get('loss/train/total', []):
        history['train'].append([int(timestamp.batch), float(value)])
    for key, points in logger.data.items():
        if key.startswith('metrics/eval_') and key.endswith('/LanguageCrossEntropy'):
            domain = key[len('metrics/eval_'):-len('/LanguageCrossEntropy')]
            history['eval'][domain] = [[int(t.batch), float(v)] for t, v in points]
    return history


def train_recipe(config: TrainConfig, extra_callbacks=()) -> tuple:
    """Train ``config`` in this process and close the trainer: (trainer, history from the in-memory logger)."""
    memory = InMemoryLogger()
    trainer = train(config, extra_loggers=[memory], extra_callbacks=extra_callbacks)
    history = history_from(memory)
    close_trainer(trainer)
    return trainer, history


def train_stage(recipe: str, overrides: list[str], max_batches: int | None, extra_callbacks=(),
                recipe_callbacks: bool = True, fsdp: bool = False) -> tuple:
    """One recipe of ``yamls/`` in this process (one rank): (trainer, config, history). Without FSDP unless
    ``fsdp=True``, which keeps the recipe's ``fsdp`` section (FSDP2 over a world of one, the code path of a
    launched multi-rank run). ``recipe_callbacks=False`` drops the recipe's callbacks (for timing)."""
    overrides = overrides + ([] if fsdp else ['fsdp.enabled=false'])
    if max_batches is not None:
        overrides.append(f'max_duration={max_batches}ba')
    config = load_config(recipe_path(recipe), overrides)
    if not recipe_callbacks:
        config.callbacks = {}
    trainer, history = train_recipe(config, extra_callbacks)
    return trainer, config, history


class BatchDigests(Callback):
    """A short digest of each training batch's token ids, in order (the first ``keep``): which data a stage saw,
    so a record can show that two stages did not train on the same batches."""

    def __init__(self, keep: int = 64):
        self.keep, self.digests = keep, []

    def after_dataloader(self, state: State, logger: Logger) -> None:
        if len(self.digests) < self.keep:
            ids = state.batch['input_ids'].detach().cpu().contiguous()
            self.digests.append(hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:12])


def mean_eval(history: dict, position: int) -> dict:
    """Validation loss per domain at one evaluation (0: first, -1: last), with the mean over domains."""
    losses = {domain: points[position][1] for domain, points in history['eval'].items()}
    return {'batch': next(iter(history['eval'].values()))[position][0], 'per_domain': losses,
            'mean': sum(losses.values()) / len(losses)}


def mean_eval_curve(history: dict) -> list[tuple[int, float]]:
    """(batch, validation loss averaged over the domains) at every evaluation."""
    domains = list(history['eval'].values())
    return [(points[0][0], sum(point[1] for point in points) / len(points)) for points in zip(*domains)]


def train_tokens(config: TrainConfig, seq_len: int) -> int:
    """Tokens a run of ``config`` trains on (its max_duration in batches, samples or tokens)."""
    return run_tokens(config, seq_len)


def ct_curve(data: Path, work: Path, model: str | Path, name: str, batches: int, eval_every: int,
             seq_len: int, recipe: str = 'gqa/tiny_ct.yaml', overrides: Sequence[str] = (),
             export: Path | None = None) -> dict:
    """Continued pre-training of an HF folder with ``recipe`` (a tiny CT recipe) on ``data`` for ``batches``, started
    fresh (a measurement never autoresumes a stale run): its validation curve, final loss and tokens; with
    ``export``, the trained model written there as an HF folder too (``hf_folder``)."""
    shutil.rmtree(work / name, ignore_errors=True)
    _, config, history = train_stage(recipe, [
        f'variables.model_path={model}', f'variables.data_root={data}', f'variables.save_root={work}',
        f'run_name={name}', f'max_duration={batches}ba', f'eval_interval={eval_every}ba', 'save_interval=100000ba',
        *overrides], None)
    if not history['eval']:
        raise RuntimeError(f'{name}: no evaluation was logged')
    result = {'curve': mean_eval_curve(history), 'final': mean_eval(history, -1)['mean'],
              'tokens': train_tokens(config, seq_len)}
    if export is not None:  # the run saves once, at its end (save_interval is past it)
        result['hf_folder'] = str(export_hf(work / name, export, overwrite=True, start=model))
    return result


def validation_loss(data: Path, hf_folder: str | Path) -> float:
    """Validation loss (mean over the domains of ``data``) of an HF folder: the first evaluation of a one-batch CT
    run that saves nothing (any head-mapped or standard LLaMA folder)."""
    _, _, history = train_stage('gqa/tiny_ct.yaml', [
        f'variables.model_path={hf_folder}', f'variables.data_root={data}', 'eval_first=true',
        'save_folder=null', 'autoresume=false', 'run_name=bench-eval'], 1)
    return mean_eval(history, 0)['mean']


def gqa_kv_heads(num_heads: int) -> int:
    """K/V heads per layer of the GQA baseline: DHA's KV_BUDGET of the heads, spread evenly over the layers."""
    try:
        kv_heads = whole_head_count(KV_BUDGET, num_heads)
    except ValueError:
        kv_heads = 0
    if kv_heads < 1 or num_heads % kv_heads:
        raise ConfigError(f'quickstart: a {KV_BUDGET:.0%} KV budget of {num_heads} heads per layer is not a whole '
                          'divisor of the heads; give the teacher a head count divisible by 4')
    return kv_heads


if __name__ == '__main__':
    exit_code = _run_stage_process(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # not sys.exit: a trainer's leftover non-daemon threads must not keep the child alive
