"""`dha-train convert`: mean-pool an MHA folder to a head map; shared equal-size maps export as standard GQA."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dha_train.cli import main
from dha_train.models.head_map import HeadMap
from dha_train.ops.heads import gather_heads, mean_pool_llama_state_dict

HEADS, HEAD_DIM, LAYERS = 8, 8, 2


def _mha_folder(path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=HEADS * HEAD_DIM, intermediate_size=96,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=32)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_identity_map_keeps_the_model(tmp_path):
    mha = _mha_folder(tmp_path / 'mha')
    assert main(['convert', str(tmp_path / 'mha'), str(tmp_path / 'same'), '--kv-heads', str(HEADS)]) == 0
    same = AutoModelForCausalLM.from_pretrained(tmp_path / 'same', local_files_only=True).eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(_logits(same, ids), _logits(mha, ids), atol=1e-5, rtol=0)


def test_shared_noncontiguous_map_becomes_standard_gqa(tmp_path, capsys):
    mha = _mha_folder(tmp_path / 'mha')
    partition = [[0, 5], [1, 3], [2, 7], [4, 6]]
    head_map = HeadMap.from_partitions([partition] * LAYERS, HEADS, HEAD_DIM)
    head_map.save(tmp_path / 'head_map.json')
    assert main(['convert', str(tmp_path / 'mha'), str(tmp_path / 'gqa'), '--head-map',
                 str(tmp_path / 'head_map.json')]) == 0
    assert '50% of the MHA KV heads' in capsys.readouterr().out
    gqa = AutoModelForCausalLM.from_pretrained(tmp_path / 'gqa', local_files_only=True).eval()
    assert type(gqa) is LlamaForCausalLM and gqa.config.num_key_value_heads == 4
    assert HeadMap.load(tmp_path / 'gqa' / 'head_map.json').uniform_gqa_groups() == 4

    # Reference: the MHA model with each K/V head replaced by its group's mean, written in MHA form.
    pooled = mean_pool_llama_state_dict(mha.state_dict(), [head_map.layers[0].key] * LAYERS,
                                        [head_map.layers[0].value] * LAYERS, HEAD_DIM)
    for layer in range(LAYERS):
        for proj in ('k_proj', 'v_proj'):
            name = f'model.layers.{layer}.self_attn.{proj}.weight'
            pooled[name] = gather_heads(pooled[name], head_map.layers[0].key, HEAD_DIM)
    reference = LlamaForCausalLM(mha.config).eval()
    reference.load_state_dict(pooled)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(_logits(gqa, ids), _logits(reference, ids), atol=1e-5, rtol=0)


def test_bad_maps_are_refused(tmp_path, capsys):
    _mha_folder(tmp_path / 'mha')
    HeadMap.gqa(LAYERS + 1, HEADS, 2, HEAD_DIM).save(tmp_path / 'wrong.json')
    assert main(['convert', str(tmp_path / 'mha'), str(tmp_path / 'out'), '--head-map',
                 str(tmp_path / 'wrong.json')]) == 2
    assert '3 layers vs num_hidden_layers=2' in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()
