"""The model card every folder the project writes carries (``dha_train.model_card``), parsed back and checked
field by field against the model in the folder: convert (mean-pool, MLA, DeepSeek format), refit (the chain of
stages), and the licence carried from the source's card. Export, import-gguf and eval are checked in their own
tests (test_single_process, test_import_gguf, test_evaluation)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.conversion.mean_pool import convert_checkpoint
from dha_train.conversion.mla import MlaSettings, convert_to_mla
from dha_train.conversion.refit import RefitSettings, refit_folder
from dha_train.methods import kv_cache_bytes
from dha_train.model_card import read_model_card
from dha_train.models.head_map import HeadMap


@pytest.fixture(scope='module')
def source(tmp_path_factory, tokenizer_dir):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=256)
    path = tmp_path_factory.mktemp('card') / 'tiny-mha'
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    (path / 'README.md').write_text('---\nlicense: apache-2.0\nbase_model: example/tiny-mha\n---\n# tiny\n')
    return path


def _check_against_the_folder(folder, header):
    config = AutoConfig.from_pretrained(folder)
    block = header['dha_train']
    assert header['library_name'] == 'transformers' and header['pipeline_tag'] == 'text-generation'
    assert block['model_type'] == config.model_type and config.model_type in header['tags']
    assert block['kv_bytes_per_4096_tokens_bf16'] == kv_cache_bytes(config, 4096, 2)
    mha = config.num_hidden_layers * 2 * config.num_attention_heads * 16 * 4096 * 2
    assert block['fraction_of_mha_kv'] == pytest.approx(block['kv_bytes_per_4096_tokens_bf16'] / mha)
    return block


def test_a_mean_pool_conversion_card_states_the_budget_the_source_and_how_to_load_it(source, tmp_path):
    out = convert_checkpoint(source, tmp_path / 'gqa', HeadMap.gqa(2, 4, 1, 16))
    header, body = read_model_card(out)
    block = _check_against_the_folder(out, header)
    assert header['base_model'] == 'example/tiny-mha' and header['license'] == 'apache-2.0'
    assert block['method'] == 'mean_pool' and 'mean_pool' in header['tags']
    assert block['fraction_of_source_kv'] == pytest.approx(0.25)  # 1 of 4 K/V heads
    assert 'K heads per layer 1' in block['attention']
    assert [stage['tokens'] for stage in block['stages']] == [0]
    assert "transformers' own class" in body and 'trust_remote_code' not in body  # standard GQA: a plain LLaMA
    assert "from_pretrained('gqa')" in body
    assert 'Tested with transformers' in body


def test_a_refit_card_continues_the_conversions_stages(source, tmp_path, data_root):
    converted = convert_checkpoint(source, tmp_path / 'gqa', HeadMap.gqa(2, 4, 2, 16))
    refit_folder(source, converted, tmp_path / 'refit', RefitSettings(data=str(data_root), tokens=256, batch_size=2))
    header, _ = read_model_card(tmp_path / 'refit')
    block = _check_against_the_folder(tmp_path / 'refit', header)
    assert block['method'] == 'mean_pool'
    assert [stage['step'].split(':')[0] for stage in block['stages']] == ['convert', 'refit']
    assert block['stages'][1]['calibration_tokens'] == 256
    assert block['fraction_of_source_kv'] == pytest.approx(0.5)
    assert header['license'] == 'apache-2.0'


def test_an_mla_card_states_its_latent_ranks(source, tmp_path):
    convert_to_mla(source, tmp_path / 'mla', MlaSettings(cache_fraction=0.5, rope_pairs=1, pair_criterion='uniform',
                                                         factorisation='weight', ranks='uniform'))
    header, body = read_model_card(tmp_path / 'mla')
    block = _check_against_the_folder(tmp_path / 'mla', header)
    config = AutoConfig.from_pretrained(tmp_path / 'mla')
    assert block['method'] == 'mla'
    assert f'latent ranks {min(config.mla_ranks)}-{max(config.mla_ranks)}' in block['attention']
    assert block['fraction_of_source_kv'] == pytest.approx(0.5, abs=0.02)
    assert 'trust_remote_code=True' in body


def test_a_deepseek_format_card_states_its_share_of_the_sources_mha_cache(source, tmp_path, data_root):
    # transformers' DeepseekV3Config sets head_dim to qk_rope_head_dim: the card's MHA reference must not use it
    from dha_train.conversion.deepseek import DeepseekSettings, convert_to_deepseek

    convert_to_deepseek(source, tmp_path / 'deepseek', DeepseekSettings(cache_fraction=0.25, rope_pairs=2,
                                                                         data=str(data_root), tokens=256,
                                                                         sample_tokens=128, batch_size=2))
    header, body = read_model_card(tmp_path / 'deepseek')
    block = _check_against_the_folder(tmp_path / 'deepseek', header)  # the MHA reference from the source's widths
    config = AutoConfig.from_pretrained(tmp_path / 'deepseek')
    assert config.model_type == 'deepseek_v3' and config.head_dim == config.qk_rope_head_dim != 16
    assert block['method'] == 'mla_deepseek'
    # the source is MHA: its share of MHA is its share of the source, a quarter to the latent rank's step
    assert block['fraction_of_mha_kv'] == pytest.approx(block['fraction_of_source_kv']) == pytest.approx(0.25, abs=0.02)
    assert f'kv_lora_rank {config.kv_lora_rank}' in block['attention']



def test_a_deepseek_card_at_a_third_written_to_four_digits_states_a_third(tmp_path, tokenizer_dir, data_root):
    # SmolLM2-135M's attention (9 query heads, 3 K/V heads of 64) with mla.md's --cache-fraction 0.3333: a third of its
    # 384 numbers is 128 a token and layer, 96 + 32 in whole blocks, 1/9 of MHA's 2 x 9 x 64 = 1,152. Floored to
    # 127 numbers, the whole blocks kept 96 (64 + 32), and the card stated 0.083333 of MHA, 0.25 of the source.
    from dha_train.conversion.deepseek import DeepseekSettings, convert_to_deepseek

    torch.manual_seed(0)
    source_config = LlamaConfig(vocab_size=384, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256)
    LlamaForCausalLM(source_config).save_pretrained(tmp_path / 'smol-shaped')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / 'smol-shaped')
    report = convert_to_deepseek(tmp_path / 'smol-shaped', tmp_path / 'deepseek', DeepseekSettings(
        cache_fraction=0.3333, quantizable_cache=True, data=str(data_root), tokens=256, sample_tokens=128,
        batch_size=2))
    assert report['quantizable_cache'] and (report['kv_lora_rank'], report['qk_rope_head_dim']) == (96, 32)
    block = read_model_card(tmp_path / 'deepseek')[0]['dha_train']
    head_dim = source_config.hidden_size // source_config.num_attention_heads
    mha_values = 2 * source_config.num_attention_heads * head_dim
    source_values = 2 * source_config.num_key_value_heads * head_dim
    assert block['fraction_of_mha_kv'] == pytest.approx(128 / mha_values, abs=1e-6)  # 0.111111
    assert block['fraction_of_source_kv'] == pytest.approx(128 / source_values, abs=1e-6)  # 0.333333
