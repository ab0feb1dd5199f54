"""`dha-train align` (aligned GQA's transform): on an MHA model whose K and V heads are rotated near-copies within
planted groups, the aligned similarity finds the groups, generalised Procrustes undoes the rotations, and the
aligned, regrouped model computes exactly what the input computes."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from dha_train.config import ConfigError
from dha_train.conversion.align import ALIGNMENT_REPORT, TARGET_MAP_FILE, AlignSettings, run_align
from dha_train.models.head_map import HeadMap
from dha_train.ops.alignment import plane_rotation
from helpers import HEAD_DIM, HEADS, launcher_env, planted_mha


def rotated_planted_mha(path, query_heads: int = HEADS):
    """planted_mha (GQA with ``query_heads`` > 8), then each head's K rows turned by a random RoPE-plane rotation and its V rows by a random
    orthogonal map: the groups are still there, but only after alignment."""
    truth = planted_mha(path / 'planted', query_heads=query_heads)
    model = LlamaForCausalLM.from_pretrained(path / 'planted')
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            key = plane_rotation(torch.rand(HEADS, HEAD_DIM // 2, generator=generator) * 6.0)
            value = torch.linalg.qr(torch.randn(HEADS, HEAD_DIM, HEAD_DIM, generator=generator))[0]
            for projection, maps in ((layer.self_attn.k_proj, key), (layer.self_attn.v_proj, value)):
                heads = projection.weight.view(HEADS, HEAD_DIM, -1)
                projection.weight.copy_((maps.transpose(1, 2) @ heads).reshape_as(projection.weight))
    model.save_pretrained(path / 'rotated')
    return truth, model.eval()


@pytest.mark.parametrize('group_by, criterion', [('value', 'cos'), ('key', 'dist')])
def test_align_finds_rotated_groups_raises_cosine_and_preserves_the_model(tmp_path, data_root, group_by, criterion):
    truth, model = rotated_planted_mha(tmp_path)
    out = tmp_path / 'aligned'
    report = run_align(tmp_path / 'rotated', out, AlignSettings(num_groups=2, criterion=criterion, group_by=group_by,
                                                                  data=str(data_root), tokens=1024, batch_size=4))
    assert [entry['groups'] for entry in report['layers']] == [layer[group_by] for layer in truth]
    cosine = report['mean_cosine']
    assert cosine[f'{group_by}_after'] > 0.9 and cosine[f'{group_by}_after'] > cosine[f'{group_by}_before'] + 0.3, \
        cosine
    assert json.loads((out / ALIGNMENT_REPORT).read_text())['head_order'] == report['head_order']
    assert HeadMap.load(out / TARGET_MAP_FILE) == HeadMap.gqa(2, HEADS, 2, HEAD_DIM)
    assert not (out / 'head_map.json').exists()  # still an MHA folder
    aligned = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(aligned(ids).logits, model(ids).logits, rtol=0, atol=1e-4)


def test_align_on_a_gqa_source_groups_its_shared_heads_and_preserves_the_model(tmp_path, data_root):
    """16 query heads sharing the 8 rotated planted K/V heads: the shared heads are aligned and grouped, each query
    head follows its K/V head's rotation and order, and the result is still standard GQA computing the same."""
    truth, model = rotated_planted_mha(tmp_path, query_heads=16)
    out = tmp_path / 'aligned'
    report = run_align(tmp_path / 'rotated', out, AlignSettings(num_groups=2, data=str(data_root), tokens=1024,
                                                                  batch_size=4))
    assert [entry['groups'] for entry in report['layers']] == [layer['value'] for layer in truth]
    assert report['mean_cosine']['value_after'] > 0.9
    assert HeadMap.load(out / TARGET_MAP_FILE) == HeadMap.gqa(2, 16, 2, HEAD_DIM)
    aligned = LlamaForCausalLM.from_pretrained(out).eval()
    assert aligned.config.num_key_value_heads == HEADS
    ids = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(aligned(ids).logits, model(ids).logits, rtol=0, atol=1e-4)
    # the aligned folder's model card: the method, one stage, the (unchanged) KV bytes of the model in the folder
    from dha_train.methods import kv_cache_bytes
    from dha_train.model_card import read_model_card
    header = read_model_card(out)[0]
    assert header['dha_train']['method'] == 'aligned_gqa' and header['base_model'] == 'rotated'
    assert header['dha_train']['kv_bytes_per_4096_tokens_bf16'] == kv_cache_bytes(aligned.config, 4096, 2)
    assert header['dha_train']['fraction_of_source_kv'] == 1.0
    assert [stage['step'].split(':')[0] for stage in header['dha_train']['stages']] == ['align']


def test_align_rejects_bad_settings_before_calibrating(tmp_path, data_root):
    planted_mha(tmp_path / 'mha')
    with pytest.raises(ConfigError, match='num_groups 3'):
        run_align(tmp_path / 'mha', tmp_path / 'out', AlignSettings(num_groups=3, data=str(data_root)))
    with pytest.raises(ConfigError, match='criterion'):
        run_align(tmp_path / 'mha', tmp_path / 'out', AlignSettings(num_groups=2, criterion='l2', data=str(data_root)))
    with pytest.raises(FileNotFoundError, match='calibration data'):
        run_align(tmp_path / 'mha', tmp_path / 'out', AlignSettings(num_groups=2, data=str(tmp_path / 'nowhere')))


@pytest.mark.slow
def test_aligned_gqa_launcher_end_to_end(tmp_path, data_root, tokenizer_dir):
    """launch/aligned_gqa.sh with the tiny recipe: align -> FSDP2 pruning with distillation (`composer -n 1`; with
    2 processes in test_kv_head_transfer.py) -> export as standard HF GQA, which plain transformers loads and
    generates with, its KV cache holding 2 heads; a re-run skips both stages."""
    import subprocess

    from transformers import AutoTokenizer

    from helpers import REPO

    planted_mha(tmp_path / 'mha')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / 'mha')
    env = launcher_env(ALIGN_ARGS='--tokens 512 --batch-size 4')
    command = ['bash', 'launch/aligned_gqa.sh', str(tmp_path / 'mha'), 'yamls/aligned_gqa/tiny', str(data_root),
               str(tmp_path / 'runs'), '2', '1', 'variables.steps=20', 'eval_interval=20ba', 'save_interval=10ba']
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    assert 'distill/kl' in log and 'transfer/frozen' in log

    hf = tmp_path / 'runs' / 'mha-agqa2-prune' / 'hf'
    model = LlamaForCausalLM.from_pretrained(hf, local_files_only=True).eval()
    assert type(model) is LlamaForCausalLM and model.config.num_key_value_heads == 2
    prompt = torch.randint(0, 384, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, min_new_tokens=6,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    assert out.sequences.shape == (1, 14)
    cache = out.past_key_values
    keys = cache.key_cache[0] if hasattr(cache, 'key_cache') else cache[0][0]
    assert keys.shape[1] == 2  # (batch, K/V heads, tokens, head dim)

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and 'align: done' in again.stdout and 'prune: done' in again.stdout
