"""`dha-train convert`: mean-pool an MHA folder to a head map; shared equal-size maps export as standard GQA."""

from __future__ import annotations

import pytest
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
    assert "50.0% of MHA's" in capsys.readouterr().out
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


@pytest.mark.slow
def test_decoupled_map_becomes_a_dha_model_that_trains_and_exports(tmp_path, data_root, tokenizer_dir):
    import os
    import subprocess
    import sys

    from transformers import AutoTokenizer

    import dha_train.models  # noqa: F401  (registers the DHA classes)
    from dha_train.models.modeling_dha import DhaLlamaForCausalLM
    from helpers import REPO, tiny_recipe, write_recipe

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=HEADS * HEAD_DIM, intermediate_size=96,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=64)
    mha = LlamaForCausalLM(config).eval()
    mha.save_pretrained(tmp_path / 'mha')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / 'mha')
    head_map = HeadMap.dha(key_partitions=[[[0, 1, 2, 3], [4, 5, 6, 7]], [list(range(8))]],
                           value_partitions=[[[0, 5], [1, 2, 3, 4, 6, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]],
                           num_heads=HEADS, head_dim=HEAD_DIM)
    head_map.save(tmp_path / 'dha.json')
    assert main(['convert', str(tmp_path / 'mha'), str(tmp_path / 'dha'), '--head-map', str(tmp_path / 'dha.json')]) == 0
    dha = AutoModelForCausalLM.from_pretrained(tmp_path / 'dha', local_files_only=True).eval()
    assert type(dha) is DhaLlamaForCausalLM and (tmp_path / 'dha' / 'modeling_dha.py').is_file()

    # Reference in MHA form: K heads replaced by their key group's mean, V heads by their value group's mean.
    keys, values = [layer.key for layer in head_map.layers], [layer.value for layer in head_map.layers]
    pooled = mean_pool_llama_state_dict(mha.state_dict(), keys, values, HEAD_DIM)
    for layer in range(LAYERS):
        for proj, maps in (('k_proj', keys), ('v_proj', values)):
            name = f'model.layers.{layer}.self_attn.{proj}.weight'
            pooled[name] = gather_heads(pooled[name], maps[layer], HEAD_DIM)
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict(pooled)
    ids = torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(_logits(dha, ids), _logits(reference, ids), atol=1e-5, rtol=0)

    # Continued pre-training of the DHA model (one process), then export back to a DHA folder.
    recipe = tiny_recipe(data_root, tokenizer_dir, max_duration='4ba', save_folder=str(tmp_path / 'ckpt'),
                         save_interval='4ba')
    recipe['model'] = {'pretrained_path': str(tmp_path / 'dha')}
    path = write_recipe(tmp_path / 'ct.yaml', recipe)
    env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
    done = subprocess.run([sys.executable, '-m', 'dha_train.cli', 'train', str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert main(['export', str(tmp_path / 'ckpt'), str(tmp_path / 'hf')]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / 'hf', local_files_only=True).eval()
    assert type(exported) is DhaLlamaForCausalLM
    assert HeadMap.load(tmp_path / 'hf' / 'head_map.json') == head_map
    assert [tuple(m.shape) for m in (exported.model.layers[1].self_attn.k_proj.weight,
                                     exported.model.layers[1].self_attn.v_proj.weight)] == [(8, 64), (32, 64)]
    assert not torch.allclose(_logits(exported, ids), _logits(dha, ids))  # it trained


# --- GQA sources: SmolLM2's shape in miniature (9 query heads sharing 3 K/V heads) -------------------------------
GQA_HEADS, GQA_KV = 9, 3


def _gqa_folder(path):
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=97, hidden_size=GQA_HEADS * HEAD_DIM, intermediate_size=96,
                         num_hidden_layers=LAYERS, num_attention_heads=GQA_HEADS, num_key_value_heads=GQA_KV,
                         max_position_embeddings=32)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _by_hand_mean_pool(gqa, source_groups):
    """The GQA source with its K/V heads replaced by the means of ``source_groups`` (lists of source heads), written
    as a plain LLaMA with one K/V head per query head (each query head reads its group's mean)."""
    state = dict(gqa.state_dict())
    size = GQA_HEADS // GQA_KV
    for layer in range(LAYERS):
        for proj in ('k_proj', 'v_proj'):
            name = f'model.layers.{layer}.self_attn.{proj}.weight'
            heads = state[name].reshape(GQA_KV, HEAD_DIM, -1)
            means = {s: heads[group].mean(dim=0) for group in source_groups for s in group}
            state[name] = torch.cat([means[h // size] for h in range(GQA_HEADS)])
    reference = LlamaForCausalLM(LlamaConfig(**{**gqa.config.to_dict(), 'num_key_value_heads': GQA_HEADS})).eval()
    reference.load_state_dict(state)
    return reference


@pytest.mark.parametrize('kv_heads, groups', [(3, [[0], [1], [2]]), (1, [[0, 1, 2]]), (2, [[0, 1], [2]])])
def test_gqa_source_pools_its_own_heads_exactly(tmp_path, capsys, kv_heads, groups):
    gqa = _gqa_folder(tmp_path / 'gqa')
    assert main(['convert', str(tmp_path / 'gqa'), str(tmp_path / 'out'), '--kv-heads', str(kv_heads)]) == 0
    share = f'{kv_heads / GQA_KV:.1%} of the source KV cache, {kv_heads / GQA_HEADS:.1%} of MHA\'s'
    assert share in capsys.readouterr().out
    out = AutoModelForCausalLM.from_pretrained(tmp_path / 'out', local_files_only=True).eval()
    assert HeadMap.from_hf_config(out.config).kv_heads() == [(kv_heads, kv_heads)] * LAYERS
    if kv_heads in (1, 3):  # divides the source's heads: standard GQA / MQA, a plain LLaMA
        assert type(out) is LlamaForCausalLM and out.config.num_key_value_heads == kv_heads
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    assert torch.allclose(_logits(out, ids), _logits(_by_hand_mean_pool(gqa, groups), ids), atol=1e-5, rtol=0)
    if kv_heads == 3:  # the identity budget is the source itself
        assert torch.allclose(_logits(out, ids), _logits(gqa, ids), atol=1e-5, rtol=0)


def test_gqa_source_head_map_relative_to_the_source(tmp_path):
    """A map given over the source's K/V heads ({0, 2} and {1}, K and V alike) is made contiguous by permuting the
    query heads with their source heads, and equals the by-hand mean-pool."""
    gqa = _gqa_folder(tmp_path / 'gqa')
    source = HeadMap.from_hf_config(gqa.config)
    target = HeadMap.from_source_partitions(source, [[[0, 2], [1]]] * LAYERS, [[[0, 2], [1]]] * LAYERS)
    target.save(tmp_path / 'map.json')
    assert main(['convert', str(tmp_path / 'gqa'), str(tmp_path / 'out'), '--head-map', str(tmp_path / 'map.json')]) == 0
    out = AutoModelForCausalLM.from_pretrained(tmp_path / 'out', local_files_only=True).eval()
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    expected = _logits(_by_hand_mean_pool(gqa, [[0, 2], [1]]), ids)
    assert torch.allclose(_logits(out, ids), expected, atol=1e-5, rtol=0)


def test_gqa_source_map_that_splits_a_source_head_is_refused(tmp_path, capsys):
    _gqa_folder(tmp_path / 'gqa')
    HeadMap.gqa(LAYERS, GQA_HEADS, GQA_HEADS, HEAD_DIM).save(tmp_path / 'mha.json')  # one K/V per query head
    assert main(['convert', str(tmp_path / 'gqa'), str(tmp_path / 'out'), '--head-map', str(tmp_path / 'mha.json')]) == 2
    assert 'must group whole source heads' in capsys.readouterr().err
    assert main(['convert', str(tmp_path / 'gqa'), str(tmp_path / 'out'), '--kv-heads', '4']) == 2
    assert '--kv-heads 4: 4 K/V heads per layer: the source has 3, so give 1..3' in capsys.readouterr().err
    assert not (tmp_path / 'out').exists()
