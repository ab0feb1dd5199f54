"""`dha-train bench load`: peak host memory per rank of starting an FSDP2 run from a pretrained folder, every rank
loading the whole model (``model.load_on_rank0=false``, the old path) against rank 0 alone (the default: the other
ranks build the model on the meta device and Composer's FSDP2 broadcasts rank 0's weights while sharding).

Both are real `composer -n 2 -m dha_train.train` launches of yamls/bench/load.yaml on the CPU, with the same code
and the same pretrained folder (a LLaMA of a few hundred MB of fp32 weights, written once as bf16 safetensors into
the output folder) and one training batch. Each rank's ``memory_probe`` callback records its peak resident set size
(Linux's ``VmHWM``: the high-water mark of the pages the process held in RAM, mmapped weight files included) before
the model is built, once it is built, once it is sharded and after the first batch; the ratios are measured in the
same run.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train.bench_support import SYNTHETIC_SEQ_LEN, SYNTHETIC_VOCAB, launch_bench_recipe, write_synthetic_shards
from dha_train.data.tokenizer import train_byte_level_bpe

# 111M parameters: 445 MB of fp32 weights in memory, enough to stand out of the ~0.8 GB every process holds after
# importing torch, transformers and Composer.
MODEL = {'vocab_size': SYNTHETIC_VOCAB, 'hidden_size': 1024, 'intermediate_size': 2816, 'num_hidden_layers': 8,
         'num_attention_heads': 16, 'num_key_value_heads': 16, 'max_position_embeddings': SYNTHETIC_SEQ_LEN}
PROCESSES = 2
PHASES = ('start', 'model_built', 'sharded', 'first_batch')
PATHS = {'every_rank': 'false', 'rank0': 'true'}  # bench label -> model.load_on_rank0


def write_pretrained(folder: Path) -> Path:
    """A randomly initialised LLaMA of ``MODEL``'s size saved as an HF folder of bf16 safetensors, as LLaMA
    checkpoints are released (in 16 bits), with a small tokenizer (training needs one beside the weights; the
    synthetic data uses token ids up to the model's vocabulary).

    16-bit on disk matters: the run builds fp32 weights, so loading converts every tensor into memory of its own.
    An fp32 file would be mapped as it is (transformers keeps the safetensors' mmap), its pages read only when the
    weights are first touched and shared by every process of the node through the page cache."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    texts = [f'The {word} of the model is loaded on rank {rank}.' for word in ('weight', 'shard', 'layer', 'head')
             for rank in range(50)]
    train_byte_level_bpe(texts, folder, vocab_size=300)
    return folder


def _launch(path: str, pretrained: Path, data: Path, work: Path) -> list[dict]:
    out = work / path
    overrides = [f'variables.model_path={pretrained}', f'variables.data_root={data}', f'variables.out={out}',
                 f'model.load_on_rank0={PATHS[path]}']
    log = work / f'{path}.log'
    code = launch_bench_recipe(PROCESSES, 'bench/load.yaml', overrides, log)
    files = [out / f'rank{rank}.json' for rank in range(PROCESSES)]
    if code != 0 or not all(f.is_file() for f in files):
        raise RuntimeError(f'bench load run {path} failed (exit {code}); see {log}')
    return [json.loads(f.read_text()) for f in files]


def _mb(value: float) -> str:
    return f'{value / 2**20:,.0f}'


def run_load_bench(out: str | None = None) -> dict:
    work = Path(out) if out else Path(tempfile.mkdtemp(prefix='dha-bench-load-'))
    work.mkdir(parents=True, exist_ok=True)
    data = work / 'data'
    if not (data / 'manifest.json').is_file():
        write_synthetic_shards(data, samples=64)
    pretrained = work / 'pretrained'
    if not (pretrained / 'model.safetensors').is_file():
        print(f'[bench] writing the pretrained folder {pretrained} ...', flush=True)
        write_pretrained(pretrained)
    with torch.device('meta'):
        weights = 4 * sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**MODEL)).parameters())  # fp32 bytes
    runs = {}
    for path in PATHS:
        print(f'[bench] {PROCESSES} processes, FSDP2, model.load_on_rank0={PATHS[path]} ...', flush=True)
        runs[path] = _launch(path, pretrained, data, work)
    for path, ranks in runs.items():
        if any(rank['built_on_meta'] for rank in ranks) != (path == 'rank0'):
            raise RuntimeError(f'bench load run {path}: the ranks built on the meta device were '
                               f'{[rank["rank"] for rank in ranks if rank["built_on_meta"]]}')

    print()
    print(f'peak host RSS per rank (MiB), {PROCESSES} processes with FSDP2 on CPU, a LLaMA of {_mb(weights)} MiB '
          'of fp32 weights (bf16 safetensors on disk); each figure is the peak up to that point')
    print(f'  {"rank":<5} {"phase":<12} {"every rank loads":>17} {"rank 0 loads":>13} {"ratio":>7}')
    results: dict = {'fp32_weights_bytes': weights, 'processes': PROCESSES, 'runs': runs, 'ratios': {}}
    for rank in range(PROCESSES):
        for phase in PHASES:
            old = runs['every_rank'][rank]['peak_rss_bytes'][phase]
            new = runs['rank0'][rank]['peak_rss_bytes'][phase]
            results['ratios'][f'rank{rank}/{phase}'] = new / old
            print(f'  {rank:<5} {phase:<12} {_mb(old):>17} {_mb(new):>13} {new / old:>6.2f}x')
    totals = {path: sum(rank['peak_rss_bytes']['first_batch'] for rank in ranks) for path, ranks in runs.items()}
    added = {path: sum(rank['peak_rss_bytes']['model_built'] - rank['peak_rss_bytes']['start'] for rank in ranks)
             for path, ranks in runs.items()}
    results['ratios']['all_ranks/first_batch'] = totals['rank0'] / totals['every_rank']
    results['ratios']['all_ranks/added_by_loading'] = added['rank0'] / added['every_rank']
    print(f'  all ranks, peak through the first batch: {_mb(totals["every_rank"])} -> {_mb(totals["rank0"])} MiB '
          f'({results["ratios"]["all_ranks/first_batch"]:.2f}x)')
    print(f'  all ranks, added by building the model (model_built - start): {_mb(added["every_rank"])} -> '
          f'{_mb(added["rank0"])} MiB ({results["ratios"]["all_ranks/added_by_loading"]:.2f}x)')
    (work / 'results.json').write_text(json.dumps(results, indent=2))
    print(f'  logs and results.json in {work}')
    return results
