"""`dha-train export-gguf` for every source family: a tiny model of each (transformers' own classes, with nonzero
Qwen2 q/k/v biases, non-trivial Qwen3 / Gemma 3 norm weights, a Gemma 3 mixing sliding-window and full layers with a
window of 6 tokens, shorter than the prompt, and ``query_pre_attn_scalar`` 24 against a head_dim of 16) and its
mean-pool to one K/V head (Gemma 3 270M's MQA) are written as the family's own llama.cpp architecture and run
there (llama-cpp-python, through ``EngineProcess``) with transformers' logits; what llama.cpp cannot run as the HF
model does is refused in one line, nothing written.

Tolerances: LLaMA, Mistral, Qwen2 and Qwen3 agree with transformers to 2-5e-6 in f32 (measured), under
test_export_gguf's 1e-4. Gemma 3 agrees to 1.3e-3 (measured): llama.cpp's CPU GELU (``ggml_vec_geglu_f32``, built
with ``GGML_GELU_FP16``) rounds its input to f16 and reads the result from an f16 table. With that rounding done in
transformers too the gap is 2e-4 (one f16 step of an input near a rounding boundary still flips where the float32
sums differ in order), so the Gemma check is 5e-3 against transformers and 1e-3 against transformers with
llama.cpp's GELU, while a wrong window, local RoPE theta or softmax scale moves these logits by 0.6 to 3.6
(measured on this model).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from family_models import FAMILY_NAMES, randomize_biases_and_norms, save_tiny_family_model, tiny_config
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from dha_train import families
from dha_train.cli import main
from dha_train.engine_process import EngineProcess
from dha_train.gguf_vocab import LLAMA3_REGEX, QWEN2_REGEX
from dha_train.llama_cpp_engine import LlamaCppModel
from dha_train.models.head_map import HeadMap
from helpers import mixed_text_lines, refused_in_one_line, synthetic_document

LOGIT_TOLERANCE = 1e-4
GEMMA_TOLERANCE = 5e-3  # llama.cpp's f16 GELU table; see the module docstring
GEMMA_F16_GELU_TOLERANCE = 1e-3
SETTINGS = {'initializer_range': 0.1}  # logits far from uniform


def _field(reader: gguf.GGUFReader, key: str):
    found = reader.fields.get(key)
    return None if found is None else found.contents()


def _llama_cpp_gelu(model) -> None:
    """Replace every MLP's GELU with llama.cpp's: the input rounded to f16, the output read as f16."""

    class F16Gelu(torch.nn.Module):
        def forward(self, x):
            return F.gelu(x.half().float(), approximate='tanh').half().float()

    for layer in model.model.layers:
        layer.mlp.act_fn = F16Gelu()


def _assert_llama_cpp_logits(family, model, prompt: list[int], found: np.ndarray, expected: np.ndarray) -> None:
    """llama.cpp's logits against transformers' (for Gemma, also against transformers with llama.cpp's GELU)."""
    gap = np.abs(found - expected).max()
    if family.llama_cpp.norm_offset:  # Gemma: GELU is llama.cpp's f16 table
        assert gap < GEMMA_TOLERANCE, gap
        _llama_cpp_gelu(model)
        with torch.no_grad():
            emulated = model(torch.tensor([prompt])).logits[0].numpy()
        assert np.abs(found - emulated).max() < min(GEMMA_F16_GELU_TOLERANCE, gap), np.abs(found - emulated).max()
    else:
        assert gap < LOGIT_TOLERANCE, gap


@pytest.fixture(scope='module')
def folders(tmp_path_factory, tokenizer_dir) -> dict[tuple[str, str], Path]:
    """Per family, a GQA source (2 K/V heads of 4) and its mean-pool to 1 K/V head made by `dha-train convert`."""
    root = tmp_path_factory.mktemp('gguf_families')
    made = {}
    for name in FAMILY_NAMES:
        source = save_tiny_family_model(root / name, name, tokenizer_dir, seed=3, num_key_value_heads=2, **SETTINGS)
        pooled = root / f'{name}-gqa1'
        assert main(['convert', str(source), str(pooled), '--kv-heads', '1']) == 0
        made[name, 'source'], made[name, 'mean_pool'] = source, pooled
    return made


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['source', 'mean_pool'])
@pytest.mark.parametrize('name', FAMILY_NAMES)
def test_each_family_runs_in_its_own_llama_cpp_architecture_as_in_transformers(name, kind, folders, tmp_path, capsys):
    family, folder = families.get(name), folders[name, kind]
    out = tmp_path / f'{name}.gguf'
    assert main(['export-gguf', str(folder), str(out), '--outtype', 'f32']) == 0
    printed = capsys.readouterr().out
    assert f'({family.llama_cpp_arch}, f32, ' in printed and f'a {family.label} model' in printed
    reader = gguf.GGUFReader(out)
    arch = family.llama_cpp_arch
    assert _field(reader, 'general.architecture') == arch
    assert _field(reader, f'{arch}.attention.head_count_kv') == (2 if kind == 'source' else 1)
    assert _field(reader, 'dha_train.family') == family.label and family.label in _field(reader, 'general.tags')
    assert _field(reader, 'dha_train.method') == ('none' if kind == 'source' else 'mean_pool')
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    assert type(model) is family.causal_lm_class
    if family.llama_cpp.sliding_rope_theta is not None:
        assert list(_field(reader, f'{arch}.attention.sliding_window_pattern')) == [True, False]
        assert _field(reader, f'{arch}.attention.sliding_window') == model.config.sliding_window
        assert _field(reader, f'{arch}.rope.freq_base_swa') == model.config.rope_local_base_freq

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = '\n'.join(mixed_text_lines())
    prompt = tokenizer(text, add_special_tokens=False)['input_ids'][:64]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    with EngineProcess(LlamaCppModel, out, n_ctx=128, all_logits=True, cache_type='f32', flash_attention=False) as engine:
        assert engine.tokenize(text, add_special=True) == tokenizer(text)['input_ids']
        found = engine.logits(prompt)
    _assert_llama_cpp_logits(family, model, prompt, found, expected)


@pytest.mark.parametrize('name', FAMILY_NAMES)
def test_the_norm_names_are_llama_cpps_own(name):
    """Every norm the family layer writes has the GGUF name llama.cpp's own table (gguf-py) gives the HF name."""
    family = families.get(name)
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == family.llama_cpp_arch)
    table = gguf.get_tensor_name_map(arch, 1)
    for hf_name, name_in_file in family.llama_cpp.norms:
        assert table.get_name(f'model.layers.0.{hf_name}.weight', try_suffixes=('.weight',)) == \
            f'blk.0.{name_in_file}.weight'


# ----------------------------------------------------------------------------------------------------------------
# Per-layer head counts: 'deci' for LLaMA-architecture families, refused for the others
# ----------------------------------------------------------------------------------------------------------------

PER_LAYER = [[[0, 1], [2, 3]], [[0, 2, 1, 3]]]  # 2 K/V heads in layer 0, 1 in layer 1, heads out of order


@pytest.mark.slow
def test_a_per_layer_mistral_dha_runs_as_deci_and_a_per_layer_qwen2_is_refused(tmp_path, tokenizer_dir, capfd):
    head_map = HeadMap.from_partitions(PER_LAYER, num_heads=4, head_dim=16)
    head_map.save(tmp_path / 'map.json')
    for name in ('mistral', 'qwen2'):
        source = save_tiny_family_model(tmp_path / name, name, tokenizer_dir, seed=4, **SETTINGS)
        assert main(['convert', str(source), str(tmp_path / f'{name}-dha'), '--head-map', str(tmp_path / 'map.json')]) == 0
    out = tmp_path / 'mistral.gguf'
    assert main(['export-gguf', str(tmp_path / 'mistral-dha'), str(out), '--outtype', 'f32']) == 0
    assert _field(gguf.GGUFReader(out), 'general.architecture') == 'deci'
    model = AutoModelForCausalLM.from_pretrained(tmp_path / 'mistral-dha', torch_dtype=torch.float32).eval()
    prompt = list(range(5, 45))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    with EngineProcess(LlamaCppModel, out, n_ctx=64, all_logits=True, cache_type='f32', flash_attention=False) as engine:
        assert np.abs(engine.logits(prompt) - expected).max() < LOGIT_TOLERANCE

    line = refused_in_one_line(['export-gguf', str(tmp_path / 'qwen2-dha'), str(tmp_path / 'q.gguf')], tmp_path, capfd)
    assert 'per-layer K/V head counts' in line and "'qwen2'" in line
    assert not (tmp_path / 'q.gguf').exists()


# 2 K/V heads a layer, the query heads out of group order, K and V numbering the same groups differently
UNIFORM = [{'key': [0, 1, 1, 0], 'value': [1, 0, 0, 1]}, {'key': [1, 0, 0, 1], 'value': [1, 0, 0, 1]}]


def _servable_dha(folder: Path, name: str, tokenizer_dir: Path) -> Path:
    """A DHA model built on the family's decoder (``source_model_type``) with ``UNIFORM``'s map, random biases and
    norm weights as ``family_models`` gives its sources."""
    from dha_train.models.modeling_dha import DhaLlamaConfig, DhaLlamaForCausalLM

    source = tiny_config(name, **SETTINGS)
    config = DhaLlamaConfig.for_source(source, {'head_dim': families.head_dim(source), 'num_query_heads': 4,
                                                'layers': UNIFORM})
    torch.manual_seed(5)
    model = DhaLlamaForCausalLM(config).eval()
    randomize_biases_and_norms(model, name)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize('name', ['qwen2', 'qwen3', 'gemma3_text'])
def test_a_servable_dha_of_one_count_runs_in_the_family_architecture(name, tmp_path, tokenizer_dir):
    """The query-head permutation folded into q_proj (rows, with the q bias) and o_proj (columns) and the K/V rows
    (with their biases) taken in group order, under a NEOX architecture (no pair reordering)."""
    folder, out = _servable_dha(tmp_path / f'{name}-dha', name, tokenizer_dir), tmp_path / f'{name}.gguf'
    assert main(['export-gguf', str(folder), str(out), '--outtype', 'f32']) == 0
    assert _field(gguf.GGUFReader(out), 'general.architecture') == families.get(name).llama_cpp_arch
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    assert model.config.model_type == 'dha_llama' and model.config.source_model_type == name
    prompt = list(range(5, 45))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    with EngineProcess(LlamaCppModel, out, n_ctx=64, all_logits=True, cache_type='f32', flash_attention=False) as engine:
        found = engine.logits(prompt)
    _assert_llama_cpp_logits(families.get(name), model, prompt, found, expected)


@pytest.mark.slow
def test_llama_attention_biases_are_carried(tmp_path, tokenizer_dir):
    """llama.cpp's 'llama' loads q/k/v and o biases: the q/k biases are pair-reordered as their rows are."""
    folder = save_tiny_family_model(tmp_path / 'llama', 'llama', tokenizer_dir, seed=6, attention_bias=True,
                                    num_key_value_heads=2, **SETTINGS)
    out = tmp_path / 'llama.gguf'
    assert main(['export-gguf', str(folder), str(out), '--outtype', 'f32']) == 0
    assert {f'blk.0.attn_{name}.bias' for name in ('q', 'k', 'v', 'output')} <= {
        tensor.name for tensor in gguf.GGUFReader(out).tensors}
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    prompt = list(range(5, 45))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    with EngineProcess(LlamaCppModel, out, n_ctx=64, all_logits=True, cache_type='f32', flash_attention=False) as engine:
        assert np.abs(engine.logits(prompt) - expected).max() < LOGIT_TOLERANCE


@pytest.mark.slow
def test_gemma_final_logit_soft_capping_is_carried(tmp_path, tokenizer_dir):
    """Gemma 3's optional final soft-capping (``cap * tanh(logits / cap)``), read by llama.cpp's gemma3."""
    folder = save_tiny_family_model(tmp_path / 'gemma', 'gemma3_text', tokenizer_dir, seed=7,
                                    final_logit_softcapping=2.0, **SETTINGS)
    out = tmp_path / 'gemma.gguf'
    assert main(['export-gguf', str(folder), str(out), '--outtype', 'f32']) == 0
    assert _field(gguf.GGUFReader(out), 'gemma3.final_logit_softcapping') == 2.0
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    prompt = list(range(5, 45))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(expected).max() < 2.0  # capped
    with EngineProcess(LlamaCppModel, out, n_ctx=64, all_logits=True, cache_type='f32', flash_attention=False) as engine:
        found = engine.logits(prompt)
    _assert_llama_cpp_logits(families.get('gemma3_text'), model, prompt, found, expected)


# ----------------------------------------------------------------------------------------------------------------
# Refusals: exit 2, one line, nothing written
# ----------------------------------------------------------------------------------------------------------------

REFUSED = {
    'qwen3 attention biases': ('qwen3', {'attention_bias': True}, 'Qwen3 attention biases'),
    'gemma3 attention biases': ('gemma3_text', {'attention_bias': True}, 'no attn_output bias'),
    'qwen2 sliding windows': ('qwen2', {'use_sliding_window': True, 'sliding_window': 8, 'max_window_layers': 1},
                              'Qwen2 sliding-window layers'),
    'mistral sliding window': ('mistral', {'sliding_window': 8}, 'Mistral sliding-window attention'),
    'gemma3 attention soft-capping': ('gemma3_text', {'attn_logit_softcapping': 50.0}, 'no attention logit soft-capping'),
}


@pytest.mark.parametrize('case', list(REFUSED))
def test_what_llama_cpp_cannot_run_as_transformers_does_is_refused(case, tmp_path, tokenizer_dir, capfd):
    name, overrides, expected = REFUSED[case]
    folder = save_tiny_family_model(tmp_path / name, name, tokenizer_dir, **overrides)
    line = refused_in_one_line(['export-gguf', str(folder), str(tmp_path / 'out.gguf')], tmp_path, capfd)
    assert expected in line, line
    assert not (tmp_path / 'out.gguf').exists()


def test_a_sentencepiece_style_tokenizer_is_refused(tmp_path, tokenizer_dir, capfd):
    """Gemma's tokenizer.json: BPE with byte fallback behind a Replace normalizer (' ' -> '▁'), which llama.cpp's
    BPE tokenizers do not apply."""
    folder = save_tiny_family_model(tmp_path / 'gemma', 'gemma3_text', tokenizer_dir)
    spec = json.loads((folder / 'tokenizer.json').read_text())
    spec['normalizer'] = {'type': 'Replace', 'pattern': {'String': ' '}, 'content': '\u2581'}
    (folder / 'tokenizer.json').write_text(json.dumps(spec))
    line = refused_in_one_line(['export-gguf', str(folder), str(tmp_path / 'out.gguf')], tmp_path, capfd)
    assert 'the tokenizer normalises text (Replace)' in line
    assert not (tmp_path / 'out.gguf').exists()


# ----------------------------------------------------------------------------------------------------------------
# The pre-tokenizers of LLaMA-3's and Qwen's tokenizer.json
# ----------------------------------------------------------------------------------------------------------------


def _split_then_bytes_tokenizer(folder: Path, regex: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here whose pre-tokenizer is a Split regex then ByteLevel without its own regex (the
    shape of LLaMA-3's and Qwen2's tokenizer.json), with Qwen's NFC normalizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior='isolated', invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    rng = random.Random(2)
    texts = [synthetic_document(rng, domain) for domain in ('github', 'wikipedia') for _ in range(200)]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=384, special_tokens=['<|endoftext|>'],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token='<|endoftext|>', pad_token='<|endoftext|>')
    fast.save_pretrained(folder)
    return fast


@pytest.mark.slow
@pytest.mark.parametrize('regex, pre', [(QWEN2_REGEX, 'qwen2'), (LLAMA3_REGEX, 'llama-bpe')])
def test_llama3_and_qwen_pre_tokenizers_split_text_as_llama_cpp_does(regex, pre, tmp_path):
    folder = save_tiny_family_model(tmp_path / 'model', 'qwen2', vocab_size=384)
    tokenizer = _split_then_bytes_tokenizer(folder, regex)
    assert main(['export-gguf', str(folder), str(tmp_path / 'model.gguf')]) == 0
    assert _field(gguf.GGUFReader(tmp_path / 'model.gguf'), 'tokenizer.ggml.pre') == pre
    lines = mixed_text_lines()
    with EngineProcess(LlamaCppModel, tmp_path / 'model.gguf', n_ctx=64) as engine:
        mismatched = [line for line in lines
                      if engine.tokenize(line) != tokenizer(line, add_special_tokens=False)['input_ids']]
    assert not mismatched, mismatched[:3]
    shutil.rmtree(folder)
