"""The DeepSeek-format MLA conversion (``ops.deepseek``, ``conversion.deepseek``) in transformers' own
``DeepseekV3ForCausalLM``: with the latent norm set aside (the one approximation the format forces), it is the
source exactly where the maths says so:

- an MQA source with every RoPE pair in the shared key and the full latent: at every position;
- a GQA source with some pairs kept: at position 0, where RoPE turns nothing (elsewhere the residual keys lose RoPE);
- and the kept frequencies are the source's for every stride (``rope_theta`` chosen per stride)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from dha_train.conversion.deepseek import deepseek_config, layer_weights
from dha_train.ops.deepseek import shared_key_mix, strided_pairs
from dha_train.ops.mla import pair_key_cross_energy

HEADS, HEAD_DIM, LAYERS = 4, 8, 2


def _source(kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=HEADS * HEAD_DIM, intermediate_size=48, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                         max_position_embeddings=128, rope_theta=100.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the init, so attention patterns (and RoPE) matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def _deepseek(source: LlamaForCausalLM, pairs: int, stride: int, rank: int, fold: int = 1) -> DeepseekV3ForCausalLM:
    """The source in the DeepSeek class, the latent norm replaced by the identity (kv_b is the un-normed up)."""
    config = source.config
    kept = strided_pairs(pairs, stride)
    model = DeepseekV3ForCausalLM(deepseek_config(config, rank, pairs, stride)).eval()
    model.config._attn_implementation = 'eager'
    state = {name: tensor for name, tensor in source.state_dict().items() if '.self_attn.' not in name}
    for index, layer in enumerate(source.model.layers):
        cross = pair_key_cross_energy(layer.self_attn.k_proj.weight, None, config.num_key_value_heads, HEAD_DIM)
        mix, _ = shared_key_mix(cross, kept, fold, stride)
        weights = layer_weights(layer.self_attn, config, mix, rank, None, 'none', None, None)
        state.update({f'model.layers.{index}.self_attn.{name}': tensor for name, tensor in weights.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm = torch.nn.Identity()
    return model


def _ids(batch: int = 2, length: int = 20) -> torch.Tensor:
    return torch.randint(0, 96, (batch, length), generator=torch.Generator().manual_seed(3))


def test_an_mqa_source_with_every_pair_in_the_shared_key_is_the_source_at_every_position():
    source = _source(kv_heads=1)
    model = _deepseek(source, pairs=HEAD_DIM // 2, stride=1, rank=2 * HEAD_DIM)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, source(_ids()).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize('pairs, stride', [(1, 1), (2, 1), (2, 2), (2, 3)])
def test_an_mqa_source_keeps_the_strided_frequencies_exactly(pairs, stride):
    """Every pair not kept is position-free in both: the source with those frequencies set to 0 is the target."""
    source = _source(kv_heads=1)
    model = _deepseek(source, pairs=pairs, stride=stride, rank=2 * HEAD_DIM)
    rope_off = _source(kv_heads=1)
    keep = torch.zeros(HEAD_DIM // 2, dtype=torch.bool)
    keep[strided_pairs(pairs, stride)] = True
    rope_off.model.rotary_emb.inv_freq[~keep] = 0.0
    with torch.no_grad():
        assert not torch.allclose(model(_ids()).logits, source(_ids()).logits, atol=1e-3)
        torch.testing.assert_close(model(_ids()).logits, rope_off(_ids()).logits, rtol=0, atol=1e-4)


def test_a_gqa_source_is_the_source_at_position_zero_and_only_the_residual_keys_lose_rope():
    source = _source(kv_heads=2)
    model = _deepseek(source, pairs=2, stride=2, rank=4 * HEAD_DIM)
    ids = _ids()
    zeros = torch.zeros_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=zeros).logits, source(ids, position_ids=zeros).logits,
                                   rtol=0, atol=1e-4)
        assert not torch.allclose(model(ids).logits, source(ids).logits, atol=1e-3)  # the residual lost RoPE


def _llama_like_latent() -> dict[str, torch.Tensor]:
    """Attention inputs as a LLaMA makes them (RMS-normed hidden states times the norm's weight, so their latents
    differ in size by direction), 4,000 to fit on and 4,000 held out; random keys and values; their rank-10
    activation-aware latent (``up``, ``down``)."""
    from dha_train.ops.deepseek import rms_normed
    from dha_train.ops.mla import latent_factors
    generator = torch.Generator().manual_seed(11)
    hidden, rows, rank = 24, 32, 10
    targets = torch.randn(rows, hidden, dtype=torch.float64, generator=generator)
    weight = torch.linspace(0.2, 2.0, hidden, dtype=torch.float64)

    def tokens(count):
        states = torch.randn(count, hidden, dtype=torch.float64, generator=generator) + 0.7
        return rms_normed(states) * weight
    fit_on, held_out = tokens(4000), tokens(4000)
    up, down = latent_factors(targets, rank, fit_on.T @ fit_on / fit_on.shape[0])
    floor = float((held_out @ targets.T - held_out @ down.T @ up.T).pow(2).mean())  # no norm at all
    return {'targets': targets, 'fit_on': fit_on, 'held_out': held_out, 'up': up, 'down': down, 'floor': floor}


def _normed_error(case: dict, latent_rows: torch.Tensor, rows_of_normed: torch.Tensor) -> float:
    """Mean squared error of the keys and values read through the latent norm, on the held-out tokens."""
    from dha_train.ops.deepseek import rms_normed
    predicted = rms_normed(case['held_out'] @ latent_rows.T) @ rows_of_normed.T
    return float((case['held_out'] @ case['targets'].T - predicted).pow(2).mean())


def test_the_latent_norm_regression_beats_the_mean_rms_on_held_out_tokens():
    """The regression of the keys and values on the normed latent reconstructs new tokens better than scaling by the
    mean RMS, and neither reaches the un-normed latent (the norm drops each token's size, which no linear map brings
    back)."""
    from dha_train.ops.deepseek import latent_norm_fit
    case = _llama_like_latent()
    up, down, targets, fit_on = case['up'], case['down'], case['targets'], case['fit_on']
    for fit in ('regression', 'scalar'):
        assert torch.equal(latent_norm_fit(fit, up, down, targets, fit_on)[0], down)  # these keep the latent rows
    regression = _normed_error(case, down, latent_norm_fit('regression', up, down, targets, fit_on)[1])
    scalar = _normed_error(case, down, latent_norm_fit('scalar', up, down, targets, fit_on)[1])
    assert case['floor'] < regression < scalar


def test_the_linear_range_puts_the_latent_where_the_norm_is_linear_and_reaches_the_un_normed_latent():
    """The linear fit scales the latent rows so that the calibration tokens' mean square averages LINEAR_RANGE * eps
    (a closed form), and the keys and values read through the norm then reach the un-normed latent's error on new
    tokens to within 1% of it, where the regression stays well above it."""
    from dha_train.ops.deepseek import LATENT_NORM_EPS, LINEAR_RANGE, latent_norm_fit
    case = _llama_like_latent()
    up, down, targets, fit_on = case['up'], case['down'], case['targets'], case['fit_on']
    scaled, fitted = latent_norm_fit('linear', up, down, targets, fit_on)
    mean_square = float((fit_on @ scaled.T).pow(2).mean())
    assert mean_square == pytest.approx(LINEAR_RANGE * LATENT_NORM_EPS, rel=1e-9)
    torch.testing.assert_close(scaled / scaled.norm(), down / down.norm())  # a scale, nothing else
    linear = _normed_error(case, scaled, fitted)
    regression = _normed_error(case, down, latent_norm_fit('regression', up, down, targets, fit_on)[1])
    assert linear < 1.01 * case['floor'] < regression


def test_a_pin_channel_holds_the_latent_rms_and_brings_the_error_near_the_un_normed_latent():
    """Attention inputs with a mean (as a LLaMA's normed hidden states have): the pin channel makes the latent's RMS
    near-constant over new tokens, and the error the norm adds to the keys and values, over the un-normed latent's,
    falls well below the unpinned regression's."""
    from dha_train.ops.deepseek import deepseek_attention_weights, latent_norm_fit, normed_latent_error, rms_normed
    generator = torch.Generator().manual_seed(12)
    heads, kv_heads, dim, hidden, rank = 4, 2, 8, 32, 24
    offset = torch.randn(hidden, dtype=torch.float64, generator=generator) * 3.0

    def tokens(count):
        states = torch.randn(count, hidden, dtype=torch.float64, generator=generator) + offset
        return rms_normed(states)
    fit_on, held_out = tokens(4000), tokens(4000)
    covariance = fit_on.T @ fit_on / fit_on.shape[0]
    weights = {name: torch.randn(rows, hidden, dtype=torch.float64, generator=generator)
               for name, rows in (('q', heads * dim), ('k', kv_heads * dim), ('v', kv_heads * dim))}
    mix, _ = shared_key_mix(pair_key_cross_energy(weights['k'], covariance, kv_heads, dim), [0, 2])
    errors, spreads, floors = {}, {}, {}
    for pin in (False, True):
        layer = deepseek_attention_weights(weights['q'], weights['k'], weights['v'], heads, kv_heads, dim, mix,
                                           rank, covariance, 'energy', fit_on if pin else None)
        down = layer['kv_a_proj_with_mqa.weight'][:rank]
        rows = latent_norm_fit('regression', layer['up'], down, layer['targets'], fit_on)[1]
        errors[pin] = normed_latent_error(layer['targets'], down, rows, held_out)
        latent = held_out @ down.T
        rms = latent.pow(2).mean(-1).sqrt()
        spreads[pin] = float(rms.std() / rms.mean())
        truth = held_out @ layer['targets'].T
        floors[pin] = float((latent @ layer['up'].T - truth).pow(2).sum() / truth.pow(2).sum())
    assert spreads[True] < 0.3 * spreads[False]
    # what the norm adds to the latent's own (rank) error: cut by more than 5x
    assert errors[True] - floors[True] < 0.2 * (errors[False] - floors[False])


def _frequencies_equal_in_pairs_of_two(model) -> torch.Tensor:
    """Give RoPE pairs 2j and 2j+1 of ``model`` the same frequency (pair 2j's); returns the new frequencies."""
    inv_freq = model.model.rotary_emb.inv_freq
    inv_freq[1::2] = inv_freq[0::2].clone()
    return inv_freq.clone()


def test_a_fold_of_two_is_exact_where_the_folded_frequencies_are_equal():
    """FreqFold's approximation is the frequency mismatch alone: an MQA source whose pairs turn alike two by two,
    every pair in the shared key folded two slots at a time (each slot a mix of both pairs), is the source at every
    position; with the source's own (unequal) frequencies it is not."""
    source = _source(kv_heads=1)
    unfolded = _deepseek(source, pairs=HEAD_DIM // 2, stride=1, rank=2 * HEAD_DIM, fold=2)
    with torch.no_grad():
        assert not torch.allclose(unfolded(_ids()).logits, source(_ids()).logits, atol=1e-3)
    frequencies = _frequencies_equal_in_pairs_of_two(source)
    model = _deepseek(source, pairs=HEAD_DIM // 2, stride=1, rank=2 * HEAD_DIM, fold=2)
    model.model.rotary_emb.inv_freq.copy_(frequencies)  # slot k turns at pair k's frequency, as in the config
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, source(_ids()).logits, rtol=0, atol=1e-4)


def test_a_fold_mixes_pairs_within_its_span_and_keeps_more_key_energy():
    """The folded shared key is orthonormal over slots, each slot reads only the pairs its fold spans, and it keeps
    at least the unfolded key's energy (the unfolded choice is one the fold could make); a fold of 1 is the
    per-pair principal key: each slot reads its own pair only."""
    generator = torch.Generator().manual_seed(5)
    kv_heads, dim, hidden = 3, 16, 40
    k_weight = torch.randn(kv_heads * dim, hidden, dtype=torch.float64, generator=generator)
    cross = pair_key_cross_energy(k_weight, None, kv_heads, dim)
    slots = strided_pairs(4, 2)  # pairs 0, 2, 4, 6 of 8
    plain, plain_kept = shared_key_mix(cross, slots, 1, 2)
    folded, folded_kept = shared_key_mix(cross, slots, 2, 2)
    for mix in (plain, folded):
        flat = mix.reshape(len(slots), -1)
        torch.testing.assert_close(flat @ flat.T, torch.eye(len(slots), dtype=torch.float64))
    assert (plain.abs().sum(-1) > 0).nonzero()[:, 1].tolist() == slots  # each slot its own pair
    reads = (folded.abs().sum(-1) > 0)
    assert reads[:2, 4:].sum() == 0 and reads[2:, :4].sum() == 0  # slots 0-1 span pairs 0-3, slots 2-3 pairs 4-7
    assert reads[:2, :4].any(0).all() and reads[2:, 4:].any(0).all()  # the dropped pairs 1, 3, 5, 7 are read too
    assert folded_kept > plain_kept


def _llama(kv_heads: int, dim: int = 64) -> LlamaConfig:
    return LlamaConfig(hidden_size=3 * kv_heads * dim, num_attention_heads=3 * kv_heads, num_key_value_heads=kv_heads,
                       head_dim=dim, num_hidden_layers=2)


@pytest.mark.parametrize('fraction, asked, expected', [
    (1 / 3, None, (16, 96, True)),  # SmolLM2's shape at a third: 128 numbers, the key nearest 32: 32 + 96
    (0.3, None, (16, 64, True)),  # 115 numbers, 96 in whole blocks, the key nearest 24: 32 + 64
    (0.3333, None, (16, 96, True)),  # 127.99 numbers, read to three decimals 128, as at 1 / 3 (floored: 96)
    (2 / 3, None, (20, 216, False)),  # above a third the unrounded split: 5/8 of the head's pairs, 40 + 216
    (2 / 3, True, (32, 192, True)),  # asked for: the key nearest 64, 64 + 192
    (1 / 3, False, (20, 88, False)),  # asked not to
])
def test_the_quantizable_split_is_whole_blocks_by_default_up_to_a_third(fraction, asked, expected):
    from dha_train.conversion.deepseek import DeepseekSettings, budget

    pairs, rank, source, quantized = budget(_llama(3), DeepseekSettings(cache_fraction=fraction,
                                                                        quantizable_cache=asked))
    assert source == 384 and (pairs, rank, quantized) == expected
    if quantized:
        assert rank % 32 == 0 and (rank + 2 * pairs) % 32 == 0 and rank + 2 * pairs <= (fraction + 1e-3) * source


def test_a_third_of_a_cache_with_no_room_for_two_blocks_keeps_the_unrounded_split():
    from dha_train.conversion.deepseek import DeepseekSettings, budget

    # 2 K/V heads of 32 dims: a third is 42 numbers, one block: no room for a latent and a key of a block each
    assert budget(_llama(2, 32), DeepseekSettings(cache_fraction=1 / 3))[3] is False
