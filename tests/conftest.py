"""Shared fixtures: a tokenizer and real MDS shards built by the project's own tools, once per test session.
Helpers the test modules import live in helpers.py."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

# Parallel workers (pytest-xdist) share the machine's cores: one torch thread each (set before torch is imported),
# as the launched runs already have, instead of every worker starting a thread per core. Each worker also registers
# streaming datasets, its own and those of the runs it launches, in its own range of shared-memory prefixes, so two
# workers can never claim the same one (dha_train.data.loaders).
_WORKER = os.environ.get('PYTEST_XDIST_WORKER', '')
if _WORKER.startswith('gw'):
    os.environ['OMP_NUM_THREADS'] = '1'
    os.environ['DHA_TRAIN_SHM_PREFIX_BASE'] = str(10_000 * (1 + int(_WORKER[2:])))

from helpers import SEQ_LEN, synthetic_document, write_redpajama_jsonl  # noqa: E402

# Tests never reach a hub or W&B servers.
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('WANDB_MODE', 'offline')
os.environ.setdefault('WANDB_SILENT', 'true')


@pytest.fixture(scope='session')
def tokenizer_dir(tmp_path_factory) -> Path:
    from dha_train.data.tokenizer import train_byte_level_bpe

    rng = random.Random(1)
    texts = [synthetic_document(rng, d) for d in ('github', 'wikipedia') for _ in range(200)]
    out = tmp_path_factory.mktemp('tokenizer')
    train_byte_level_bpe(texts, out, vocab_size=384)
    return out


@pytest.fixture(scope='session')
def data_root(tmp_path_factory, tokenizer_dir) -> Path:
    """Two domains (github, wikipedia) of real MDS shards with train and val splits, written by data prep."""
    from dha_train.data.prep import prep_redpajama

    raw = write_redpajama_jsonl(tmp_path_factory.mktemp('raw'))
    out = tmp_path_factory.mktemp('mds') / 'data'
    prep_redpajama([raw], out, tokenizer_dir, seq_len=SEQ_LEN, val_tokens=8 * SEQ_LEN, workers=1, progress=False)
    return out




@pytest.fixture(autouse=True, scope='module')
def _release_streaming_shared_memory():
    """streaming frees a dataset's shared memory only at process exit (about 5 files per dataset); over the whole
    suite in one process that ran out of file descriptors. Each module's datasets are closed when it ends."""
    from dha_train.data.loaders import live_shared_memory, release_shared_memory_since
    before = live_shared_memory()
    yield
    release_shared_memory_since(before)
