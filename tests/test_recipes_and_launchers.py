"""Shipped recipes pass the config checks; the launchers derive the right composer flags."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from dha_train.config import ConfigError, load_config

RECIPES = sorted((REPO / 'yamls').rglob('*.yaml'))
PLACEHOLDERS = ['variables.model_path=/m', 'variables.data_root=/d', 'variables.save_root=/s',
                'variables.out=/o', 'variables.run_dir=/r']


@pytest.mark.parametrize('recipe', RECIPES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_recipe_is_valid(recipe):
    overrides = [o for o in PLACEHOLDERS if o.split('=')[0].split('.')[1] in recipe.read_text()]
    config = load_config(recipe, overrides)
    assert config.global_train_batch_size % config.device_train_microbatch_size == 0


def test_7b_recipe_matches_the_issue():
    config = load_config(REPO / 'yamls/pretrain/llama2_7b_cpt.yaml', PLACEHOLDERS[:3])
    assert config.fsdp.enabled and config.fsdp.state_dict_type == 'sharded'
    assert config.global_train_batch_size == 256 and config.autoresume
    assert config.model.activation_checkpointing and config.model.attn_implementation in ('sdpa', 'flash_attention_2')
    assert 'wandb' in config.loggers


def test_7b_recipe_names_its_missing_variables():
    with pytest.raises(ConfigError, match='variables.model_path'):
        load_config(REPO / 'yamls/pretrain/llama2_7b_cpt.yaml')


def test_slurm_launcher_derives_composer_flags(tmp_path):
    # A stand-in `scontrol`, exported as a bash function (no executable file to race on).
    env = {**os.environ, 'BASH_FUNC_scontrol%%': '() { printf "gpu-node-07\\ngpu-node-08\\ngpu-node-09\\n"; }',
           'COMPOSER': 'printf %s\\n',
           'SLURM_JOB_NODELIST': 'gpu-node-[07-09]', 'SLURM_JOB_NUM_NODES': '3', 'SLURM_NODEID': '2',
           'SLURM_JOB_ID': '123456', 'GPUS_PER_NODE': '8'}
    env.pop('MASTER_ADDR', None)
    env.pop('MASTER_PORT', None)
    out = subprocess.run(['bash', 'launch/slurm_node.sh', 'r.yaml', 'seed=3'], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ['--world_size', '24', '--node_rank', '2', '--master_addr', 'gpu-node-07', '--master_port',
                   str(20000 + 123456 % 20000), '-n', '8', '-m', 'dha_train.train', 'r.yaml', 'seed=3']


def test_single_node_launcher_uses_nproc(tmp_path):
    env = {**os.environ, 'COMPOSER': 'printf %s\\n', 'NPROC': '8'}
    out = subprocess.run(['bash', 'launch/single_node.sh', 'r.yaml'], env=env, cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ['-n', '8', '-m', 'dha_train.train', 'r.yaml']
