"""Head surgery: mean-pool closed form, GQA conversion equivalence, function-preserving permutation."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train.models.head_map import HeadMap
from dha_train.ops.heads import gather_heads, mean_pool_heads, mean_pool_llama_state_dict, permute_llama_state_dict

HEADS, HEAD_DIM, LAYERS = 8, 8, 2


def _llama(num_kv_heads: int = HEADS, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=HEADS * HEAD_DIM, intermediate_size=96,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=32, attn_implementation='eager')
    return LlamaForCausalLM(config).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_mean_pool_closed_form():
    rows = torch.arange(4 * 2 * 3, dtype=torch.float64).reshape(4 * 2, 3)  # 4 heads of dim 2
    pooled = mean_pool_heads(rows, [1, 0, 1, 0], head_dim=2)
    heads = rows.reshape(4, 2, 3)
    assert torch.equal(pooled.reshape(2, 2, 3)[0], (heads[1] + heads[3]) / 2)
    assert torch.equal(pooled.reshape(2, 2, 3)[1], (heads[0] + heads[2]) / 2)
    bias = torch.arange(8, dtype=torch.float64)
    assert torch.equal(mean_pool_heads(bias, [0, 0, 0, 1], 2), torch.tensor([2.0, 3.0, 6.0, 7.0], dtype=torch.float64))


def test_gqa_conversion_equals_mha_with_group_mean_heads():
    mha = _llama()
    head_map = HeadMap.gqa(LAYERS, HEADS, num_groups=2, head_dim=HEAD_DIM)
    keys = [layer.key for layer in head_map.layers]
    values = [layer.value for layer in head_map.layers]
    pooled = mean_pool_llama_state_dict(mha.state_dict(), keys, values, HEAD_DIM)
    gqa = _llama(num_kv_heads=2)
    gqa.load_state_dict(pooled)
    # The same function, written as MHA: every query head's K/V head is its group's mean, repeated.
    expanded = dict(pooled)
    for layer, mapping in enumerate(keys):
        for proj in ('k_proj', 'v_proj'):
            name = f'model.layers.{layer}.self_attn.{proj}.weight'
            expanded[name] = gather_heads(pooled[name], mapping, HEAD_DIM)
    reference = _llama()
    reference.load_state_dict(expanded)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(_logits(gqa, ids), _logits(reference, ids), atol=1e-5, rtol=0)
    assert not torch.allclose(_logits(gqa, ids), _logits(mha, ids), atol=1e-3)


def test_head_permutation_preserves_the_function():
    mha = _llama()
    generator = torch.Generator().manual_seed(3)
    orders = [torch.randperm(HEADS, generator=generator).tolist() for _ in range(LAYERS)]
    permuted = _llama()
    permuted.load_state_dict(permute_llama_state_dict(mha.state_dict(), orders, HEAD_DIM))
    ids = torch.randint(0, 97, (2, 16), generator=generator)
    assert torch.allclose(_logits(permuted, ids), _logits(mha, ids), atol=1e-5, rtol=0)
    q_name = 'model.layers.0.self_attn.q_proj.weight'
    assert not torch.equal(permuted.state_dict()[q_name], mha.state_dict()[q_name])
