"""Streaming loaders over the MDS folders written by `dha-train data prep`.

Training mixes one ``streaming.Stream`` per domain by proportion inside one ``StreamingDataset``; Composer saves
and restores the ``StreamingDataLoader`` state, which gives deterministic mid-epoch resume. Evaluation builds one
Composer ``Evaluator`` per domain, so every domain reports its own LM loss and a domain can never be absent from
(or dilute) another domain's mean.
"""

from __future__ import annotations

import atexit
import gc
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from composer.core import Evaluator
from streaming import Stream, StreamingDataLoader, StreamingDataset
from streaming.base.shared import prefix as _streaming_prefix
from streaming.base.shared.memory import SharedMemory

from dha_train.config import ConfigError, EvalLoaderConfig, TrainLoaderConfig
from dha_train.data.domains import DOMAINS, REDPAJAMA_PROPORTIONS
from dha_train.data.integrity import check_splits, index_shards, streaming_hash
from dha_train.data.prep import MANIFEST_NAME, TOKENS_COLUMN, read_manifest
from dha_train.data.tokenizer import tokenizer_fingerprint

# streaming registers each dataset under the first free shared-memory prefix (000000_locals, 000001_locals, ...),
# found by trying names from 0 and created after the search: two jobs that start on one machine at the same moment
# can both find the same prefix free, and then share one dataset's memory. SHM_PREFIX_BASE_ENV gives a job (and the
# processes it launches) its own range of prefixes, so jobs started with different bases can never collide: the
# test suite's parallel workers each get one.
SHM_PREFIX_BASE_ENV = 'DHA_TRAIN_SHM_PREFIX_BASE'


def _prefixes_from_base():
    """streaming's prefix search order, from this job's base (``SHM_PREFIX_BASE_ENV``, default 0)."""
    value = os.environ.get(SHM_PREFIX_BASE_ENV, '0')
    if not value.isdigit() or int(value) > 900_000:
        raise ConfigError(f'{SHM_PREFIX_BASE_ENV} must be a whole number from 0 to 900000, got {value!r}')
    prefix = int(value)
    while True:
        yield prefix
        prefix += 1


_streaming_prefix._each_prefix_int = _prefixes_from_base


def collate_tokens(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack packed samples into a causal-LM batch. HF LLaMA shifts the labels itself."""
    try:
        tokens = np.stack([np.asarray(sample[TOKENS_COLUMN]) for sample in samples])
    except KeyError as exc:
        raise ValueError(f"MDS samples need a '{TOKENS_COLUMN}' column; found {sorted(samples[0])}") from exc
    input_ids = torch.from_numpy(tokens.astype(np.int64))
    return {'input_ids': input_ids, 'labels': input_ids.clone()}


def _split_dir(root: str, domain: str, split: str) -> Path:
    return Path(root) / domain / split


def domains_with_split(root: str, split: str) -> list[str]:
    return [d for d in DOMAINS if (_split_dir(root, d, split) / 'index.json').is_file()]


def check_data_matches_model(root: str, *, vocab_size: int, max_seq_len: int, where: str, tokenizer=None) -> None:
    """Fail early on a tokenizer/vocab or sequence-length mismatch between the data and the model."""
    if not (Path(root) / MANIFEST_NAME).is_file():
        return  # MDS written by another tool: nothing to compare against
    manifest = read_manifest(root)
    if tokenizer is not None and 'tokenizer_fingerprint' in manifest:
        if tokenizer_fingerprint(tokenizer) != manifest['tokenizer_fingerprint']:
            raise ConfigError(
                f"{where}: data under {root} was tokenized with {manifest.get('tokenizer')}, whose token ids differ "
                f"from the model's tokenizer {tokenizer.name_or_path}; prep the data with the model's tokenizer")
    if manifest['vocab_size'] > vocab_size:
        raise ConfigError(
            f"{where}: data under {root} was tokenized with a {manifest['vocab_size']}-token vocabulary "
            f'({manifest.get("tokenizer")}) but the model has vocab_size={vocab_size}; use the same tokenizer')
    if manifest['seq_len'] > max_seq_len:
        raise ConfigError(f"{where}: samples under {root} are {manifest['seq_len']} tokens long but the model's "
                          f'max_position_embeddings is {max_seq_len}')


def _stream_kwargs(cfg: TrainLoaderConfig) -> list[dict[str, Any]]:
    """Resolve the per-domain stream locations and proportions, checking that local data exists."""
    if cfg.streams is None:
        domains = domains_with_split(cfg.root, cfg.split) if cfg.remote is None else []
        if not domains:
            raise ConfigError(
                f"train_loader: no MDS data under '{cfg.root}' (expected <root>/<domain>/{cfg.split}/index.json for "
                f"a domain in {', '.join(DOMAINS)}); run `dha-train data prep` or list train_loader.streams")
        streams = {d: None for d in domains}
    else:
        if not cfg.streams:
            raise ConfigError('train_loader.streams is empty')
        streams = dict(cfg.streams)
    resolved = []
    for domain, stream in streams.items():
        local = (stream.local if stream and stream.local else None) or str(_split_dir(cfg.root, domain, cfg.split))
        remote = (stream.remote if stream and stream.remote else None)
        if remote is None and cfg.remote is not None:
            remote = f'{cfg.remote.rstrip("/")}/{domain}/{cfg.split}'
        if remote is None and not (Path(local) / 'index.json').is_file():
            found = domains_with_split(cfg.root, cfg.split)
            raise ConfigError(f"train_loader.streams.{domain}: no MDS index at '{local}/index.json' "
                              f"(domains with a '{cfg.split}' split under {cfg.root}: {found or 'none'})")
        proportion = stream.proportion if stream and stream.proportion is not None else REDPAJAMA_PROPORTIONS[domain]
        resolved.append({'domain': domain, 'local': local, 'remote': remote, 'proportion': proportion})
    return resolved


def build_train_dataloader(cfg: TrainLoaderConfig, *, device_batch_size: int, seed: int, download_retry: int = 2):
    """A ``StreamingDataLoader`` over the domain mixture. Its state dict makes mid-epoch resume exact."""

    streams = _stream_kwargs(cfg)
    # Every index's names are checked here (a remote's index downloaded first), and local shard files; a remote's
    # shards by streaming, as it downloads them.
    check_splits([(f"domain {s['domain']}", s['local'], s['remote']) for s in streams], cfg.validate_hash,
                 where='train_loader', timeout=cfg.download_timeout, attempts=download_retry)
    total = sum(s['proportion'] for s in streams)
    dataset = StreamingDataset(
        streams=[Stream(local=s['local'], remote=s['remote'], proportion=s['proportion'] / total,
                        validate_hash=streaming_hash(cfg.validate_hash) if s['remote'] else None) for s in streams],
        batch_size=device_batch_size,
        epoch_size=cfg.epoch_size,
        shuffle=cfg.shuffle,
        shuffle_algo=cfg.shuffle_algo,
        shuffle_seed=seed,
        shuffle_block_size=cfg.shuffle_block_size,
        num_canonical_nodes=cfg.num_canonical_nodes,
        predownload=cfg.predownload,
        cache_limit=cfg.cache_limit,
        download_timeout=cfg.download_timeout,
        download_retry=download_retry,
    )
    return StreamingDataLoader(
        dataset,
        batch_size=device_batch_size,
        collate_fn=collate_tokens,
        drop_last=cfg.drop_last,
        num_workers=cfg.num_workers,
        prefetch_factor=cfg.prefetch_factor if cfg.num_workers > 0 else None,
        persistent_workers=cfg.persistent_workers and cfg.num_workers > 0,
    )


def eval_label(domain: str) -> str:
    return f'eval_{domain}'


def build_evaluators(cfg: EvalLoaderConfig, *, device_batch_size: int, metric_names: list[str]):
    """One Composer ``Evaluator`` per domain; each logs ``metrics/eval_<domain>/<metric>``."""

    if cfg.domains is None:
        domains = domains_with_split(cfg.root, cfg.split)
        if not domains:
            raise ConfigError(f"eval_loader: no '{cfg.split}' split under '{cfg.root}' for any domain "
                              f"(expected <root>/<domain>/{cfg.split}/index.json); prep data with --val-tokens, "
                              'or list eval_loader.domains when streaming from a remote')
    else:
        domains = list(cfg.domains)
    locations = {}
    for domain in domains:
        local = _split_dir(cfg.root, domain, cfg.split)
        remote = f'{cfg.remote.rstrip("/")}/{domain}/{cfg.split}' if cfg.remote else None
        if remote is None and not (local / 'index.json').is_file():
            raise ConfigError(f"eval_loader.domains: '{domain}' has no MDS index at '{local}/index.json'")
        locations[domain] = local, remote
    check_splits([(f'domain {domain}', local, remote) for domain, (local, remote) in locations.items()],
                 cfg.validate_hash, where='eval_loader')
    evaluators = []
    for domain, (local, remote) in locations.items():
        dataset = StreamingDataset(local=str(local), remote=remote, batch_size=device_batch_size, shuffle=False,
                                   validate_hash=streaming_hash(cfg.validate_hash) if remote else None)
        loader = StreamingDataLoader(dataset, batch_size=device_batch_size, collate_fn=collate_tokens,
                                     drop_last=False, num_workers=cfg.num_workers)
        evaluators.append(Evaluator(label=eval_label(domain), dataloader=loader, metric_names=metric_names,
                                    subset_num_batches=cfg.subset_num_batches))
    return evaluators


def _live_segments() -> list:
    """Every streaming shared-memory segment alive in this process (scanning gc's objects touches deprecated torch
    attributes, whose warnings are not ours)."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return [item for item in gc.get_objects() if isinstance(item, SharedMemory)]


def live_shared_memory() -> set[int]:
    """The ids of the streaming shared-memory segments alive now (for ``release_shared_memory_since``)."""
    return {id(item) for item in _live_segments()}


def release_shared_memory_since(before: set[int]) -> None:
    """Close and unregister every streaming shared-memory segment made since ``before`` (``live_shared_memory()``
    taken earlier); their datasets must not be iterated again."""
    for segment in [item for item in _live_segments() if id(item) not in before]:
        atexit.unregister(segment.cleanup)
        segment.cleanup()


def closing_batches(loader, before: set[int]):
    """The loader's batches, then, when the caller is done (e.g. calibration, which takes a few batches), the
    streaming dataset's epoch threads stopped and the shared-memory segments it made closed. streaming registers
    every segment for cleanup at process exit only, so each calibration would otherwise hold about 150 open files
    until the process ends, and a long process (the test suite, a bench) runs out of them."""
    try:
        yield from loader
    finally:
        iterator = getattr(loader.dataset, '_iterator', None)  # streaming 0.13's epoch state and its threads
        if iterator is not None:
            iterator.exit()
        release_shared_memory_since(before)


def split_sequences(root: str | Path, domain: str, split: str) -> list[np.ndarray]:
    """Every packed sample of one domain's split, in shard order, read straight from its MDS shards (no streaming
    dataset, no shared memory): for scoring fixed text outside a training loop (``bench serve``'s held-out loss)."""
    local = _split_dir(str(root), domain, split)
    index = local / 'index.json'
    if not index.is_file():
        raise FileNotFoundError(f'no MDS split at {local} (expected {index})')
    sequences = []
    for reader in index_shards(local, f'the {domain} {split} split'):
        sequences.extend(np.asarray(reader.get_item(i)[TOKENS_COLUMN]) for i in range(reader.samples))
    return sequences
