"""Calibration: per-layer Grams of K (before RoPE), V and head outputs over exactly N streamed tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train.calibration import CalibrationError, CalibrationStats, calibrate

HEADS, HEAD_DIM, LAYERS, SEQ = 4, 8, 2, 16


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config).eval()


def batches(count: int, rows: int = 3, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{'input_ids': torch.randint(0, 50, (rows, SEQ), generator=generator)} for _ in range(count)]


def reference_projections(model, data: list[dict]) -> dict[tuple[int, str], torch.Tensor]:
    """K and V per layer computed without hooks: k_proj/v_proj of the normed layer input, all tokens flattened."""
    out: dict[tuple[int, str], list[torch.Tensor]] = {}
    with torch.no_grad():
        for batch in data:
            hidden = model(input_ids=batch['input_ids'], output_hidden_states=True).hidden_states
            for index, layer in enumerate(model.model.layers):
                normed = layer.input_layernorm(hidden[index])
                out.setdefault((index, 'key'), []).append(layer.self_attn.k_proj(normed).reshape(-1, HEADS * HEAD_DIM))
                out.setdefault((index, 'value'), []).append(layer.self_attn.v_proj(normed).reshape(-1, HEADS * HEAD_DIM))
                out.setdefault((index, 'query'), []).append(layer.self_attn.q_proj(normed).reshape(-1, HEADS * HEAD_DIM))
                out.setdefault((index, 'input'), []).append(normed.reshape(-1, HEADS * HEAD_DIM))
    return {key: torch.cat(rows).double() for key, rows in out.items()}


def test_calibration_accumulates_exactly_n_tokens_of_pre_rope_keys_and_values(tmp_path):
    model = tiny_model()
    data = batches(4)
    num_tokens = 2 * 3 * SEQ + 21  # not a whole number of sequences or batches
    stats = calibrate(model, data, num_tokens=num_tokens, kinds=('key', 'value', 'output'), sample_tokens=10, seed=3)
    reference = reference_projections(model, data)
    for layer in range(LAYERS):
        for kind in ('key', 'value'):
            rows = reference[(layer, kind)][:num_tokens]
            centred = rows - rows.mean(dim=0)
            recorded = stats.layer(layer, kind)
            assert recorded.running.count == num_tokens
            assert torch.allclose(recorded.running.centered(), centred.T @ centred, atol=1e-4, rtol=1e-5)
        assert stats.layer(layer, 'output').running.gram.shape == (HEADS * HEAD_DIM, HEADS * HEAD_DIM)

    # The sample: 10 real token rows, the same tokens for every layer and kind. Layer-0 keys depend on the token
    # id alone (repeats are common), so positions are identified by the context-dependent layer-1 keys.
    key_rows = reference[(1, 'key')][:num_tokens].float()
    sample = stats.layer(1, 'key').sample
    assert sample.shape == (10, HEADS * HEAD_DIM)
    positions = [int(torch.cdist(row[None], key_rows).argmin()) for row in sample]
    assert len(set(positions)) == 10
    assert torch.allclose(key_rows[positions], sample, atol=1e-5)
    for layer, kind in ((0, 'key'), (0, 'value'), (1, 'value')):
        rows = reference[(layer, kind)][:num_tokens].float()
        assert torch.allclose(rows[positions], stats.layer(layer, kind).sample, atol=1e-5)
    assert stats.layer(0, 'key').sample_by_head().shape == (HEADS, 10, HEAD_DIM)

    path = stats.save(tmp_path / 'calibration.pt')
    loaded = CalibrationStats.load(path)
    assert loaded.tokens == num_tokens and loaded.sample_tokens == 10
    assert torch.equal(loaded.layer(1, 'value').running.gram, stats.layer(1, 'value').running.gram)


def test_query_and_input_kinds_are_the_pre_rope_queries_and_the_normed_attention_input():
    """What the MLA conversion reads: query rows for the RoPE-pair scores, the input covariance for the whitening."""
    model = tiny_model()
    data = batches(2)
    reference = reference_projections(model, data)
    stats = calibrate(model, data, num_tokens=2 * 3 * SEQ, kinds=('query', 'input'), sample_tokens=2 * 3 * SEQ)
    for layer in range(LAYERS):
        for kind in ('query', 'input'):
            rows = reference[(layer, kind)]
            torch.testing.assert_close(stats.layer(layer, kind).running.gram, rows.T @ rows, rtol=1e-5, atol=1e-4)
        assert stats.layer(layer, 'input').num_heads == 1 and stats.layer(layer, 'query').num_heads == HEADS
        torch.testing.assert_close(stats.layer(layer, 'query').sample.double(), reference[(layer, 'query')],
                                   rtol=1e-6, atol=1e-6)


def test_calibration_sample_is_seeded_and_memory_does_not_grow_with_tokens():
    model = tiny_model()
    first = calibrate(model, batches(6), num_tokens=5 * 3 * SEQ, sample_tokens=8, seed=1)
    again = calibrate(model, batches(6), num_tokens=5 * 3 * SEQ, sample_tokens=8, seed=1)
    other = calibrate(model, batches(6), num_tokens=5 * 3 * SEQ, sample_tokens=8, seed=2)
    assert torch.equal(first.layer(0, 'key').sample, again.layer(0, 'key').sample)
    assert not torch.equal(first.layer(0, 'key').sample, other.layer(0, 'key').sample)
    small = calibrate(model, batches(6), num_tokens=SEQ, sample_tokens=8, seed=1)
    assert small.layer(0, 'key').running.gram.shape == first.layer(0, 'key').running.gram.shape


def test_calibration_errors_name_the_problem():
    model = tiny_model()
    with pytest.raises(CalibrationError, match='only 96'):
        calibrate(model, batches(2, rows=3), num_tokens=1000)
    with pytest.raises(CalibrationError, match='kinds'):
        calibrate(model, batches(1), num_tokens=10, kinds=('logits',))
    stats = calibrate(model, batches(1), num_tokens=10)
    with pytest.raises(CalibrationError, match="'output' was not recorded"):
        stats.layer(0, 'output')
    with pytest.raises(CalibrationError, match='no token sample'):
        stats.layer(0, 'key').sample_by_head()


def test_unit_rows_gram_is_the_gram_of_per_head_normalised_caches(tmp_path):
    model = tiny_model()
    data = batches(2)
    num_tokens = 3 * SEQ + 5
    stats = calibrate(model, data, num_tokens=num_tokens, kinds=('key', 'value'), unit_rows=True)
    reference = reference_projections(model, data)
    for layer in range(LAYERS):
        for kind in ('key', 'value'):
            heads = reference[(layer, kind)][:num_tokens].reshape(num_tokens, HEADS, HEAD_DIM)
            unit = (heads / heads.norm(dim=-1, keepdim=True)).reshape(num_tokens, -1)
            assert torch.allclose(stats.layer(layer, kind).unit_gram(), unit.T @ unit, atol=1e-4, rtol=1e-5)
            diagonal = torch.diagonal(stats.layer(layer, kind).unit_gram()).reshape(HEADS, HEAD_DIM).sum(dim=1)
            assert torch.allclose(diagonal, torch.full((HEADS,), float(num_tokens), dtype=torch.float64))
    loaded = CalibrationStats.load(stats.save(tmp_path / 'calibration.pt'))
    assert torch.equal(loaded.layer(1, 'key').unit_gram(), stats.layer(1, 'key').unit_gram())
    with pytest.raises(CalibrationError, match='unit_rows'):
        calibrate(model, data, num_tokens=8).layer(0, 'key').unit_gram()
