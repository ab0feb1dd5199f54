"""Decode speed of GGUF files in llama.cpp with weight repacking on and off, and with other builds of its libraries:
the measurement behind docs/serving.md's "AMX CPUs" section. Each (build, file, repacking) runs in a process of its
own, so a crash is a row (with its signal), not the end of the run; every row of one run shares the machine's state.

    python tools/llama_cpp_speed.py FILE.gguf ... --out docs/results/llama_cpp_amx.json \
        [--build no-amx=/path/to/lib]   # a folder of llama.cpp's shared libraries (LLAMA_CPP_LIB_PATH)

Prints the Markdown table the docs quote and writes it with the rows to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# One child: load, answer the prompt greedily, then time decoding after a 256-token prompt (best of 3 rounds).
_CHILD = r'''
import json, sys, time, llama_cpp
path, repack, threads = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
defaults = llama_cpp.llama_cpp.llama_model_default_params
def params():
    p = defaults(); p.use_extra_bufts = repack; return p
llama_cpp.llama_cpp.llama_model_default_params = params
llm = llama_cpp.Llama(model_path=path, n_ctx=1024, verbose=False, n_threads=threads, n_threads_batch=threads,
                      flash_attn=True)
prompt = llm.tokenize(b"The capital of France is", add_bos=False)
answer = []
for token in llm.generate(prompt, top_k=1, temp=0):
    answer.append(token)
    if len(answer) == 4:
        break
best = 0.0
for _ in range(3):
    llm.reset(); llm.eval((prompt * 64)[:256])
    start = time.perf_counter()
    for i in range(48):
        llm.eval([prompt[i % len(prompt)]])
    best = max(best, 48 / (time.perf_counter() - start))
info = llama_cpp.llama_print_system_info().decode()
print(json.dumps({"decode_tps": round(best, 1), "answer": llm.detokenize(answer).decode("utf-8", "replace"),
                  "amx": "AMX_INT8 = 1" in info, "repack_kernels": "REPACK = 1" in info}))
'''


def _signal_name(code: int) -> str:
    import signal
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f'signal {-code}'


def measure(build: str, lib: str | None, path: Path, repack: bool, threads: int) -> dict:
    env = dict(os.environ)
    if lib:
        env['LLAMA_CPP_LIB_PATH'] = lib
    done = subprocess.run([sys.executable, '-c', _CHILD, str(path), '1' if repack else '0', str(threads)],
                          capture_output=True, text=True, env=env, timeout=900)
    row = {'build': build, 'file': path.name, 'repack': repack}
    if done.returncode < 0:
        return {**row, 'crashed': _signal_name(done.returncode)}
    if done.returncode != 0:
        return {**row, 'crashed': f'exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}'}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1])}


def table(rows: list[dict]) -> str:
    lines = ['| build | file | repacking | decode tok/s | answer to "The capital of France is" |',
             '| --- | --- | --- | --- | --- |']
    for row in rows:
        speed = f"crashed ({row['crashed']})" if 'crashed' in row else f"{row['decode_tps']:.1f}"
        answer = '' if 'crashed' in row else row['answer'].replace('\n', ' ').strip()
        lines.append(f"| {row['build']} | {row['file']} | {'on' if row['repack'] else 'off'} | {speed} | {answer} |")
    return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('files', nargs='+', type=Path)
    parser.add_argument('--build', action='append', default=[], metavar='NAME=LIBDIR',
                        help='another build of llama.cpp\'s libraries to measure beside the installed one')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--out', type=Path, required=True)
    args = parser.parse_args(argv)
    builds = [('installed', None)] + [tuple(item.split('=', 1)) for item in args.build]
    rows = [measure(build, lib, path, repack, args.threads)
            for build, lib in builds for path in args.files for repack in (True, False)]
    text = table(rows)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({'date': time.strftime('%Y-%m-%d'), 'machine': os.uname().machine,
                                    'cpu_count': os.cpu_count(), 'threads': args.threads,
                                    'builds': {name: lib or 'llama-cpp-python as installed' for name, lib in builds},
                                    'rows': rows, 'table': text}, indent=2) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
