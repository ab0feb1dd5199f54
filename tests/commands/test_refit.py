"""`dha-train refit` on tiny models: the refitted folder keeps its class and cache bytes, is the source exactly where
the maths allows (identity budget, heads equal up to RoPE-commuting rotations, MLA at full rank), gets closer to the
source otherwise, and bad folders are refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from dha_train.cli import main
from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.conversion.mla import MlaSettings, convert_to_mla
from dha_train.conversion.refit import REFIT_REPORT, RefitError, RefitSettings, refit_folder
from dha_train.methods import kv_cache_bytes
from dha_train.models.head_map import HeadMap, LayerHeadMap
from helpers import save_tiny_llama

HEADS, HEAD_DIM = 8, 8


def _settings(data_root):
    return RefitSettings(data=str(data_root), tokens=1024, batch_size=4)


def _logits(folder, ids):
    import dha_train.models  # noqa: F401
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope='module')
def ids():
    return torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope='module')
def rotated_source(tmp_path_factory, tokenizer_dir):
    """An MHA source whose heads 2i and 2i+1 have keys equal up to a per-pair rotation and scale and values equal up to
    an invertible map: mean-pooling pairs loses information, the refit none."""
    folder = tmp_path_factory.mktemp('rotated') / 'source'
    save_tiny_llama(folder, tokenizer_dir, seed=1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            keys = attn.k_proj.weight.view(HEADS, HEAD_DIM, -1)
            values = attn.v_proj.weight.view(HEADS, HEAD_DIM, -1)
            for head in range(1, HEADS, 2):
                turn = torch.polar(torch.rand(HEAD_DIM // 2, generator=generator) + 0.5,
                                   torch.rand(HEAD_DIM // 2, generator=generator) * 6.28)
                z = torch.complex(keys[head - 1, :HEAD_DIM // 2], keys[head - 1, HEAD_DIM // 2:]) * turn[:, None]
                keys[head] = torch.cat([z.real, z.imag])
                mix = torch.randn(HEAD_DIM, HEAD_DIM, generator=generator) + 3 * torch.eye(HEAD_DIM)
                values[head] = mix @ values[head - 1]
    model.save_pretrained(folder)
    return folder


def test_heads_equal_up_to_rotations_are_refitted_to_the_source_exactly(rotated_source, data_root, tmp_path, ids):
    pooled = convert_checkpoint(rotated_source, tmp_path / 'pooled', HeadMap.pooled(
        HeadMap.from_hf_config(AutoModelForCausalLM.from_pretrained(rotated_source).config), 4))
    report = refit_folder(rotated_source, pooled, tmp_path / 'refit', _settings(data_root))
    source = _logits(rotated_source, ids)
    assert (_logits(pooled, ids) - source).abs().max() > 1e-2  # mean-pool loses the rotated heads
    torch.testing.assert_close(_logits(tmp_path / 'refit', ids), source, rtol=0, atol=1e-4)
    refitted = AutoModelForCausalLM.from_pretrained(tmp_path / 'refit')
    assert type(refitted).__name__ == 'LlamaForCausalLM' and refitted.config.num_key_value_heads == 4
    assert kv_cache_bytes(refitted.config) == kv_cache_bytes(AutoModelForCausalLM.from_pretrained(pooled).config)
    assert report['mean_key_error_after'] < 1e-8 < report['mean_key_error_before']
    assert json.loads((tmp_path / 'refit' / REFIT_REPORT).read_text())['kind'] == 'head_map'


def test_the_identity_budget_refits_to_the_source(tmp_path, tokenizer_dir, data_root, ids):
    save_tiny_llama(tmp_path / 'gqa', tokenizer_dir, seed=4, num_key_value_heads=2)
    same = convert_checkpoint(tmp_path / 'gqa', tmp_path / 'same', HeadMap.pooled(
        HeadMap.from_hf_config(AutoModelForCausalLM.from_pretrained(tmp_path / 'gqa').config), 2))
    code = main(['refit', str(tmp_path / 'gqa'), str(same), str(tmp_path / 'refit'), '--data', str(data_root),
                 '--tokens', '512', '--batch-size', '4'])
    assert code == 0
    torch.testing.assert_close(_logits(tmp_path / 'refit', ids), _logits(tmp_path / 'gqa', ids), rtol=0, atol=1e-5)


def test_a_dha_model_keeps_its_class_and_head_map_and_gets_closer_to_the_source(tmp_path, tokenizer_dir, data_root,
                                                                               ids):
    save_tiny_llama(tmp_path / 'mha', tokenizer_dir, seed=5)
    layer = LayerHeadMap(key=(0, 0, 0, 1, 1, 2, 2, 2), value=(0, 1, 1, 1, 1, 1, 2, 2))
    head_map = HeadMap((layer, layer), HEAD_DIM)
    dha = convert_checkpoint(tmp_path / 'mha', tmp_path / 'dha', head_map)
    report = refit_folder(tmp_path / 'mha', dha, tmp_path / 'refit', _settings(data_root))
    refitted = AutoModelForCausalLM.from_pretrained(tmp_path / 'refit')
    assert type(refitted).__name__ == 'DhaLlamaForCausalLM'
    assert HeadMap.from_hf_config(refitted.config) == HeadMap.from_hf_config(AutoModelForCausalLM.from_pretrained(dha).config)
    assert kv_cache_bytes(refitted.config) == kv_cache_bytes(AutoModelForCausalLM.from_pretrained(dha).config)
    assert (tmp_path / 'refit' / 'head_map.json').is_file()
    for layer_report in report['layers']:
        assert layer_report['key_error_after'] < layer_report['key_error_before']
        assert layer_report['value_error_after'] < layer_report['value_error_before']
    source = _logits(tmp_path / 'mha', ids)
    assert (_logits(tmp_path / 'refit', ids) - source).pow(2).mean() < (_logits(dha, ids) - source).pow(2).mean()


def test_mla_at_full_rank_refits_to_the_source_and_a_third_keeps_its_bytes(tmp_path, tokenizer_dir, data_root, ids):
    save_tiny_llama(tmp_path / 'gqa', tokenizer_dir, seed=6, num_key_value_heads=4)
    full = tmp_path / 'mla-full'
    # FreqFold over all 4 pairs re-bases queries and keys: the refit reads the re-basis off the queries
    convert_to_mla(tmp_path / 'gqa', full, MlaSettings(cache_fraction=1.0, rope_pairs=1, freq_fold=4,
                                                       pair_criterion='uniform', factorisation='weight',
                                                       ranks='uniform', rank_step=1))
    refit_folder(tmp_path / 'gqa', full, tmp_path / 'refit-full', _settings(data_root))
    # full rank with 1 of 4 pairs rotated: the position-free dims lose RoPE, so compare with the conversion itself
    torch.testing.assert_close(_logits(tmp_path / 'refit-full', ids), _logits(full, ids), rtol=0, atol=1e-4)
    third = tmp_path / 'mla-third'
    convert_to_mla(tmp_path / 'gqa', third, MlaSettings(cache_fraction=0.3333, rope_pairs=1, data=str(data_root),
                                                        tokens=512, batch_size=4, rank_step=1))
    report = refit_folder(tmp_path / 'gqa', third, tmp_path / 'refit-third', _settings(data_root))
    refitted = AutoModelForCausalLM.from_pretrained(tmp_path / 'refit-third')
    assert type(refitted).__name__ == 'MlaLlamaForCausalLM'
    assert refitted.config.mla_ranks == AutoModelForCausalLM.from_pretrained(third).config.mla_ranks
    assert kv_cache_bytes(refitted.config) == kv_cache_bytes(AutoModelForCausalLM.from_pretrained(third).config)
    assert report['mean_value_error_after'] < report['mean_value_error_before']


def test_moh_and_foreign_conversions_are_refused(tmp_path, tokenizer_dir, data_root):
    save_tiny_llama(tmp_path / 'source', tokenizer_dir, seed=7)
    shutil.copytree(tmp_path / 'source', tmp_path / 'moh')
    config = json.loads((tmp_path / 'moh' / 'config.json').read_text())
    (tmp_path / 'moh' / 'config.json').write_text(json.dumps({**config, 'model_type': 'moh_llama'}))
    with pytest.raises(RefitError, match='MoH keeps every K/V head'):
        refit_folder(tmp_path / 'source', tmp_path / 'moh', tmp_path / 'out', _settings(data_root))
    save_tiny_llama(tmp_path / 'other', tokenizer_dir, seed=8, num_hidden_layers=3)
    with pytest.raises(RefitError, match='num_hidden_layers'):
        refit_folder(tmp_path / 'source', tmp_path / 'other', tmp_path / 'out', _settings(data_root))
    save_tiny_llama(tmp_path / 'unrelated', tokenizer_dir, seed=9)
    with pytest.raises(RefitError, match='do not match the source'):
        refit_folder(tmp_path / 'source', tmp_path / 'unrelated', tmp_path / 'out', _settings(data_root))
    assert not (tmp_path / 'out').exists()
