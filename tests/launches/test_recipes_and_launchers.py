"""Shipped recipes pass the config checks; the launchers derive the right composer flags."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from dha_train.config import ConfigError, load_config
from helpers import REPO

RECIPES = sorted((REPO / 'yamls').rglob('*.yaml'))
PLACEHOLDERS = ['variables.model_path=/m', 'variables.data_root=/d', 'variables.save_root=/s',
                'variables.out=/o', 'variables.run_dir=/r', 'variables.teacher_path=/t', 'variables.tokenizer=/k', 'variables.head_map=/h',
                'variables.source_path=/p']


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


@pytest.mark.parametrize('model', ['llama2-7b', 'sheared-llama-2.7b', 'sheared-llama-1.3b', 'tiny'])
def test_dha_recipes_build_their_components_and_follow_table_4(model, tmp_path):
    import dha_train.algorithms  # noqa: F401  (registers the algorithms)
    import dha_train.callbacks  # noqa: F401  (registers the callbacks)
    from dha_train import registry
    from dha_train.algorithms.head_fusion import HeadFusion
    from dha_train.callbacks.head_search import HeadSearch
    from dha_train.models.head_map import HeadMap

    placeholders = [f'variables.save_root={tmp_path}' if o.startswith('variables.save_root') else o
                    for o in PLACEHOLDERS]
    stages = {stage: load_config(REPO / 'yamls/dha' / model / f'{stage}.yaml',
                                 placeholders[1:3] if stage == 'ct' else placeholders[:3])  # CT reads the Fusion's
              for stage in ('search', 'fusion', 'ct')}
    # The Fusion reads the Search's head map when it is built, as it does when its stage starts.
    searched = Path(stages['search'].save_folder) / 'search' / 'head_map.json'
    searched.parent.mkdir(parents=True)
    HeadMap.gqa(2, 4, 2, 16).save(searched)
    search = registry.callbacks.build_all(stages['search'].callbacks)
    assert any(isinstance(c, HeadSearch) and c.kv_budget == 0.25 for c in search)
    (warmup,) = registry.algorithms.build_all(stages['search'].algorithms)
    assert warmup.warmup_groups == 1 and not warmup.stop_at_threshold
    (fusion,) = registry.algorithms.build_all(stages['fusion'].algorithms)
    assert isinstance(fusion, HeadFusion) and fusion.omega_lr == 0.05 and fusion.threshold == 1e-3
    # Each stage reads the previous stage's output under the same save_root and name.
    assert fusion.head_map_path == str(Path(stages['search'].save_folder) / 'search' / 'head_map.json')
    assert stages['ct'].model.pretrained_path == str(Path(stages['fusion'].save_folder) / 'hf')
    if model != 'tiny':  # Table 4: fusion 0.2B tokens in 262K-token batches, CT 5B in 1M; lr 1e-4; seq 4096
        assert fusion.lambda_lr == 0.05
        assert stages['fusion'].global_train_batch_size == 64 and stages['fusion'].max_duration == '800ba'
        assert stages['ct'].global_train_batch_size == 256 and stages['ct'].max_duration == '5000ba'
        assert stages['fusion'].optimizer.lr == stages['ct'].optimizer.lr == 1e-4
        assert stages['fusion'].scheduler.t_warmup == '80ba' and stages['ct'].scheduler.t_warmup == '150ba'
        assert all(s.fsdp.enabled and s.autoresume and 'wandb' in s.loggers for s in stages.values())


@pytest.mark.parametrize('model', ['llama2-7b', 'sheared-llama-1.3b', 'tiny'])
def test_aligned_gqa_recipes_build_and_follow_the_paper(model, tmp_path):
    import dha_train.algorithms  # noqa: F401  (registers the algorithms)
    import dha_train.callbacks  # noqa: F401  (registers the callbacks)
    from dha_train import registry
    from dha_train.algorithms.distillation import Distillation
    from dha_train.algorithms.kv_head_transfer import KVHeadTransfer

    (tmp_path / 'config.json').write_text('{}')  # a teacher folder to point at
    config = load_config(REPO / 'yamls/aligned_gqa' / model / 'prune.yaml',
                         ['variables.data_root=/d', 'variables.save_root=/s', f'variables.teacher_path={tmp_path}'])
    transfer, distill = registry.algorithms.build_all(config.algorithms)
    assert isinstance(transfer, KVHeadTransfer) and isinstance(distill, Distillation)
    assert (transfer.warmup_fraction, transfer.freeze_fraction) == (0.3, 0.8) and distill.top_k == 16
    assert config.model.pretrained_path == f'/s/{config.variables["name"]}-aligned'
    assert config.save_folder == f'/s/{config.variables["name"]}-prune'
    if model != 'tiny':  # seed 001 section 4.1 and App. A Table 3
        assert transfer.mask_lr == 1e-2 and config.optimizer.lr == 1e-5 and config.scheduler.alpha_f == 0.0
        assert config.global_train_batch_size == 64 and config.scheduler.t_warmup == '32ba'
        assert distill.lm_weight == 0.0 and config.fsdp.enabled and config.autoresume


@pytest.mark.parametrize('script, recipes, model, last, message', [
    ('dha_pipeline.sh', 'yamls/dha/tiny', 'm', '25', 'kv_budget must be a fraction'),
    ('dha_pipeline.sh', 'yamls/dha/tiny', 'x', '0.25', 'not a HF model folder'),
    ('aligned_gqa.sh', 'yamls/aligned_gqa/tiny', 'm', 'two', 'num_groups must be a positive integer'),
    ('aligned_gqa.sh', 'yamls/dha/tiny', 'm', '2', 'prune.yaml not found'),
    ('aligned_gqa.sh', 'yamls/aligned_gqa/tiny', 'x', '2', 'not a HF model folder'),
])
def test_chain_launchers_refuse_bad_arguments_before_running_anything(tmp_path, script, recipes, model, last,
                                                                      message):
    (tmp_path / 'm').mkdir()
    (tmp_path / 'm' / 'config.json').write_text('{}')
    env = {**os.environ, 'COMPOSER': 'false', 'DHA_TRAIN': 'false'}  # any stage that did start would fail
    done = subprocess.run(['bash', f'launch/{script}', str(tmp_path / model), recipes, 'd', 's', last], env=env,
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize('model,nproc,recipe,message', [
    ('x', '2', 'yamls/moh/tiny/continue.yaml', 'not a HF model folder'),
    ('m', '2', 'yamls/moh/tiny/none.yaml', 'not found'),
    ('m', 'two', 'yamls/moh/tiny/continue.yaml', 'nproc must be a positive integer'),
])
def test_moh_launcher_refuses_bad_arguments_before_running_anything(tmp_path, model, nproc, recipe, message):
    (tmp_path / 'm').mkdir()
    (tmp_path / 'm' / 'config.json').write_text('{}')
    env = {**os.environ, 'COMPOSER': 'false', 'DHA_TRAIN': 'false'}
    done = subprocess.run(['bash', 'launch/moh.sh', str(tmp_path / model), 'd', 's', nproc, recipe], env=env,
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr, done.stderr
