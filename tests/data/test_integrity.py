"""Shard integrity: data prep records xxh64 hashes, the loaders and `dha-train data verify` refuse a damaged shard by
name before anything trains."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from streaming import MDSWriter
from streaming.base.hashing import get_hash

from dha_train.config import ConfigError, EvalLoaderConfig, StreamConfig, TrainLoaderConfig, load_config
from dha_train.data.integrity import CorruptShardError, verify_data
from dha_train.data.prep import SHARD_HASH, read_manifest
from helpers import tiny_recipe

GITHUB_SHARD = Path('github', 'train', '00000-github_0', 'shard.00000.mds')


def _shards(split_dir: Path) -> list[dict]:
    return json.loads((split_dir / 'index.json').read_text())['shards']


def _copy(data_root: Path, tmp_path: Path) -> Path:
    copy = tmp_path / 'data'
    shutil.copytree(data_root, copy)
    return copy


def _flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_prep_records_a_hash_of_every_shard_in_the_merged_indexes(data_root):
    assert read_manifest(data_root)['shard_hashes'] == [SHARD_HASH] == ['xxh64']
    checked = 0
    for index in sorted(data_root.glob('*/*/index.json')):  # the merged <domain>/<split> indexes the loaders read
        for shard in _shards(index.parent):
            assert shard['hashes'] == [SHARD_HASH]
            raw = shard['raw_data']
            assert raw['hashes'][SHARD_HASH] == get_hash(SHARD_HASH, (index.parent / raw['basename']).read_bytes())
            checked += 1
    assert checked == 4  # github and wikipedia, train and val


def test_flipped_byte_in_a_train_shard_is_refused_naming_the_shard(data_root, tmp_path):
    from dha_train.data.loaders import build_train_dataloader

    data = _copy(data_root, tmp_path)
    _flip_byte(data / GITHUB_SHARD)
    with pytest.raises(CorruptShardError) as caught:
        build_train_dataloader(TrainLoaderConfig(root=str(data)), device_batch_size=4, seed=0)
    message = str(caught.value)
    assert message.startswith(f'train_loader: shard {data / GITHUB_SHARD} (domain github) fails its xxh64 check')
    assert '\n' not in message and 'dha-train data prep' in message
    # validate_hash: null turns the check off: the same data then builds a loader (streaming itself never checks a
    # shard it reads in place).
    build_train_dataloader(TrainLoaderConfig(root=str(data), validate_hash=None), device_batch_size=4, seed=0)


def test_truncated_val_shard_is_refused_by_the_eval_loader(data_root, tmp_path):
    from dha_train.data.loaders import build_evaluators

    data = _copy(data_root, tmp_path)
    shard = data / 'wikipedia' / 'val' / '00001-wikipedia_0' / 'shard.00000.mds'
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(CorruptShardError, match=f'eval_loader: shard {shard} \\(domain wikipedia\\) is {size - 7} '
                                                f'bytes but index.json records {size}'):
        build_evaluators(EvalLoaderConfig(root=str(data)), device_batch_size=4, metric_names=['LanguageCrossEntropy'])


def test_missing_shard_and_hash_the_data_lacks_are_refused(data_root, tmp_path):
    from dha_train.data.loaders import build_train_dataloader

    with pytest.raises(ConfigError, match='the sha1 hash was asked for, but .*github/train/index.json records none '
                                          r'for its shards \(it records: xxh64\)'):
        build_train_dataloader(TrainLoaderConfig(root=str(data_root), validate_hash='sha1'), device_batch_size=4,
                               seed=0)
    data = _copy(data_root, tmp_path)
    (data / GITHUB_SHARD).unlink()
    cfg = TrainLoaderConfig(root=str(data), streams={'github': StreamConfig()})
    with pytest.raises(CorruptShardError, match=f'shard {data / GITHUB_SHARD} \\(domain github\\) is missing'):
        build_train_dataloader(cfg, device_batch_size=4, seed=0)


def test_validate_hash_must_be_auto_null_or_a_known_hash(data_root, tokenizer_dir):
    recipe = tiny_recipe(data_root, tokenizer_dir)
    recipe['train_loader']['validate_hash'] = 'xxh46'
    with pytest.raises(ConfigError, match="train_loader.validate_hash: 'xxh46' is neither auto, null nor a hash"):
        load_config(recipe)
    recipe['train_loader']['validate_hash'] = None
    assert load_config(recipe).train_loader.validate_hash is None
    assert load_config(tiny_recipe(data_root, tokenizer_dir)).train_loader.validate_hash == 'auto'


def test_data_recorded_without_hashes_gets_its_sizes_checked(tmp_path):
    split = tmp_path / 'other' / 'github' / 'train'
    with MDSWriter(out=str(split), columns={'tokens': 'ndarray:uint16'}) as writer:  # no hashes=
        for i in range(50):
            writer.write({'tokens': np.full(64, i, dtype=np.uint16)})
    assert verify_data(tmp_path / 'other') == [('github/train', 1, {None})]
    shard = split / 'shard.00000.mds'
    shard.write_bytes(shard.read_bytes() + b'\0')
    with pytest.raises(CorruptShardError, match=f'data verify: shard {shard} \\(github/train\\) is '):
        verify_data(tmp_path / 'other')


def test_compressed_shards_are_checked_by_their_zip_hash(tmp_path, tokenizer_dir):
    from dha_train.data.prep import prep_redpajama
    from helpers import SEQ_LEN, write_redpajama_jsonl

    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=40)
    out = tmp_path / 'zstd'
    prep_redpajama([raw], out, tokenizer_dir, seq_len=SEQ_LEN, workers=1, progress=False, compression='zstd')
    assert {split for split, _, algorithms in verify_data(out) if algorithms == {SHARD_HASH}} == {
        'github/train', 'wikipedia/train'}
    (zipped,) = (out / 'github' / 'train').glob('*/shard.00000.mds.zstd')
    _flip_byte(zipped, offset=len(zipped.read_bytes()) // 2)
    with pytest.raises(CorruptShardError, match=f'shard {zipped} \\(github/train\\) fails its xxh64 check'):
        verify_data(out)


def test_data_verify_command(data_root, tmp_path, capsys):
    from dha_train.cli import main

    assert main(['data', 'verify', str(data_root)]) == 0
    out = capsys.readouterr().out
    assert 'github/train' in out and 'every shard file matches its index.json' in out
    data = _copy(data_root, tmp_path)
    _flip_byte(data / GITHUB_SHARD)
    assert main(['data', 'verify', str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'dha-train: error: data verify: shard {data / GITHUB_SHARD} (github/train) fails its '
                          'xxh64 check') and err.count('\n') == 1


def test_a_remote_stream_hands_only_a_named_hash_to_streaming(data_root, tmp_path):
    from dha_train.data.loaders import build_train_dataloader

    for validate_hash, expected in (('auto', None), ('xxh64', 'xxh64')):
        cfg = TrainLoaderConfig(root=str(tmp_path / validate_hash), remote=str(data_root),
                                streams={'github': StreamConfig()}, validate_hash=validate_hash)
        loader = build_train_dataloader(cfg, device_batch_size=4, seed=0)
        assert [stream.validate_hash for stream in loader.dataset.streams] == [expected]
        assert next(iter(loader))['input_ids'].shape == (4, 64)  # streaming downloaded (and checked) the shard
        del loader
        gc.collect()
