"""Real `composer` launches with FSDP2 on gloo: training, SIGKILL + autoresume in the second epoch of a two-domain
mix (exact weights, the same samples), and elastic resume from 2 processes to 1 and from 1 to 2 (the same global
batches sample for sample, the loss curve within fp tolerance)."""

from __future__ import annotations

import json
import math
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    RECORDING_ENTRY,
    global_batches,
    launch_and_kill_after_checkpoint,
    run_composer,
    tiny_recipe,
    write_recipe,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MAX_BATCHES = 24
SAVE_EVERY = 6
GLOBAL_BATCH = 8
EPOCH_BATCHES = 10  # train_loader.epoch_size = 80 samples: the 24 batches run through two and a half epochs
KILL_AT = 12  # the first checkpoint in the second epoch (batches 10-19)


def _recipe(tmp: Path, data_root: Path, tokenizer_dir: Path) -> Path:
    recipe = tiny_recipe(
        data_root, tokenizer_dir,
        max_duration=f'{MAX_BATCHES}ba',
        eval_loader={'root': '${variables.data_root}'},
        eval_first=True,
        eval_interval=f'{MAX_BATCHES}ba',
        fsdp={'enabled': True, 'state_dict_type': 'sharded'},
        save_interval=f'{SAVE_EVERY}ba',
        autoresume=True,
        callbacks={'record_samples_for_tests': {'out': 'set-per-launch'}},
        # Adam's eps at 1e-8 lets the reduction-order noise of another process or micro-batch count grow into
        # visibly different losses within a few steps on this tiny model (0.28 after 12 steps with 2 micro-batches
        # per rank instead of 1); at 1e-5 such runs agree to the printed digits, so the elastic runs can be held to
        # fp tolerance. (The elastic runs also caught gloo summing FSDP2 gradients: distributed.average_fsdp_gradients.)
        optimizer={'lr': 3.0e-3, 'eps': 1.0e-5},
    )
    recipe['train_loader']['epoch_size'] = EPOCH_BATCHES * GLOBAL_BATCH
    assert recipe['global_train_batch_size'] == GLOBAL_BATCH
    return write_recipe(tmp / 'recipe.yaml', recipe)


def _launch(nproc: int, recipe: Path, save_folder: Path, samples: Path, log: Path):
    return run_composer(nproc, recipe, f'save_folder={save_folder}', f'callbacks.record_samples_for_tests.out={samples}',
                        log=log, entry=RECORDING_ENTRY)


def _kill_after_checkpoint(nproc: int, recipe: Path, save_folder: Path, samples: Path, log: Path) -> int:
    resumed_from = launch_and_kill_after_checkpoint(recipe, save_folder, f'callbacks.record_samples_for_tests.out={samples}',
                                                    log=log, at_least=KILL_AT, nproc=nproc, entry=RECORDING_ENTRY)
    assert resumed_from is not None and EPOCH_BATCHES <= resumed_from < MAX_BATCHES, resumed_from
    return resumed_from


def _train_losses(log: Path) -> dict[int, float]:
    """Batch number (1-based, as the console logger prints it) -> loss/train/total."""
    losses, batch = {}, None
    for line in log.read_text().splitlines():
        header = re.match(r'\[batch=(\d+)/\d+\]:', line)
        if header:
            batch = int(header.group(1))
        loss = re.search(r'Train loss/train/total: ([-+0-9.eE]+)', line)
        if loss and batch is not None:
            losses[batch] = float(loss.group(1))
    return losses


def _domain_of_samples(data_root: Path) -> dict[str, str]:
    """Sample hash -> domain, from every train shard (hashed the way the recorder hashes a device batch row)."""
    from scripts.train_recording_samples import sample_hash
    from streaming.base.format import reader_from_json

    domains = {}
    for domain in ('github', 'wikipedia'):
        split = data_root / domain / 'train'
        for shard in json.loads((split / 'index.json').read_text())['shards']:
            reader = reader_from_json(str(split), None, shard)
            for index in range(reader.samples):
                row = torch.from_numpy(np.asarray(reader.get_item(index)['tokens']).astype(np.int64))
                domains[sample_hash(row)] = domain
    return domains


def _floats(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern + r': ([-+0-9.eEnaif]+)', text)]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, data_root, tokenizer_dir):
    tmp = tmp_path_factory.mktemp('uninterrupted')
    recipe = _recipe(tmp, data_root, tokenizer_dir)
    log = tmp / 'log.txt'
    done = _launch(2, recipe, tmp / 'ckpt', tmp / 'samples', log)
    return tmp, recipe, done.returncode, log.read_text()


def test_fsdp2_two_process_run_trains(uninterrupted):
    tmp, _, returncode, log = uninterrupted
    assert returncode == 0, log[-4000:]
    assert 'starts at batch 0' in log
    train_losses = _floats(r'loss/train/total', log)
    assert len(train_losses) >= MAX_BATCHES // 2
    assert train_losses[-1] < train_losses[0] - 0.5, (train_losses[0], train_losses[-1])
    for domain in ('github', 'wikipedia'):
        evals = _floats(rf'metrics/eval_{domain}/LanguageCrossEntropy', log)
        assert len(evals) == 2, f'{domain}: expected an eval at batch 0 and at the end, got {evals}'
        assert all(math.isfinite(v) for v in evals)
        assert evals[-1] < evals[0] - 0.5
    # Sharded checkpoints: one file per rank.
    final, = (tmp / 'ckpt').glob(f'ep*-ba{MAX_BATCHES}')
    assert int(final.name.split('-')[0][2:]) >= 2  # the epoch in the name: well past one
    assert sorted(p.name for p in final.glob('*.distcp')) == ['__0_0.distcp', '__1_0.distcp']


@pytest.fixture(scope='module')
def killed_with_two(uninterrupted, tmp_path_factory):
    """One 2-process run SIGKILLed after a checkpoint in the second epoch; the same-count and the 2 -> 1 resumes
    each continue from a copy of its save folder (one launch fewer than killing a run for each)."""
    _, recipe, returncode, _ = uninterrupted
    assert returncode == 0
    tmp = tmp_path_factory.mktemp('killed-2')
    resumed_from = _kill_after_checkpoint(2, recipe, tmp / 'ckpt', tmp / 'samples-killed', tmp / 'killed.txt')
    return tmp, resumed_from


def _killed_run(nproc: int, recipe: Path, tmp_path: Path, killed_with_two) -> int:
    """A killed run's save folder, samples and log under ``tmp_path``: a copy of the shared 2-process one, or a run
    killed here with ``nproc`` processes. Returns the batch the resume will start at."""
    if nproc != 2:
        return _kill_after_checkpoint(nproc, recipe, tmp_path / 'ckpt', tmp_path / 'samples-killed',
                                      tmp_path / 'killed.txt')
    shared, resumed_from = killed_with_two
    shutil.copytree(shared / 'ckpt', tmp_path / 'ckpt', symlinks=True)
    shutil.copytree(shared / 'samples-killed', tmp_path / 'samples-killed')
    shutil.copy(shared / 'killed.txt', tmp_path / 'killed.txt')
    return resumed_from


def test_sigkill_then_autoresume_matches_uninterrupted_bit_exactly(uninterrupted, killed_with_two, tmp_path):
    from dha_train.export import export_hf

    reference_tmp, recipe, returncode, _ = uninterrupted
    assert returncode == 0
    save_folder = tmp_path / 'ckpt'
    resumed_from = _killed_run(2, recipe, tmp_path, killed_with_two)

    log = tmp_path / 'resumed.txt'
    done = _launch(2, recipe, save_folder, tmp_path / 'samples-resumed', log)
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]
    assert f'starts at batch {resumed_from} of {MAX_BATCHES}ba' in text

    ours = export_hf(save_folder, tmp_path / 'resumed_hf')
    reference = export_hf(reference_tmp / 'ckpt', tmp_path / 'reference_hf')
    ours_weights = load_file(ours / 'model.safetensors')
    reference_weights = load_file(reference / 'model.safetensors')
    assert ours_weights.keys() == reference_weights.keys()
    for name, tensor in reference_weights.items():
        assert torch.equal(ours_weights[name], tensor), f'{name} differs after resume'
    # Resumed mid-way through the second epoch, the run trains on exactly the batches of the uninterrupted run.
    reference_batches = global_batches(reference_tmp / 'samples')
    assert len(reference_batches) == MAX_BATCHES
    assert {**global_batches(tmp_path / 'samples-killed', end=resumed_from),
            **global_batches(tmp_path / 'samples-resumed', first=resumed_from)} == reference_batches
    # (A finished run launched again is reported done: test_dha_pipeline's re-run, with 2 processes.)


@pytest.mark.parametrize('before, after', [(2, 1), (1, 2)])
def test_elastic_resume_keeps_the_global_batches_and_the_loss_curve(uninterrupted, killed_with_two, tmp_path, data_root,
                                                                    before, after):
    """Killed in the second epoch with ``before`` processes and resumed with ``after`` (the same global batch of 8:
    4 per rank, or 2 micro-batches of 4 on one): every global batch holds the same samples as in the uninterrupted
    2-process run, none repeated or skipped, and the losses agree to fp tolerance (reduction orders differ)."""
    reference_tmp, recipe, returncode, _ = uninterrupted
    assert returncode == 0
    save_folder = tmp_path / 'ckpt'
    resumed_from = _killed_run(before, recipe, tmp_path, killed_with_two)
    log = tmp_path / 'resumed.txt'
    done = _launch(after, recipe, save_folder, tmp_path / 'samples-resumed', log)
    assert done.returncode == 0, log.read_text()[-4000:]
    assert f'starts at batch {resumed_from} of {MAX_BATCHES}ba' in log.read_text()

    reference = global_batches(reference_tmp / 'samples')
    ours = {**global_batches(tmp_path / 'samples-killed', end=resumed_from),
            **global_batches(tmp_path / 'samples-resumed', first=resumed_from)}
    assert ours == reference
    domain_of = _domain_of_samples(data_root)
    seen = Counter(domain_of[h] for batch in ours.values() for h in batch)
    assert seen == Counter(domain_of[h] for batch in reference.values() for h in batch)
    assert sum(seen.values()) == MAX_BATCHES * GLOBAL_BATCH and set(seen) == {'github', 'wikipedia'}

    reference_losses = _train_losses(reference_tmp / 'log.txt')
    losses = {**{b: v for b, v in _train_losses(tmp_path / 'killed.txt').items() if b <= resumed_from},
              **{b: v for b, v in _train_losses(log).items() if b > resumed_from}}
    assert sorted(losses) == sorted(reference_losses) == list(range(1, MAX_BATCHES + 1))
    for batch, loss in reference_losses.items():
        assert losses[batch] == pytest.approx(loss, rel=1e-3, abs=1e-3), batch
