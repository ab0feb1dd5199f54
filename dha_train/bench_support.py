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

from dha_train.model_folders import file_sha256
from dha_train.paths import recipe_path, write_file_atomically

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


def bench_say(bench: str, message: str) -> None:
    """A bench's progress line: ``[bench <name>] message``, flushed (benches run for hours)."""
    print(f'[bench {bench}] {message}', flush=True)


def bench_source(work: Path, source: str, say=print) -> Path:
    """A bench's source model as an HF folder: an existing folder as is, else the GGUF (a path, or a name
    ``import-gguf`` takes) imported into ``work``, again whenever the file differs from the one the folder was
    imported from."""
    if (Path(source) / 'config.json').is_file():
        return Path(source).resolve()
    from dha_train.gguf_import import PROVENANCE_FILE, import_gguf, resolve_source

    folder = work / Path(source).name.removesuffix('.gguf')
    path, _ = resolve_source(source)
    provenance = folder / PROVENANCE_FILE
    recorded = json.loads(provenance.read_text()).get('sha256') if provenance.is_file() else None
    if not (folder / 'config.json').is_file() or recorded != file_sha256(path):
        say(f'importing {source} into {folder} (about 45 s on 2 cores) ...')
        import_gguf(source, folder, overwrite=True)
    return folder


def write_results(results: dict, folder: Path, copy_to: str | Path | None = None) -> None:
    """Write a bench's ``results.json`` in its own folder and, when asked (``--results``), the same bytes at
    ``copy_to`` (docs/results/...): each atomically, so a run cut off leaves every file whole."""
    text = json.dumps(results, indent=2, default=str)
    Path(folder).mkdir(parents=True, exist_ok=True)
    write_file_atomically(Path(folder) / 'results.json', text)
    if copy_to is not None:
        Path(copy_to).parent.mkdir(parents=True, exist_ok=True)
        write_file_atomically(Path(copy_to), text)
