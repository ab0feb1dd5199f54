"""Strict registration: a misspelt key or a bad value of one of our algorithms in a recipe is one line on stderr and
exit 2, raised before any process group, data loader or model exists."""

from __future__ import annotations

import subprocess
import sys

import pytest

import dha_train.train
from dha_train import registry
from dha_train.cli import main
from dha_train.config import ConfigError
from helpers import REPO, tiny_recipe, write_recipe

MISSPELT = [
    ('head_fusion', {'warmup_groups': 1, 'lamda_lr': 0.1}, 'lamda_lr', 'lambda_lr'),
    ('kv_head_transfer', {'num_groups': 2, 'mask_rl': 0.01}, 'mask_rl', 'mask_lr'),
    ('distillation', {'teacher_path': 'TEACHER', 'kl_wieght': 1.0}, 'kl_wieght', 'kl_weight'),
]


@pytest.fixture
def nothing_heavy_starts(monkeypatch):
    """Fail the test if the run gets as far as the process group or the data loaders (an AssertionError is no
    DhaTrainError: it escapes ``main``)."""
    def must_not_run(*args, **kwargs):
        raise AssertionError('the run went past its component checks')

    monkeypatch.setattr(dha_train.train.dist, 'initialize_dist', must_not_run)
    monkeypatch.setattr(dha_train.train, 'build_train_dataloader', must_not_run)


def _teacher(tmp_path):
    folder = tmp_path / 'teacher'
    folder.mkdir()
    (folder / 'config.json').write_text('{}')  # distillation checks the folder when built, loads it at FIT_START
    return str(folder)


@pytest.mark.parametrize('name, kwargs, key, closest', MISSPELT, ids=[m[0] for m in MISSPELT])
def test_misspelt_algorithm_key_is_one_line_and_exit_2_before_any_process_group(
        name, kwargs, key, closest, tmp_path, data_root, tokenizer_dir, capsys, nothing_heavy_starts):
    kwargs = {k: (_teacher(tmp_path) if v == 'TEACHER' else v) for k, v in kwargs.items()}
    recipe = write_recipe(tmp_path / 'r.yaml', tiny_recipe(data_root, tokenizer_dir, algorithms={name: kwargs}))
    assert main(['train', str(recipe)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"'algorithms.{name}.{key}'" in lines[0] and f"did you mean '{closest}'" in lines[0]


@pytest.mark.parametrize('name, kwargs, message', [
    ('head_fusion', {'warmup_groups': 1, 'omega_lr': -0.05}, 'omega_lr must be > 0'),
    ('head_fusion', {'head_map': 'no/such/head_map.json'}, 'head map file not found: no/such/head_map.json'),
    ('kv_head_transfer', {'num_groups': 2, 'warmup_fraction': 0.9, 'freeze_fraction': 0.5}, 'warmup_fraction'),
    ('distillation', {'teacher_path': 'no/such/teacher'}, 'teacher_path no/such/teacher'),
])
def test_bad_algorithm_value_is_a_config_error_naming_it(name, kwargs, message, tmp_path, data_root, tokenizer_dir,
                                                         capsys, nothing_heavy_starts):
    with pytest.raises(ConfigError, match=f'algorithms.{name}: .*{message}'):
        registry.algorithms.build(name, kwargs)
    recipe = write_recipe(tmp_path / 'r.yaml', tiny_recipe(data_root, tokenizer_dir, algorithms={name: kwargs}))
    assert main(['train', str(recipe)]) == 2
    assert message in capsys.readouterr().err


def test_a_composer_callback_key_is_checked_too():
    with pytest.raises(ConfigError, match=r"'callbacks.speed_monitor.windo'; did you mean 'window_size'"):
        registry.callbacks.build('speed_monitor', {'windo': 3})


def test_every_registered_component_has_an_explicit_signature():
    for components in (registry.algorithms, registry.callbacks, registry.loggers):
        for name in components.names():
            assert components.accepted(name) is not None  # raises for a **kwargs builder


@pytest.mark.slow
def test_the_composer_entry_point_prints_one_line_and_exits_2(tmp_path, data_root, tokenizer_dir):
    recipe = write_recipe(tmp_path / 'r.yaml', tiny_recipe(data_root, tokenizer_dir,
                                                            algorithms={'head_fusion': {'lamda_lr': 0.1}}))
    done = subprocess.run([sys.executable, '-m', 'dha_train.train', str(recipe)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert 'Traceback' not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("dha-train: error: unknown config key "
                                                            "'algorithms.head_fusion.lamda_lr'")
