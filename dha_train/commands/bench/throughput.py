"""`dha-train bench throughput`: training tokens/s, 1 process against N processes with FSDP2, same global batch.

Every configuration is a real `composer -n N -m dha_train.train` launch of yamls/bench/throughput.yaml over
synthetic MDS shards, timed by the `throughput_probe` callback after warm-up batches. Ratios are measured in the
same run, so they compare like with like on a noisy machine.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from dha_train.bench_support import SYNTHETIC_SEQ_LEN, launch_bench_recipe, write_synthetic_shards

MODEL_SIZES: dict[str, dict] = {
    'tiny': {'hidden_size': 128, 'intermediate_size': 344, 'num_hidden_layers': 4, 'num_attention_heads': 8,
             'num_key_value_heads': 8},
    'small': {'hidden_size': 384, 'intermediate_size': 1024, 'num_hidden_layers': 6, 'num_attention_heads': 8,
              'num_key_value_heads': 8},
}
def _launch(model: str, processes: int, steps: int, data: Path, work: Path) -> dict:
    result_file = work / f'{model}-{processes}p.json'
    overrides = [f'variables.data_root={data}', f'variables.out={result_file}', f'max_duration={steps + 3}ba']
    overrides += [f'model.config.{k}={v}' for k, v in MODEL_SIZES[model].items()]
    if processes > 1:
        overrides.append('fsdp.enabled=true')
    log = work / f'{model}-{processes}p.log'
    code = launch_bench_recipe(processes, 'bench/throughput.yaml', overrides, log)
    if code != 0 or not result_file.is_file():
        raise RuntimeError(f'bench run {model} x{processes} failed (exit {code}); see {log}')
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
    print(f'training throughput, global batch 16 x {SYNTHETIC_SEQ_LEN} tokens, {steps} timed batches after 3 warm-up')
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
