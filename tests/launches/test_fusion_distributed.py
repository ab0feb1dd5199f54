"""HeadFusion under the platform's FSDP2 path with 2 real processes: the fusion model at init equals MHA, and a
fusion run killed with SIGKILL and auto-resumed ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, free_port, fusion_recipe, launch_and_kill_after_checkpoint, run_composer, write_recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MAX_BATCHES = 24
SAVE_EVERY = 6


def _fsdp_fusion_recipe(tmp_path, data_root, tokenizer_dir, **overrides):
    recipe = fusion_recipe(tmp_path, data_root, tokenizer_dir, fsdp={'enabled': True, 'state_dict_type': 'sharded'},
                           **overrides)
    recipe['callbacks'] = {'fusion_monitor': {}}
    return recipe


def test_fsdp2_fusion_model_at_init_equals_mha(tmp_path, data_root, tokenizer_dir):
    recipe = write_recipe(tmp_path / 'fusion.yaml', _fsdp_fusion_recipe(tmp_path, data_root, tokenizer_dir))
    out = tmp_path / 'result.json'
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1'}
    done = subprocess.run([sys.executable, '-m', 'composer.cli.launcher', '-n', '2', '--master_port', str(free_port()),
                           str(REPO / 'tests/scripts/fusion_fsdp_init.py'), str(recipe), str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result['world_size'] == 2 and result['fused_projections'] == 4
    assert result['fsdp'].startswith('FSDP') and result['omega_is_sharded'] == 'DTensor'  # really sharded
    assert result['max_abs_diff'] <= 1e-5, result
    assert result['fusion_loss'] == pytest.approx((1 + 4 / 7) / 2, rel=1e-6)  # the Kronecker init's loss


def _fusion_state(save_folder):
    from dha_train.export import load_composer_state, model_weights

    state = load_composer_state(save_folder)
    algorithms = state['state']['algorithms']
    fusion = next(s for _, s in algorithms if isinstance(s, dict) and 'lam' in s)
    return fusion, model_weights(state), int(state['state']['timestamp']['Timestamp']['batch'])


@pytest.fixture(scope='module')
def uninterrupted_fusion(tmp_path_factory, data_root, tokenizer_dir):
    tmp = tmp_path_factory.mktemp('fusion_uninterrupted')
    recipe = write_recipe(tmp / 'fusion.yaml', _fsdp_fusion_recipe(
        tmp, data_root, tokenizer_dir, max_duration=f'{MAX_BATCHES}ba', save_interval=f'{SAVE_EVERY}ba',
        autoresume=True, run_name='fusion-resume'))
    done = run_composer(2, recipe, f'save_folder={tmp / "ckpt"}', log=tmp / 'log.txt')
    assert done.returncode == 0, (tmp / 'log.txt').read_text()[-4000:]
    return recipe, tmp / 'ckpt', (tmp / 'log.txt').read_text()


def test_fusion_sigkill_then_autoresume_continues_exactly(uninterrupted_fusion, tmp_path):
    recipe, reference_folder, reference_log = uninterrupted_fusion
    assert 'fusion/layer1/value_self_weight' in reference_log and 'fusion/lambda' in reference_log  # monitor logs
    save_folder = tmp_path / 'ckpt'
    resumed_from = launch_and_kill_after_checkpoint(recipe, save_folder, log=tmp_path / 'killed.txt',
                                                    at_least=SAVE_EVERY)
    assert resumed_from is not None and SAVE_EVERY <= resumed_from < MAX_BATCHES, resumed_from
    done = run_composer(2, recipe, f'save_folder={save_folder}', log=tmp_path / 'resumed.txt')
    text = (tmp_path / 'resumed.txt').read_text()
    assert done.returncode == 0, text[-4000:]
    assert f'starts at batch {resumed_from} of {MAX_BATCHES}ba' in text

    ours, our_weights, our_batch = _fusion_state(save_folder)
    reference, reference_weights, reference_batch = _fusion_state(reference_folder)
    assert our_batch == reference_batch == MAX_BATCHES
    assert ours['step'] == reference['step'] == MAX_BATCHES
    assert ours['lam'] == reference['lam'] and ours['lam'] > 0  # the same multiplier, bit for bit
    # The whole trajectory (fusion loss, lambda, margin per batch) matches, including the batches before the kill.
    assert ours['history'] == reference['history'] and len(ours['history']) == MAX_BATCHES
    omegas = [name for name in reference_weights if name.endswith('.omega')]
    assert len(omegas) == 4
    for name, tensor in reference_weights.items():
        assert torch.equal(our_weights[name], tensor), f'{name} differs after resume'
