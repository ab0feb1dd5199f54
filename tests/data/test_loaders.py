"""Streaming loaders over data-prep output: batches, remote roots, seeds, per-domain evaluators."""

from __future__ import annotations

import gc

import torch

from dha_train.config import EvalLoaderConfig, StreamConfig, TrainLoaderConfig


def _first_batches(cfg: TrainLoaderConfig, seed: int, n: int = 3) -> list[torch.Tensor]:
    from dha_train.data.loaders import build_train_dataloader

    loader = build_train_dataloader(cfg, device_batch_size=4, seed=seed)
    batches = []
    for batch in loader:
        batches.append(batch['input_ids'])
        if len(batches) == n:
            break
    del loader
    gc.collect()
    return batches


def test_batches_are_causal_lm_batches_and_seeded(data_root):
    cfg = TrainLoaderConfig(root=str(data_root))
    first = _first_batches(cfg, seed=1)
    assert first[0].shape == (4, 64) and first[0].dtype == torch.int64
    batch = first[0]
    assert int(batch.min()) >= 0 and int(batch.max()) < 384
    again = _first_batches(cfg, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = _first_batches(cfg, seed=2)
    assert not all(torch.equal(a, b) for a, b in zip(first, other))


def test_remote_root_streams_into_a_local_cache(data_root, tmp_path):
    cache = tmp_path / 'cache'
    cfg = TrainLoaderConfig(root=str(cache), remote=str(data_root),
                            streams={'github': StreamConfig(proportion=1.0)})
    batches = _first_batches(cfg, seed=0, n=1)
    assert batches[0].shape == (4, 64)
    assert (cache / 'github' / 'train' / 'index.json').is_file()


def test_one_evaluator_per_domain(data_root):
    from dha_train.data.loaders import build_evaluators

    evaluators = build_evaluators(EvalLoaderConfig(root=str(data_root)), device_batch_size=4,
                                  metric_names=['LanguageCrossEntropy'])
    assert [e.label for e in evaluators] == ['eval_github', 'eval_wikipedia']
    batch = next(iter(evaluators[0].dataloader.dataloader))
    assert batch['input_ids'].shape == (4, 64)


def test_closing_batches_gives_back_the_files_the_loader_opened(data_root):
    """streaming frees a dataset's shared memory only at process exit; `closing_batches` (calibration's loader) frees
    it when the caller stops, so a long process does not run out of file descriptors."""
    import os

    from dha_train.data.loaders import build_train_dataloader, closing_batches, live_shared_memory

    def open_files() -> int:
        return len(os.listdir('/proc/self/fd'))

    before, files = live_shared_memory(), open_files()
    batches = closing_batches(build_train_dataloader(TrainLoaderConfig(root=str(data_root), drop_last=False),
                                                     device_batch_size=2, seed=0), before)
    assert next(batches)['input_ids'].shape[0] == 2
    assert open_files() > files  # the dataset's shared-memory segments
    batches.close()
    assert open_files() <= files


def test_a_job_with_its_own_shared_memory_prefix_base_registers_its_datasets_from_there(data_root, monkeypatch):
    """Two jobs on one machine with different bases never search the same shared-memory names, so they cannot both
    claim one prefix; an unusable base is refused by name."""
    import pytest

    from dha_train.config import ConfigError
    from dha_train.data.loaders import SHM_PREFIX_BASE_ENV, build_train_dataloader, closing_batches, live_shared_memory

    before = live_shared_memory()
    monkeypatch.setenv(SHM_PREFIX_BASE_ENV, '123400')
    loader = build_train_dataloader(TrainLoaderConfig(root=str(data_root)), device_batch_size=4, seed=0)
    assert loader.dataset._shm_prefix_int >= 123400
    assert next(iter(closing_batches(loader, before)))['input_ids'].shape[0] == 4
    monkeypatch.setenv(SHM_PREFIX_BASE_ENV, 'gw1')
    with pytest.raises(ConfigError, match=SHM_PREFIX_BASE_ENV):
        build_train_dataloader(TrainLoaderConfig(root=str(data_root)), device_batch_size=4, seed=0)
