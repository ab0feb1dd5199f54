"""tools/gpu_check.py, run as the GPU check runs it but with ``--device cpu`` (no GPU here): a conversion, a real
`composer -n 1` FSDP2 launch of the method's recipe, its plan, and the JSON and Markdown it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, save_tiny_llama

pytestmark = pytest.mark.slow


def test_the_gpu_check_runs_a_method_on_cpu_and_writes_its_table(tokenizer_dir, tmp_path):
    source = tmp_path / 'source'
    save_tiny_llama(source, tokenizer_dir, hidden_size=144, intermediate_size=256, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=128)
    out = tmp_path / 'out'
    done = subprocess.run([sys.executable, str(REPO / 'tools' / 'gpu_check.py'), '--device', 'cpu', '--source',
                           str(source), '--out', str(out), '--batches', '3', '--batch', '4', '--microbatch', '2',
                           '--seq-len', '64', '--corpus-bytes', '200000', '--skip-bench-real', '--methods', 'gqa-ct'],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = json.loads((out / 'gpu_check.json').read_text())
    assert results['environment']['device'] == 'cpu'
    (row,) = results['methods']
    assert row['name'] == 'gqa-ct' and 'error' not in row and 'plan_error' not in row
    assert row['tokens_per_s'] > 0 and row['plan_peak_gib'] > 0 and row['flops_per_token'] > 0
    assert '| gqa-ct | `yamls/real/ct.yaml` |' in (out / 'gpu_check.md').read_text()
