"""The GQA baseline end to end: convert a tiny MHA model, continue pre-training with 2 processes, export."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import REPO, SEQ_LEN
from dha_train.models.head_map import HeadMap


def test_convert_then_ct_with_two_processes_then_export(tmp_path, data_root, tokenizer_dir):
    from dha_train.export import export_hf

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=SEQ_LEN)
    mha_dir = tmp_path / 'tiny-mha'
    LlamaForCausalLM(config).save_pretrained(mha_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(mha_dir)

    env = {**os.environ, 'PYTHONUNBUFFERED': '1', 'OMP_NUM_THREADS': '1',
           'DHA_TRAIN': f'{sys.executable} -m dha_train.cli',
           'COMPOSER': f'{sys.executable} -m composer.cli.launcher --master_port 29631'}
    save_root = tmp_path / 'runs'
    done = subprocess.run(
        ['bash', 'launch/gqa_baseline.sh', str(mha_dir), '2', str(data_root), str(save_root), '2',
         'yamls/gqa/tiny_ct.yaml', 'max_duration=8ba', 'eval_interval=8ba', 'save_interval=4ba'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]

    init = save_root / 'tiny-mha-gqa2-init'
    assert HeadMap.load(init / 'head_map.json').kv_budget_fraction() == 0.25
    evals = [float(x) for x in re.findall(r'metrics/eval_github/LanguageCrossEntropy: ([0-9.]+)', log)]
    assert len(evals) == 2 and all(math.isfinite(v) for v in evals)

    exported = export_hf(save_root / 'tiny-mha-gqa2-ct', tmp_path / 'hf')
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert type(model) is LlamaForCausalLM and model.config.num_key_value_heads == 2
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, 384, (1, 16))).logits
    assert torch.isfinite(logits).all()
