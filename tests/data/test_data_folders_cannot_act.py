"""A data folder is read as data (issue 59): the file names an MDS ``index.json`` gives stay inside their split folder
(``data verify``, ``train``'s train_loader and eval_loader, a remote split), and ``data prep`` reads every input line
with a length limit, a line it cannot parse for any reason being a bad line. Each crafted folder goes through the
command a user would run and must end in one line, exit 2, with nothing outside the folder written or opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import zstandard
from streaming.base.hashing import get_hash

from dha_train.data.prep import SHARD_HASH
from helpers import REPO, folder_snapshot, tiny_recipe, write_recipe, write_redpajama_jsonl

SHARD = Path('00000-github_0', 'shard.00000.mds')  # the first train shard data prep writes for github
PAYLOAD = b'#!/bin/sh\necho a data folder wrote this\n'
CLIMBS_OUT = '../../../victim/planted.sh'  # from <tmp>/data/github/<split>: <tmp>/victim/planted.sh
NOT_PLAIN = 'is not a plain file name inside its folder'


# ----------------------------------------------------------------------------------------------------------------
# Crafted MDS splits
# ----------------------------------------------------------------------------------------------------------------

_RECORDERS: list[list[str]] = []
_HOOKED: list[bool] = []  # whether _audit is installed (a hook stays for the process; it records only when asked)


def _audit(event: str, args: tuple) -> None:
    if event == 'open' and _RECORDERS and isinstance(args[0], (str, bytes, os.PathLike)):
        _RECORDERS[-1].append(os.fsdecode(args[0]))


@contextlib.contextmanager
def _opened_paths():
    """Every path this process (any thread) opens inside the block, from Python's ``open`` audit event."""
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)
    opened: list[str] = []
    _RECORDERS.append(opened)
    try:
        yield opened
    finally:
        _RECORDERS.remove(opened)


def _opened_under(opened: list[str], folder: Path) -> list[str]:
    root = folder.resolve()
    return [path for path in opened if Path(path).resolve().is_relative_to(root)]


def _file_info(basename: str, content: bytes) -> dict:
    return {'basename': basename, 'bytes': len(content), 'hashes': {SHARD_HASH: get_hash(SHARD_HASH, content)}}


def _data_copy(data_root: Path, tmp: Path) -> Path:
    data = tmp / 'data'
    shutil.copytree(data_root, data)
    (tmp / 'victim').mkdir()
    return data


def _plant_shard(folder: Path, raw: str, zipped: str | None, content: bytes = PAYLOAD) -> None:
    """Put a shard first in ``folder``'s index.json whose raw file is ``raw`` and, when ``zipped`` is given, whose
    compressed file ``zipped`` holds ``content`` as a real zstd blob (written where the name leads), both with their
    true sizes and hashes: everything an index records is right but the names."""
    index = json.loads((folder / 'index.json').read_text())
    blob = zstandard.ZstdCompressor().compress(content)
    shard = {**index['shards'][0], 'compression': 'zstd' if zipped else None, 'raw_data': _file_info(raw, content),
             'zip_data': _file_info(zipped, blob) if zipped else None}
    index['shards'].insert(0, shard)
    (folder / 'index.json').write_text(json.dumps(index))
    if zipped:
        (folder / zipped).parent.mkdir(parents=True, exist_ok=True)
        (folder / zipped).write_bytes(blob)


def _crafted(data: Path, tmp: Path, kind: str, split: str = 'train') -> str:
    """Craft ``data/github/<split>`` as ``kind``; returns the refusal's expected words. What it plants outside the
    split folder lies in ``tmp/victim`` or is ``data/github/x``."""
    folder = data / 'github' / split
    planted = str(tmp / 'victim' / 'planted.sh')
    if kind == 'raw name climbs out':
        _plant_shard(folder, CLIMBS_OUT, 'planted.mds.zstd')
        return f'{folder / "index.json"}: shard file {CLIMBS_OUT!r} {NOT_PLAIN}'
    if kind == 'raw name absolute':
        _plant_shard(folder, planted, 'planted.mds.zstd')
        return f'{folder / "index.json"}: shard file {planted!r} {NOT_PLAIN}'
    if kind == 'zip name climbs out':
        _plant_shard(folder, 'planted.mds', '../../../victim/planted.mds.zstd')
        return f"shard file '../../../victim/planted.mds.zstd' {NOT_PLAIN}"
    if kind == 'zip name absolute':
        _plant_shard(folder, 'planted.mds', planted + '.zstd')
        return f'shard file {planted + ".zstd"!r} {NOT_PLAIN}'
    if kind == 'uncompressed raw ../x':  # a real shard beside the split folder, read as this split's data
        shutil.copy(folder / SHARD, folder.parent / 'x')
        _plant_shard(folder, '../x', None, (folder / SHARD).read_bytes())
        return f"shard file '../x' {NOT_PLAIN}"
    if kind == 'link leading out':  # the shard itself, moved outside and linked back: size and hash still match
        shutil.move(folder / SHARD, tmp / 'victim' / 'shard.mds')
        (folder / SHARD).symlink_to(tmp / 'victim' / 'shard.mds')
        return f"{folder / 'index.json'}: shard file '{SHARD.as_posix()}' leads out of {folder} through a link"
    raise AssertionError(kind)


KINDS = ['raw name climbs out', 'raw name absolute', 'zip name climbs out', 'zip name absolute',
         'uncompressed raw ../x', 'link leading out']


# data prep's progress bar (tqdm) draws on stderr, frames separated by carriage returns; it is not an error line.
_PROGRESS_FRAME = re.compile(r'^data prep: +\d+%\|')


def _error_lines(err: str) -> list[str]:
    frames = (frame for line in err.splitlines() for frame in line.split('\r'))
    return [frame for frame in frames if frame.strip() and not _PROGRESS_FRAME.match(frame)]


def _refused(argv: list[str], folder: Path, capfd, never_opened: tuple[Path, ...] = ()) -> str:
    """Run ``dha-train`` with ``argv`` in this process; assert exit 2, one ``dha-train: error:`` line (besides data
    prep's progress bar), no traceback, ``folder`` unchanged (nothing written, no staging file left), and no file
    under ``never_opened`` opened by the command. Returns the line."""
    from dha_train.cli import main

    before = folder_snapshot(folder)
    capfd.readouterr()
    with _opened_paths() as opened:
        status = main(argv)
    out, err = capfd.readouterr()
    lines = _error_lines(err)
    assert 'Traceback' not in out + err and status == 2, err
    assert len(lines) == 1 and lines[0].startswith('dha-train: error: '), err
    assert folder_snapshot(folder) == before
    for path in never_opened:
        assert _opened_under(opened, path) == [], f'{path} was opened'
    return lines[0]


def _refused_without_touching(argv: list[str], tmp: Path, capfd) -> str:
    """``_refused`` with nothing under ``tmp/victim`` and no ``data/github/x`` opened, and no ``planted.sh`` made."""
    line = _refused(argv, tmp, capfd, never_opened=(tmp / 'victim', tmp / 'data' / 'github' / 'x'))
    assert not (tmp / 'victim' / 'planted.sh').exists()
    return line


# ----------------------------------------------------------------------------------------------------------------
# data verify and train refuse an index naming a file outside its split folder
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize('kind', KINDS)
def test_data_verify_refuses_an_index_naming_a_file_outside_its_folder(kind, data_root, tmp_path, capfd):
    data = _data_copy(data_root, tmp_path)
    expected = _crafted(data, tmp_path, kind)
    line = _refused_without_touching(['data', 'verify', str(data)], tmp_path, capfd)
    assert line.startswith('dha-train: error: data verify: ') and expected in line, line


# (kind, the split crafted, recipe changes): the eval case leaves train intact; the absolute case turns hashing off,
# which must not turn the name check off.
TRAIN_CASES = {
    'train: raw name climbs out': ('raw name climbs out', 'train', {}),
    'train: raw name absolute, validate_hash null': ('raw name absolute', 'train', {'validate_hash': None}),
    'train: uncompressed raw ../x': ('uncompressed raw ../x', 'train', {}),
    'train: link leading out': ('link leading out', 'train', {}),
    'eval: raw name climbs out': ('raw name climbs out', 'val', {}),
}


@pytest.mark.parametrize('case', TRAIN_CASES)
def test_train_refuses_an_index_naming_a_file_outside_its_folder(case, data_root, tokenizer_dir, tmp_path, capfd):
    kind, split, loader = TRAIN_CASES[case]
    data = _data_copy(data_root, tmp_path)
    expected = _crafted(data, tmp_path, kind, split)
    recipe = tiny_recipe(data, tokenizer_dir, max_duration='2ba', eval_interval='1ba',
                         eval_loader={'root': str(data), 'domains': ['github']})
    recipe['train_loader'].update(loader)
    argv = ['train', str(write_recipe(tmp_path / 'recipe.yaml', recipe))]
    line = _refused_without_touching(argv, tmp_path, capfd)
    where = 'train_loader' if split == 'train' else 'eval_loader'
    assert line.startswith(f'dha-train: error: {where}: ') and expected in line, line


def test_a_remote_split_naming_a_file_outside_is_refused_before_any_download(data_root, tokenizer_dir, tmp_path,
                                                                            capfd):
    """The remote's index names a compressed shard ``../../../victim/planted.sh``: streaming would download the
    remote's file of that name (the attacker's) to the same name under the local cache, outside it."""
    remote = _data_copy(data_root, tmp_path / 'remote')  # remote: <tmp>/remote/data, its victim <tmp>/remote/victim
    _plant_shard(remote / 'github' / 'train', 'planted.mds', CLIMBS_OUT)
    work = tmp_path / 'work'
    work.mkdir()
    recipe = tiny_recipe(work / 'data', tokenizer_dir, max_duration='1ba')
    recipe['train_loader'] = {'root': str(work / 'data'), 'remote': str(remote), 'streams': {'github': {}}}
    argv = ['train', str(write_recipe(work / 'recipe.yaml', recipe))]
    line = _refused(argv, tmp_path / 'remote', capfd, never_opened=(tmp_path / 'remote' / 'victim',))
    assert line.startswith(f'dha-train: error: train_loader: {remote}/github/train/index.json: shard file '
                           f'{CLIMBS_OUT!r} {NOT_PLAIN}'), line
    assert not (work / 'victim').exists()  # where streaming would have written the attacker's file
    # the refused index is not left in the cache (only the folder streaming would have made), and no shard came
    assert [path for path in (work / 'data').rglob('*') if not path.is_dir()] == []


# ----------------------------------------------------------------------------------------------------------------
# data prep: a line longer than the limit, or one the parser cannot read, is a bad line
# ----------------------------------------------------------------------------------------------------------------

# Runs `dha-train data prep` in a process of its own under an address-space cap (1 GiB above what it holds once
# dha-train is imported), and writes how far its peak resident memory rose above that point to $RSS_REPORT.
_MEASURED_PREP = '''
import json, os, resource, sys, tracemalloc
import dha_train.cli, dha_train.data.prep, dha_train.data.tokenizer

def status(key):
    with open('/proc/self/status') as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(key + ':'))

cap = status('VmSize') + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))  # a backstop: reading the 1 GiB line whole fails here
tracemalloc.start()  # what Python allocates from here on (the line's bytes would be): no import or arena noise
code = dha_train.cli.main(sys.argv[1:])
grown = tracemalloc.get_traced_memory()[1]
with open(os.environ['RSS_REPORT'], 'w') as handle:
    json.dump({'grown': grown}, handle)
sys.exit(code)
'''


def _long_line_zst(path: Path, text_bytes: int, before: list[bytes]) -> None:
    """A .jsonl.zst: the ``before`` lines, then one valid document whose text is ``text_bytes`` of 'a', compressed
    in a stream so the test never holds it whole (1 GiB compresses to about 33 KB)."""
    path.parent.mkdir(parents=True)
    chunk = b'a' * (1 << 20)
    with path.open('wb') as raw, zstandard.ZstdCompressor().stream_writer(raw) as out:
        for line in before:
            out.write(line)
        out.write(b'{"text": "')
        for _ in range(text_bytes // len(chunk)):
            out.write(chunk)
        out.write(b'"}\n')


def _prep_argv(inputs: Path, out: Path, tokenizer_dir: Path, *extra: str) -> list[str]:
    return ['data', 'prep', '--input', str(inputs), '--out', str(out), '--tokenizer', str(tokenizer_dir),
            '--seq-len', '64', '--workers', '1', *extra]


@pytest.mark.slow  # a fresh interpreter imports dha-train: about 25 s on 2 busy cores
def test_a_line_over_the_default_limit_is_refused_in_bounded_memory(tmp_path, tokenizer_dir):
    """A 1 GiB line (33 KB compressed) at the default 64 MiB limit: refused naming file:line, exit 2, nothing
    written, and the process's peak of Python allocations stays under half the line (about twice the limit:
    readline joins its pieces). Measured by tracemalloc, not the RSS peak, which lazy imports and other tests'
    environment moved from 207 to 812 MiB between runs."""
    work = tmp_path / 'work'
    inputs = work / 'raw'
    path = inputs / 'github' / 'github_0.jsonl.zst'
    _long_line_zst(path, 1 << 30, [b'{"text": "def f(x):\\n    return x"}\n'])
    assert path.stat().st_size < 200_000
    before = folder_snapshot(work)
    done = subprocess.run([sys.executable, '-c', _MEASURED_PREP, *_prep_argv(inputs, work / 'out', tokenizer_dir)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, 'RSS_REPORT': str(tmp_path / 'rss.json'), 'MALLOC_ARENA_MAX': '2',
                               'PYTHONPATH': str(REPO)})
    lines = _error_lines(done.stderr)
    assert done.returncode == 2, done.stderr[-3000:]
    assert lines == [f'dha-train: error: {path}:2: line is longer than 64 MiB (--max-line-bytes); pass '
                     '--skip-bad-lines to skip such lines'], done.stderr[-3000:]
    assert folder_snapshot(work) == before  # no output, no staging folder
    assert not (work / 'out').exists()
    grown = json.loads((tmp_path / 'rss.json').read_text())['grown']
    # the limit's worth (readline joins its pieces: about twice that) and the run's own needs; the line is 1 GiB
    assert grown < 512 << 20, f'data prep grew by {grown >> 20} MiB reading a line it refuses'


def _lines_file(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True)
    path.write_bytes(b''.join(line + b'\n' for line in lines))
    return path


GOOD = b'{"text": "The attention of the model is a head."}'


def test_a_line_the_parser_cannot_read_is_a_bad_line(tmp_path, tokenizer_dir, capfd):
    """200,000 nested ``[`` (the JSON parser's RecursionError) is a bad line naming file:line; with
    --skip-bad-lines it is skipped and counted."""
    from dha_train.cli import main
    from dha_train.data.prep import read_manifest

    work = tmp_path / 'work'
    path = _lines_file(work / 'raw' / 'github' / 'github_0.jsonl', [GOOD] * 3 + [b'[' * 200_000] + [GOOD] * 40)
    line = _refused(_prep_argv(work / 'raw', work / 'out', tokenizer_dir), work, capfd)
    assert line.startswith(f'dha-train: error: {path}:4: JSON line the parser cannot read (RecursionError: '), line
    assert line.endswith('; pass --skip-bad-lines to skip such lines')
    assert main(_prep_argv(work / 'raw', work / 'out', tokenizer_dir, '--skip-bad-lines')) == 0
    assert f'data prep: skipped 1 bad line(s) in {path} (lines 4)' in capfd.readouterr().err
    github = read_manifest(work / 'out')['domains']['github']
    assert github['skipped_lines'] == 1 and github['documents'] == 43


def test_a_line_over_a_set_limit_is_a_bad_line_held_no_more_than_the_limit(tmp_path, tokenizer_dir, capfd,
                                                                          monkeypatch):
    """--max-line-bytes 1 MiB and a 16 MiB line: with --skip-bad-lines it is skipped and counted and the lines
    around it are read (a second zstd frame after it too); without, refused naming file:line, while reading the file
    never holds more than a few MiB (tracemalloc's peak from the moment data prep opens the file: loading the
    tokenizer before that costs what it costs)."""
    from dha_train.cli import main
    from dha_train.data import redpajama
    from dha_train.data.prep import read_manifest

    open_binary = redpajama._open_binary

    def opened_from_here(path, stack):
        tracemalloc.reset_peak()
        return open_binary(path, stack)

    monkeypatch.setattr(redpajama, '_open_binary', opened_from_here)

    work = tmp_path / 'work'
    path = work / 'raw' / 'github' / 'github_0.jsonl.zst'
    _long_line_zst(path, 16 << 20, [GOOD + b'\n'] * 20)
    with path.open('ab') as handle:
        handle.write(zstandard.ZstdCompressor().compress(GOOD + b'\n'))
    limit = ['--max-line-bytes', str(1 << 20)]
    assert main(_prep_argv(work / 'raw', work / 'out', tokenizer_dir, *limit, '--skip-bad-lines')) == 0
    assert f'data prep: skipped 1 bad line(s) in {path} (lines 21)' in capfd.readouterr().err
    github = read_manifest(work / 'out')['domains']['github']
    assert github['skipped_lines'] == 1 and github['documents'] == 21
    tracemalloc.start()
    try:
        line = _refused(_prep_argv(work / 'raw', work / 'refused', tokenizer_dir, *limit), work, capfd)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert line == (f'dha-train: error: {path}:21: line is longer than 1 MiB (--max-line-bytes); pass '
                    '--skip-bad-lines to skip such lines')
    assert peak < 6 << 20, f'{peak >> 20} MiB held while reading a file whose long line is refused at 1 MiB'


def test_a_limit_below_one_byte_is_refused(tmp_path, tokenizer_dir, capfd):
    inputs = write_redpajama_jsonl(tmp_path / 'raw', docs_per_domain=5)
    line = _refused(_prep_argv(inputs, tmp_path / 'out', tokenizer_dir, '--max-line-bytes', '0'), tmp_path,
                         capfd)
    assert line == 'dha-train: error: --max-line-bytes must be at least 1, got 0'
