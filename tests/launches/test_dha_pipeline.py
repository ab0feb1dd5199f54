"""launch/dha_pipeline.sh with the tiny recipes: Search -> Fusion -> CT -> export with 2 processes (gloo, FSDP2);
the export loads with trust_remote_code=True and generates with a KV cache of exactly the budgeted size; a re-run
skips finished stages and finishes an interrupted one."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.models.head_map import HeadMap
from helpers import REPO, SEQ_LEN, free_port, launcher_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYERS, HEADS, HEAD_DIM = 2, 8, 8
STAGE_OVERRIDES = ['max_duration=8ba', 'eval_interval=8ba', 'save_interval=4ba', 'scheduler.t_warmup=2ba',
                   'global_train_batch_size=8', 'device_train_microbatch_size=4', 'device_eval_batch_size=8']


def _run_pipeline(mha_dir, data_root, save_root, port):
    env = launcher_env(port, DHA_NAME='tiny-dha25')
    done = subprocess.run(['bash', 'launch/dha_pipeline.sh', str(mha_dir), 'yamls/dha/tiny', str(data_root),
                           str(save_root), '0.25', '2', *STAGE_OVERRIDES],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-5000:]
    return log


def test_dha_pipeline_end_to_end_with_two_processes(tmp_path, data_root, tokenizer_dir):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ_LEN)
    mha_dir = tmp_path / 'tiny-mha'
    LlamaForCausalLM(config).save_pretrained(mha_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(mha_dir)
    save_root = tmp_path / 'runs'

    log = _run_pipeline(mha_dir, data_root, save_root, free_port())
    searched = HeadMap.load(save_root / 'tiny-dha25-search' / 'search' / 'head_map.json')
    assert sum(k + v for k, v in searched.kv_heads()) == 2 * LAYERS * HEADS // 4  # the 25% budget, exactly
    assert 'head_search: wrote' in log

    final = save_root / 'tiny-dha25-ct' / 'hf'
    model = AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True, local_files_only=True).eval()
    assert type(model).__name__ == 'DhaLlamaForCausalLM'
    head_map = HeadMap.from_dict(model.config.head_map)
    assert head_map == searched and HeadMap.load(final / 'head_map.json') == searched
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(0))
    new_tokens = 6
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, use_cache=True, return_dict_in_generate=True, pad_token_id=0)
    assert out.sequences.shape == (2, 12 + new_tokens)
    layers = list(out.past_key_values)
    assert [(k.shape[1], v.shape[1]) for k, v in layers] == searched.kv_heads()
    cached_len = 12 + new_tokens - 1  # the last generated token is never fed back
    cache_bytes = sum(t.numel() * t.element_size() for k, v in layers for t in (k, v))
    assert cache_bytes == searched.kv_cache_bytes(2, cached_len, bytes_per_element=4)
    assert 4 * cache_bytes == HeadMap.mha(LAYERS, HEADS, HEAD_DIM).kv_cache_bytes(2, cached_len, 4)

    # Re-run after losing the final export: Search and Fusion are skipped, CT is already finished, export redone.
    shutil.rmtree(final)
    again = _run_pipeline(mha_dir, data_root, save_root, free_port())
    assert 'search: done' in again and 'fusion: done' in again and 'already finished' in again
    assert (final / 'config.json').is_file()
