"""Checkpoints and model folders whose *data* would act (issue 44): plain dicts, strings and the numpy types a
checkpoint's RNG state needs, crafted so that today's readers would write a file where the data says, import code the
data names, or forge an object. Every command each one reaches refuses it in one line, writes nothing, runs nothing.

Each case builds its artefact from a real checkpoint or folder and changes one piece of data; the marker a case
looks for is a file or folder the crafted data would create if anything acted on it."""

from __future__ import annotations

import io
import json
import pathlib
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy._core.multiarray import _reconstruct

from dha_train.checkpoints import (
    LATEST,
    CheckpointError,
    UnsafeCheckpointError,
    check_byte_item,
    check_checkpoint,
    torch_load,
)
from dha_train.config import load_config
from helpers import refused_in_one_line, save_tiny_llama, tiny_recipe, write_recipe


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory, data_root, tokenizer_dir) -> Path:
    """A whole-file checkpoint of a real 1-batch run (its HF config and tokenizer entries as Composer writes them)."""
    from dha_train.train import close_trainer, train

    folder = tmp_path_factory.mktemp('run') / 'ckpt'
    trainer = train(load_config(tiny_recipe(data_root, tokenizer_dir, max_duration='1ba', save_interval='1ba',
                                            save_folder=str(folder), run_name='data')))
    close_trainer(trainer)
    return folder / 'ep0-ba1-rank0.pt'


def _crafted(checkpoint: Path, out: Path, edit) -> Path:
    """``checkpoint`` with ``edit`` applied to its state, saved as ``out``: plain data only (read back weights-only)."""
    state = torch_load(checkpoint)
    edit(state)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, out)
    return out


def _hf(state: dict) -> dict:
    return state['state']['integrations']['huggingface']


def _refused_everywhere(checkpoint: Path, tmp_path: Path, capfd, data_root, tokenizer_dir) -> dict[str, str]:
    """Resume, export and eval of ``checkpoint``: each ends with one ``dha-train: error:`` line (exit 2) and nothing
    under ``tmp_path`` changes (no output folder, no file the data names). Returns each command's line."""
    recipe = write_recipe(tmp_path / 'recipe.yaml', tiny_recipe(data_root, tokenizer_dir, run_name='data',
                                                                save_folder=str(tmp_path / 'new')))
    commands = {'resume': ['train', str(recipe), f'load_path={checkpoint}'],
                'export': ['export', str(checkpoint), str(tmp_path / 'hf')],
                'eval': ['eval', str(checkpoint), '--tasks', 'piqa', '--limit', '2']}
    return {name: refused_in_one_line(argv, tmp_path, capfd) for name, argv in commands.items()}


# ---------------------------------------------------------------------------------------------------------------
# A file written where the checkpoint says: the tokenizer entries' names
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('form', ['absolute', 'dot-dot', 'code base name'])
def test_tokenizer_file_names_from_a_checkpoint_write_nothing(form, checkpoint, tmp_path, capfd, data_root,
                                                              tokenizer_dir):
    site = tmp_path / 'site'  # stands for a site-packages folder: a usercustomize.py there runs at Python's start
    site.mkdir()
    target = site / 'usercustomize'
    names = {'absolute': str(target), 'dot-dot': '../' * 40 + str(target).lstrip('/'), 'code base name': 'tokenizer'}
    entry = {'file_extension': '.py', 'content': f'import pathlib; pathlib.Path({str(site / "ran")!r}).mkdir()\n'}
    crafted = _crafted(checkpoint, tmp_path / 'crafted' / 'ep0-ba1-rank0.pt',
                       lambda state: _hf(state)['tokenizer'].update({names[form]: entry}))
    lines = _refused_everywhere(crafted, tmp_path, capfd, data_root, tokenizer_dir)
    for command, line in lines.items():
        assert 'restores only tokenizer.json' in line and 'wrote nothing' in line, (command, line)
    assert list(site.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Code named by a config: a checkpoint's HF config, and a model folder's config.json
# ---------------------------------------------------------------------------------------------------------------


def _code_folder(folder: Path, marker: Path, config: dict) -> Path:
    """A folder holding ``config`` as config.json and pwned.py, whose import creates ``marker``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / 'pwned.py').write_text(
        'import pathlib\n'
        f'pathlib.Path({str(marker)!r}).mkdir(exist_ok=True)\n'
        'from transformers import LlamaConfig, LlamaForCausalLM\n'
        'class PwnedConfig(LlamaConfig):\n    model_type = "pwned_model"\n'
        'class PwnedModel(LlamaForCausalLM):\n    config_class = PwnedConfig\n')
    (folder / 'config.json').write_text(json.dumps(config))
    return folder


_FOREIGN_AUTO_MAP = {'AutoConfig': 'pwned.PwnedConfig', 'AutoModelForCausalLM': 'pwned.PwnedModel'}


def test_a_checkpoint_config_naming_code_runs_none_of_it(checkpoint, tmp_path, capfd, data_root, tokenizer_dir):
    marker = tmp_path / 'ran'
    code = _code_folder(tmp_path / 'code', marker, {'model_type': 'pwned_model', 'auto_map': _FOREIGN_AUTO_MAP})

    def name_code(state):
        content = _hf(state)['model']['config']['content']
        content.update(model_type='pwned_model', _name_or_path=str(code), trust_remote_code=True,
                       auto_map=_FOREIGN_AUTO_MAP)

    crafted = _crafted(checkpoint, tmp_path / 'crafted' / 'ep0-ba1-rank0.pt', name_code)
    lines = _refused_everywhere(crafted, tmp_path, capfd, data_root, tokenizer_dir)
    for command, line in lines.items():
        assert "holds a 'pwned_model' model" in line and "never imports a config's own code" in line, (command, line)
    assert not marker.exists()


def test_a_llama_checkpoint_config_with_foreign_auto_map_is_refused(checkpoint, tmp_path, capfd, data_root,
                                                                    tokenizer_dir):
    crafted = _crafted(checkpoint, tmp_path / 'crafted' / 'ep0-ba1-rank0.pt',
                       lambda state: _hf(state)['model']['config']['content'].update(auto_map=_FOREIGN_AUTO_MAP,
                                                                                     trust_remote_code=True))
    for command, line in _refused_everywhere(crafted, tmp_path, capfd, data_root, tokenizer_dir).items():
        assert 'its auto_map names code dha-train does not ship' in line, (command, line)


def test_a_model_folder_whose_config_names_code_is_refused_by_every_command(tmp_path, capfd, data_root,
                                                                            tokenizer_dir):
    """A real LLaMA folder whose config.json adds an auto_map to its own pwned.py and trust_remote_code: true."""
    marker = tmp_path / 'ran'
    folder = tmp_path / 'model'
    save_tiny_llama(folder, tokenizer_dir)
    config = json.loads((folder / 'config.json').read_text())
    _code_folder(folder, marker, {**config, 'auto_map': _FOREIGN_AUTO_MAP, 'trust_remote_code': True})
    clean = tmp_path / 'clean'
    save_tiny_llama(clean, tokenizer_dir)
    recipe = write_recipe(tmp_path / 'recipe.yaml', {
        **tiny_recipe(data_root, tokenizer_dir, run_name='data', save_folder=str(tmp_path / 'new')),
        'model': {'pretrained_path': str(folder), 'tokenizer': str(tokenizer_dir)}})
    commands = {'eval': ['eval', str(folder), '--tasks', 'piqa', '--limit', '2'],
                'convert': ['convert', str(folder), str(tmp_path / 'out'), '--kv-heads', '2'],
                'convert mla': ['convert', str(folder), str(tmp_path / 'out'), '--method', 'mla',
                                '--cache-fraction', '0.5', '--data', str(data_root)],
                'refit (converted)': ['refit', str(clean), str(folder), str(tmp_path / 'out'), '--data',
                                      str(data_root)],
                'refit (source)': ['refit', str(folder), str(clean), str(tmp_path / 'out'), '--data',
                                   str(data_root)],
                'export-gguf': ['export-gguf', str(folder), str(tmp_path / 'model.gguf')],
                'train (model.pretrained_path)': ['train', str(recipe)]}
    for command, argv in commands.items():
        line = refused_in_one_line(argv, tmp_path, capfd)
        assert 'its auto_map names code dha-train does not ship' in line, (command, line)
        assert not marker.exists(), f'{command} ran the folder\'s code'


def test_the_projects_own_auto_map_still_loads_with_its_own_classes(tmp_path, tokenizer_dir):
    """What the project's exports carry (their modeling file, for users without dha_train) loads, and the file in
    the folder is not what runs: a changed copy of it would create a marker."""
    from dha_train.conversion.mean_pool import convert_checkpoint
    from dha_train.model_folders import load_causal_lm
    from dha_train.models.head_map import HeadMap

    source = tmp_path / 'source'
    save_tiny_llama(source, tokenizer_dir)
    dha = tmp_path / 'dha'
    unequal_groups = [[[0, 1, 2], [3, 4, 5, 6, 7]]] * 2  # unequal: the DHA class, not a plain GQA LLaMA
    convert_checkpoint(source, dha, HeadMap.from_partitions(unequal_groups, num_heads=8, head_dim=8))
    config = json.loads((dha / 'config.json').read_text())
    assert config['model_type'] == 'dha_llama' and config['auto_map']['AutoConfig'] == 'modeling_dha.DhaLlamaConfig'
    modeling = dha / 'modeling_dha.py'
    marker = tmp_path / 'ran'
    modeling.write_text(f'import pathlib\npathlib.Path({str(marker)!r}).mkdir()\n' + modeling.read_text())
    model = load_causal_lm(dha, who='test')
    assert type(model).__module__ == 'dha_train.models.modeling_dha' and not marker.exists()


# ---------------------------------------------------------------------------------------------------------------
# Objects forged from the numpy types the RNG state needs
# ---------------------------------------------------------------------------------------------------------------


class _ObjectDtype:
    def __reduce__(self):
        return np.dtype, ('O8', False, True)  # numpy's object dtype, built bare (no BUILD)


class _ForgedDtype:
    def __reduce__(self):  # the RNG key's uint32 dtype, re-stated with a field of object type and flags 0
        return np.dtype, ('u4', False, True), (3, '|', None, ('f0',), {'f0': (_ObjectDtype(), 0)}, 4, 1, 0)


class _PlainDtypeForgedState:
    def __reduce__(self):  # the plain dtype's own arguments, with fields added in its state only
        return np.dtype, ('u4', False, True), (3, '<', None, ('f0',), {'f0': (np.dtype('u4'), 0)}, 4, 1, 0)


class _ForgedArray:
    """Pickles as numpy pickles an array, with a forged dtype: its 8 zero bytes would read as a NULL object."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __reduce__(self):
        return _reconstruct, (np.ndarray, (0,), b'b'), (1, (2,), self.dtype, False, b'\0' * 8)


@pytest.mark.parametrize('dtype', [_ForgedDtype(), _PlainDtypeForgedState()], ids=['object field', 'state only'])
def test_a_forged_numpy_dtype_is_refused_by_every_loader_and_the_pre_check(dtype, checkpoint, tmp_path, capfd,
                                                                           data_root, tokenizer_dir):
    def forge(state):
        state['rng'][0]['numpy'] = ('MT19937', _ForgedArray(dtype), 0, 0, 0.0)

    crafted = _crafted(checkpoint, tmp_path / 'crafted' / 'ep0-ba1-rank0.pt', forge)
    for command, line in _refused_everywhere(crafted, tmp_path, capfd, data_root, tokenizer_dir).items():
        assert 'numpy dtype' in line, (command, line)
    for load in (check_checkpoint, torch_load):
        with pytest.raises(UnsafeCheckpointError, match='numpy dtype'):
            load(crafted)
    raw = io.BytesIO()
    torch.save({'numpy': _ForgedArray(dtype)}, raw)
    with pytest.raises(UnsafeCheckpointError, match='numpy dtype'):
        check_byte_item(raw.getvalue(), 'rng')


def test_a_forged_numpy_dtype_in_a_sharded_item_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / 'ep0-ba1'
    dcp.save({'state': {'model': {'model.w': torch.arange(8.0)}, 'rng': _ForgedArray(_ForgedDtype())}},
             checkpoint_id=str(folder), no_dist=True)
    with pytest.raises(CheckpointError, match='numpy dtype'):
        check_checkpoint(folder)
    with pytest.raises(BaseException, match='numpy dtype'):  # DCP's CheckpointException is a BaseException
        dcp.load({'state': {'model': {'model.w': torch.zeros(8)}, 'rng': None}}, checkpoint_id=str(folder),
                 no_dist=True)


def test_the_rng_state_of_a_real_checkpoint_loads_as_a_plain_uint32_array(checkpoint):
    key = torch_load(checkpoint)['rng'][0]['numpy'][1]
    assert isinstance(key, np.ndarray) and key.dtype == np.uint32 and key.dtype.fields is None and key.shape == (624,)
    np.random.set_state(('MT19937', key, 0, 0, 0.0))  # what Composer's resume does with it
    assert np.array_equal(np.random.get_state()[1], key)


# ---------------------------------------------------------------------------------------------------------------
# One read, checked: .metadata BUILD, shard names, the object used is the object checked
# ---------------------------------------------------------------------------------------------------------------


def _sharded(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({'state': {'model': {'model.w': torch.arange(8.0)}, 'rng': np.arange(4, dtype=np.uint32)}},
             checkpoint_id=str(folder), no_dist=True)
    return folder


def test_metadata_cannot_set_attributes_on_a_class(tmp_path, capfd, data_root, tokenizer_dir):
    folder = _sharded(tmp_path / 'ckpt')
    metadata = (folder / '.metadata').read_bytes()
    # before STOP: push pathlib.PosixPath, BUILD it with (None, {'dha_probe': 1}) (setattr on the class), pop it
    build_on_class = b'cpathlib\nPosixPath\n' + pickle.dumps((None, {'dha_probe': 1}), protocol=2)[2:-1] + b'b0'
    (folder / '.metadata').write_bytes(metadata[:-1] + build_on_class + metadata[-1:])
    for command, line in _refused_everywhere(folder, tmp_path, capfd, data_root, tokenizer_dir).items():
        assert 'sets the state of' in line and 'PosixPath' in line, (command, line)
    assert not hasattr(pathlib.PosixPath, 'dha_probe')


def test_metadata_naming_a_shard_outside_its_folder_is_refused(tmp_path):
    import dataclasses

    from torch.distributed.checkpoint import FileSystemReader

    folder = _sharded(tmp_path / 'ckpt')
    metadata = pickle.loads((folder / '.metadata').read_bytes())  # the test's own file: plain pickle is fine here
    metadata.storage_data = {index: dataclasses.replace(info, relative_path='../outside.distcp')
                             for index, info in metadata.storage_data.items()}
    (folder / '.metadata').write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match='not a plain file name inside its folder'):
        check_checkpoint(folder)
    with pytest.raises(UnsafeCheckpointError):
        FileSystemReader(str(folder)).read_metadata()


def test_each_read_is_the_checked_one(tmp_path, monkeypatch):
    """``.metadata`` is unpickled once, by the checked reader (torch's plain pickle.load never runs); a non-tensor
    item is the object the check built; Composer's whole-file load is the checked load itself, so a file swapped
    after the pre-check is refused where Composer reads it."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as dcp_filesystem
    from composer.utils.checkpoint import safe_torch_load
    from torch.distributed.checkpoint import FileSystemReader

    folder = _sharded(tmp_path / 'ckpt')

    def no_plain_pickle(*args, **kwargs):
        raise AssertionError('torch read .metadata with plain pickle')

    monkeypatch.setattr(dcp_filesystem.pickle, 'load', no_plain_pickle)
    assert FileSystemReader(str(folder)).read_metadata().storage_meta is not None
    loaded = {'state': {'model': {'model.w': torch.zeros(8)}, 'rng': None}}
    dcp.load(loaded, checkpoint_id=str(folder), no_dist=True)
    assert type(loaded['state']['rng']).__name__ == '_CheckedArray'
    assert np.array_equal(loaded['state']['rng'], np.arange(4, dtype=np.uint32))
    monkeypatch.undo()

    whole = tmp_path / 'ep0-ba1-rank0.pt'
    torch.save({'state': {'model': {'model.w': torch.arange(8.0)}}}, whole)
    assert check_checkpoint(whole) == whole
    marker = tmp_path / 'ran'
    torch.save({'state': {'model': {}}, 'payload': _Marker(marker)}, whole)  # swapped after the check
    with pytest.raises(CheckpointError, match='os.makedirs'):
        safe_torch_load(str(whole))
    assert not marker.exists()


class _Marker:
    """Unpickling this with plain pickle runs ``os.makedirs(path)``."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return os.makedirs, (self.path,)


# ---------------------------------------------------------------------------------------------------------------
# Remote sources, tar archives, every node
# ---------------------------------------------------------------------------------------------------------------


class _FolderStore:
    """An object store over a local folder, standing in for s3:// (no network here)."""

    def __init__(self, root: Path):
        self.root = root
        self.downloaded: list[str] = []

    def get_uri(self, object_name: str) -> str:
        return f's3://bucket/{object_name}'

    def get_object_size(self, object_name: str) -> int:
        return (self.root / object_name).stat().st_size

    def download_object(self, object_name, filename, overwrite=False, callback=None):
        self.downloaded.append(object_name)
        shutil.copy(self.root / object_name, filename)


@pytest.mark.parametrize('payload', ['code', 'forged dtype'])
def test_a_remote_load_path_is_read_only_through_the_checked_loader(payload, checkpoint, tmp_path, monkeypatch,
                                                                     data_root, tokenizer_dir):
    import composer.trainer.trainer as composer_trainer
    from composer.utils import ObjectStore

    from dha_train.train import build_trainer

    class Store(_FolderStore, ObjectStore):
        pass

    bucket = tmp_path / 'bucket'
    marker = tmp_path / 'ran'
    if payload == 'code':
        _crafted(checkpoint, bucket / 'ep0-ba1-rank0.pt', lambda state: state.update(payload=_Marker(marker)))
    else:
        _crafted(checkpoint, bucket / 'ep0-ba1-rank0.pt',
                 lambda state: state['rng'][0].update(numpy=('MT19937', _ForgedArray(_ForgedDtype()), 0, 0, 0.0)))
    store = Store(bucket)
    monkeypatch.setattr(composer_trainer, 'maybe_create_object_store_from_uri', lambda uri: store)
    with pytest.raises(CheckpointError, match='os.makedirs' if payload == 'code' else 'numpy dtype'):
        build_trainer(load_config(tiny_recipe(data_root, tokenizer_dir, run_name='data',
                                              save_folder=str(tmp_path / 'new'),
                                              load_path='s3://bucket/ep0-ba1-rank0.pt')))
    assert store.downloaded == ['ep0-ba1-rank0.pt'] and not marker.exists()  # Composer fetched it; our reader refused


def test_a_tar_load_path_is_refused_local_or_remote(checkpoint, tmp_path, capfd, data_root, tokenizer_dir):
    import tarfile

    from composer.utils import checkpoint as composer_checkpoint

    archive = tmp_path / 'ep0-ba1.tar.gz'
    with tarfile.open(archive, 'w:gz') as tar:
        tar.add(checkpoint, arcname='composer_states.pt')
    recipe = write_recipe(tmp_path / 'recipe.yaml', tiny_recipe(data_root, tokenizer_dir, run_name='data',
                                                                save_folder=str(tmp_path / 'new')))
    for load_path in (str(archive), 's3://bucket/ep0-ba1.tar.gz'):
        line = refused_in_one_line(['train', str(recipe), f'load_path={load_path}'], tmp_path, capfd)
        assert 'is a tar archive' in line and 'never extracts an archive' in line, line
    # and where Composer itself would download and extract one (a remote save folder's latest link may name one)
    with pytest.raises(CheckpointError, match='is a tar archive'):
        composer_checkpoint.download_checkpoint(str(archive), str(tmp_path / 'node'), None, False)
    assert not (tmp_path / 'node').exists()


def test_every_nodes_local_rank_zero_checks_its_own_copy(checkpoint, tmp_path, monkeypatch, data_root,
                                                         tokenizer_dir):
    """Global rank 1 as local rank 0 of a second node: it checks its own disk's copy, and every rank raises."""
    from composer.utils import dist

    from dha_train import train as train_module

    folder = tmp_path / 'ckpt'
    folder.mkdir()
    broken = folder / 'ep0-ba1-rank0.pt'
    broken.write_bytes(checkpoint.read_bytes()[:1000])  # this node's copy is cut short
    gathered = []

    def all_gather_object(obj):
        gathered.append(obj)
        return [None, obj]  # node 0's local rank 0 found nothing wrong with its own copy

    monkeypatch.setattr(dist, 'get_global_rank', lambda: 1)
    monkeypatch.setattr(dist, 'get_local_rank', lambda: 0)
    monkeypatch.setattr(dist, 'all_gather_object', all_gather_object)
    config = load_config(tiny_recipe(data_root, tokenizer_dir, run_name='data', load_path=str(broken)))
    with pytest.raises(CheckpointError, match=f'load_path: cannot read checkpoint {broken}'):
        train_module.check_checkpoint_to_load(config)
    assert isinstance(gathered[0], CheckpointError)


def test_the_latest_link_of_a_crafted_folder_is_refused_by_autoresume(checkpoint, tmp_path, capfd, data_root,
                                                                      tokenizer_dir):
    """The same tokenizer-name checkpoint, found by autoresume through latest-rank0.pt."""
    folder = tmp_path / 'new'
    _crafted(checkpoint, folder / 'ep0-ba1-rank0.pt', lambda state: _hf(state)['tokenizer'].update(
        {str(tmp_path / 'usercustomize'): {'file_extension': '.py', 'content': 'raise SystemExit'}}))
    (folder / LATEST).symlink_to('ep0-ba1-rank0.pt')
    recipe = write_recipe(tmp_path / 'recipe.yaml', tiny_recipe(data_root, tokenizer_dir, run_name='data',
                                                                save_folder=str(folder), autoresume=True))
    line = refused_in_one_line(['train', str(recipe)], tmp_path, capfd)
    assert line.startswith('dha-train: error: autoresume: ') and 'restores only tokenizer.json' in line, line


@pytest.mark.parametrize('named', ['AutoModelForCausalLM', 'os.system', 'PwnedTokenizer'])
def test_a_tokenizer_config_naming_a_class_outside_transformers_tokenizers_is_refused(named, tmp_path, tokenizer_dir):
    from dha_train.data.tokenizer import load_tokenizer
    from dha_train.untrusted import UntrustedDataError

    folder = tmp_path / 'tokenizer'
    shutil.copytree(tokenizer_dir, folder)
    config = json.loads((folder / 'tokenizer_config.json').read_text())
    (folder / 'tokenizer_config.json').write_text(json.dumps({**config, 'tokenizer_class': named,
                                                              'auto_map': {'AutoTokenizer': ['pwned.Tok', None]}}))
    with pytest.raises(UntrustedDataError, match=f"names tokenizer_class '{named}', which is not a tokenizer class"):
        load_tokenizer(folder)
    # transformers' own classes pass, the slow name of a fast-only install included; the auto_map is not followed
    for allowed in ('PreTrainedTokenizerFast', 'LlamaTokenizer'):
        (folder / 'tokenizer_config.json').write_text(json.dumps({**config, 'tokenizer_class': allowed,
                                                                  'auto_map': {'AutoTokenizer': ['pwned.Tok', None]}}))
        assert load_tokenizer(folder).bos_token == '<s>'
