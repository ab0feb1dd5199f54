"""Healing a DeepSeek-format MLA export (`convert --method mla --format deepseek`) with launch/heal.sh: no refit stage
(the conversion fits kv_b_proj in closed form, and `refit` says so), then attention transfer and KL distillation as
real 2-process FSDP2 runs of transformers' own DeepseekV3ForCausalLM; the healed folder is still that class."""

from __future__ import annotations

import subprocess

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dha_train.cli import main
from dha_train.model_card import read_model_card
from helpers import REPO, launcher_env, logged, save_tiny_llama

STEPS = 6


@pytest.fixture(scope='module')
def deepseek_export(tmp_path_factory, tokenizer_dir, data_root):
    """(a tiny GQA source, its DeepSeek-format conversion at a third of the cache)."""
    folder = tmp_path_factory.mktemp('deepseek-heal')
    save_tiny_llama(folder / 'source', tokenizer_dir, seed=4, num_key_value_heads=2, rope_theta=100.0)
    assert main(['convert', str(folder / 'source'), str(folder / 'deepseek'), '--method', 'mla', '--format',
                 'deepseek', '--cache-fraction', '0.3333', '--rope-pairs', '1', '--data', str(data_root),
                 '--tokens', '512', '--batch-size', '4']) == 0
    return folder / 'source', folder / 'deepseek'


def test_refit_names_the_conversion_as_the_refit_of_a_deepseek_folder(deepseek_export, data_root, tmp_path, capsys):
    source, converted = deepseek_export
    before = {path.name: path.read_bytes() for path in converted.iterdir()}
    assert main(['refit', str(source), str(converted), str(tmp_path / 'out'), '--data', str(data_root)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and 'Traceback' not in error
    assert 'DeepSeek-format' in error and 'kv_b_proj' in error and 'attention transfer' in error
    assert not (tmp_path / 'out').exists()
    assert {path.name: path.read_bytes() for path in converted.iterdir()} == before


def test_heal_sh_refuses_refit_options_for_a_deepseek_folder_before_any_run(deepseek_export, data_root, tmp_path):
    source, converted = deepseek_export
    done = subprocess.run(['bash', str(REPO / 'launch' / 'heal.sh'), str(source), str(converted), str(data_root),
                           str(tmp_path / 'heal'), '2'], capture_output=True, text=True, cwd=REPO, timeout=60,
                          env=launcher_env(REFIT_ARGS='--tokens 65536'))
    assert done.returncode == 2 and 'REFIT_ARGS does not apply' in done.stderr, done.stdout + done.stderr
    assert not (tmp_path / 'heal').exists()


def test_a_deepseek_folder_trains_at_an_eps_that_scales_its_latent_like_its_other_rows_and_exports_back(
        deepseek_export):
    """The conversion's latent sits in the norm's linear range, rows thousands of times smaller than the RoPE rows
    (an Adam step would throw it out of that range). The run's model is the same function with the latent rows at
    the RoPE rows' RMS and the latent norm at the matching eps; a rank on the meta device sets the same eps from the
    folder; the export gives back the folder's weights and a config without the training eps."""
    from dha_train.builders import build_model
    from dha_train.config import ModelConfig
    from dha_train.methods import LATENT_TRAINING_EPS, METHOD_TAG, export_model

    _, converted = deepseek_export
    folder_model = AutoModelForCausalLM.from_pretrained(converted, torch_dtype=torch.float32).eval()
    model = build_model(ModelConfig(pretrained_path=str(converted))).eval()
    meta = build_model(ModelConfig(pretrained_path=str(converted)), on_meta_device=True)
    rank = model.config.kv_lora_rank
    for before, layer in zip(folder_model.model.layers, model.model.layers):
        start, trained = before.self_attn.kv_a_proj_with_mqa.weight, layer.self_attn.kv_a_proj_with_mqa.weight
        assert start[:rank].pow(2).mean().sqrt() < 1e-2 * start[rank:].pow(2).mean().sqrt()  # the linear range
        torch.testing.assert_close(trained[:rank].pow(2).mean().sqrt(), trained[rank:].pow(2).mean().sqrt())
        assert torch.equal(trained[rank:], start[rank:])
    assert getattr(meta.config, LATENT_TRAINING_EPS) == getattr(model.config, LATENT_TRAINING_EPS)
    assert [layer.self_attn.kv_a_layernorm.variance_epsilon for layer in meta.model.layers] == getattr(
        model.config, LATENT_TRAINING_EPS)
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, folder_model(ids).logits, rtol=1e-4, atol=1e-4)
    config, weights = export_model(model.config, model.state_dict())
    assert not hasattr(config, LATENT_TRAINING_EPS) and not hasattr(config, METHOD_TAG)
    for name, tensor in load_file(converted / 'model.safetensors').items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-6, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.slow
def test_heal_sh_trains_a_deepseek_export_from_transfer_with_two_processes(deepseek_export, data_root, tmp_path):
    source, converted = deepseek_export
    heal = ['bash', str(REPO / 'launch' / 'heal.sh'), str(source), str(converted), str(data_root),
            str(tmp_path / 'heal'), '2', str(REPO / 'yamls' / 'healing' / 'tiny_transfer.yaml'),
            str(REPO / 'yamls' / 'healing' / 'tiny_kl.yaml'), f'variables.steps={STEPS}ba', 'save_interval=3ba',
            'global_train_batch_size=8', 'device_train_microbatch_size=4', 'console_log_interval=1ba']
    done = subprocess.run(heal, capture_output=True, text=True, env=launcher_env(HEAL_NAME='ds'), cwd=REPO,
                          timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert 'no refit stage' in done.stdout and not (tmp_path / 'heal' / 'ds-refit').exists()
    mse = logged(log, 'Train transfer/mse')
    assert len(mse) == STEPS and mse[-1] < mse[0], mse
    kl = logged(log, 'Train distill/kl')
    assert len(kl) == STEPS, log[-3000:]

    healed = tmp_path / 'heal' / 'ds-kl-hf'
    assert done.stdout.strip().endswith(f'heal: {healed}')
    assert not list(healed.glob('*.py'))  # still transformers' own class, no code in the folder
    model = AutoModelForCausalLM.from_pretrained(healed, torch_dtype=torch.float32).eval()
    assert type(model).__name__ == 'DeepseekV3ForCausalLM'
    before, after = load_file(converted / 'model.safetensors'), load_file(healed / 'model.safetensors')
    assert before.keys() == after.keys()
    trained = {name for name, tensor in before.items() if not torch.equal(tensor, after[name])}
    assert any('kv_a_proj_with_mqa' in name for name in trained) and any('kv_b_proj' in name for name in trained)
    block = read_model_card(healed)[0]['dha_train']
    assert block['method'] == 'mla_deepseek' and block['stages'][0]['step'].startswith('convert')
    ids = torch.randint(0, 384, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
