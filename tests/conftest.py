"""Shared fixtures: a tokenizer and real MDS shards built by the project's own tools, once per test session."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 64

# Tests never reach a hub or W&B servers.
os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('WANDB_MODE', 'offline')
os.environ.setdefault('WANDB_SILENT', 'true')

_WORDS = ('attention head key value query fusion group budget layer token model weight train loss gradient '
          'sample shard stream domain batch checkpoint resume export search merge mean pool kernel').split()


def synthetic_document(rng: random.Random, domain: str) -> str:
    """Text with enough structure to learn quickly: repeated templates over a small vocabulary."""
    if domain == 'github':
        name = rng.choice(_WORDS)
        return '\n'.join(f'def {name}_{i}(x):\n    return x * {rng.randint(1, 9)} + {name}' for i in range(rng.randint(2, 8)))
    return ' '.join(f'The {rng.choice(_WORDS)} of the {rng.choice(_WORDS)} is {rng.choice(_WORDS)}.'
                    for _ in range(rng.randint(3, 15)))


def write_redpajama_jsonl(root: Path, docs_per_domain: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    for domain in ('github', 'wikipedia'):
        folder = root / domain
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / f'{domain}_0.jsonl').open('w') as handle:
            for i in range(docs_per_domain):
                handle.write(json.dumps({'text': synthetic_document(rng, domain), 'meta': {'id': i}}) + '\n')
    return root


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


def tiny_recipe(data_root: Path, tokenizer_dir: Path, **overrides) -> dict:
    """A tiny LLaMA recipe over the session data; keyword overrides replace top-level keys."""
    recipe = {
        'variables': {'data_root': str(data_root)},
        'run_name': 'tiny-test',
        'seed': 7,
        'model': {
            'tokenizer': str(tokenizer_dir),
            'config': {'vocab_size': 384, 'hidden_size': 64, 'intermediate_size': 128, 'num_hidden_layers': 2,
                       'num_attention_heads': 4, 'num_key_value_heads': 4, 'max_position_embeddings': SEQ_LEN},
        },
        'train_loader': {'root': '${variables.data_root}',
                         'streams': {'github': {'proportion': 0.6}, 'wikipedia': {'proportion': 0.4}}},
        'optimizer': {'lr': 3.0e-3},
        'scheduler': {'t_warmup': '2ba'},
        'max_duration': '12ba',
        'global_train_batch_size': 8,
        'device_train_microbatch_size': 4,
        'console_log_interval': '1ba',
    }
    recipe.update(overrides)
    return recipe


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def composer_command(nproc: int, recipe: Path, *overrides: str, port: int) -> list[str]:
    return [sys.executable, '-m', 'composer.cli.launcher', '-n', str(nproc), '--master_port', str(port),
            '-m', 'dha_train.train', str(recipe), *overrides]


def run_composer(nproc: int, recipe: Path, *overrides: str, port: int, log: Path, timeout: int = 300):
    """A real `composer -n N` launch (gloo on CPU); returns the completed process with its output in ``log``."""
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1'}
    with log.open('w') as handle:
        done = subprocess.run(composer_command(nproc, recipe, *overrides, port=port), stdout=handle,
                              stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout)
    return done


def latest_checkpoint_batch(save_folder: Path) -> int | None:
    """The batch of the checkpoint ``latest-rank0.pt`` points to, or None before the first checkpoint."""
    import re

    link = save_folder / 'latest-rank0.pt'
    if not link.is_symlink():
        return None
    match = re.search(r'ba(\d+)', os.readlink(link))
    return int(match.group(1)) if match else None


def launch_and_kill_after_checkpoint(recipe: Path, save_folder: Path, *, port: int, log: Path,
                                     at_least: int) -> int:
    """Launch `composer -n 2`, SIGKILL the whole process group as soon as a checkpoint at batch >= ``at_least``
    exists, and return the batch the run would resume from."""
    import signal
    import time

    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1'}
    with log.open('w') as handle:
        proc = subprocess.Popen(composer_command(2, recipe, f'save_folder={save_folder}', port=port),
                                stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + 240
        while (latest_checkpoint_batch(save_folder) or 0) < at_least:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, 'no checkpoint appeared in time'
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return latest_checkpoint_batch(save_folder)
