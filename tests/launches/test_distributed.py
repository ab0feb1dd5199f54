"""Real 2-process `composer` launches with FSDP2 on gloo: training, SIGKILL + autoresume, exact weights."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import launch_and_kill_after_checkpoint, run_composer, tiny_recipe, write_recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MAX_BATCHES = 48
SAVE_EVERY = 6


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
    )
    return write_recipe(tmp / 'recipe.yaml', recipe)


def _floats(pattern: str, text: str) -> list[float]:
    return [float(x) for x in re.findall(pattern + r': ([-+0-9.eEnaif]+)', text)]


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory, data_root, tokenizer_dir):
    tmp = tmp_path_factory.mktemp('uninterrupted')
    recipe = _recipe(tmp, data_root, tokenizer_dir)
    log = tmp / 'log.txt'
    done = run_composer(2, recipe, f'save_folder={tmp / "ckpt"}', log=log)
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
    final = tmp / 'ckpt' / f'ep0-ba{MAX_BATCHES}'
    assert sorted(p.name for p in final.glob('*.distcp')) == ['__0_0.distcp', '__1_0.distcp']


def test_sigkill_then_autoresume_matches_uninterrupted_bit_exactly(uninterrupted, tmp_path):
    from dha_train.export import export_hf

    reference_tmp, recipe, returncode, _ = uninterrupted
    assert returncode == 0
    save_folder = tmp_path / 'ckpt'
    resumed_from = launch_and_kill_after_checkpoint(recipe, save_folder, log=tmp_path / 'killed.txt',
                                                    at_least=SAVE_EVERY)
    assert resumed_from is not None and SAVE_EVERY <= resumed_from < MAX_BATCHES, resumed_from

    log = tmp_path / 'resumed.txt'
    done = run_composer(2, recipe, f'save_folder={save_folder}', log=log)
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

    # A finished run launched again is reported done instead of crashing.
    again = run_composer(2, recipe, f'save_folder={save_folder}', log=tmp_path / 'again.txt')
    assert again.returncode == 0
    assert 'already finished' in (tmp_path / 'again.txt').read_text()
