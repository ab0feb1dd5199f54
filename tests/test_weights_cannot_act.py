"""Weights that cannot act (issue 59, findings 4, 5 and 7): a shard index naming weights outside its folder, declared
sizes that the bytes on disk do not back, and malformed weights and configs. Each crafted input goes through the
command a user would run (convert, export-gguf, eval, export) and must end in one ``dha-train: error:`` line naming
the file and the problem, exit 2, nothing written; the index cases also read nothing outside the folder (the other
folder's weights keep an access time older than their change time), and the size cases run in one child process
whose memory and file sizes are capped, each case's peak memory measured."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from dha_train.model_folders import folder_digest
from dha_train.untrusted import UntrustedDataError
from helpers import REPO, folder_snapshot, refused_in_one_line, save_tiny_llama

# ---------------------------------------------------------------------------------------------------------------
# Inputs: a tiny LLaMA folder, another one whose weights must not be read, and checkpoints built from the first
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def tiny(tmp_path_factory, tokenizer_dir) -> Path:
    folder = tmp_path_factory.mktemp('tiny') / 'model'
    save_tiny_llama(folder, tokenizer_dir)
    return folder


def _copy(tiny: Path, folder: Path) -> Path:
    shutil.copytree(tiny, folder)
    return folder


def _weight_names(folder: Path) -> list[str]:
    (header_size,) = struct.unpack('<Q', (folder / 'model.safetensors').read_bytes()[:8])
    header = json.loads((folder / 'model.safetensors').read_bytes()[8:8 + header_size])
    return sorted(name for name in header if name != '__metadata__')


def _index(folder: Path, weight_map, name: str = 'model.safetensors.index.json') -> None:
    (folder / name).write_text(json.dumps({'metadata': {}, 'weight_map': weight_map}))


def _untouched(path: Path):
    """``path``'s access time set before its change time: any read of it (the file system records reads as
    relatime does) moves it. Returns a check that it was not read, or None when this file system records no reads."""
    probe = path.with_name('atime-probe')
    probe.write_bytes(b'x')
    os.utime(probe, (0, probe.stat().st_mtime))
    probe.read_bytes()
    if probe.stat().st_atime == 0:
        return None
    os.utime(path, (0, path.stat().st_mtime))
    return lambda: path.stat().st_atime == 0


def _listing(folder: Path) -> list:
    """A folder's entries without following a link (a link's target, a file's size)."""
    return sorted((p.name, os.readlink(p) if p.is_symlink() else p.stat().st_size) for p in folder.iterdir())


def _commands(model: Path, outs: Path) -> dict[str, list[str]]:
    return {'convert': ['convert', str(model), str(outs / 'converted'), '--kv-heads', '2'],
            'export-gguf': ['export-gguf', str(model), str(outs / 'model.gguf')],
            'eval': ['eval', str(model), '--tasks', 'piqa', '--limit', '2']}


# ---------------------------------------------------------------------------------------------------------------
# Finding 4: a shard index (or a link) pulls in another folder's weights
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('form', ['dot-dot', 'absolute', 'bin index', 'link'])
def test_weights_outside_the_folder_are_never_read(form, tiny, tmp_path, tokenizer_dir, capfd):
    private = tmp_path / 'private'
    save_tiny_llama(private, tokenizer_dir, seed=1)
    secret = private / 'model.safetensors'
    model = _copy(tiny, tmp_path / 'model')
    names = _weight_names(model)
    named = {'dot-dot': '../private/model.safetensors', 'absolute': str(secret)}
    if form == 'link':
        (model / 'model.safetensors').unlink()
        (model / 'model.safetensors').symlink_to(secret)
        expected = "a weight file 'model.safetensors' leads out of"
    elif form == 'bin index':  # transformers falls back to a .bin index when no safetensors are there
        secret = private / 'pytorch_model.bin'
        torch.save(LlamaForCausalLM.from_pretrained(private).state_dict(), secret)
        (model / 'model.safetensors').unlink()
        _index(model, {name: '../private/pytorch_model.bin' for name in names}, 'pytorch_model.bin.index.json')
        expected = "a weight shard '../private/pytorch_model.bin' is not a plain file name inside its folder"
    else:
        (model / 'model.safetensors').unlink()
        _index(model, {name: named[form] for name in names})
        expected = f"a weight shard {named[form]!r} is not a plain file name inside its folder"
    outs = tmp_path / 'outs'
    outs.mkdir()
    listing = _listing(model)
    not_read = _untouched(secret)
    for command, argv in _commands(model, outs).items():
        line = refused_in_one_line(argv, outs, capfd)
        assert expected in line and str(model) in line, (command, line)
    with pytest.raises(UntrustedDataError, match='not a plain file name|leads out of'):
        folder_digest(model)  # the bench's identity of a model covers only the folder's own files
    assert _listing(model) == listing
    assert not_read is None or not_read(), 'the other folder\'s weights were read'


@pytest.mark.parametrize('weight_map, expected', [
    ({'lm_head.weight': 7}, "a weight shard 7 is not a plain file name"),
    ({}, 'is not a shard index (no weight_map object'),
], ids=['integer shard name', 'weight_map empty'])
def test_a_shard_index_that_is_not_a_map_of_plain_names_is_refused(weight_map, expected, tiny, tmp_path, capfd):
    model = _copy(tiny, tmp_path / 'model')
    (model / 'model.safetensors').rename(model / 'model-00001-of-00001.safetensors')
    _index(model, weight_map)
    for command, argv in _commands(model, tmp_path).items():
        line = refused_in_one_line(argv, tmp_path, capfd)
        assert expected in line and 'model.safetensors.index.json' in line, (command, line)


# ---------------------------------------------------------------------------------------------------------------
# Finding 7: a model folder whose config or safetensors header is not what it says
# ---------------------------------------------------------------------------------------------------------------


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (size,) = struct.unpack('<Q', raw[:8])
    header = edit(json.loads(raw[8:8 + size]))
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack('<Q', len(encoded)) + encoded + raw[8 + size:])


def _first_tensor(header: dict) -> str:
    return next(name for name in sorted(header) if name != '__metadata__')


FOLDER_CASES = {
    'config.json a JSON list': (lambda m: (m / 'config.json').write_text('[1, 2]'),
                                'config.json holds a JSON list, not a config object'),
    'hidden_size "eight"': (lambda m: (m / 'config.json').write_text(json.dumps(
        {**json.loads((m / 'config.json').read_text()), 'hidden_size': 'eight'})),
        "config.json: hidden_size is 'eight', not a whole number of at least 1"),
    'header a list': (lambda m: _rewrite_header(m / 'model.safetensors', lambda header: [header]),
                      'model.safetensors has a safetensors header that is a list'),
    'header entry not a dict': (lambda m: _rewrite_header(m / 'model.safetensors', lambda header: {
        **header, _first_tensor(header): 'F32'}), 'model.safetensors: its entry'),
    'dtype O': (lambda m: _rewrite_header(m / 'model.safetensors', lambda header: {
        **header, _first_tensor(header): {**header[_first_tensor(header)], 'dtype': 'O'}}),
        "has dtype 'O', not a safetensors dtype"),
}


@pytest.mark.parametrize('case', list(FOLDER_CASES))
def test_a_model_folder_that_is_not_what_it_declares_is_one_line(case, tiny, tmp_path, capfd):
    damage, expected = FOLDER_CASES[case]
    model = _copy(tiny, tmp_path / 'model')
    damage(model)
    for command, argv in _commands(model, tmp_path).items():
        line = refused_in_one_line(argv, tmp_path, capfd)
        assert expected in line and str(model) in line, (command, line)


# ---------------------------------------------------------------------------------------------------------------
# Finding 7: a whole-file checkpoint whose weights are strings
# ---------------------------------------------------------------------------------------------------------------


def _composer_state(folder: Path, weights: dict | None = None, **config) -> dict:
    """A whole Composer checkpoint's state as `dha-train train` saves one (the model's weights under ``model.``, the
    HF config under integrations), from a tiny folder's model; ``config`` changes its HF config."""
    llama = LlamaForCausalLM.from_pretrained(folder)
    content = {**llama.config.to_dict(), **config}
    weights = weights if weights is not None else {f'model.{k}': v for k, v in llama.state_dict().items()}
    return {'state': {'model': weights, 'run_name': 'crafted', 'integrations': {'huggingface': {
        'model': {'config': {'content': content, 'class': 'transformers.LlamaForCausalLM'}}}}}}


def test_a_checkpoint_whose_weights_are_strings_is_one_line(tiny, tmp_path, capfd):
    checkpoint = tmp_path / 'ckpt' / 'ep0-ba1-rank0.pt'
    checkpoint.parent.mkdir()
    state = _composer_state(tiny)
    state['state']['model'] = {name: 'lots' for name in state['state']['model']}
    torch.save(state, checkpoint)
    for argv in (['export', str(checkpoint), str(tmp_path / 'hf')],
                 ['eval', str(checkpoint), '--tasks', 'piqa', '--limit', '2']):
        line = refused_in_one_line(argv, tmp_path, capfd)
        assert f'{checkpoint}: its model state holds a str as weight' in line, line


# ---------------------------------------------------------------------------------------------------------------
# Findings 5 and 7: declared sizes the bytes do not back, in a child process with memory and file sizes capped
# ---------------------------------------------------------------------------------------------------------------

MEMORY_HEADROOM = 1 << 30  # address space the capped child may add after its imports
FILE_CAP = 16 << 20  # no file it writes may grow past this (RLIMIT_FSIZE): a temporary gather of a huge tensor fails
PEAK_CAP = 256 << 20  # the resident memory a refused case may add

_CAPPED = textwrap.dedent('''
    import contextlib, io, json, os, resource, signal, sys
    import dha_train.commands.convert, dha_train.commands.export, dha_train.commands.export_gguf  # noqa: F401
    from dha_train.cli import main

    def status(key):
        return int(next(line for line in open('/proc/self/status') if line.startswith(key)).split()[1]) * 1024

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails (EFBIG) instead of killing us
    limit = status('VmSize') + int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[4]), int(sys.argv[4])))
    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        with contextlib.suppress(OSError), open('/proc/self/clear_refs', 'w') as refs:
            refs.write('5')  # the peak resident size starts again from the current one
        before, err = status('VmRSS'), io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except BaseException as exc:  # a traceback is a result too
                code, err = repr(exc), io.StringIO(err.getvalue() + 'Traceback: ' + repr(exc))
        results[name] = {'code': code, 'err': err.getvalue(), 'peak': status('VmHWM') - before,
                         'address_space_left': limit - status('VmSize')}
    with open(sys.argv[2], 'w') as report:
        json.dump(results, report)
''')


def _sharded_checkpoint(folder: Path, edit) -> Path:
    """A ~35 KB sharded (torch.distributed.checkpoint) checkpoint of a 1000 x 8 lm_head and one RNG item, with
    ``edit`` applied to its ``.metadata`` (the test's own file: plain pickle is fine here)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({'state': {'model': {'model.lm_head.weight': torch.zeros(1000, 8)},
                        'rng': [{'torch': torch.zeros(4, dtype=torch.uint8)}]}}, checkpoint_id=str(folder),
             no_dist=True)
    metadata = pickle.loads((folder / '.metadata').read_bytes())
    edit(metadata)
    (folder / '.metadata').write_bytes(pickle.dumps(metadata))
    return folder


def _huge_lm_head(metadata) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    entry = metadata.state_dict_metadata['state.model.model.lm_head.weight']
    entry.size = torch.Size([40_000_000, 8])
    entry.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([40_000_000, 8]))]


def _far_list_index(metadata) -> None:
    """The RNG item moved to list index 10^12: its key, its storage key and its planner path all agree."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    old, new = 'state.rng.0.torch', f'state.rng.{10 ** 12}.torch'
    metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
    metadata.planner_data.pop(old)
    metadata.planner_data[new] = ('state', 'rng', 10 ** 12, 'torch')
    metadata.storage_data = {(MetadataIndex(new, index.offset, index.index) if index.fqn == old else index): info
                             for index, info in metadata.storage_data.items()}


@pytest.fixture(scope='module')
def capped(tiny, tmp_path_factory) -> dict:
    """Every size case built, then run by one child process (its imports are the slow part) with its address space
    capped at its size after imports plus ``MEMORY_HEADROOM``, files at ``FILE_CAP`` and ``TMPDIR`` in a folder of
    its own; returns each case's exit code, stderr and peak added memory, with the folders to check."""
    root = tmp_path_factory.mktemp('capped')
    big = {'hidden_size': 5120, 'intermediate_size': 13824, 'num_hidden_layers': 40, 'vocab_size': 32000,
           'num_attention_heads': 40, 'num_key_value_heads': 40, 'head_dim': 128}  # LLaMA-13B: 52 GB in float32
    cases, shown = {}, {}
    for name, edit in (('declared lm_head 40,000,000 x 8', _huge_lm_head), ('list index 10^12', _far_list_index)):
        checkpoint = _sharded_checkpoint(root / name.split()[0] / 'ckpt', edit)
        cases[name], shown[name] = ['export', str(checkpoint), str(checkpoint.parent / 'hf')], checkpoint
    whole = root / 'stride' / 'ep0-ba1-rank0.pt'
    whole.parent.mkdir()
    state = _composer_state(tiny)
    state['state']['model']['model.lm_head.weight'] = torch.zeros(1).expand(100_000, 100_000)
    torch.save(state, whole)
    cases['zero-stride 100000 x 100000'], shown['zero-stride 100000 x 100000'] = \
        ['export', str(whole), str(whole.parent / 'hf')], whole
    config_52gb = root / 'big-config' / 'ep0-ba1-rank0.pt'
    config_52gb.parent.mkdir()
    torch.save(_composer_state(tiny, **big), config_52gb)
    cases['checkpoint config of 52 GB'], shown['checkpoint config of 52 GB'] = \
        ['export', str(config_52gb), str(config_52gb.parent / 'hf')], config_52gb
    folder = _copy(tiny, root / 'big-folder' / 'model')
    (folder / 'config.json').write_text(json.dumps({**json.loads((folder / 'config.json').read_text()), **big}))
    for command, argv in _commands(folder, folder.parent).items():
        if command != 'eval':  # eval loads the folder as convert does
            cases[f'folder config of 52 GB ({command})'] = argv
            shown[f'folder config of 52 GB ({command})'] = folder / 'config.json'
    wide = _copy(tiny, root / 'wide-folder' / 'model')  # only its MLP is large: counted on the meta device
    (wide / 'config.json').write_text(json.dumps({**json.loads((wide / 'config.json').read_text()),
                                                  'intermediate_size': 35_000_000}))
    cases['folder MLP of 52 GB (convert)'] = _commands(wide, wide.parent)['convert']
    shown['folder MLP of 52 GB (convert)'] = wide / 'config.json'
    scratch = root / 'tmp'
    scratch.mkdir()
    before = folder_snapshot(root)
    report = root / 'report.json'
    env = {**os.environ, 'TMPDIR': str(scratch), 'OMP_NUM_THREADS': '1', 'MALLOC_ARENA_MAX': '2'}
    done = subprocess.run([sys.executable, '-c', _CAPPED, json.dumps(cases), str(report), str(MEMORY_HEADROOM),
                           str(FILE_CAP)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and report.is_file(), done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(report.read_text())
    report.unlink()
    return {'results': results, 'shown': shown, 'unchanged': folder_snapshot(root) == before}


SIZE_CASES = {
    'declared lm_head 40,000,000 x 8': 'its .metadata declares state.model.model.lm_head.weight as 40000000 x 8 '
                                       'float32, a chunk of 1,280,000,000 bytes of which has',
    'list index 10^12': 'its .metadata places an item at list index 1,000,000,000,000 of state.rng, a list of 1',
    'zero-stride 100000 x 100000': 'its tensor state.model.model.lm_head.weight declares (100000, 100000) with a '
                                   'stride of 0',
    'checkpoint config of 52 GB': 'the config declares a model of',
    'folder config of 52 GB (convert)': 'the config declares a model of',
    'folder config of 52 GB (export-gguf)': 'the config declares a model of',
    'folder MLP of 52 GB (convert)': 'the config declares a model of 13,440,',
}


@pytest.mark.parametrize('case', list(SIZE_CASES))
def test_declared_sizes_the_bytes_do_not_back_are_refused_before_allocating(case, capped):
    result = capped['results'][case]
    lines = [line for line in result['err'].splitlines() if line.strip()]
    print(f"\nSIZE-CASE | {case} | {lines[-1] if lines else result['err']!r} | peak {result['peak'] >> 20} MiB")
    assert 'Traceback' not in result['err'], result['err'][-2000:]
    assert result['code'] == 2 and len(lines) == 1 and lines[0].startswith('dha-train: error: '), result['err']
    assert SIZE_CASES[case] in lines[0] and str(capped['shown'][case]) in lines[0], lines[0]
    assert result['peak'] < PEAK_CAP, f"{case} added {result['peak'] / 2 ** 20:.0f} MiB of resident memory"
    assert capped['unchanged'], 'a case wrote a file (an output, or a temporary file left in TMPDIR)'
