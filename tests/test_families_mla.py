"""MLA on every source family: the project's MLA class inside the family's own decoder (Qwen2's K/V biases, Qwen3's
and Gemma 3's per-head q/k norms, Gemma 3's sliding-window layers, local/global RoPE and scale, MQA included) and
DeepSeek's format, where its decoder can carry the family.

- at full rank with every RoPE pair kept it is the source; with one pair kept it is the source with RoPE off on the
  others (so the position-free keys, their biases and their k_norm are exact too);
- at a lower rank, decode through the latent cache equals the whole forward, cached greedy generation equals
  uncached decoding, and the cache holds the numbers the conversion reports;
- `convert --method mla` writes a folder that loads again as the source's logits at the whole budget;
- what a family's features rule out is refused in one line naming the feature, with nothing written; a Mistral
  without a window converts to DeepSeek's format and is the source there at full rank.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_models import FAMILY_NAMES, logits_of, save_tiny_family_model, tiny_model
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM, DynamicCache

from dha_train import families
from dha_train.cli import main
from dha_train.conversion.deepseek import deepseek_config, layer_weights
from dha_train.conversion.mla import mla_model_of
from dha_train.model_folders import load_causal_lm
from dha_train.models.modeling_mla import MlaLlamaForCausalLM
from dha_train.ops.deepseek import shared_key_mix, strided_pairs
from dha_train.ops.mla import cache_values_per_token, kept_rope_pairs, pair_key_cross_energy
from helpers import refused_in_one_line

DIM = 16  # head_dim of every tiny family model (tests/family_models.py)
# every family, and the windows of Mistral (every layer, from its config) and Qwen2 (the layers past
# max_window_layers) beside Gemma 3's, each shorter than the test sequences
CASES = [(name, {}) for name in FAMILY_NAMES] + [
    ('mistral', {'sliding_window': 6}),
    ('qwen2', {'use_sliding_window': True, 'sliding_window': 6, 'max_window_layers': 1})]
CASE_IDS = [name + ('-window' if overrides else '') for name, overrides in CASES]


def _source(model_type: str, kv_heads: int = 1, **overrides):
    """A tiny model of the family whose queries and keys are large enough for attention patterns (and RoPE) to
    matter; with q/k norms the norms set their size."""
    model = tiny_model(model_type, num_key_value_heads=kv_heads, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def _mla(source, pairs: int, rank_cut: int = 0) -> MlaLlamaForCausalLM:
    """``source`` in the MLA class: ``pairs`` kept per K/V head (uniform), the full rank less ``rank_cut``."""
    config = source.config
    kv_heads, layers = config.num_key_value_heads, config.num_hidden_layers
    kept = [kept_rope_pairs(kv_heads, DIM, pairs, 'uniform') for _ in range(layers)]
    full = kv_heads * (DIM - 2 * pairs) + kv_heads * DIM
    return mla_model_of(source, families.of(config).model_type, kept, [full - rank_cut] * layers).eval()


def _rope_off_but(model, kept_pairs: list[int]):
    """The model with every RoPE frequency but ``kept_pairs`` set to 0 (Gemma's local and global tables alike)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, 'inv_freq', None), torch.Tensor):
                keep = torch.zeros_like(module.inv_freq, dtype=torch.bool)
                keep[kept_pairs] = True
                module.inv_freq[~keep] = 0.0
    return model


@pytest.mark.parametrize('kv_heads', [1, 2])
@pytest.mark.parametrize('model_type, overrides', CASES, ids=CASE_IDS)
def test_full_rank_mla_is_the_source_and_one_kept_pair_is_the_source_without_rope_on_the_others(model_type,
                                                                                                  overrides,
                                                                                                  kv_heads):
    source = _source(model_type, kv_heads, **overrides)
    every_pair = _mla(source, pairs=DIM // 2)
    windows = [layer.self_attn.sliding_window for layer in every_pair.model.layers]
    assert windows == families.get(model_type).sliding_windows(source.config)
    assert type(every_pair.model.layers[0]) is families.get(model_type).classes.decoder_layer
    torch.testing.assert_close(logits_of(every_pair), logits_of(source), rtol=0, atol=1e-4)

    one_pair = _mla(source, pairs=1)  # pair 0 rotated: the position-free keys come from the latent
    attention = one_pair.model.layers[0].self_attn
    assert (attention.q_norm is not None) == families.get(model_type).qk_norm == attention.caches_key_scale
    assert not torch.allclose(logits_of(one_pair), logits_of(source), atol=1e-3)
    rope_off = _rope_off_but(_source(model_type, kv_heads, **overrides), [0])
    torch.testing.assert_close(logits_of(one_pair), logits_of(rope_off), rtol=0, atol=1e-4)


def _stored_numbers(cache, layers: int) -> int:
    if hasattr(cache, 'layers'):  # transformers 5.x
        return sum(cache.layers[i].keys.numel() + cache.layers[i].values.numel() for i in range(layers))
    return sum(cache.key_cache[i].numel() + cache.value_cache[i].numel() for i in range(layers))


@pytest.mark.parametrize('model_type, overrides', CASES, ids=CASE_IDS)
def test_latent_decode_equals_the_whole_forward_and_the_cache_holds_the_stated_numbers(model_type, overrides):
    """Past the 6-token windows too: the decode steps attend to the window the family's layer does."""
    model = _mla(_source(model_type, kv_heads=2, **overrides), pairs=1, rank_cut=7)
    config = model.config
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(ids).logits
        cache = DynamicCache()
        prefix = model(ids[:, :5], past_key_values=cache, use_cache=True).logits
        steps = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(5, 12)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), whole, rtol=0, atol=1e-4)
    key_norm = DIM if families.get(model_type).qk_norm else None
    per_token = cache_values_per_token(config.mla_ranks, [1] * config.num_hidden_layers, 2, key_norm)
    assert _stored_numbers(cache, config.num_hidden_layers) == ids.numel() * per_token


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_cached_greedy_generation_equals_uncached_argmax_decoding(model_type):
    model = _mla(_source(model_type), pairs=2, rank_cut=5)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    prompt = ids
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for _ in range(8):
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(generated, ids)


def _convert(source_dir, out_dir, fraction: float, *extra: str) -> int:
    return main(['convert', str(source_dir), str(out_dir), '--method', 'mla', '--cache-fraction', str(fraction),
                 '--pair-criterion', 'uniform', '--factorisation', 'weight', '--ranks', 'uniform', *extra])


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_convert_at_the_whole_budget_saves_a_folder_that_loads_as_the_source(model_type, tmp_path, capfd):
    source = _source(model_type, kv_heads=2)
    source.save_pretrained(tmp_path / 'source')
    assert _convert(tmp_path / 'source', tmp_path / 'mla', 1.0, '--rope-pairs', str(DIM // 2)) == 0
    assert '100.0% of the source KV cache' in capfd.readouterr().out
    saved = json.loads((tmp_path / 'mla' / 'config.json').read_text())
    assert saved['model_type'] == 'mla_llama' and saved['source_model_type'] == model_type
    for loaded in (load_causal_lm(tmp_path / 'mla', who='test'),
                   AutoModelForCausalLM.from_pretrained(tmp_path / 'mla')):
        loaded = loaded.float().eval()
        assert type(loaded) is MlaLlamaForCausalLM and families.of(loaded.config).model_type == model_type
        torch.testing.assert_close(logits_of(loaded), logits_of(source), rtol=0, atol=1e-4)


@pytest.mark.parametrize('model_type', FAMILY_NAMES)
def test_convert_at_half_the_cache_holds_what_it_reports(model_type, tmp_path, capfd):
    save_tiny_family_model(tmp_path / 'source', model_type, num_key_value_heads=1)
    assert _convert(tmp_path / 'source', tmp_path / 'mla', 0.5) == 0
    out = capfd.readouterr().out
    model = load_causal_lm(tmp_path / 'mla', who='test').float().eval()
    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    per_token = _stored_numbers(cache, config.num_hidden_layers) // ids.numel()
    assert f'{per_token} cache numbers per token' in out
    assert per_token <= 0.5 * config.num_hidden_layers * 2 * DIM


@pytest.mark.parametrize('model_type', [name for name in FAMILY_NAMES if families.get(name).qk_norm])
def test_a_freq_fold_with_q_k_norms_is_refused_in_one_line(model_type, tmp_path, capfd):
    save_tiny_family_model(tmp_path / 'source', model_type)
    line = refused_in_one_line(['convert', str(tmp_path / 'source'), str(tmp_path / 'mla'), '--method', 'mla',
                                '--cache-fraction', '0.5', '--pair-criterion', 'uniform', '--factorisation',
                                'weight', '--freq-fold', '2'], tmp_path, capfd)
    assert 'per-head q/k norms' in line and '--freq-fold 2' in line, line


DEEPSEEK_REFUSALS = [('llama', {'attention_bias': True}, 'attention biases'),
                     ('mistral', {'sliding_window': 8}, 'sliding-window attention'),
                     ('qwen2', {}, 'q/k/v biases'),
                     ('qwen3', {}, 'per-head q/k norms'),
                     ('gemma3_text', {}, 'per-head q/k norms')]


@pytest.mark.parametrize('model_type, overrides, feature', DEEPSEEK_REFUSALS,
                         ids=[case[0] for case in DEEPSEEK_REFUSALS])
def test_deepseek_format_refuses_a_feature_its_decoder_cannot_carry_in_one_line(model_type, overrides, feature,
                                                                               tmp_path, capfd):
    save_tiny_family_model(tmp_path / 'source', model_type, **overrides)
    line = refused_in_one_line(['convert', str(tmp_path / 'source'), str(tmp_path / 'ds'), '--method', 'mla',
                                '--format', 'deepseek', '--cache-fraction', '0.5'], tmp_path, capfd)
    assert feature in line and families.get(model_type).label in line, line


def test_a_mistral_source_in_deepseeks_format_is_the_source_at_full_rank():
    """MQA, every pair in the shared key, the full latent, the latent norm set aside (the format's one
    approximation, as tests/models/test_deepseek_format.py sets it aside for LLaMA)."""
    source = _source('mistral', kv_heads=1)
    config = source.config
    kept = strided_pairs(DIM // 2, 1)
    model = DeepseekV3ForCausalLM(deepseek_config(config, 2 * DIM, DIM // 2, 1)).eval()
    state = {name: tensor for name, tensor in source.state_dict().items() if '.self_attn.' not in name}
    for index, layer in enumerate(source.model.layers):
        cross = pair_key_cross_energy(layer.self_attn.k_proj.weight, None, 1, DIM)
        mix, _ = shared_key_mix(cross, kept, 1, 1)
        weights = layer_weights(layer.self_attn, config, mix, 2 * DIM, None, 'none', None, None)
        state.update({f'model.layers.{index}.self_attn.{name}': tensor for name, tensor in weights.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    torch.testing.assert_close(logits_of(model), logits_of(source), rtol=0, atol=1e-4)


def test_convert_writes_deepseeks_format_from_a_mistral_folder(tmp_path, tokenizer_dir, data_root):
    save_tiny_family_model(tmp_path / 'source', 'mistral', tokenizer_dir, num_key_value_heads=1)
    assert main(['convert', str(tmp_path / 'source'), str(tmp_path / 'ds'), '--method', 'mla', '--format',
                 'deepseek', '--cache-fraction', '0.5', '--data', str(data_root), '--tokens', '512']) == 0
    model = load_causal_lm(tmp_path / 'ds', who='test').float().eval()
    assert type(model) is DeepseekV3ForCausalLM
    assert torch.isfinite(logits_of(model)).all()


def test_the_latent_decode_keeps_the_sliding_window_that_a_two_d_padding_mask_lacks():
    """flash-attention-2 passes a (B, S) padding mask, which holds no window: a decode step of a sliding layer then
    attends to the last ``window`` keys as the 4-D sliding mask of SDPA and eager says."""
    model = _mla(_source('gemma3_text', kv_heads=1), pairs=1, rank_cut=3)
    attention = model.model.layers[0].self_attn
    window, batch, length = attention.sliding_window, 2, 10
    assert attention.is_sliding and window == 6
    generator = torch.Generator().manual_seed(6)
    query_nope = torch.randn(batch, 4, 1, attention.nope_width, generator=generator)
    query_rope = torch.randn(batch, 4, 1, attention.rope_width, generator=generator)
    latent = torch.randn(batch, 1, length, attention.rank, generator=generator)
    value_slot = torch.rand(batch, 1, length, attention.cache_width, generator=generator) + 0.5
    in_window = torch.zeros(batch, 1, 1, length)
    in_window[..., :length - window] = torch.finfo(torch.float32).min
    with torch.no_grad():
        from_2d, weights = attention.latent_attention(query_nope, query_rope, latent, value_slot,
                                                      torch.ones(batch, length, dtype=torch.long))
        from_4d, _ = attention.latent_attention(query_nope, query_rope, latent, value_slot, in_window)
    torch.testing.assert_close(from_2d, from_4d, rtol=0, atol=1e-6)
    assert float(weights[..., :length - window].abs().max()) == 0.0
