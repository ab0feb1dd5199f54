"""Checkpoints: a truncated or foreign file given as load_path, or found by autoresume, is refused by name before
anything is built, the save folder is left byte for byte as it was, and export refuses the same files. Every load of
our own is weights_only."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from dha_train.checkpoints import LATEST, SAFE_GLOBALS, CheckpointError, check_checkpoint, load_composer_state
from dha_train.config import load_config
from helpers import REPO, tiny_recipe, write_recipe


@pytest.fixture(scope='module')
def trained(tmp_path_factory, data_root, tokenizer_dir):
    """A save folder of a real 2-batch run (ep0-ba1-rank0.pt, ep0-ba2-rank0.pt, latest-rank0.pt -> ba2) and the
    trained model's weights."""
    from dha_train.train import close_trainer, train

    folder = tmp_path_factory.mktemp('saved') / 'ckpt'
    trainer = train(load_config(tiny_recipe(data_root, tokenizer_dir, max_duration='2ba', save_interval='1ba',
                                            save_folder=str(folder), run_name='integrity')))
    weights = {key: value.detach().clone() for key, value in trainer.state.model.state_dict().items()}
    close_trainer(trainer)
    assert os.readlink(folder / LATEST) == 'ep0-ba2-rank0.pt'
    return folder, weights


@pytest.fixture
def saved(trained):
    return trained[0]


def _snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a link's target, or a file's size and sha256."""
    entries = {}
    for path in sorted(folder.rglob('*')):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            entries[name] = f'-> {os.readlink(path)}'
        elif path.is_file():
            entries[name] = f'{path.stat().st_size} {hashlib.sha256(path.read_bytes()).hexdigest()}'
    return entries


def _copy(saved: Path, tmp_path: Path) -> Path:
    folder = tmp_path / 'ckpt'
    shutil.copytree(saved, folder, symlinks=True)
    return folder


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _build(data_root, tokenizer_dir, **overrides):
    from dha_train.train import build_trainer

    return build_trainer(load_config(tiny_recipe(data_root, tokenizer_dir, run_name='integrity', **overrides)))


class _Marker:
    """Unpickling this runs ``os.makedirs(path)``: proof of whether anyone unpickled it with plain pickle."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.makedirs, (self.path,)


def _foreign(kind: str, folder: Path) -> tuple[Path, str]:
    """A file named like a checkpoint that is not one, and the message that refuses it."""
    path = folder / 'ep0-ba9-rank0.pt'
    if kind == 'text':
        path.write_text('step 9: loss 2.31\n')
        return path, f'cannot read checkpoint {path} (corrupted or incomplete?): it is not a whole torch.save file'
    if kind == 'plain dict':
        torch.save({'weights': torch.zeros(3)}, path)
        return path, f'{path} is not a Composer checkpoint (no state.model)'
    torch.save({'state': {'model': {}}, 'payload': _Marker(folder / 'pwned')}, path)
    return path, f'{path} holds a os.makedirs object, not one of the types a checkpoint of `dha-train train` holds'


def _refusal(saved, folder, truncated: str, data_root, tokenizer_dir, **settings) -> str:
    """Copy the saved run to ``folder``, truncate one checkpoint, build a trainer on it with ``settings``: the
    CheckpointError's message, after checking that nothing in the folder changed."""
    assert _copy(saved, folder.parent) == folder
    _truncate(folder / truncated)
    before = _snapshot(folder)
    with pytest.raises(CheckpointError) as caught:
        _build(data_root, tokenizer_dir, save_folder=str(folder), **settings)
    assert _snapshot(folder) == before
    return str(caught.value)


def test_truncated_checkpoint_as_load_path_is_refused_and_the_save_folder_kept(saved, tmp_path, data_root,
                                                                              tokenizer_dir):
    folder = tmp_path / 'ckpt'
    message = _refusal(saved, folder, 'ep0-ba1-rank0.pt', data_root, tokenizer_dir,
                       load_path=str(folder / 'ep0-ba1-rank0.pt'))
    assert message.startswith(f'load_path: cannot read checkpoint {folder / "ep0-ba1-rank0.pt"} '
                                        '(corrupted or incomplete?): it is not a whole torch.save file')


def test_truncated_latest_checkpoint_stops_autoresume_and_the_save_folder_is_kept(saved, tmp_path, data_root,
                                                                                 tokenizer_dir):
    folder = tmp_path / 'ckpt'
    message = _refusal(saved, folder, 'ep0-ba2-rank0.pt', data_root, tokenizer_dir, autoresume=True)
    assert message.startswith(f'autoresume: cannot read checkpoint {folder / "ep0-ba2-rank0.pt"} (corrupted or '
                              'incomplete?)')
    assert f'it is what {folder / LATEST} names, and nothing in {folder} was changed' in message


@pytest.mark.parametrize('kind', ['text', 'plain dict', 'pickle with code'])
def test_foreign_file_is_refused_as_load_path_and_by_autoresume(saved, tmp_path, data_root, tokenizer_dir, kind):
    folder = _copy(saved, tmp_path)
    path, expected = _foreign(kind, folder)
    before = _snapshot(folder)
    with pytest.raises(CheckpointError) as caught:
        _build(data_root, tokenizer_dir, save_folder=str(tmp_path / 'new'), load_path=str(path))
    assert str(caught.value).startswith(f'load_path: {expected}')
    assert _snapshot(folder) == before
    (folder / LATEST).unlink()
    (folder / LATEST).symlink_to(path.name)
    before = _snapshot(folder)
    with pytest.raises(CheckpointError) as caught:
        _build(data_root, tokenizer_dir, save_folder=str(folder), autoresume=True)
    assert str(caught.value).startswith(f'autoresume: {expected}')
    assert _snapshot(folder) == before
    assert not (tmp_path / 'new').exists()
    assert not (folder / 'pwned').exists()  # nobody unpickled the payload


def test_dangling_latest_link_is_refused(saved, tmp_path, data_root, tokenizer_dir):
    folder = _copy(saved, tmp_path)
    (folder / 'ep0-ba2-rank0.pt').unlink()
    before = _snapshot(folder)
    with pytest.raises(CheckpointError) as caught:
        _build(data_root, tokenizer_dir, save_folder=str(folder), autoresume=True)
    assert str(caught.value).startswith(f'autoresume: {folder / LATEST} links to ep0-ba2-rank0.pt, which does not '
                                        'exist')
    assert _snapshot(folder) == before


@pytest.mark.parametrize('kind', ['truncated', 'text', 'plain dict', 'pickle with code'])
def test_export_refuses_the_same_files(saved, tmp_path, kind):
    from dha_train.export import export_hf

    folder = _copy(saved, tmp_path)
    if kind == 'truncated':
        path = folder / 'ep0-ba2-rank0.pt'
        _truncate(path)
        expected = f'cannot read checkpoint {path} (corrupted or incomplete?)'
    else:
        path, expected = _foreign(kind, folder)
        (folder / LATEST).unlink()
        (folder / LATEST).symlink_to(path.name)
    for given in (path, folder):  # the file itself, and the save folder whose latest link names it
        with pytest.raises(CheckpointError) as caught:
            export_hf(given, tmp_path / 'hf')
        assert str(caught.value).startswith(expected)
    assert not (tmp_path / 'hf').exists() and not (folder / 'pwned').exists()


def test_a_whole_checkpoint_passes_and_loads_weights_only_with_the_listed_types(trained):
    from torch.serialization import get_unsafe_globals_in_checkpoint

    saved, weights = trained
    latest = saved / 'ep0-ba2-rank0.pt'
    assert check_checkpoint(saved / LATEST) == latest
    allowed = {entry[1] if isinstance(entry, tuple) else f'{entry.__module__}.{entry.__qualname__}'
               for entry in SAFE_GLOBALS}
    needed = set(get_unsafe_globals_in_checkpoint(latest))
    assert needed and needed <= allowed, needed - allowed
    state = load_composer_state(saved)  # weights_only=True, tensors mapped from the file
    assert state['state']['timestamp']['Timestamp']['batch'] == 2
    assert state['state']['model'].keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(state['state']['model'][key], value), key


def test_sharded_folder_with_missing_or_short_shards_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / 'ep0-ba2'
    dcp.save({'state': {'model': {'model.w': torch.arange(1000.0)}}}, checkpoint_id=str(folder), no_dist=True)
    assert check_checkpoint(folder) == folder
    assert torch.equal(load_composer_state(folder)['state']['model']['model.w'], torch.arange(1000.0))
    (shard,) = folder.glob('*.distcp')
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f'its shard file {shard.name} is 100 bytes but .metadata places data '
                                              f'up to byte {size}'):
        check_checkpoint(folder)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f'its shard file {shard.name} is missing'):
        load_composer_state(folder)
    (folder / '.metadata').write_bytes(b'\x80\x04not a pickle')
    with pytest.raises(CheckpointError, match=r'its \.metadata is unreadable'):
        check_checkpoint(folder)
    (folder / '.metadata').unlink()
    with pytest.raises(CheckpointError, match=r'is a folder but not a sharded checkpoint \(no \.metadata file\)'):
        check_checkpoint(folder)


@pytest.mark.slow  # a fresh interpreter imports Composer: about 20 s on 2 cores
def test_cli_refuses_a_truncated_autoresume_checkpoint_in_one_line(saved, tmp_path, data_root, tokenizer_dir):
    folder = _copy(saved, tmp_path)
    _truncate(folder / 'ep0-ba2-rank0.pt')
    before = _snapshot(folder)
    recipe = write_recipe(tmp_path / 'recipe.yaml', tiny_recipe(data_root, tokenizer_dir, run_name='integrity',
                                                                save_folder=str(folder), autoresume=True))
    done = subprocess.run([sys.executable, '-m', 'dha_train.cli', 'train', str(recipe)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith('dha-train: error: ')]
    assert errors == [line for line in done.stderr.splitlines() if 'error' in line.lower()], done.stderr[-3000:]
    assert len(errors) == 1 and 'Traceback' not in done.stderr
    assert errors[0].startswith(f'dha-train: error: autoresume: cannot read checkpoint {folder / "ep0-ba2-rank0.pt"}')
    assert _snapshot(folder) == before


def _malicious(kind: str, folder: Path, marker: Path) -> Path:
    """A checkpoint whose unpickling with plain pickle would create ``marker``: a sharded folder whose ``.metadata``
    carries the payload, one whose non-tensor item does, or a single file."""
    import pickle

    import torch.distributed.checkpoint as dcp

    state = {'state': {'model': {'model.w': torch.arange(8.0)}, 'timestamp': {'batch': 3}}}
    if kind == 'single file':
        path = folder / 'ep0-ba1-rank0.pt'
        folder.mkdir()
        torch.save({**state, 'payload': _Marker(marker)}, path)
        return path
    if kind == 'sharded byte item':
        state['state']['payload'] = _Marker(marker)  # DCP torch.saves non-tensor items into the shard file
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    if kind == 'sharded .metadata':
        metadata = FileSystemReader(str(folder)).read_metadata()
        metadata.planner_data = _Marker(marker)
        (folder / '.metadata').write_bytes(pickle.dumps(metadata))
    return folder


@pytest.mark.parametrize('kind', ['sharded .metadata', 'sharded byte item', 'single file'])
def test_a_checkpoint_that_would_run_code_is_refused_by_resume_export_and_eval(kind, tmp_path, data_root,
                                                                                tokenizer_dir, capfd):
    from helpers import refused_in_one_line

    marker = tmp_path / 'pwned'
    checkpoint = _malicious(kind, tmp_path / 'ckpt', marker)
    recipe = write_recipe(tmp_path / 'recipe.yaml', tiny_recipe(data_root, tokenizer_dir, run_name='integrity',
                                                                save_folder=str(tmp_path / 'new')))
    refusals = {'resume': ['train', str(recipe), f'load_path={checkpoint}'],
                'export': ['export', str(checkpoint), str(tmp_path / 'hf')],
                'eval': ['eval', str(checkpoint), '--tasks', 'piqa', '--limit', '2']}
    for command, argv in refusals.items():
        line = refused_in_one_line(argv, tmp_path, capfd)
        assert 'os.makedirs' in line, (command, line)
        assert not marker.exists(), f'{command} ran the payload'
    assert not (tmp_path / 'new').exists() and not (tmp_path / 'hf').exists()
    # torch.distributed.checkpoint's own readers refuse it too, whoever calls them (Composer's load, export's gather)
    if kind != 'single file':
        import torch.distributed.checkpoint as dcp

        with pytest.raises(BaseException) as caught:  # DCP's CheckpointException is a BaseException
            dcp.load({'state': {'model': {'model.w': torch.zeros(8)}, 'timestamp': {'batch': 0}, 'payload': None}},
                     checkpoint_id=str(checkpoint), no_dist=True)
        assert 'UnsafeCheckpointError' in str(caught.value) and 'refuses to unpickle' in str(caught.value)
        assert not marker.exists()
