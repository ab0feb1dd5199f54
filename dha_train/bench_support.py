"""What the benches share (`dha-train bench ...`, each section a module of ``dha_train.commands.bench``): timing,
synthetic data, and a real `composer -n N` launch of a bench recipe. The quickstart run the conversion and MoH
benches build their teacher with is ``dha_train.quickstart``."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from streaming import MDSWriter

from dha_train.paths import recipe_path

COLD_BYTES = 512 * 2 ** 20  # K/V copies the attention timings cycle through, so a cache is read from memory
SYNTHETIC_SEQ_LEN = 256
SYNTHETIC_VOCAB = 4096


def median_rounds(timers: dict, repeats: int) -> dict[str, float]:
    """Run every timer once per round, interleaved, and keep each one's median seconds."""
    seconds = {name: [] for name in timers}
    for _ in range(repeats):
        for name, timer in timers.items():
            seconds[name].append(timer())
    return {name: statistics.median(values) for name, values in seconds.items()}


def moh_budget(heads: int, fraction: float) -> tuple[int, int]:
    """(shared heads, routed top-k) activating ``round(fraction * heads)`` heads: H/2 shared (the paper's LLaMA
    setting) when more than half the heads are active, else H/4."""
    active = round(fraction * heads)
    shared = heads // 2 if active > heads // 2 else heads // 4
    if not shared < active <= heads:
        raise ValueError(f'bench moh: {fraction:.0%} of {heads} heads leaves no routed head to pick')
    return shared, active - shared


def write_synthetic_shards(root: Path, samples: int = 2048, seed: int = 0) -> Path:
    """Random-token MDS samples in the data-prep layout (<root>/github/train), with a manifest."""
    rng = np.random.default_rng(seed)
    with MDSWriter(out=str(root / 'github' / 'train'), columns={'tokens': 'ndarray:uint16'}) as writer:
        for _ in range(samples):
            writer.write({'tokens': rng.integers(3, SYNTHETIC_VOCAB, SYNTHETIC_SEQ_LEN, dtype=np.uint16)})
    (root / 'manifest.json').write_text(json.dumps({'vocab_size': SYNTHETIC_VOCAB, 'seq_len': SYNTHETIC_SEQ_LEN}))
    return root


def free_port() -> int:
    """A TCP port free on this machine now, for a launch's --master_port."""
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        return probe.getsockname()[1]


def launch_bench_recipe(processes: int, recipe: str, overrides: list[str], log: Path) -> int:
    """`composer -n processes -m dha_train.train yamls/<recipe> overrides...` on a free port, its output in ``log``;
    the cores are split between the processes, so N processes do not oversubscribe what 1 process uses alone.
    Returns the exit code."""
    cmd = [sys.executable, '-m', 'composer.cli.launcher', '-n', str(processes), '--master_port', str(free_port()),
           '-m', 'dha_train.train', str(recipe_path(recipe)), *overrides]
    threads = max(1, (os.cpu_count() or 1) // processes)
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': str(threads)}
    with log.open('w') as handle:
        return subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env).returncode
