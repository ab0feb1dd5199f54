"""The MLA model: at full rank with every RoPE pair kept it is the GQA source; at full rank with some pairs kept it
is the source with RoPE switched off on the other pairs; decode through the latent cache (up-projections absorbed)
equals the expanded forward, cached greedy generation equals uncached argmax decoding, and the cache holds exactly
the stated numbers per token."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from dha_train.models.modeling_mla import MlaLlamaConfig, MlaLlamaForCausalLM
from dha_train.ops.mla import cache_values_per_token, kept_rope_pairs, mla_layer_weights

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2


def _source(attention_bias: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=HEADS * HEAD_DIM, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=128, attention_bias=attention_bias, rope_theta=100.0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the init, so attention patterns (and RoPE) matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if projection.bias is not None:  # HF initialises biases to 0, which would test nothing
                    projection.bias.normal_(0.0, 0.5)
    return model


def _convert(source: LlamaForCausalLM, pairs: int, rank: int | None, criterion: str = 'uniform',
             scores=None) -> MlaLlamaForCausalLM:
    """The source's weights under the MLA class (float32), ``pairs`` kept per head, rank ``rank`` (None: full)."""
    config = source.config
    kept = [kept_rope_pairs(KV_HEADS, HEAD_DIM, pairs, criterion, None if scores is None else scores[layer])
            for layer in range(LAYERS)]
    full_rank = KV_HEADS * (HEAD_DIM - 2 * pairs) + KV_HEADS * HEAD_DIM
    ranks = [full_rank if rank is None else rank] * LAYERS
    mla_config = MlaLlamaConfig(mla_ranks=ranks, mla_rope_pairs=[k.tolist() for k in kept],
                                **config.to_diff_dict())
    mla_config._attn_implementation = 'eager'
    model = MlaLlamaForCausalLM(mla_config).eval()
    state = {name: tensor for name, tensor in source.state_dict().items() if 'k_proj' not in name and 'v_proj' not in name}
    for index, layer in enumerate(source.model.layers):
        attention = layer.self_attn
        converted = mla_layer_weights(attention.k_proj.weight, attention.v_proj.weight, kept[index], HEAD_DIM,
                                      ranks[index], k_bias=attention.k_proj.bias, v_bias=attention.v_proj.bias)
        state.update({f'model.layers.{index}.self_attn.{name}': tensor.float() for name, tensor in converted.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(name.endswith('lm_head.weight') for name in missing), (missing, unexpected)
    return model


def _ids(batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize('attention_bias', [False, True])
def test_full_rank_with_every_pair_kept_is_the_source(attention_bias):
    source = _source(attention_bias)
    model = _convert(source, pairs=HEAD_DIM // 2, rank=None)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, source(_ids()).logits, rtol=0, atol=1e-5)


def test_full_rank_with_some_pairs_kept_is_the_source_without_rope_on_the_others():
    source = _source()
    model = _convert(source, pairs=1, rank=None, criterion='uniform')  # pair 0 of 4 rotated
    with torch.no_grad():
        rope_off = _source()
        inv_freq = rope_off.model.rotary_emb.inv_freq
        inv_freq[1:] = 0.0  # angle 0: pairs 1..3 position-free
        assert not torch.allclose(model(_ids()).logits, source(_ids()).logits, atol=1e-3)
        torch.testing.assert_close(model(_ids()).logits, rope_off(_ids()).logits, rtol=0, atol=1e-5)


def test_absorbed_decode_equals_the_expanded_forward_and_the_cache_holds_the_stated_numbers():
    source = _source(attention_bias=True)
    scores = torch.rand(LAYERS, KV_HEADS, HEAD_DIM // 2, generator=torch.Generator().manual_seed(4))
    model = _convert(source, pairs=1, rank=10, criterion='norm', scores=scores)  # reduced rank, per-head pairs
    ids = _ids(length=12)
    with torch.no_grad():
        whole = model(ids).logits
        cache = DynamicCache()
        prefix = model(ids[:, :5], past_key_values=cache, use_cache=True).logits
        steps = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(5, 12)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), whole, rtol=0, atol=1e-5)
    stored = sum(tensor.numel() for layer in range(LAYERS) for tensor in _layer_cache(cache, layer))
    per_token = cache_values_per_token(model.config.mla_ranks, [1] * LAYERS, KV_HEADS)
    assert per_token == LAYERS * (10 + 2 * KV_HEADS)
    assert stored == ids.shape[0] * ids.shape[1] * per_token


def _layer_cache(cache, layer):
    if hasattr(cache, 'layers'):  # transformers 5.x
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def test_cached_generation_equals_uncached_argmax_decoding():
    model = _convert(_source(), pairs=2, rank=12)
    prompt = _ids(batch=1, length=6)
    with torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        ids = prompt
        for _ in range(8):
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
    assert torch.equal(generated, ids)


def test_config_refuses_layouts_that_do_not_fit():
    base = _source().config.to_diff_dict()
    with pytest.raises(ValueError, match='mla_ranks must list 2'):
        MlaLlamaConfig(mla_ranks=[4], mla_rope_pairs=[[[0], [0]]] * 2, **base)
    with pytest.raises(ValueError, match='every head must keep as many'):
        MlaLlamaConfig(mla_ranks=[4, 4], mla_rope_pairs=[[[0], [0, 1]]] * 2, **base)
    with pytest.raises(ValueError, match='rank must be within 1..28'):
        MlaLlamaConfig(mla_ranks=[29, 4], mla_rope_pairs=[[[0], [1]]] * 2, **base)
    with pytest.raises(ValueError, match='increasing and within 0..3'):
        MlaLlamaConfig(mla_ranks=[4, 4], mla_rope_pairs=[[[4], [1]]] * 2, **base)


def test_absorbed_decode_takes_flash_attention_2s_two_d_padding_mask():
    """transformers gives flash-attention-2 the (B, S) padding mask, not the 4-D one: the absorbed decode step must
    read it as the same mask (it crashed slicing it as 4-D)."""
    model = _convert(_source(), pairs=1, rank=10)
    attention = model.model.layers[0].self_attn
    batch, length, nope = 2, 9, attention.nope_width
    generator = torch.Generator().manual_seed(5)
    query_nope = torch.randn(batch, HEADS, 1, nope, generator=generator)
    query_rope = torch.randn(batch, HEADS, 1, attention.rope_width, generator=generator)
    latent = torch.randn(batch, 1, length, attention.rank, generator=generator)
    key_rope = torch.randn(batch, KV_HEADS, length, attention.rope_width, generator=generator)
    padding = torch.ones(batch, length, dtype=torch.long)
    padding[1, :4] = 0  # the second sequence is left-padded
    additive = torch.zeros(batch, 1, 1, length).masked_fill(padding[:, None, None, :] == 0, torch.finfo().min)
    with torch.no_grad():
        from_2d, weights_2d = attention.latent_attention(query_nope, query_rope, latent, key_rope, padding)
        from_4d, _ = attention.latent_attention(query_nope, query_rope, latent, key_rope, additive)
        unmasked, _ = attention.latent_attention(query_nope, query_rope, latent, key_rope, None)
    torch.testing.assert_close(from_2d, from_4d, rtol=0, atol=1e-6)
    assert float(weights_2d[1, :, :, :4].abs().max()) == 0.0
    assert not torch.allclose(from_2d[1], unmasked[1], atol=1e-3)


def test_a_yarn_source_keeps_its_attention_factor_on_the_position_free_dims():
    """YaRN multiplies cos and sin by m, so every source score carries m^2. At position 0 RoPE turns nothing, so the
    source's scores are (q.k) m^2 on every dim; the MLA model at full rank must match there with some pairs
    position-free, which it only does if those dims carry m^2 too."""
    yarn = {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32}
    source = _source()
    source.config.rope_scaling = yarn
    yarn_source = LlamaForCausalLM(source.config).eval()
    yarn_source.load_state_dict(source.state_dict())
    factor = float(yarn_source.model.rotary_emb.attention_scaling)
    assert abs(factor - 1.0) > 0.1  # the check below could not tell the scaling apart otherwise
    model = _convert(yarn_source, pairs=1, rank=None)
    ids = _ids()
    positions = torch.zeros_like(ids)
    with torch.no_grad():
        expected = yarn_source(ids, position_ids=positions).logits
        torch.testing.assert_close(model(ids, position_ids=positions).logits, expected, rtol=0, atol=1e-5)
        unscaled = model.model.layers[0].self_attn
        unscaled.nope_score_scale = 1.0  # the model as it was before the fix
        assert (model(ids, position_ids=positions).logits - expected).abs().max() > 1e-2
