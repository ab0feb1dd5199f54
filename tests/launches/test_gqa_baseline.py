"""The GQA and AsymGQA launchers end to end: convert a tiny MHA model, continue pre-training (`composer -n 1`: the
launchers pass their process count through; plain LLaMA and the DHA class under 2-process FSDP2 are in
test_distributed.py and test_dha_pipeline.py), export."""

from __future__ import annotations

import math
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from dha_train.models.head_map import HeadMap
from helpers import REPO, launcher_env, logged, save_tiny_llama

pytestmark = pytest.mark.slow


def test_convert_then_ct_then_export(tmp_path, data_root, tokenizer_dir):
    from dha_train.export import export_hf

    mha_dir = tmp_path / 'tiny-mha'
    save_tiny_llama(mha_dir, tokenizer_dir)

    env = launcher_env()
    save_root = tmp_path / 'runs'
    done = subprocess.run(
        ['bash', 'launch/gqa_baseline.sh', str(mha_dir), '2', str(data_root), str(save_root), '1',
         'yamls/gqa/tiny_ct.yaml', 'max_duration=8ba', 'eval_interval=8ba', 'save_interval=4ba'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]

    init = save_root / 'tiny-mha-gqa2-init'
    assert HeadMap.load(init / 'head_map.json').kv_budget_fraction() == 0.25
    evals = logged(log, 'metrics/eval_github/LanguageCrossEntropy')
    assert len(evals) == 2 and all(math.isfinite(v) for v in evals)

    exported = export_hf(save_root / 'tiny-mha-gqa2-ct', tmp_path / 'hf')
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    assert type(model) is LlamaForCausalLM and model.config.num_key_value_heads == 2
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, 384, (1, 16))).logits
    assert torch.isfinite(logits).all()
    # The export's card continues the conversion's: convert, then the CT run with the tokens it trained on; the
    # budget is still stated against the source; no local path is left in the config.
    from dha_train.model_card import read_model_card
    block = read_model_card(exported)[0]['dha_train']
    assert [stage['step'].split(':')[0] for stage in block['stages']] == ['convert', 'train']
    assert block['stages'][-1]['tokens'] == 8 * 16 * 64 and block['method'] == 'mean_pool'
    assert block['fraction_of_source_kv'] == HeadMap.load(init / 'head_map.json').kv_budget_fraction()
    assert 'dha_train_start' not in (exported / 'config.json').read_text()


def test_asym_gqa_launcher_searches_converts_trains_and_exports(tmp_path, data_root, tokenizer_dir):
    """launch/asym_gqa.sh: the AsymGQA search (K and V share a map whose groups may differ in size), mean-pooling
    to it, CT (`composer -n 1`), export; the export loads (plain LLaMA for contiguous equal groups, else the DHA class) and
    generates."""
    from dha_train.export import export_hf
    from helpers import planted_mha

    planted_mha(tmp_path / 'mha')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / 'mha')
    env = launcher_env(SEARCH_ARGS='--tokens 512 --sample-tokens 64 --iterations 25 --fitness kl --batch-size 4')
    save_root = tmp_path / 'runs'
    done = subprocess.run(
        ['bash', 'launch/asym_gqa.sh', str(tmp_path / 'mha'), '2', str(data_root), str(save_root), '1',
         'yamls/asym_gqa/tiny/ct.yaml', 'max_duration=8ba', 'eval_interval=8ba', 'save_interval=4ba'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    head_map = HeadMap.load(save_root / 'mha-asym2-search' / 'head_map.json')
    assert HeadMap.load(save_root / 'mha-asym2-init' / 'head_map.json') == head_map
    assert all(layer.key == layer.value and layer.num_key_heads == 2 for layer in head_map.layers)
    exported = export_hf(save_root / 'mha-asym2-ct', tmp_path / 'hf')
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True, trust_remote_code=True).eval()
    uniform = head_map.uniform_gqa_groups() is not None
    assert (type(model) is LlamaForCausalLM) == uniform
    prompt = torch.randint(0, 384, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    assert out.sequences.shape == (1, 12)
