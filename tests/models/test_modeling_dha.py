"""DhaLlamaForCausalLM: equals LLaMA for MHA/GQA maps, compact KV cache, save/load with and without dha_train."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

import dha_train.models  # noqa: F401  (registers the Auto classes)
from dha_train.models.head_map import HeadMap
from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM
from helpers import logits_without_dha_train

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 2, 8, 8
TINY = dict(vocab_size=100, hidden_size=NUM_HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
            num_attention_heads=NUM_HEADS, max_position_embeddings=128,
            # A wide init keeps the logits well apart, so greedy decoding does not hinge on rounding.
            initializer_range=0.2)

# 25% of MHA's 2 x 8 x 2 = 32 KV heads: layer 0 has K 2 + V 2, layer 1 has K 1 + V 3; groups are interleaved and
# of unequal size.
DHA_25 = HeadMap.dha(key_partitions=[[[0, 2, 4, 6], [1, 3, 5, 7]], [list(range(8))]],
                     value_partitions=[[[0, 1, 2], [3, 4, 5, 6, 7]], [[0], [1, 6], [2, 3, 4, 5, 7]]],
                     num_heads=NUM_HEADS, head_dim=HEAD_DIM)


def input_ids(batch: int = 2, seq_len: int = 7) -> torch.Tensor:
    return torch.randint(0, TINY['vocab_size'], (batch, seq_len), generator=torch.Generator().manual_seed(1))


def dha_model(head_map: HeadMap, **overrides) -> DhaLlamaForCausalLM:
    torch.manual_seed(0)
    return DhaLlamaForCausalLM(DhaLlamaConfig(head_map=head_map.to_dict(), **TINY, **overrides)).eval()


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits


@pytest.mark.parametrize('attn', ['sdpa', 'eager'])
@pytest.mark.parametrize('num_groups', [NUM_HEADS, 2])
def test_mha_and_gqa_maps_equal_llama(attn, num_groups):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=num_groups, attn_implementation=attn)).eval()
    head_map = HeadMap.gqa(NUM_LAYERS, NUM_HEADS, num_groups, HEAD_DIM)
    dha = dha_model(head_map, attn_implementation=attn)
    dha.load_state_dict(llama.state_dict())
    assert llama.config._attn_implementation == dha.config._attn_implementation == attn
    ids = input_ids()
    torch.testing.assert_close(logits(dha, ids), logits(llama, ids), rtol=0, atol=1e-5)


def test_cached_generation_matches_uncached_argmax_and_cache_is_compact():
    model = dha_model(DHA_25, eos_token_id=None)
    assert [(a.num_key_heads, a.num_value_heads) for a in (layer.self_attn for layer in model.model.layers)] \
        == DHA_25.kv_heads() == [(2, 2), (1, 3)]
    ids, new_tokens = input_ids(), 10

    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         use_cache=True, return_dict_in_generate=True, pad_token_id=0)

    expected = ids
    for _ in range(new_tokens):
        expected = torch.cat([expected, logits(model, expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, expected)

    # The last generated token is never fed back, so the cache holds every position but that one.
    batch, cached_len = ids.shape[0], ids.shape[1] + new_tokens - 1
    layers = list(out.past_key_values)
    assert [(k.shape[1], v.shape[1]) for k, v in layers] == DHA_25.kv_heads()
    assert all(k.shape[2] == v.shape[2] == cached_len for k, v in layers)
    cache_bytes = sum(t.numel() * t.element_size() for k, v in layers for t in (k, v))
    head_map = HeadMap.from_dict(model.config.head_map)
    assert cache_bytes == head_map.kv_cache_bytes(batch, cached_len, bytes_per_element=4)
    assert cache_bytes * 4 == HeadMap.mha(NUM_LAYERS, NUM_HEADS, HEAD_DIM).kv_cache_bytes(batch, cached_len, 4)


@pytest.mark.parametrize('change, message', [
    (dict(num_hidden_layers=3), 'has 2 layers but num_hidden_layers=3'),
    (dict(num_attention_heads=4, head_dim=HEAD_DIM), 'num_query_heads=8 but num_attention_heads=4'),
    (dict(head_dim=16), 'head_dim=8 but the model has head_dim=16'),
])
def test_config_rejects_mismatched_head_map(change, message):
    with pytest.raises(ValueError, match=message):
        DhaLlamaConfig(head_map=DHA_25.to_dict(), **{**TINY, **change})


def test_config_default_is_mha():
    model = DhaLlamaForCausalLM(DhaLlamaConfig(**TINY))
    assert model.config.head_map is None
    assert torch.equal(model.model.layers[0].self_attn.key_index, torch.arange(NUM_HEADS))


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    """A DHA model saved with save_pretrained, and its logits on fixed ids."""
    model = dha_model(DHA_25)
    folder = tmp_path_factory.mktemp('dha_model')
    model.save_pretrained(folder)
    return folder, logits(model, input_ids())


def test_save_writes_safetensors_code_and_auto_map(saved):
    folder, _ = saved
    assert {'model.safetensors', 'modeling_dha.py', 'config.json'} <= set(os.listdir(folder))
    config = json.loads((folder / 'config.json').read_text())
    assert config['model_type'] == 'dha_llama'
    assert config['auto_map'] == {'AutoConfig': 'modeling_dha.DhaLlamaConfig',
                                  'AutoModelForCausalLM': 'modeling_dha.DhaLlamaForCausalLM'}
    assert HeadMap.from_dict(config['head_map']) == DHA_25


def test_round_trip_equal_logits(saved):
    folder, expected = saved
    loaded = DhaLlamaForCausalLM.from_pretrained(folder).eval()
    torch.testing.assert_close(logits(loaded, input_ids()), expected, rtol=0, atol=1e-5)


def test_auto_class_loads_without_trust_remote_code_after_import(saved):
    folder, expected = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is DhaLlamaForCausalLM
    torch.testing.assert_close(logits(loaded, input_ids()), expected, rtol=0, atol=1e-5)


def test_trust_remote_code_load_without_dha_train(saved, tmp_path):
    folder, expected = saved
    torch.testing.assert_close(logits_without_dha_train(folder, input_ids(), tmp_path), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize('dtype, tolerance', [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize('mask_kind', ['none', 'additive_4d', 'bool_4d', 'padding_2d'])
def test_grouped_decode_equals_the_expanded_kernels(dtype, tolerance, mask_kind):
    """One decode step read grouped by compact head equals expanding K/V to the query heads and running the eager
    and SDPA kernels, for uneven groups whose K and V groupings differ, with every form of padding mask: to float64
    rounding against SDPA, within bf16's resolution in bf16."""
    model = dha_model(DHA_25).to(dtype)
    batch, cached = 3, 11
    padding = torch.ones(batch, cached, dtype=torch.long)
    padding[1, :4] = 0  # left-padded
    padding[2, :1] = 0
    masks = {'none': None, 'padding_2d': padding, 'bool_4d': padding[:, None, None, :].bool(),
             'additive_4d': torch.zeros(batch, 1, 1, cached, dtype=dtype).masked_fill(
                 padding[:, None, None, :] == 0, torch.finfo(dtype).min)}
    reference_mask = masks['bool_4d'] if mask_kind != 'none' else None
    generator = torch.Generator().manual_seed(2)
    for attention in (layer.self_attn for layer in model.model.layers):
        query = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, generator=generator, dtype=torch.float64).to(dtype)
        keys = torch.randn(batch, attention.num_key_heads, cached, HEAD_DIM, generator=generator,
                           dtype=torch.float64).to(dtype) * 3
        values = torch.randn(batch, attention.num_value_heads, cached, HEAD_DIM, generator=generator,
                             dtype=torch.float64).to(dtype)
        with torch.no_grad():
            grouped, weights = attention.grouped_attention(query, keys, values, masks[mask_kind])
            for kernel in ('eager', 'sdpa'):
                model.config._attn_implementation = kernel
                expanded, _ = attention.expanded_attention(
                    query, keys, values, reference_mask if kernel == 'sdpa' or reference_mask is None
                    else masks['additive_4d'])
                # the eager kernel takes its softmax in float32 whatever the input
                bound = max(tolerance, 1e-6) if kernel == 'eager' else tolerance
                torch.testing.assert_close(grouped, expanded, rtol=bound, atol=bound)
        assert grouped.shape == (batch, 1, NUM_HEADS, HEAD_DIM) and weights.shape == (batch, NUM_HEADS, 1, cached)
        if mask_kind != 'none':
            assert float(weights[1, :, :, :4].abs().max()) == 0.0


def test_decode_steps_run_grouped_and_never_build_query_sized_key_or_value_tensors():
    """A cached decode step goes through the grouped path, whose tensors stay at the compact head counts; the
    logits of cached decoding equal the uncached forward (which expands)."""
    model = dha_model(DHA_25)
    sizes = []
    attention = model.model.layers[1].self_attn  # K 1 head, V 3 heads

    def record(module, args):
        sizes.append((args[1].shape[1], args[2].shape[1]))
    handle = attention.__class__.grouped_attention
    calls = []

    def spy(self, *args):
        calls.append(self.layer_idx)
        record(self, args)
        return handle(self, *args)
    ids = input_ids(batch=2, seq_len=9)
    try:
        attention.__class__.grouped_attention = spy
        with torch.no_grad():
            cache = DynamicCache()
            prefix = model(ids[:, :5], past_key_values=cache, use_cache=True).logits
            steps = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(5, 9)]
    finally:
        attention.__class__.grouped_attention = handle
    assert calls == [0, 1] * 4  # every decode step, every layer; never the prefix
    assert set(sizes) == {(2, 2), (1, 3)}
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), logits(model, ids), rtol=0, atol=1e-5)
