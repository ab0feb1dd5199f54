"""`dha-train export-gguf`: each exportable kind of tiny model, written as GGUF and run in llama.cpp (llama-cpp-python,
installed by `make install`), computes what the HF folder computes; what no engine serves is refused in one line.

The kinds: a GQA folder (``llama``), the same with LLaMA-3.x's RoPE scaling (``rope_freqs``), a servable DHA export whose layers keep different K/V head counts with the
query heads out of group order (``deci``: llama.cpp's LLaMA with per-layer head counts), and MLA in DeepSeek's format
from ``convert --format deepseek`` (``deepseek2``, MLA mode), its ``rms_norm_eps`` set to 1e-5 so that the latent
norm's own epsilon (1e-6 in transformers) has to be carried.

Tolerances: llama.cpp in f32 with an f32 cache and without flash attention agrees with transformers to about 3e-6 on
these models (measured; the order of float32 sums differs); 1e-4 leaves 30x headroom while a wrong RoPE layout, head
order, epsilon or softmax scale moves logits by 1e-2 or more. Flash attention on the CPU computes in f16, so the
logit checks run without it, and the cache check with it (llama-server's default, ``--flash-attn auto``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dha_train.models  # noqa: F401  (registers the DHA class)
from dha_train.cli import main
from dha_train.engine_process import EngineProcess
from dha_train.llama_cpp_engine import LlamaCppModel
from dha_train.methods import kv_cache_bytes
from dha_train.models.head_map import HeadMap
from helpers import mixed_text_lines, refused_in_one_line, save_tiny_llama

pytestmark = pytest.mark.slow

HEADS, HEAD_DIM, LAYERS = 8, 8, 3
LOGIT_TOLERANCE = 1e-4
N_CTX = 8192  # one cached value per token and layer is 16 KiB at this length: above the 0.01 MiB llama.cpp prints
# Servable but not contiguous: per layer, equal groups shared by K and V, counts 2, 4 and 1, heads out of order.
SERVABLE_GROUPS = [[[0, 3, 5, 6], [1, 2, 4, 7]], [[7, 0], [1, 5], [2, 3], [4, 6]], [list(range(HEADS))]]
# unequal groups in layer 0: no engine serves them
UNEQUAL = [[[0, 1, 2], [3, 4, 5, 6, 7]]] + [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2


@pytest.fixture(scope='module')
def sources(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp('gguf_sources')
    # initializer_range 0.1: logits far from uniform, so greedy decoding is decided by clear margins
    settings = dict(num_hidden_layers=LAYERS, num_attention_heads=HEADS, hidden_size=HEADS * HEAD_DIM,
                    max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-5, rope_theta=500.0)
    save_tiny_llama(root / 'mha', tokenizer_dir, seed=1, num_key_value_heads=HEADS, **settings)
    save_tiny_llama(root / 'gqa', tokenizer_dir, seed=2, num_key_value_heads=2, **settings)
    # LLaMA-3.x's RoPE scaling (frequency-dependent: at these widths two of four frequencies are scaled, one smoothly)
    llama3 = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
              'original_max_position_embeddings': 64}
    save_tiny_llama(root / 'llama3', tokenizer_dir, seed=4, num_key_value_heads=4, rope_scaling=llama3, **settings)
    return {'mha': root / 'mha', 'gqa': root / 'gqa', 'llama3': root / 'llama3'}


@pytest.fixture(scope='module')
def folders(sources, tmp_path_factory, data_root) -> dict[str, Path]:
    """The three exportable kinds, made by the project's own commands (a GQA folder is the source itself)."""
    root = tmp_path_factory.mktemp('gguf_folders')
    head_map = HeadMap.from_partitions(SERVABLE_GROUPS, num_heads=HEADS, head_dim=HEAD_DIM)
    head_map.save(root / 'servable_map.json')
    assert main(['convert', str(sources['mha']), str(root / 'dha'), '--head-map', str(root / 'servable_map.json')]) == 0
    assert main(['convert', str(sources['gqa']), str(root / 'deepseek'), '--method', 'mla', '--format', 'deepseek',
                 '--cache-fraction', '0.5', '--data', str(data_root), '--tokens', '1024', '--batch-size', '4']) == 0
    # the conversion writes the latent norm's eps (1e-6) as rms_norm_eps; a DeepSeek folder with another one (as
    # the source's 1e-5) makes the exporter carry transformers' latent eps into llama.cpp's single eps
    config = json.loads((root / 'deepseek' / 'config.json').read_text())
    assert config['rms_norm_eps'] == 1e-6
    (root / 'deepseek' / 'config.json').write_text(json.dumps({**config, 'rms_norm_eps': 1e-5}))
    return {'gqa': sources['gqa'], 'dha': root / 'dha', 'deepseek': root / 'deepseek', 'llama3': sources['llama3']}


ARCHITECTURES = {'gqa': 'llama', 'dha': 'deci', 'deepseek': 'deepseek2', 'llama3': 'llama'}


def _field(reader: gguf.GGUFReader, key: str):
    found = reader.fields.get(key)
    return None if found is None else found.contents()


@pytest.mark.parametrize('kind', ['gqa', 'dha', 'deepseek', 'llama3'])
def test_the_export_runs_in_llama_cpp_as_in_transformers(kind, folders, sources, tmp_path, capsys):
    folder = folders[kind]
    out = tmp_path / f'{kind}.gguf'
    assert main(['export-gguf', str(folder), str(out), '--outtype', 'f32']) == 0
    assert f'({ARCHITECTURES[kind]}, f32' in capsys.readouterr().out
    reader = gguf.GGUFReader(out)
    assert _field(reader, 'general.architecture') == ARCHITECTURES[kind]
    if kind == 'dha':
        assert list(_field(reader, 'deci.attention.head_count_kv')) == [2, 4, 1]
    if kind == 'llama3':
        assert any(tensor.name == 'rope_freqs.weight' for tensor in reader.tensors)
    if kind in ('dha', 'deepseek'):  # a converted folder's card: its method and its cache against the source's
        assert _field(reader, 'dha_train.method') == {'dha': 'mean_pool', 'deepseek': 'mla_deepseek'}[kind]
        source = AutoModelForCausalLM.from_pretrained(sources['mha' if kind == 'dha' else 'gqa']).config
        expected = kv_cache_bytes(AutoModelForCausalLM.from_pretrained(folder).config, 1, 2) / kv_cache_bytes(source, 1, 2)
        assert _field(reader, 'dha_train.fraction_of_source_kv') == pytest.approx(expected, rel=1e-6)
        assert _field(reader, 'general.base_model.0.name') == sources['mha' if kind == 'dha' else 'gqa'].name

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lines = mixed_text_lines()
    assert len(lines) >= 200
    with EngineProcess(LlamaCppModel, out, n_ctx=256, all_logits=True, cache_type='f32', flash_attention=False) as engine:
        # the same ids for every line, and for the whole text with the special tokens the tokenizer adds
        mismatched = [line for line in lines
                      if engine.tokenize(line) != tokenizer(line, add_special_tokens=False)['input_ids']]
        assert not mismatched, mismatched[:3]
        text = '\n'.join(lines)
        assert engine.tokenize(text, add_special=True) == tokenizer(text)['input_ids']

        prompt = tokenizer(text, add_special_tokens=False)['input_ids'][:64]
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0].numpy()
        found = engine.logits(prompt)
        assert found.shape == expected.shape
        assert np.abs(found - expected).max() < LOGIT_TOLERANCE, np.abs(found - expected).max()

        with torch.no_grad():
            generated = model.generate(torch.tensor([prompt[:16]]), attention_mask=torch.ones(1, 16, dtype=torch.long),
                                       max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 16:].tolist()
        assert engine.greedy(prompt[:16], 32) == generated

    with EngineProcess(LlamaCppModel, out, n_ctx=N_CTX, cache_type='f16') as engine:
        cache = engine.kv_cache
    expected_mib = kv_cache_bytes(model.config, N_CTX, 2) / 2 ** 20
    assert cache.k_type == cache.v_type == 'f16' and cache.cells == N_CTX and cache.layers == LAYERS
    assert abs(cache.k_mib + cache.v_mib - expected_mib) <= 0.0101, (cache, expected_mib)


def test_q8_0_and_f16_files_load_and_stay_close(folders, tmp_path):
    """The other weight types load and give logits near the f32 file's (q8_0: 8-bit blocks of 32)."""
    prompt = list(range(3, 40))
    logits = {}
    for outtype in ('f32', 'f16', 'q8_0', 'bf16'):
        out = tmp_path / f'{outtype}.gguf'
        assert main(['export-gguf', str(folders['dha']), str(out), '--outtype', outtype]) == 0
        with EngineProcess(LlamaCppModel, out, n_ctx=64, all_logits=True, cache_type='f32', flash_attention=False) as engine:
            logits[outtype] = engine.logits(prompt)
    scale = np.abs(logits['f32']).max()
    # measured, as a share of the largest logit: f16 0.2%, bf16 1.8%, q8_0 5.5% (llama.cpp rounds the activations to
    # the weights' type too); a misplaced block or row would be of the order of 100%
    assert np.abs(logits['f16'] - logits['f32']).max() < 1e-2 * scale
    assert np.abs(logits['bf16'] - logits['f32']).max() < 5e-2 * scale
    assert np.abs(logits['q8_0'] - logits['f32']).max() < 1.5e-1 * scale
    assert (tmp_path / 'q8_0.gguf').stat().st_size < 0.6 * (tmp_path / 'f16.gguf').stat().st_size


def test_a_q8_0_deepseek_file_keeps_the_tensors_that_write_and_read_the_latent_in_f16(folders, tmp_path):
    """The latent's rows sit in the norm's linear range (about 1e-5), where a q8_0 block's f16 scale is subnormal,
    and the tensors that read the normed latent see llama.cpp round their input to 8 bits: those three stay f16,
    the rest is q8_0."""
    out = tmp_path / 'deepseek.q8_0.gguf'
    assert main(['export-gguf', str(folders['deepseek']), str(out), '--outtype', 'q8_0']) == 0
    types = {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(out).tensors}
    for layer in range(LAYERS):
        for name in ('attn_kv_a_mqa', 'attn_k_b', 'attn_v_b'):
            assert types[f'blk.{layer}.{name}.weight'] == gguf.GGMLQuantizationType.F16, name
        assert types[f'blk.{layer}.ffn_up.weight'] == gguf.GGMLQuantizationType.Q8_0


# ----------------------------------------------------------------------------------------------------------------
# Refusals: exit 2, one line, nothing written
# ----------------------------------------------------------------------------------------------------------------


def _converted(source: Path, out: Path, key, value) -> Path:
    head_map = HeadMap.dha(key, value, num_heads=HEADS, head_dim=HEAD_DIM)
    head_map.save(out.with_suffix('.json'))
    assert main(['convert', str(source), str(out), '--head-map', str(out.with_suffix('.json'))]) == 0
    return out


def test_maps_that_no_engine_serves_are_refused_naming_the_layer_and_the_fix(sources, tmp_path, capfd):
    apart = _converted(sources['mha'], tmp_path / 'apart', [[[0, 1, 2, 3], [4, 5, 6, 7]]] * LAYERS,
                       [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2 + [[[0, 2, 4, 6], [1, 3, 5, 7]]])
    line = refused_in_one_line(['export-gguf', str(apart), str(tmp_path / 'apart.gguf')], tmp_path, capfd)
    assert 'layer 2: K and V are grouped apart' in line and 'layer 0' not in line
    assert 'servable: true' in line and '--servable' in line

    uneven = _converted(sources['mha'], tmp_path / 'uneven', UNEQUAL, UNEQUAL)
    line = refused_in_one_line(['export-gguf', str(uneven), str(tmp_path / 'uneven.gguf')], tmp_path, capfd)
    assert 'layer 0: groups of sizes [3, 5]' in line


def test_the_mla_class_and_moh_are_refused_by_name(sources, tmp_path, capfd, data_root):
    assert main(['convert', str(sources['gqa']), str(tmp_path / 'mla'), '--method', 'mla', '--cache-fraction', '0.75',
                 '--data', str(data_root), '--tokens', '512', '--batch-size', '4']) == 0
    line = refused_in_one_line(['export-gguf', str(tmp_path / 'mla'), str(tmp_path / 'mla.gguf')], tmp_path, capfd)
    assert 'the MLA class (mla_llama)' in line and '--format deepseek' in line

    from dha_train.models.modeling_moh import MohLlamaConfig, MohLlamaForCausalLM

    config = AutoModelForCausalLM.from_pretrained(sources['mha']).config.to_dict()
    config = {key: value for key, value in config.items() if key not in ('model_type', 'architectures')}
    MohLlamaForCausalLM(MohLlamaConfig(**config, moh_shared_heads=4, moh_top_k=2)).save_pretrained(tmp_path / 'moh')
    line = refused_in_one_line(['export-gguf', str(tmp_path / 'moh'), str(tmp_path / 'moh.gguf')], tmp_path, capfd)
    assert 'MoH routes query heads per token' in line


def test_missing_truncated_and_tokenizerless_folders_and_an_existing_file_are_refused(sources, tmp_path, capfd):
    out = tmp_path / 'model.gguf'
    line = refused_in_one_line(['export-gguf', str(tmp_path / 'nowhere'), str(out)], tmp_path, capfd)
    assert 'does not exist' in line

    truncated = tmp_path / 'truncated'
    shutil.copytree(sources['gqa'], truncated)
    weights = truncated / 'model.safetensors'
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    line = refused_in_one_line(['export-gguf', str(truncated), str(out)], tmp_path, capfd)
    assert 'model.safetensors is truncated' in line

    bare = tmp_path / 'bare'
    shutil.copytree(sources['gqa'], bare)
    (bare / 'tokenizer.json').unlink()
    line = refused_in_one_line(['export-gguf', str(bare), str(out)], tmp_path, capfd)
    assert 'has no tokenizer.json' in line

    out.write_bytes(b'an earlier file')
    line = refused_in_one_line(['export-gguf', str(sources['gqa']), str(out)], tmp_path, capfd)
    assert f'{out} exists; pass --overwrite' in line
    assert main(['export-gguf', str(sources['gqa']), str(out), '--overwrite']) == 0
    assert out.read_bytes()[:4] == b'GGUF'


def test_a_chat_template_travels_into_the_file(sources, tmp_path):
    folder = tmp_path / 'chat'
    shutil.copytree(sources['gqa'], folder)
    settings = json.loads((folder / 'tokenizer_config.json').read_text())
    settings['chat_template'] = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    (folder / 'tokenizer_config.json').write_text(json.dumps(settings))
    assert main(['export-gguf', str(folder), str(tmp_path / 'chat.gguf')]) == 0
    reader = gguf.GGUFReader(tmp_path / 'chat.gguf')
    assert _field(reader, 'tokenizer.chat_template') == settings['chat_template']
    assert _field(reader, 'tokenizer.ggml.eos_token_id') == AutoTokenizer.from_pretrained(folder).eos_token_id


def test_a_map_whose_k_and_v_number_the_same_groups_differently_exports_exactly(tokenizer_dir, tmp_path):
    """Servability is about the groups, not their numbering: V head 0 may serve K head 1's group. The exporter
    orders the K and the V rows by the groups, so llama.cpp's contiguous GQA pairs them right."""
    from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM

    layers = [{'key': [0, 1, 1, 0, 2, 2, 3, 3], 'value': [3, 2, 2, 3, 1, 1, 0, 0]},
              {'key': [0, 0, 0, 0, 1, 1, 1, 1], 'value': [1, 1, 1, 1, 0, 0, 0, 0]}]
    config = DhaLlamaConfig(head_map={'head_dim': HEAD_DIM, 'num_query_heads': HEADS, 'layers': layers},
                            vocab_size=384, hidden_size=HEADS * HEAD_DIM, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=HEADS, max_position_embeddings=256, initializer_range=0.1)
    torch.manual_seed(3)
    model = DhaLlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / 'dha')
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / 'dha')
    assert main(['export-gguf', str(tmp_path / 'dha'), str(tmp_path / 'dha.gguf'), '--outtype', 'f32']) == 0
    prompt = list(range(7, 47))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    with EngineProcess(LlamaCppModel, tmp_path / 'dha.gguf', n_ctx=64, all_logits=True, cache_type='f32',
                       flash_attention=False) as engine:
        assert np.abs(engine.logits(prompt) - expected).max() < LOGIT_TOLERANCE
