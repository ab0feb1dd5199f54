"""Config checking: bad keys, types, values and paths fail early with a message that names them."""

from __future__ import annotations

import pytest

from dha_train.config import ConfigError, load_config
from helpers import tiny_recipe, write_recipe


@pytest.fixture
def recipe(tmp_path):
    return tiny_recipe(tmp_path / 'data', tmp_path / 'tok')


def test_valid_recipe_resolves_variables_and_overrides(recipe, tmp_path):
    path = write_recipe(tmp_path / 'r.yaml', recipe)
    config = load_config(path, ['optimizer.lr=0.5', 'variables.data_root=/elsewhere', 'fsdp.enabled=true'])
    assert config.optimizer.lr == 0.5
    assert config.train_loader.root == '/elsewhere'  # interpolated from variables after the override
    assert config.fsdp is not None and config.fsdp.state_dict_type == 'sharded'
    assert config.train_loader.streams['github'].proportion == 0.6


@pytest.mark.parametrize('mutate, message', [
    (lambda r: r.update(max_durration='5ba'), "unknown config key 'max_durration'; did you mean 'max_duration'?"),
    (lambda r: r['optimizer'].update(learning_rate=1.0), "unknown config key 'optimizer.learning_rate'"),
    (lambda r: r['model']['config'].update(hiden_size=8), "unknown config key 'model.config.hiden_size'; did you mean 'hidden_size'?"),
    (lambda r: r['train_loader']['streams'].update(wikipedai={}), "did you mean 'wikipedia'?"),
    (lambda r: r.update(global_train_batch_size='eight'), "global_train_batch_size: must be int, got str 'eight'"),
    (lambda r: r['optimizer'].update(lr=[1]), 'optimizer.lr: must be float'),
    (lambda r: r.pop('max_duration'), 'max_duration: missing required value'),
    (lambda r: r.update(max_duration='5 bananas'), "max_duration: '5 bananas' is not a Composer time string"),
    (lambda r: r.update(autoresume=True), 'autoresume needs both save_folder and run_name'),
    (lambda r: r['optimizer'].update(lr=2e-5, weight_decay=0.1),
     "optimizer.weight_decay=0.1: decoupled_adamw shrinks every weight by weight_decay x (lr / peak lr) each step "
     "(10% per step at the peak here), so it must be in [0, 0.001]. For torch AdamW's weight decay 0.1 at lr 2e-05, "
     "use 2e-06"),
    (lambda r: r.update(algorithms={'attention_transfer': {'source_path': 'src'}, 'distillation': {'teacher_path': 't'}}),
     "algorithms: attention_transfer and distillation each set the LM loss's weight (lm_weight), so together they "
     'would weight it -1'),
    (lambda r: r.update(callbacks={'speed_monitor': {'window': 3}}), None),
])
def test_bad_config_is_named(recipe, mutate, message):
    mutate(recipe)
    if message is None:  # registry kwargs are checked when the component is built
        from dha_train import registry

        config = load_config(recipe)
        with pytest.raises(ConfigError, match=r"'callbacks.speed_monitor.window'; did you mean 'window_size'"):
            registry.callbacks.build_all(config.callbacks)
        return
    with pytest.raises(ConfigError) as info:
        load_config(recipe)
    assert message in str(info.value)


def test_override_must_be_key_value(recipe):
    with pytest.raises(ConfigError, match='key=value'):
        load_config(recipe, ['optimizer.lr'])


def test_missing_data_folder_is_reported_by_the_cli(recipe, tmp_path, capsys, tokenizer_dir):
    from dha_train.cli import main

    recipe['model']['tokenizer'] = str(tokenizer_dir)
    path = write_recipe(tmp_path / 'r.yaml', recipe)
    assert main(['train', str(path)]) == 2
    err = capsys.readouterr().err
    assert f"train_loader.root: data folder '{tmp_path / 'data'}' does not exist" in err


def test_missing_domain_split_names_what_exists(recipe, data_root, tokenizer_dir):
    from dha_train.data.loaders import build_train_dataloader

    recipe['variables']['data_root'] = str(data_root)
    recipe['train_loader']['streams'] = {'arxiv': {}}
    config = load_config(recipe)
    with pytest.raises(ConfigError, match=r"train_loader.streams.arxiv: no MDS index .*\['github', 'wikipedia'\]"):
        build_train_dataloader(config.train_loader, device_batch_size=4, seed=0)


def test_vocab_mismatch_between_data_and_model(recipe, data_root):
    from dha_train.data.loaders import check_data_matches_model

    with pytest.raises(ConfigError, match='384-token vocabulary .* vocab_size=100'):
        check_data_matches_model(str(data_root), vocab_size=100, max_seq_len=64, where='train_loader')
    with pytest.raises(ConfigError, match='samples .* are 64 tokens long'):
        check_data_matches_model(str(data_root), vocab_size=384, max_seq_len=32, where='train_loader')


def test_data_tokenized_with_another_tokenizer_is_refused(data_root, tokenizer_dir, tmp_path):
    from dha_train.data.loaders import check_data_matches_model
    from dha_train.data.tokenizer import load_tokenizer, train_byte_level_bpe

    same = load_tokenizer(tokenizer_dir)
    check_data_matches_model(str(data_root), vocab_size=384, max_seq_len=64, where='train_loader', tokenizer=same)
    other = train_byte_level_bpe(['completely different text ' * 50, 'zebra quartz'] * 20, tmp_path / 'tok', 300)
    with pytest.raises(ConfigError, match="token ids differ from the model's tokenizer"):
        check_data_matches_model(str(data_root), vocab_size=384, max_seq_len=64, where='train_loader',
                                 tokenizer=other)
