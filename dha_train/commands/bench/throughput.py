"""`dha-train bench throughput`: training tokens/s, 1 process against N processes with FSDP2, same global batch.

Every configuration is a real `composer -n N -m dha_train.train` launch of yamls/bench/throughput.yaml over
synthetic MDS shards, timed by the `throughput_probe` callback after warm-up batches. Ratios are measured in the
same run, so they compare like with like on a noisy machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from streaming import MDSWriter

from dha_train.paths import recipe_path

MODEL_SIZES: dict[str, dict] = {
    'tiny': {'hidden_size': 128, 'intermediate_size': 344, 'num_hidden_layers': 4, 'num_attention_heads': 8,
             'num_key_value_heads': 8},
    'small': {'hidden_size': 384, 'intermediate_size': 1024, 'num_hidden_layers': 6, 'num_attention_heads': 8,
              'num_key_value_heads': 8},
}
SEQ_LEN = 256
VOCAB = 4096


def write_synthetic_shards(root: Path, samples: int = 2048, seed: int = 0) -> Path:
    """Random-token MDS samples in the data-prep layout (<root>/github/train), with a manifest."""
    rng = np.random.default_rng(seed)
    with MDSWriter(out=str(root / 'github' / 'train'), columns={'tokens': 'ndarray:uint16'}) as writer:
        for _ in range(samples):
            writer.write({'tokens': rng.integers(3, VOCAB, SEQ_LEN, dtype=np.uint16)})
    (root / 'manifest.json').write_text(json.dumps({'vocab_size': VOCAB, 'seq_len': SEQ_LEN}))
    return root


def _launch(model: str, processes: int, steps: int, data: Path, work: Path) -> dict:
    result_file = work / f'{model}-{processes}p.json'
    overrides = [f'variables.data_root={data}', f'variables.out={result_file}', f'max_duration={steps + 3}ba']
    overrides += [f'model.config.{k}={v}' for k, v in MODEL_SIZES[model].items()]
    if processes > 1:
        overrides.append('fsdp.enabled=true')
    cmd = [sys.executable, '-m', 'composer.cli.launcher', '-n', str(processes), '--master_port',
           str(29500 + processes), '-m', 'dha_train.train', str(recipe_path('bench/throughput.yaml')), *overrides]
    log = work / f'{model}-{processes}p.log'
    # Split the cores between the processes, so N processes do not oversubscribe what 1 process uses alone.
    threads = max(1, (os.cpu_count() or 1) // processes)
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': str(threads)}
    with log.open('w') as handle:
        done = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0 or not result_file.is_file():
        raise RuntimeError(f'bench run {model} x{processes} failed (exit {done.returncode}); see {log}')
    return json.loads(result_file.read_text())


def run_throughput_bench(models=('tiny', 'small'), processes=(1, 2), steps: int = 12, out: str | None = None) -> dict:
    unknown = [m for m in models if m not in MODEL_SIZES]
    if unknown:
        raise ValueError(f'unknown bench model(s) {unknown}; choose from {sorted(MODEL_SIZES)}')
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix='dha-bench-'))
    work.mkdir(parents=True, exist_ok=True)
    data = work / 'data'
    if not (data / 'manifest.json').is_file():
        write_synthetic_shards(data)
    results: dict = {}
    for model in models:
        for n in processes:
            print(f'[bench] {model}: {n} process(es){" with FSDP2" if n > 1 else ""} ...', flush=True)
            results.setdefault(model, {})[n] = _launch(model, n, steps, data, work)
    base = min(processes)
    print()
    print(f'training throughput, global batch 16 x {SEQ_LEN} tokens, {steps} timed batches after 3 warm-up')
    print(f'  {"model":<7} {"processes":>9} {"tokens/s":>10} {"vs " + str(base) + " proc":>10}')
    for model, rows in results.items():
        for n, row in rows.items():
            ratio = row['tokens_per_sec'] / rows[base]['tokens_per_sec']
            row['ratio_vs_base'] = ratio
            label = f'{n} (FSDP2)' if n > 1 else str(n)
            print(f'  {model:<7} {label:>9} {row["tokens_per_sec"]:>10.0f} {ratio:>9.2f}x')
    (work / 'results.json').write_text(json.dumps(results, indent=2))
    print(f'  logs and results.json in {work}')
    return results
