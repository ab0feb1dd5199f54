"""A run's own files cannot act (issue 59): `train` writes dha_train_config.json and dha_train_run.json as it writes
checkpoints (a link at the name is replaced, never written through), keeps what ``${oc.env:NAME}`` gave out of the
saved config and the logs, `export` follows a run record's start only beside its save folder or when the command
line names it, and a checkpoint timestamp that is not a whole number is refused in one line.

One 1-batch `dha-train train` (the module's fixture) serves every case; each case runs the command a user would run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from dha_train.checkpoints import LATEST, torch_load
from dha_train.model_card import CARD_FILE, RUN_RECORD
from helpers import refused_in_one_line, tiny_recipe, write_recipe

SECRET = 'marker-secret-123'
VICTIM = b'a file outside the save folder, which no run may write\n'
CONFIG_FILE = 'dha_train_config.json'
CHECKPOINT = 'ep0-ba1-rank0.pt'


@pytest.fixture(scope='module')
def run(tmp_path_factory, data_root, tokenizer_dir) -> dict:
    """`dha-train train` for one batch into a save folder where dha_train_config.json and dha_train_run.json are links
    to files outside it, with a recipe that takes a value from ``${oc.env:DHA_SECRET}`` (and a variable built on it),
    and W&B logging offline into the save folder."""
    from dha_train.cli import main

    root = tmp_path_factory.mktemp('run_files')
    victims = root / 'victims'
    victims.mkdir()
    save = root / 'runs' / 'ckpt'
    save.mkdir(parents=True)
    for name in (CONFIG_FILE, RUN_RECORD):
        (victims / name).write_bytes(VICTIM)
        (save / name).symlink_to(victims / name)
    recipe = write_recipe(root / 'recipe.yaml', tiny_recipe(
        data_root, tokenizer_dir, max_duration='1ba', save_interval='1ba', save_folder=str(save),
        device_train_microbatch_size=8, run_name='run-files',
        variables={'data_root': str(data_root), 'hub_token': '${oc.env:DHA_SECRET}',
                   'note': 'token ${variables.hub_token} here'},
        loggers={'wandb': {'project': 'dha-tests', 'mode': 'offline', 'dir': str(save)}}))
    before = os.environ.get('DHA_SECRET')
    os.environ['DHA_SECRET'] = SECRET
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(['train', str(recipe)])
    finally:
        if before is None:
            os.environ.pop('DHA_SECRET')
        else:
            os.environ['DHA_SECRET'] = before
    assert status == 0, err.getvalue()[-3000:]
    return {'root': root, 'save': save, 'victims': victims, 'recipe': recipe, 'output': out.getvalue() + err.getvalue()}


def test_train_replaces_links_at_its_own_files_and_leaves_what_they_name(run):
    save = run['save']
    for name in (CONFIG_FILE, RUN_RECORD):
        assert (run['victims'] / name).read_bytes() == VICTIM, name
        assert (save / name).is_file() and not (save / name).is_symlink(), name
    assert json.loads((save / CONFIG_FILE).read_text())['run_name'] == 'run-files'
    assert json.loads((save / RUN_RECORD).read_text())['run_name'] == 'run-files'
    assert sorted(p.name for p in run['victims'].iterdir()) == sorted([CONFIG_FILE, RUN_RECORD])
    assert not [p.name for p in save.iterdir() if p.name.startswith('.')]  # no temporary file left


def test_an_environment_value_is_used_but_kept_out_of_the_saved_config_and_the_logs(run, monkeypatch):
    from dha_train.config import load_config

    save = run['save']
    saved = json.loads((save / CONFIG_FILE).read_text())
    assert saved['variables']['hub_token'] == '${oc.env:DHA_SECRET}'  # shown as written, in every value it went into
    assert saved['variables']['note'] == 'token ${oc.env:DHA_SECRET} here'
    logged = list(save.glob('wandb/offline-run-*/run-*.wandb'))  # W&B's offline record, hyperparameters included
    assert len(logged) == 1 and b'${oc.env:DHA_SECRET}' in logged[0].read_bytes()
    leaking = [str(p) for p in save.rglob('*') if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaking == []
    assert SECRET not in run['output'] and 'hub_token' in run['output']  # the console's copy of the config
    monkeypatch.setenv('DHA_SECRET', SECRET)
    assert load_config(run['recipe']).variables['hub_token'] == SECRET  # what the run itself uses


def _card(folder: Path) -> tuple[dict, str]:
    text = (folder / CARD_FILE).read_text()
    return yaml.safe_load(text[4:].partition('\n---\n')[0]), text


def _model_folder(folder: Path, licence: str, base_model: str, step: str) -> Path:
    """A model folder of the project's, known only by its card (what an export reads of the start folder)."""
    folder.mkdir(parents=True)
    header = {'base_model': base_model, 'license': licence, 'dha_train': {'stages': [{'step': step, 'tokens': 1}]}}
    (folder / CARD_FILE).write_text('---\n' + yaml.safe_dump(header) + '---\n')
    return folder


def _downloaded_run(run: dict, folder: Path, start: Path) -> Path:
    """The run's checkpoint in a save folder of its own, with a run record naming ``start``."""
    folder.mkdir(parents=True)
    shutil.copy(run['save'] / CHECKPOINT, folder / CHECKPOINT)
    (folder / LATEST).symlink_to(CHECKPOINT)
    (folder / RUN_RECORD).write_text(json.dumps({'run_name': 'run-files', 'recipe': 'recipe.yaml',
                                                 'start': str(start)}))
    return folder


def test_a_run_record_naming_a_folder_elsewhere_does_not_reach_the_exported_card(run, tmp_path, capfd):
    from dha_train.cli import main

    elsewhere = _model_folder(tmp_path / 'elsewhere' / 'private', 'private-licence-xyz', 'private/base-model',
                              'a private stage')
    checkpoint = _downloaded_run(run, tmp_path / 'download' / 'ckpt', elsewhere)
    capfd.readouterr()
    assert main(['export', str(checkpoint), str(tmp_path / 'hf')]) == 0
    _, err = capfd.readouterr()
    _, text = _card(tmp_path / 'hf')
    for planted in ('private-licence-xyz', 'private/base-model', 'a private stage'):
        assert planted not in text
    warnings = [line for line in err.splitlines() if 'warning' in line]
    assert len(warnings) == 1 and str(checkpoint / RUN_RECORD) in warnings[0] and str(elsewhere) in warnings[0]


def test_a_start_beside_the_save_folder_or_named_on_the_command_line_is_carried(run, tmp_path, capfd):
    from dha_train.cli import main

    beside = _model_folder(tmp_path / 'runs' / 'init', 'beside-licence', 'beside/base', 'convert: beside')
    checkpoint = _downloaded_run(run, tmp_path / 'runs' / 'ckpt', beside)
    assert main(['export', str(checkpoint), str(tmp_path / 'hf')]) == 0
    header, _ = _card(tmp_path / 'hf')
    assert header['license'] == 'beside-licence' and header['base_model'] == 'beside/base'
    assert [stage['step'] for stage in header['dha_train']['stages']][0] == 'convert: beside'

    named = _model_folder(tmp_path / 'models' / 'source', 'named-licence', 'named/base', 'convert: named')
    assert main(['export', str(checkpoint), str(tmp_path / 'hf-named'), '--start', str(named)]) == 0
    header, _ = _card(tmp_path / 'hf-named')
    assert header['license'] == 'named-licence' and header['base_model'] == 'named/base'
    assert 'warning' not in capfd.readouterr().err


def test_a_checkpoint_whose_timestamp_token_is_not_a_number_is_refused_in_one_line(run, tmp_path, capfd,
                                                                                   monkeypatch):
    state = torch_load(run['save'] / CHECKPOINT)
    state['state']['timestamp']['Timestamp']['token'] = 'lots'
    bad = tmp_path / 'bad'
    bad.mkdir()
    torch.save(state, bad / CHECKPOINT)
    message = refused_in_one_line(['export', str(bad / CHECKPOINT), str(tmp_path / 'hf')], tmp_path, capfd)
    assert str(bad / CHECKPOINT) in message and "timestamp's token is 'lots'" in message

    # training from it is refused before anything is built, and its save folder is not made
    monkeypatch.setenv('DHA_SECRET', SECRET)
    message = refused_in_one_line(['train', str(run['recipe']), f'load_path={bad / CHECKPOINT}',
                                   f'save_folder={tmp_path / "resumed"}'], tmp_path, capfd)
    assert str(bad / CHECKPOINT) in message and "timestamp's token is 'lots'" in message
