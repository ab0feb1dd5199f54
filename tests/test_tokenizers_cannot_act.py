"""Tokenizer folders that would act (issue 59, findings 2 and 3): every tokenizer is loaded from the project's own
copy of a folder's tokenizer files (``dha_train.tokenizer_files``), so no command reaches transformers' "run the
custom code? [y/N]" prompt, imports a folder's code, or reads a file a ``tokenizer_config.json`` names.

The code cases plant ``evil.py`` (its import writes a marker file) behind ``AutoProcessor``: the model config's
``tokenizer_class`` is ``AutoProcessor`` and ``tokenizer_config.json`` has no class but an ``auto_map`` for it. Each
command runs with a user who answers ``y``: through a real stdin in a subprocess (data prep), else with
``builtins.input`` answering ``y`` and recording the prompt. The file cases name a secret file holding a marker
string in ``tokenizer_file`` / ``vocab_file``: the outputs of ``export`` and ``convert`` must not contain it.
Temporary folders are made under the test's own folder, so a copy left behind shows in its snapshot."""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from composer.models import HuggingFaceModel
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from dha_train.cli import main
from dha_train.data.tokenizer import load_tokenizer
from helpers import REPO, folder_snapshot, refused_in_one_line, save_tiny_llama, write_redpajama_jsonl

MARKER = 'SECRET-MARKER-59'
PROMPT = 'run the custom code'
REFUSED_CLASS = "names tokenizer_class 'AutoProcessor', which is not a tokenizer class of transformers"


@pytest.fixture(autouse=True)
def own_temporary_folders(tmp_path, monkeypatch) -> Path:
    """Every temporary folder of the case under ``tmp_path/tmp``, so a copy left behind changes its snapshot."""
    folder = tmp_path / 'tmp'
    folder.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(folder))
    return folder


@pytest.fixture
def prompts(monkeypatch) -> list[str]:
    """Prompts on stdin, each answered ``y`` (a user who trusts the folder)."""
    asked: list[str] = []

    def answer(prompt: str = '') -> str:
        asked.append(prompt)
        return 'y'

    monkeypatch.setattr(builtins, 'input', answer)
    return asked


def _plant_code(folder: Path, marker: Path) -> Path:
    """``folder`` with evil.py behind AutoProcessor: config.json's tokenizer_class, tokenizer_config.json's auto_map."""
    (folder / 'evil.py').write_text(f'import pathlib\npathlib.Path({str(marker)!r}).write_text("ran")\n'
                                    'class EvilProcessor:\n    pass\n')
    config_file = folder / 'config.json'
    config = json.loads(config_file.read_text()) if config_file.is_file() else {'model_type': 'llama'}
    config_file.write_text(json.dumps({**config, 'tokenizer_class': 'AutoProcessor'}))
    tokenizer_config = folder / 'tokenizer_config.json'
    if tokenizer_config.is_file():
        tokenizer_config.write_text(json.dumps(_without_class(json.loads(tokenizer_config.read_text()))))
    return folder


def _without_class(tokenizer_config: dict) -> dict:
    tokenizer_config = {key: value for key, value in tokenizer_config.items() if key != 'tokenizer_class'}
    return {**tokenizer_config, 'auto_map': {'AutoProcessor': 'evil.EvilProcessor'}}


def _secret_tokenizer_json(tokenizer_dir: Path, path: Path) -> Path:
    """The session's tokenizer.json with its last merged token renamed to ``MARKER`` (same size, a valid BPE)."""
    spec = json.loads((tokenizer_dir / 'tokenizer.json').read_text())
    vocab = spec['model']['vocab']
    last = max(vocab, key=vocab.get)
    vocab[MARKER] = vocab.pop(last)
    merges = [merge.split(' ') if isinstance(merge, str) else merge for merge in spec['model']['merges']]
    spec['model']['merges'] = [merge for merge in merges if last not in (*merge, ''.join(merge))]
    path.write_text(json.dumps(spec))
    Tokenizer.from_file(str(path))  # loads: the secret would be taken whole
    return path


def _holding_marker(folder: Path) -> list[str]:
    return [str(path) for path in folder.rglob('*') if path.is_file() and MARKER.encode() in path.read_bytes()]


def _tiny_checkpoint(path: Path, tokenizer_dir: Path, edit) -> Path:
    """What Composer saves of a tiny LLaMA with the session's tokenizer, ``edit`` applied to its HF metadata."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))
    wrapped = HuggingFaceModel(model, tokenizer=load_tokenizer(tokenizer_dir))
    metadata = wrapped.get_metadata()
    edit(metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({'state': {'model': wrapped.state_dict(), 'integrations': {'huggingface': metadata}}}, path)
    return path


def _tokenizer_config_entry(metadata: dict) -> dict:
    return metadata['tokenizer']['tokenizer_config.json']['content']


# ---------------------------------------------------------------------------------------------------------------
# Finding 2: code behind transformers' prompt
# ---------------------------------------------------------------------------------------------------------------


def test_data_prep_with_a_tokenizer_naming_code_asks_nothing_and_runs_nothing(tmp_path, tokenizer_dir):
    """Through a real stdin that answers y: one line, exit 2, no prompt, evil.py not imported, no output."""
    marker = tmp_path / 'ran'
    folder = tmp_path / 'tokenizer'
    folder.mkdir()
    for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    _plant_code(folder, marker)
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=5)
    before = folder_snapshot(tmp_path)
    done = subprocess.run([sys.executable, '-m', 'dha_train.cli', 'data', 'prep', '--input', str(raw), '--out',
                           str(tmp_path / 'out'), '--tokenizer', str(folder), '--seq-len', '64', '--workers', '1'],
                          input='y\n', capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, 'HF_HUB_OFFLINE': '1', 'TMPDIR': str(tmp_path / 'tmp'),
                               'HF_MODULES_CACHE': str(tmp_path / 'modules')})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert PROMPT not in done.stdout + done.stderr, done.stdout + done.stderr
    assert not marker.exists()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[-1].startswith('dha-train: error: ') and REFUSED_CLASS in lines[-1], lines
    assert str(folder) in lines[-1] and 'config.json' in lines[-1]
    assert folder_snapshot(tmp_path) == before


@pytest.mark.parametrize('command', ['eval', 'convert'])
def test_a_model_folder_naming_code_for_its_tokenizer_is_refused(command, tmp_path, capfd, prompts, tokenizer_dir):
    marker = tmp_path / 'ran'
    folder = tmp_path / 'model'
    save_tiny_llama(folder, tokenizer_dir)
    _plant_code(folder, marker)
    argv = {'eval': ['eval', str(folder), '--tasks', 'piqa', '--limit', '2'],
            'convert': ['convert', str(folder), str(tmp_path / 'out'), '--kv-heads', '2']}[command]
    line = refused_in_one_line(argv, tmp_path, capfd)
    assert REFUSED_CLASS in line and str(folder) in line, line
    assert prompts == [] and not marker.exists()


def test_a_checkpoint_whose_tokenizer_falls_back_to_auto_processor_is_refused(tmp_path, capfd, prompts,
                                                                               tokenizer_dir):
    """Its HF config says tokenizer_class AutoProcessor, its tokenizer_config entry names no tokenizer class but an
    auto_map for AutoProcessor (the code itself cannot travel in a checkpoint: the prompt alone is the failure)."""
    def name_auto_processor(metadata):
        metadata['model']['config']['content']['tokenizer_class'] = 'AutoProcessor'
        entry = metadata['tokenizer']['tokenizer_config.json']
        # a processor class of its own keeps AutoProcessor from asking the (absent) config.json before its prompt
        entry['content'] = {**_without_class(entry['content']), 'processor_class': 'EvilProcessor'}

    checkpoint = _tiny_checkpoint(tmp_path / 'run' / 'ep0-ba1-rank0.pt', tokenizer_dir, name_auto_processor)
    line = refused_in_one_line(['export', str(checkpoint), str(tmp_path / 'hf')], tmp_path, capfd)
    assert REFUSED_CLASS in line and str(checkpoint) in line, line
    assert prompts == []


@pytest.mark.parametrize('file', ['config.json', 'tokenizer_config.json'])
def test_a_processor_class_outside_transformers_is_refused(file, tmp_path, capfd, tokenizer_dir):
    """AutoProcessor (and any class of the folder's own) as processor_class, in either config: one line."""
    folder = tmp_path / 'tokenizer'
    folder.mkdir()
    for name in ('tokenizer.json', 'tokenizer_config.json'):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    fields = json.loads((folder / file).read_text()) if (folder / file).is_file() else {'model_type': 'llama'}
    (folder / file).write_text(json.dumps({**fields, 'processor_class': 'AutoProcessor'}))
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=5)
    line = refused_in_one_line(['data', 'prep', '--input', str(raw), '--out', str(tmp_path / 'out'), '--tokenizer',
                                str(folder), '--seq-len', '64', '--workers', '1'], tmp_path, capfd)
    assert f"{folder / file} names processor_class 'AutoProcessor', which is not a processor class" in line, line


def test_import_gguf_reads_nothing_beside_the_gguf(tmp_path, prompts, tokenizer_dir):
    """A tiny GGUF from export-gguf, in a folder that also holds a tokenizer_config.json naming AutoProcessor with an
    auto_map to evil.py, and a config.json naming it too: the import is the GGUF's alone."""
    source = tmp_path / 'source'
    save_tiny_llama(source, tokenizer_dir)
    downloads = tmp_path / 'downloads'
    downloads.mkdir()
    gguf = downloads / 'tiny.gguf'
    assert main(['export-gguf', str(source), str(gguf), '--outtype', 'f32']) == 0
    marker = tmp_path / 'ran'
    tokenizer_config = _without_class(json.loads((source / 'tokenizer_config.json').read_text()))
    _plant_code(downloads, marker)  # config.json and evil.py
    (downloads / 'tokenizer_config.json').write_text(json.dumps({**tokenizer_config, 'tokenizer_class': 'AutoProcessor'}))
    around = folder_snapshot(downloads)
    out = tmp_path / 'imported'
    assert main(['import-gguf', str(gguf), str(out)]) == 0
    assert prompts == [] and not marker.exists()
    assert folder_snapshot(downloads) == around
    written = json.loads((out / 'tokenizer_config.json').read_text())
    assert 'auto_map' not in written and written.get('tokenizer_class') != 'AutoProcessor', written
    assert 'tokenizer_class' not in json.loads((out / 'config.json').read_text())
    assert load_tokenizer(out).get_vocab() == load_tokenizer(tokenizer_dir).get_vocab()


# ---------------------------------------------------------------------------------------------------------------
# Finding 3: files a tokenizer_config.json names
# ---------------------------------------------------------------------------------------------------------------


def _bert_entries(vocab: list[str]) -> dict:
    """A WordPiece tokenizer's Composer entries: tokenizer_config.json and vocab.txt."""
    config = {'tokenizer_class': 'BertTokenizer', 'do_lower_case': True, 'bos_token': '[CLS]', 'eos_token': '[SEP]'}
    return {'tokenizer_config.json': {'file_extension': '.json', 'content': config},
            'vocab.txt': {'file_extension': '.txt', 'content': vocab}}


@pytest.mark.parametrize('form', ['tokenizer_file, absolute', 'vocab_file, ../'])
def test_export_never_reads_a_file_its_checkpoint_tokenizer_names(form, tmp_path, monkeypatch, own_temporary_folders,
                                                                 tokenizer_dir):
    """The key is dropped: the checkpoint exports with its own tokenizer files, the secret is not in the output."""
    vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', *'abcdefghijklmnopqrstuvwxyz']
    if form.startswith('tokenizer_file'):
        secret = _secret_tokenizer_json(tokenizer_dir, tmp_path / 'secret.json')

        def name_secret(metadata):
            _tokenizer_config_entry(metadata)['tokenizer_file'] = str(secret)
    else:
        (tmp_path / 'secret.txt').write_text('\n'.join([*vocab, MARKER]) + '\n')
        monkeypatch.chdir(tmp_path / 'tmp')  # the name is relative to where the command runs

        def name_secret(metadata):
            metadata['tokenizer'] = _bert_entries(vocab)
            _tokenizer_config_entry(metadata)['vocab_file'] = '../secret.txt'

    checkpoint = _tiny_checkpoint(tmp_path / 'run' / 'ep0-ba1-rank0.pt', tokenizer_dir, name_secret)
    out = tmp_path / 'hf'
    assert main(['export', str(checkpoint), str(out)]) == 0
    assert _holding_marker(out) == []
    expected = load_tokenizer(tokenizer_dir).get_vocab() if form.startswith('tokenizer_file') else \
        {token: index for index, token in enumerate(vocab)}
    assert load_tokenizer(out).get_vocab() == expected
    written = json.loads((out / 'tokenizer_config.json').read_text())
    assert not [key for key in written if key.endswith('_file')], written
    assert list(own_temporary_folders.iterdir()) == []  # no tokenizer copy left behind


def test_convert_never_reads_a_file_its_tokenizer_config_names(tmp_path, own_temporary_folders, tokenizer_dir):
    folder = tmp_path / 'model'
    save_tiny_llama(folder, tokenizer_dir)
    secret = _secret_tokenizer_json(tokenizer_dir, tmp_path / 'secret.json')
    config = json.loads((folder / 'tokenizer_config.json').read_text())
    (folder / 'tokenizer_config.json').write_text(json.dumps({**config, 'tokenizer_file': str(secret),
                                                              'sp_model_kwargs': {'model_file': str(secret)}}))
    out = tmp_path / 'out'
    assert main(['convert', str(folder), str(out), '--kv-heads', '2']) == 0
    assert _holding_marker(out) == []
    assert load_tokenizer(out).get_vocab() == load_tokenizer(tokenizer_dir).get_vocab()
    assert list(own_temporary_folders.iterdir()) == []


def test_a_tokenizer_file_linked_out_of_its_folder_is_refused(tmp_path, capfd, tokenizer_dir):
    """A folder whose tokenizer.json is a link to a file elsewhere (the secret): refused in one line, nothing read."""
    folder = tmp_path / 'tokenizer'
    folder.mkdir()
    (folder / 'tokenizer_config.json').write_bytes((tokenizer_dir / 'tokenizer_config.json').read_bytes())
    (folder / 'tokenizer.json').symlink_to(_secret_tokenizer_json(tokenizer_dir, tmp_path / 'secret.json'))
    raw = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=5)
    line = refused_in_one_line(['data', 'prep', '--input', str(raw), '--out', str(tmp_path / 'out'), '--tokenizer',
                                str(folder), '--seq-len', '64', '--workers', '1'], tmp_path, capfd)
    assert "'tokenizer.json' leads out of" in line and str(folder) in line, line
