"""`dha-train convert --method mla` on a tiny GQA LLaMA: at the whole budget with every RoPE pair kept it is the
source; at a third of the cache (calibrated pair choice, activation-aware factorisation, ranks from the spectra) the
cache holds what the report and the method registry say; bad requests are named before any work."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dha_train.cli import main
from dha_train.conversion.mla import (
    MlaSettings,
    convert_to_mla,
    default_freq_fold,
    default_rope_pairs,
    resolved_settings,
)
from dha_train.methods import kv_cache_bytes
from dha_train.model_card import read_model_card

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2


@pytest.fixture(scope='module')
def gqa_source(tmp_path_factory, tokenizer_dir):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=HEADS * HEAD_DIM, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=256, rope_theta=100.0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(8)
    path = tmp_path_factory.mktemp('gqa') / 'source'
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _logits(folder, ids):
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize('ranks', ['uniform', 'spectrum'])
def test_whole_budget_with_every_pair_kept_is_the_source(gqa_source, tmp_path, ranks):
    report = convert_to_mla(gqa_source, tmp_path / 'mla', MlaSettings(
        cache_fraction=1.0, rope_pairs=HEAD_DIM // 2, pair_criterion='uniform', factorisation='weight', ranks=ranks,
        rank_step=1))
    assert report['ranks'] == [KV_HEADS * HEAD_DIM] * LAYERS and report['fraction_of_source'] == 1.0
    ids = torch.randint(0, 384, (2, 20), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(tmp_path / 'mla', ids), _logits(gqa_source, ids), rtol=0, atol=1e-5)


def test_default_pairs_give_the_rotated_keys_three_eighths_of_the_cache_and_the_fold_one_window_each():
    assert [default_rope_pairs(64, fraction) for fraction in (1 / 3, 0.3333, 2 / 3, 1.0)] == [8, 8, 16, 24]
    assert default_rope_pairs(8, 0.05) == 1 and default_rope_pairs(8, 1.0) == 3
    assert [default_freq_fold(64, pairs) for pairs in (8, 16, 11, 32, 0)] == [4, 2, 2, 1, 1]
    settings = resolved_settings(MlaSettings(cache_fraction=1 / 3), 64)
    assert (settings.rope_pairs, settings.freq_fold) == (8, 4)
    assert resolved_settings(MlaSettings(cache_fraction=1 / 3, rope_pairs=4, freq_fold=1), 64) == MlaSettings(
        cache_fraction=1 / 3, rope_pairs=4, freq_fold=1)


def test_freq_fold_is_exact_where_its_assumptions_hold_and_plain_pairs_are_not(tmp_path, tokenizer_dir):
    """FreqFold's two conditions, made true: every frequency equal (rope_theta 1) and each window's keys rank one
    across its pairs. The folded conversion at the whole budget is then the source, with half the pairs kept
    rotated; keeping half the source pairs as they are is not."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=384, hidden_size=HEADS * HEAD_DIM, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=256, rope_theta=1.0)
    model = LlamaForCausalLM(config)
    half, fold = HEAD_DIM // 2, 2
    with torch.no_grad():
        for layer in model.model.layers:
            rows = torch.zeros(KV_HEADS, 2, half, config.hidden_size)  # (head, component, pair, hidden)
            for head, first in itertools.product(range(KV_HEADS), range(0, half, fold)):
                # one mix of the window's pairs, the same on both components: rank one across the pairs
                rows[head, :, first:first + fold] = torch.randn(fold, 1) * torch.randn(2, 1, config.hidden_size) * 2
            layer.self_attn.k_proj.weight.copy_(rows.reshape(-1, config.hidden_size))
    model.save_pretrained(tmp_path / 'source')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / 'source')
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(1))
    source = _logits(tmp_path / 'source', ids)
    errors = {}
    for freq_fold in (1, fold):
        report = convert_to_mla(tmp_path / 'source', tmp_path / f'fold{freq_fold}', MlaSettings(
            cache_fraction=1.0, rope_pairs=half // fold, freq_fold=freq_fold, pair_criterion='uniform',
            factorisation='weight', rank_step=1))
        assert report['freq_fold'] == freq_fold
        errors[freq_fold] = (float((_logits(tmp_path / f'fold{freq_fold}', ids) - source).abs().max()),
                             report['rope_energy_kept'])
    assert errors[fold][0] < 1e-4 and errors[fold][1] == pytest.approx(1.0)
    assert errors[1][0] > 1e-2 and errors[1][1] < 0.9, errors


def test_a_third_of_the_cache_calibrated_holds_the_stated_bytes(gqa_source, tmp_path, data_root, capsys):
    code = main(['convert', str(gqa_source), str(tmp_path / 'mla'), '--method', 'mla', '--cache-fraction', '0.3333',
                 '--rope-pairs', '1', '--data', str(data_root), '--tokens', '512', '--batch-size', '4',
                 '--rank-step', '2'])
    assert code == 0
    printed = capsys.readouterr().out
    config = AutoModelForCausalLM.from_pretrained(tmp_path / 'mla').config
    source_values = LAYERS * 2 * KV_HEADS * HEAD_DIM  # 64 numbers per token
    cached = sum(config.mla_ranks) + LAYERS * KV_HEADS * 2 * 1
    assert cached <= source_values // 3 and cached > source_values // 3 - 2  # the budget, to the rank step
    assert all(rank % 2 == 0 for rank in config.mla_ranks)
    assert f'{cached} cache numbers per token' in printed
    assert kv_cache_bytes(config, 4096, 2) == cached * 4096 * 2
    assert all(len(head) == 1 for layer in config.mla_rope_pairs for head in layer)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / 'mla').eval()
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


def test_a_deepseek_format_export_loads_in_transformers_own_class_and_decodes_with_its_cache(gqa_source, tmp_path,
                                                                                           data_root, capsys):
    """A third of the cache in DeepSeek's format: transformers' DeepseekV3ForCausalLM loads it with no code in the
    folder; the latent plus the shared RoPE key hold the budget; cached greedy decoding equals the uncached argmax,
    with every fit of the latent norm."""
    ids = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(5))
    for fit in ('linear', 'scalar', 'regression'):
        out = tmp_path / fit
        assert main(['convert', str(gqa_source), str(out), '--method', 'mla', '--format', 'deepseek',
                     '--cache-fraction', '0.3333', '--rope-pairs', '1', '--latent-norm-fit', fit,
                     '--data', str(data_root), '--tokens', '512', '--batch-size', '4']) == 0
        printed = capsys.readouterr().out
        assert not list(out.glob('*.py'))  # no custom code: transformers' own class
        model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        assert type(model).__name__ == 'DeepseekV3ForCausalLM'
        config = model.config
        assert config.q_lora_rank is None and config.first_k_dense_replace == LAYERS and config.rope_interleave
        assert config.kv_lora_rank + config.qk_rope_head_dim == (2 * KV_HEADS * HEAD_DIM) // 3  # 32 per layer
        assert f'{LAYERS * (2 * KV_HEADS * HEAD_DIM // 3)} cache numbers per token' in printed
        header = read_model_card(out)[0]['dha_train']
        assert header['method'] == 'mla_deepseek' and header['kv_bytes_per_4096_tokens_bf16'] == kv_cache_bytes(
            config, 4096, 2) == LAYERS * (2 * KV_HEADS * HEAD_DIM // 3) * 4096 * 2
        prompt = ids[:1, :6]
        with torch.no_grad():
            generated = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
            expected = prompt
            for _ in range(6):
                expected = torch.cat([expected, model(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)],
                                     dim=1)
        assert torch.equal(generated, expected)


@pytest.mark.parametrize('arguments, message', [
    (['--method', 'mla', '--format', 'deepseek', '--cache-fraction', '0.5', '--ranks', 'uniform'],
     '--ranks do not apply'),
    (['--method', 'mla', '--format', 'deepseek', '--cache-fraction', '0.5'], 'needs calibration data'),
    (['--method', 'mla', '--format', 'deepseek', '--cache-fraction', '0.05', '--data', 'x'], 'leaves no latent'),
    (['--method', 'mla'], 'needs --cache-fraction'),
    (['--method', 'mla', '--cache-fraction', '0.5', '--kv-heads', '1'], 'not --head-map or --kv-heads'),
    (['--method', 'mla', '--cache-fraction', '0.5'], 'need calibration data'),
    (['--method', 'mla', '--cache-fraction', '0.05', '--pair-criterion', 'uniform', '--factorisation', 'weight'],
     'leaves no latent'),
    (['--method', 'mla', '--cache-fraction', '1.5', '--pair-criterion', 'uniform', '--factorisation', 'weight'],
     'must be in (0, 1]'),
    ([], 'needs --head-map or --kv-heads'),
    # options that do not apply are refused, not ignored
    (['--kv-heads', '1', '--cache-fraction', '0.5', '--balance', 'none'],
     'mean_pool: --cache-fraction, --balance apply only to --method mla'),
    (['--method', 'mla', '--cache-fraction', '0.5', '--latent-norm-fit', 'scalar', '--no-latent-pin'],
     '--latent-norm-fit, --no-latent-pin apply only to --format deepseek'),
    (['--method', 'mla', '--cache-fraction', '0.5', '--rope-pairs', '3', '--freq-fold', '2', '--pair-criterion',
      'uniform', '--factorisation', 'weight'], 'has only 2 windows of 2 pairs'),
    (['--method', 'mla', '--cache-fraction', '0.5', '--freq-fold', '0', '--pair-criterion', 'uniform',
      '--factorisation', 'weight'], '--freq-fold >= 1'),
    (['--method', 'mla', '--format', 'deepseek', '--cache-fraction', '0.5', '--no-latent-pin', '--data', 'x'],
     '--no-latent-pin applies to --latent-norm-fit regression or scalar'),
    (['--method', 'mla', '--format', 'deepseek', '--cache-fraction', '0.5', '--freq-fold', '0', '--data', 'x'],
     '--freq-fold must be at least 1'),
])
def test_bad_requests_are_one_line_before_any_work(gqa_source, tmp_path, capsys, arguments, message):
    assert main(['convert', str(gqa_source), str(tmp_path / 'out'), *arguments]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and message in error[0], error
    assert not (tmp_path / 'out').exists()
