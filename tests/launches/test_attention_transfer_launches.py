"""`attention_transfer` in real 2-process FSDP2 runs (gloo): the layer-wise MSE goes down, a run resumed from a
mid-run checkpoint ends with the same weights as an uninterrupted one, and the export is the converted model alone. The
healing chain (launch/heal.sh) runs on the quickstart teacher in tests/commands/test_quickstart.py."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.export import export_hf
from dha_train.models.head_map import HeadMap
from helpers import REPO, logged, run_composer, save_tiny_llama, stopped_after

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
RECIPE = REPO / 'yamls' / 'healing' / 'tiny_transfer.yaml'
BATCHES = 8


def _overrides(models, data_root, save_root):
    return [f'variables.model_path={models / "gqa"}', f'variables.source_path={models / "source"}',
            f'variables.data_root={data_root}', f'variables.save_root={save_root}', f'variables.steps={BATCHES}ba',
            'save_interval=4ba', 'global_train_batch_size=8', 'device_train_microbatch_size=4',
            'console_log_interval=1ba', 'run_name=transfer']


@pytest.fixture(scope='module')
def models(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp('transfer-models')
    save_tiny_llama(folder / 'source', tokenizer_dir, seed=3)
    source_map = HeadMap.from_hf_config(AutoConfig.from_pretrained(folder / 'source'))
    convert_checkpoint(folder / 'source', folder / 'gqa', HeadMap.pooled(source_map, 2))
    return folder


@pytest.fixture(scope='module')
def uninterrupted(models, data_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('transfer-run')
    done = run_composer(2, RECIPE, *_overrides(models, data_root, tmp), log=tmp / 'log.txt')
    log = (tmp / 'log.txt').read_text()
    assert done.returncode == 0, log[-4000:]
    return tmp, log


def test_two_process_transfer_lowers_the_layerwise_mse_and_exports_the_converted_class(uninterrupted, models,
                                                                                       tmp_path):
    save_root, log = uninterrupted
    mse = logged(log, 'Train transfer/mse')
    assert len(mse) == BATCHES, log[-3000:]
    assert mse[-1] < 0.8 * mse[0]
    for layer in range(2):
        assert f'transfer/layer{layer}/mse' in log
    exported = export_hf(save_root / 'transfer', tmp_path / 'hf')
    weights = load_file(exported / 'model.safetensors')
    assert not [name for name in weights if 'transfer' in name]
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert type(model).__name__ == 'LlamaForCausalLM' and model.config.num_key_value_heads == 2
    start = load_file(models / 'gqa' / 'model.safetensors')
    # only the converted attention trained
    for name, tensor in weights.items():
        changed = not torch.equal(tensor, start[name])
        assert changed == ('self_attn' in name), name


def test_resumed_mid_run_it_ends_with_the_uninterrupted_weights(uninterrupted, models, data_root, tmp_path):
    """Resumed from the uninterrupted run's batch-4 checkpoint (its folder as a run killed after that save leaves it;
    SIGKILL itself is rehearsed in test_distributed.py), the transfer ends with the same weights bit for bit."""
    reference_root, _ = uninterrupted
    overrides = _overrides(models, data_root, tmp_path)
    stopped_after(reference_root / 'transfer', 4, into=tmp_path / 'transfer')
    done = run_composer(2, RECIPE, *overrides, log=tmp_path / 'b.txt')
    assert done.returncode == 0, (tmp_path / 'b.txt').read_text()[-4000:]
    assert f'starts at batch 4 of {BATCHES}ba' in (tmp_path / 'b.txt').read_text()
    ours = load_file(export_hf(tmp_path / 'transfer', tmp_path / 'resumed') / 'model.safetensors')
    reference = load_file(export_hf(reference_root / 'transfer', tmp_path / 'reference') / 'model.safetensors')
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), f'{name} differs after resume'
    shutil.rmtree(tmp_path / 'transfer')

