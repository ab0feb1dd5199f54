"""An 8-rank rehearsal on CPU: a tiny Fusion recipe under real `composer -n 8` FSDP2 launches (gloo), as the shipped
recipes run on 8 GPUs. Stopped after its batch-4 checkpoint, it resumes with 8 ranks exactly (Lagrange multiplier,
fusion history, every weight including the omegas, and the samples of every global batch equal an uninterrupted
8-rank run) and with 4 ranks elastically (the same global batch of 16 as 2 micro-batches of 2 per rank: the same
samples in every global batch, the multiplier and weights equal to fp tolerance).

The stopped run is the uninterrupted run's folder as it stood after that checkpoint (``stopped_after``): the files a
run SIGKILLed there leaves. Killing a launch with SIGKILL mid-run is rehearsed with 2 ranks (test_distributed.py);
here each 8-rank launch costs ~100 CPU-seconds of start-up, so the suite launches 8 ranks twice, not three times."""

from __future__ import annotations

import pytest
import torch

from helpers import (
    RECORDING_ENTRY,
    fusion_recipe,
    global_batches,
    run_composer,
    stopped_after,
    write_recipe,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RANKS = 8
MAX_BATCHES = 12
SAVE_EVERY = 4
GLOBAL_BATCH = 16  # 2 a rank at 8 ranks, 4 a rank (2 micro-batches of 2) at 4


def _fusion_state(save_folder):
    from dha_train.export import load_composer_state, model_weights

    state = load_composer_state(save_folder)
    algorithms = state['state']['algorithms']
    fusion = next(s for _, s in algorithms if isinstance(s, dict) and 'lam' in s)
    return fusion, model_weights(state), int(state['state']['timestamp']['Timestamp']['batch'])


def _launch(nproc: int, recipe, save_folder, samples, log):
    return run_composer(nproc, recipe, f'save_folder={save_folder}', f'callbacks.record_samples_for_tests.out={samples}',
                        log=log, entry=RECORDING_ENTRY, timeout=600)


@pytest.fixture(scope='module')
def rehearsal(tmp_path_factory, data_root, tokenizer_dir):
    """(recipe, the uninterrupted run's folder)."""
    tmp = tmp_path_factory.mktemp('eight_ranks')
    recipe = fusion_recipe(tmp, data_root, tokenizer_dir, max_duration=f'{MAX_BATCHES}ba',
                           global_train_batch_size=GLOBAL_BATCH, device_train_microbatch_size=2,
                           save_interval=f'{SAVE_EVERY}ba', autoresume=True, run_name='rehearsal',
                           fsdp={'enabled': True, 'state_dict_type': 'sharded'},
                           optimizer={'lr': 1.0e-3, 'eps': 1.0e-5},  # see test_distributed: fp-stable elastic runs
                           callbacks={'record_samples_for_tests': {'out': 'set-per-launch'}, 'fusion_monitor': {}})
    recipe['train_loader']['num_workers'] = 0  # 8 ranks on 2 cores: no loader processes besides
    recipe = write_recipe(tmp / 'fusion.yaml', recipe)
    reference = tmp / 'reference'
    reference.mkdir()
    done = _launch(RANKS, recipe, reference / 'ckpt', reference / 'samples', reference / 'log.txt')
    assert done.returncode == 0, (reference / 'log.txt').read_text()[-4000:]
    log = (reference / 'log.txt').read_text()
    assert 'fusion/layer1/value_self_weight' in log and 'fusion/lambda' in log  # the monitor logs on 8 ranks
    return recipe, reference


def _resume(rehearsal, tmp_path, nproc: int):
    recipe, reference = rehearsal
    run = tmp_path / 'run'
    run.mkdir()
    stopped_after(reference / 'ckpt', SAVE_EVERY, into=run / 'ckpt')
    resumed_from = SAVE_EVERY
    done = _launch(nproc, recipe, run / 'ckpt', run / 'samples-resumed', run / 'resumed.txt')
    text = (run / 'resumed.txt').read_text()
    assert done.returncode == 0, text[-4000:]
    assert f'starts at batch {resumed_from} of {MAX_BATCHES}ba' in text
    resumed = global_batches(run / 'samples-resumed')
    assert sorted(resumed) == list(range(resumed_from, MAX_BATCHES))  # no batch before the checkpoint again
    # every global batch after the checkpoint: the same samples as the uninterrupted run's, none twice
    assert resumed == global_batches(reference / 'samples', first=resumed_from)
    assert all(len(batch) == GLOBAL_BATCH for batch in resumed.values())
    return _fusion_state(run / 'ckpt'), _fusion_state(reference / 'ckpt')


def test_eight_ranks_stopped_and_resumed_with_eight_continue_exactly(rehearsal, tmp_path):
    (ours, our_weights, our_batch), (reference, reference_weights, reference_batch) = _resume(rehearsal, tmp_path, 8)
    assert our_batch == reference_batch == MAX_BATCHES
    assert ours['lam'] == reference['lam'] and ours['lam'] > 0
    assert ours['history'] == reference['history'] and len(ours['history']) == MAX_BATCHES
    assert sum(name.endswith('.omega') for name in reference_weights) == 4
    for name, tensor in reference_weights.items():
        assert torch.equal(our_weights[name], tensor), f'{name} differs after an 8-rank resume'


def test_eight_ranks_stopped_and_resumed_with_four_continue_elastically(rehearsal, tmp_path):
    (ours, our_weights, our_batch), (reference, reference_weights, reference_batch) = _resume(rehearsal, tmp_path, 4)
    assert our_batch == reference_batch == MAX_BATCHES and ours['step'] == MAX_BATCHES
    assert ours['lam'] == pytest.approx(reference['lam'], rel=1e-3) and ours['lam'] > 0
    for mine, theirs in zip(ours['history'], reference['history'], strict=True):
        assert mine['fusion_loss'] == pytest.approx(theirs['fusion_loss'], rel=1e-3, abs=1e-6)
    for name, tensor in reference_weights.items():
        assert torch.allclose(our_weights[name], tensor, rtol=1e-3, atol=1e-5), f'{name} after a 4-rank resume'
